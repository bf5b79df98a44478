"""What the kit does to a model built under `distributed()`, in both of its forms.

A model returned by a decorated factory, or compiled inside `with kmk.distributed(...)`
(`keras_mirror_kit.with_block`), is *prepared* once (`prepare_model`):

* checked: a `keras.Model` whose variables and optimizer were created under the strategy
  (a model built outside silently trains on one device in Keras 3), and without stateful
  RNN layers when there are several replicas (refused: their state follows each row of a
  fixed batch, which no replica holds whole);
* registered (`keras_mirror_kit.model_record`), so `kmk.distribution_of(model)` and the
  kit's callbacks find its distribution;
* given the distribution's knobs: float32 outputs under mixed precision, synchronized
  BatchNormalization, `steps_per_execution`, gradient accumulation;
* given an optimizer that trains on N replicas as on one: gradient clipping of the
  all-reduced gradient, a working `use_ema=True` overwrite;
* given the checking `fit`, `evaluate` and `predict` of `keras_mirror_kit.fit_wrapper`, and
  the workarounds a model under a strategy needs (`keras_mirror_kit.workarounds`).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import keras

from keras_mirror_kit import backends, fit_wrapper
from keras_mirror_kit.distribution import Distribution, activate
from keras_mirror_kit.model_record import record_of, register_model
from keras_mirror_kit.precision import keep_outputs_float32, policy_scope
from keras_mirror_kit.schedules import check_accumulation
from keras_mirror_kit.workarounds import inner_optimizer

__all__ = [
    "ModelOptions",
    "check_model",
    "check_stateful_layers",
    "is_prepared",
    "prepare_model",
]

logger = logging.getLogger("keras_mirror_kit")


@dataclass(frozen=True)
class ModelOptions:
    """The per-model knobs of a `distributed()`: mixed precision, sync BN, steps per call."""

    # "mixed_float16", "mixed_bfloat16" or None; "auto" until `distributed()` decides it
    mixed_precision: str | None = None
    sync_batch_norm: bool = False  # BatchNormalization layers get synchronized statistics
    steps_per_execution: int | None = None  # None: left as `compile()` set it


def check_model(
    model: Any, dist: Distribution, factory_name: str = "factory", origin: str | None = None
) -> None:
    """Checks that a model was built (and compiled) under `dist`'s strategy.

    Keras 3 silently trains a model built outside the scope on one device, so: `TypeError`
    for anything but a `keras.Model`, `ValueError` when the model, one of its variables or its
    optimizer was created outside the strategy's scope, or when it has stateful layers
    (`stateful=True` RNNs) and the distribution has several replicas. `factory_name` and
    `origin` (default:
    "returned by `factory_name`") word the messages.
    """
    origin = origin or f"returned by `{factory_name}`"
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"The factory `{factory_name}` decorated with @kmk.distributed must return a "
            f"keras.Model. Received: {type(model).__name__} ({model!r:.80})"
        )
    backends.current().check_placement(model, dist.engine, origin)
    check_stateful_layers(model, dist, origin)


def check_stateful_layers(model: Any, dist: Distribution, origin: str) -> None:
    """`ValueError` for a stateful RNN layer on several replicas (module docstring).

    A `stateful=True` layer carries its state from batch `i` to batch `i + 1` row by row,
    for the fixed batch size it was built with; each replica holds only its part of the
    global batch (and another part at every step of a reshuffled pipeline), so the state
    would neither fit nor follow its sequence.
    """
    if dist.num_replicas <= 1:
        return
    flatten = getattr(model, "_flatten_layers", None)
    layers = list(flatten(include_self=False)) if callable(flatten) else []
    stateful = [layer.name for layer in layers if getattr(layer, "stateful", False) is True]
    if stateful:
        raise ValueError(
            f"The model {origin} has stateful layers ({', '.join(stateful)}), which carry "
            "each row's state from one batch to the next for the batch size they were built "
            f"with; on {dist.num_replicas} replicas each replica holds only its part of the "
            "global batch, so that state would neither fit nor follow its sequence. Train "
            "it on one device (kmk.distributed(..., devices=['/gpu:0'])), or make the "
            "layers stateless (stateful=False) and pass the state as an input "
            "(`initial_state=`, `return_state=True`). "
            f"Received: stateful layers={stateful}, replicas={dist.num_replicas}"
        )


def _apply_steps_per_execution(model: Any, steps: int | None, name: str) -> None:
    if steps is None or model.steps_per_execution == steps:
        return
    if model.steps_per_execution != 1:
        raise ValueError(
            f"`{name}` compiled with steps_per_execution={model.steps_per_execution}, but "
            f"distributed(steps_per_execution={steps}) asks for another value. Pass it in "
            f"one place only. Received: steps_per_execution={steps}"
        )
    model.steps_per_execution = steps
    config = getattr(model, "_compile_config", None)
    if config is not None and isinstance(getattr(config, "config", None), dict):
        config.config["steps_per_execution"] = steps  # so a saved model keeps it


def _apply_gradient_accumulation(model: Any, steps: int, name: str) -> None:
    """Gives the optimizer `distributed(gradient_accumulation_steps=)`, refusing another value."""
    # A LossScaleOptimizer's inner one holds gradient_accumulation_steps.
    optimizer = inner_optimizer(getattr(model, "optimizer", None))
    if optimizer is None:
        return
    given = getattr(optimizer, "gradient_accumulation_steps", None) or 1
    if given != steps:
        if given != 1:
            raise ValueError(
                f"The optimizer of `{name}` was created with gradient_accumulation_steps="
                f"{given}, but distributed(gradient_accumulation_steps={steps}) asks for "
                "another value. Pass it to distributed() only, so that the effective batch "
                "size and the learning-rate scaling know it. "
                f"Received: gradient_accumulation_steps={given}"
            )
        if optimizer.built:
            raise ValueError(
                f"The optimizer of `{name}` is already built, so it cannot accumulate "
                f"gradients over {steps} steps (its accumulators are created when it is "
                "built). Do not build it in the factory or block (fit() builds it). "
                f"Received: gradient_accumulation_steps={steps}"
            )
        optimizer.gradient_accumulation_steps = steps  # Keras' own mechanism (and config)
    check_accumulation(optimizer._learning_rate, steps, name)  # noqa: SLF001


def _optimizer_in_scope(optimizer: Any, dist: Distribution, model_name: str) -> Any:
    """`optimizer` as `compile()` may use it under `dist`'s strategy: itself, or, for an
    optimizer object made outside the scope that holds no state yet, the same optimizer
    re-created from its config inside the scope (`ValueError` for one that holds state)."""
    made_in = getattr(optimizer, "_distribution_strategy", None)  # TensorFlow's optimizers
    if not isinstance(optimizer, keras.optimizers.Optimizer) or made_in is None:
        return optimizer
    if made_in is dist.engine.strategy:
        return optimizer
    steps = int(keras.ops.convert_to_numpy(optimizer.iterations))
    if optimizer.built or steps:
        held = f"it took {steps} step(s)" if steps else "it was built"
        raise ValueError(
            f"compile() of {model_name!r} was given an optimizer created outside the "
            f"strategy's scope that already holds state ({held}), which cannot be mirrored "
            "over the replicas without losing it. Pass a new optimizer (or a string such as "
            "'adam'): the kit re-creates an optimizer that holds no state inside the scope. "
            f"Received: optimizer={type(optimizer).__name__}, built={optimizer.built}, "
            f"iterations={steps}"
        )
    try:
        with activate(dist, "kmk.distribution_of(model).strategy"):
            return type(optimizer).from_config(optimizer.get_config())
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"compile() of {model_name!r} was given an optimizer created outside the "
            "strategy's scope, and the kit could not re-create it inside the scope from its "
            f"config ({err}). Create it there: `with kmk.distribution_of(model).strategy."
            "scope(): optimizer = ...`, or pass a string such as 'adam'. "
            f"Received: optimizer={type(optimizer).__name__}"
        ) from err


def _compile_inside_scope(model: keras.Model, dist: Distribution, options: ModelOptions) -> None:
    """Makes every later `model.compile(...)` run inside the strategy's scope and the
    distribution's dtype policy, with an optimizer usable there, then checks the model and
    gives it the distribution's settings again (a fine-tuning phase's second compile)."""
    original = model.compile

    @functools.wraps(original)
    def compile_in_scope(*args: Any, **kwargs: Any) -> None:
        name = f"compile() of {model.name!r}"
        if args:
            args = (_optimizer_in_scope(args[0], dist, model.name), *args[1:])
        elif "optimizer" in kwargs:
            kwargs["optimizer"] = _optimizer_in_scope(kwargs["optimizer"], dist, model.name)
        with activate(dist, "kmk.distribution_of(model).strategy"):
            with policy_scope(options.mixed_precision):
                original(*args, **kwargs)
        check_model(model, dist, factory_name=name)
        _apply_compile_settings(model, dist, options, name)
        backends.current().after_prepare(model, dist.engine)

    object.__setattr__(model, "compile", compile_in_scope)


def _apply_compile_settings(
    model: Any, dist: Distribution, options: ModelOptions, name: str
) -> None:
    """What a compiled model gets from `distributed()`, and what its compile may not ask."""
    _apply_steps_per_execution(model, options.steps_per_execution, name)
    _apply_gradient_accumulation(model, dist.gradient_accumulation_steps, name)
    backends.current().after_compile(model, dist.engine, name)


def is_prepared(model: Any) -> bool:
    """Whether `prepare_model` ran on `model` (a decorated factory or a `with` block built it)."""
    record = record_of(model)
    return record is not None and record.prepared


def prepare_model(
    model: Any,
    dist: Distribution,
    options: ModelOptions,
    name: str = "factory",
    origin: str | None = None,
) -> None:
    """Checks a model built under `dist` and gives it the kit's guarantees (module docstring).

    Raises `TypeError` for anything but a `keras.Model`, and `ValueError` for a model built
    outside the strategy's scope, compiled with another `steps_per_execution` or an optimizer
    with another `gradient_accumulation_steps` than `distributed()` asks for, compiled with
    `jit_compile=True` on several replicas, or using float16 loss scaling, gradient clipping on
    several replicas, or `use_ema=True` with `ema_overwrite_frequency` on a Keras version whose
    bug the kit does not correct (`keras_mirror_kit.workarounds`). Preparing twice re-checks
    and re-applies the knobs but installs the wrappers once.
    """
    check_model(model, dist, factory_name=name, origin=origin)
    record = register_model(model, dist)
    if options.mixed_precision:
        keep_outputs_float32(model)
    backend = backends.current()
    if options.sync_batch_norm:
        backend.sync_batch_norm(model)
    if model.compiled:
        _apply_compile_settings(model, dist, options, name)
    if not record.prepared:  # a later compile (a fine-tuning phase's) runs in the scope too
        _compile_inside_scope(model, dist, options)
    backend.after_prepare(model, dist.engine)
    if record.prepared:
        return
    fit_wrapper.install(model, dist)
    backend.install(model)
    record.prepared = True
