"""What the kit does to a model built under `distributed()`, in both of its forms.

A model returned by a decorated factory, or compiled inside `with kmk.distributed(...)`, is
*prepared* once (`prepare_model`):

* checked: a `keras.Model` whose variables and optimizer were created under the strategy
  (a model built outside silently trains on one device in Keras 3);
* registered, so `kmk.distribution_of(model)` and the kit's callbacks find its distribution;
* given the distribution's knobs: float32 outputs under mixed precision, synchronized
  BatchNormalization, `steps_per_execution`;
* given per-instance `fit`, `evaluate` and `predict` wrappers that, before any step, check
  the data (`keras_mirror_kit.fit_inputs`) and the step counts
  (`keras_mirror_kit.workarounds.keras_epoch_rounding`), batch in-memory arrays with the
  global batch
  size when no `batch_size` is given (and tell `ThroughputMonitor` the batch really used,
  `batch_plan`), run the kit's log-producing callbacks first (so loggers listed before them
  still see their figures), run without per-device tf.data autotuning
  (`keras_mirror_kit.workarounds.tf_data_iterator_stall`), and feed the replicas a
  `make_dataset` dataset in
  its stored dtype when its `preprocess` runs on the replicas
  (`keras_mirror_kit.replica_preprocess`).

The `with` form reaches models through `compile()`: while a block is active in a thread,
`keras.Model.compile` prepares the model it compiled (a class-level wrapper installed the
first time a block is entered, on Keras' `Trainer` base class so that `load_model` still
sees an unmodified `compile`; outside a block, and in every other thread, it is Keras' own
`compile` plus one thread-local lookup).
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import keras
import tensorflow as tf

from keras_mirror_kit import replica_preprocess
from keras_mirror_kit.batch_norm import synchronize_batch_norm
from keras_mirror_kit.distribution import (
    Distribution,
    activate,
    distribution_of,
    known_replica_counts,
    register_model,
)
from keras_mirror_kit.fit_inputs import BatchPlan, check_input, is_array_data, plan_batches
from keras_mirror_kit.precision import keep_outputs_float32
from keras_mirror_kit.schedules import check_accumulation
from keras_mirror_kit.workarounds import (
    keras_grad_accumulation,
    keras_loss_scale,
    tf_data_iterator_stall,
)
from keras_mirror_kit.workarounds.keras_epoch_rounding import check_step_arguments

__all__ = [
    "ModelOptions",
    "batch_plan",
    "check_callback_model",
    "check_model",
    "compiled_models_prepared",
    "factory_running",
    "is_prepared",
    "notify_fit_exception",
    "order_callbacks",
    "prepare_model",
]

logger = logging.getLogger("keras_mirror_kit")

_PREPARED = "_kmk_prepared"
_BATCH_PLAN = "_kmk_batch_plan"
#: Class attribute of callbacks that add figures to `logs` (run first by a prepared `fit`).
LOGS_PRODUCER = "_kmk_logs_producer"


@dataclass(frozen=True)
class ModelOptions:
    """The per-model knobs of a `distributed()`: mixed precision, sync BN, steps per call.

    Args:
        mixed_precision: `"mixed_float16"`, `"mixed_bfloat16"` or None.
        sync_batch_norm: Switch BatchNormalization layers to synchronized statistics.
        steps_per_execution: Steps per compiled call, or None to leave `compile()`'s.

    Example:

    ```python
    prepare_model(model, dist, ModelOptions(steps_per_execution=8))
    ```
    """

    mixed_precision: str | None = None
    sync_batch_norm: bool = False
    steps_per_execution: int | None = None


def _strategy_of_variable(variable: Any) -> tf.distribute.Strategy | None:
    value = getattr(variable, "value", variable)
    if isinstance(value, tf.distribute.DistributedValues):
        return value._distribute_strategy  # noqa: SLF001
    return None


def check_model(
    model: Any, dist: Distribution, factory_name: str = "factory", origin: str | None = None
) -> None:
    """Checks that a model was built (and compiled) under `dist`'s strategy.

    Args:
        model: What the factory returned, or the model compiled in a `with` block.
        dist: The distribution it should belong to.
        factory_name: The factory's name, used in error messages.
        origin: How the model was obtained, for messages (default: "returned by
            `factory_name`").

    Returns:
        None.

    Raises:
        TypeError: If `model` is not a `keras.Model`.
        ValueError: If the model, one of its variables or its optimizer was created
            outside the strategy's scope.

    Example:

    ```python
    check_model(model, build_model.distribution)
    ```
    """
    origin = origin or f"returned by `{factory_name}`"
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"The factory `{factory_name}` decorated with @kmk.distributed must return a "
            f"keras.Model. Received: {type(model).__name__} ({model!r:.80})"
        )
    strategy = dist.strategy
    if getattr(model, "_distribute_strategy", None) is not strategy:
        raise ValueError(
            f"The model {origin} was created outside the strategy's scope, so it would "
            "silently train on one device. Create the model inside the decorated "
            "factory (or inside `with kmk.distributed(...)`), not before it. "
            f"Received: model={model.name!r}"
        )
    if dist.num_replicas > 1 or isinstance(strategy, tf.distribute.MirroredStrategy):
        outside = [v.path for v in model.variables if _strategy_of_variable(v) is not strategy]
        if outside:
            raise ValueError(
                f"{len(outside)} variable(s) of the model {origin} were created outside the "
                "strategy's scope (for example a layer built before the factory "
                "or block ran). Create and build every layer inside the decorated factory "
                "or the `with` block. "
                f"Received: variables={outside[:5]}{' ...' if len(outside) > 5 else ''}"
            )
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        opt_strategy = getattr(optimizer, "_distribution_strategy", strategy)
        if opt_strategy is not strategy:
            raise ValueError(
                f"The optimizer of the model {origin} was created outside the strategy's "
                "scope; its updates would not be mirrored. Create the optimizer "
                "inside the decorated factory or the `with` block, e.g. "
                "`model.compile(optimizer=keras.optimizers.Adam(lr), ...)` there. "
                f"Received: optimizer={type(optimizer).__name__}"
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
    optimizer = keras_grad_accumulation.accumulating_optimizer(getattr(model, "optimizer", None))
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
    keras_grad_accumulation.apply(optimizer)  # runs under the strategy: see that module


def _compile_inside_scope(model: keras.Model, dist: Distribution, options: ModelOptions) -> None:
    """Makes a later `model.compile(...)` run inside the strategy's scope, then checks it."""
    original = model.compile

    @functools.wraps(original)
    def compile_in_scope(*args: Any, **kwargs: Any) -> None:
        with activate(dist):
            original(*args, **kwargs)
        name = f"compile() of {model.name!r}"
        check_model(model, dist, factory_name=name)
        _apply_steps_per_execution(model, options.steps_per_execution, name)
        _apply_gradient_accumulation(model, dist.gradient_accumulation_steps, name)

    object.__setattr__(model, "compile", compile_in_scope)


def is_prepared(model: Any) -> bool:
    """Whether `prepare_model` ran on `model` (a decorated factory or a `with` block built it).

    Args:
        model: Any object.

    Returns:
        True for a model the kit prepared.

    Example:

    ```python
    assert is_prepared(build_model())
    ```
    """
    return bool(getattr(model, _PREPARED, False))


def prepare_model(
    model: Any,
    dist: Distribution,
    options: ModelOptions,
    name: str = "factory",
    origin: str | None = None,
) -> None:
    """Checks a model built under `dist` and gives it the kit's guarantees (module docstring).

    Args:
        model: The model a factory returned or a `with` block compiled.
        dist: Its distribution.
        options: The `distributed()` knobs.
        name: The factory's (or compile call's) name, for messages.
        origin: How the model was obtained, for messages (see `check_model`).

    Returns:
        None.

    Raises:
        TypeError: If `model` is not a `keras.Model`.
        ValueError: If it was built outside the strategy's scope, compiled with another
            `steps_per_execution` or an optimizer with another `gradient_accumulation_steps`
            than `distributed()` asks for, or uses float16 loss
            scaling on several replicas with a Keras version whose `LossScaleOptimizer`
            the kit cannot make agree across replicas
            (`keras_mirror_kit.workarounds.keras_loss_scale`).

    Example:

    ```python
    prepare_model(model, dist, ModelOptions(mixed_precision="mixed_bfloat16"))
    ```
    """
    check_model(model, dist, factory_name=name, origin=origin)
    register_model(model, dist)
    if options.mixed_precision:
        keep_outputs_float32(model)
    if options.sync_batch_norm:
        synchronize_batch_norm(model)
    if model.compiled:
        _apply_steps_per_execution(model, options.steps_per_execution, name)
        _apply_gradient_accumulation(model, dist.gradient_accumulation_steps, name)
    elif not is_prepared(model):
        _compile_inside_scope(model, dist, options)
    keras_loss_scale.apply(model, dist.strategy)  # float16: every replica agrees on overflow
    if is_prepared(model):
        return
    _wrap_methods(model, dist)
    tf_data_iterator_stall.apply(model)  # no tf.data autotuning thread: see tf_data_iterator_stall
    object.__setattr__(model, _PREPARED, True)


def order_callbacks(callbacks: Any) -> Any:
    """Puts the callbacks that add figures to `logs` first, keeping the order otherwise.

    Keras calls callbacks in list order, so a logger (CSVLogger, TensorBoard, W&B) listed
    before `ThroughputMonitor` would write its row before the figures exist.

    Args:
        callbacks: What the user passed as `callbacks=` (a list, None, or a `CallbackList`,
            which is returned unchanged).

    Returns:
        A new list with producers first, or `callbacks` itself.

    Example:

    ```python
    order_callbacks([csv_logger, kmk.ThroughputMonitor()])  # [monitor, csv_logger]
    ```
    """
    if not isinstance(callbacks, Sequence) or isinstance(callbacks, (str, bytes)):
        return callbacks
    listed = list(callbacks)
    producers = [c for c in listed if getattr(c, LOGS_PRODUCER, False)]
    if not producers:
        return callbacks
    return producers + [c for c in listed if not getattr(c, LOGS_PRODUCER, False)]


def batch_plan(model: Any) -> BatchPlan | None:
    """The batch the running `fit` of a prepared model uses (for `ThroughputMonitor`).

    Args:
        model: A `keras.Model`.

    Returns:
        The `BatchPlan` of the `fit` call in progress, or None outside one (or for a model
        the kit did not prepare).

    Example:

    ```python
    plan = batch_plan(self.model)   # in on_train_begin
    ```
    """
    return getattr(model, _BATCH_PLAN, None)


def notify_fit_exception(callbacks: Any, exception: BaseException) -> None:
    """Calls `on_fit_exception(exception)` of every callback that has it, in list order.

    Keras' `fit` tells callbacks nothing when it raises (no `on_train_end`); `fit` of a
    prepared model calls this before re-raising, so a callback can close what it opened
    (`WandbLogger` finishes its run as failed). An error raised by a hook is logged and
    never replaces `exception`.

    Args:
        callbacks: The `callbacks=` of the `fit` call (a list, a `CallbackList` or None).
        exception: What `fit` raised.

    Returns:
        None.

    Example:

    ```python
    try:
        model.fit(ds, callbacks=callbacks)
    except Exception as err:
        notify_fit_exception(callbacks, err)
        raise
    ```
    """
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    if not isinstance(callbacks, Sequence) or isinstance(callbacks, (str, bytes)):
        return
    for callback in callbacks:
        hook = getattr(callback, "on_fit_exception", None)
        if callable(hook):
            try:
                hook(exception)
            except Exception:
                logger.exception("keras-mirror-kit: on_fit_exception of %r failed", callback)


def _wrap_methods(model: Any, dist: Distribution) -> None:
    """Installs the checking `fit`, `evaluate` and `predict` wrappers on this instance."""
    for method_name, steps_args, data_args in (
        ("fit", ("steps_per_epoch", "validation_steps"), ("x", "validation_data")),
        ("evaluate", ("steps",), ("x",)),
        ("predict", (), ("x",)),
    ):
        original = getattr(model, method_name)
        signature = inspect.signature(original)

        def wrapper(
            *args: Any,
            _original: Any = original,
            _signature: inspect.Signature = signature,
            _method: str = method_name,
            _steps: tuple[str, ...] = steps_args,
            _data: tuple[str, ...] = data_args,
            **kwargs: Any,
        ) -> Any:
            bound = _signature.bind_partial(*args, **kwargs)
            given = bound.arguments
            for argument in _data:
                check_input(given.get(argument), dist, _method, argument)
            check_step_arguments(model, **{name: given.get(name) for name in _steps})
            if is_array_data(given.get("x")) and not given.get("batch_size"):
                given["batch_size"] = dist.global_batch_size  # not Keras' default of 32
            if "callbacks" in given:
                given["callbacks"] = order_callbacks(given["callbacks"])
            if _method != "fit":
                with replica_preprocess.applied(model, _method, given):  # after the checks
                    return _original(*bound.args, **bound.kwargs)
            callbacks = given.get("callbacks")
            for callback in callbacks if isinstance(callbacks, Sequence) else ():
                check = getattr(callback, "_kmk_check_fit_data", None)
                if callable(check):  # e.g. SyncedCheckpoint(dataset=) vs the data of this fit
                    check(given.get("x"))
            plan = plan_batches(
                given.get("x"),
                dist,
                batch_size=given.get("batch_size"),
                validation_split=given.get("validation_split") or 0.0,
                steps_per_epoch=given.get("steps_per_epoch"),
            )
            previous = batch_plan(model)
            object.__setattr__(model, _BATCH_PLAN, plan)
            try:
                with replica_preprocess.applied(model, _method, given):  # after the checks
                    return _original(*bound.args, **bound.kwargs)
            except BaseException as exception:  # Ctrl-C too: Keras' fit has no finally
                notify_fit_exception(callbacks, exception)
                raise
            finally:
                object.__setattr__(model, _BATCH_PLAN, previous)

        object.__setattr__(model, method_name, functools.wraps(original)(wrapper))
    replica_preprocess.install(model)  # make_dataset's preprocess on the replicas


# -- the `with` form ----------------------------------------------------------------------------

_local = threading.local()
_hook_lock = threading.Lock()
_hook_installed = False


def _blocks() -> list[tuple[Distribution, ModelOptions]]:
    if not hasattr(_local, "blocks"):
        _local.blocks = []
    return _local.blocks


@contextmanager
def factory_running() -> Iterator[None]:
    """While a decorated factory runs, `compile()` leaves preparing to the factory.

    Returns:
        A context manager (per thread, re-entrant).

    Example:

    ```python
    with activate(dist), factory_running():
        model = factory()
    prepare_model(model, dist, options)
    ```
    """
    _local.factories = getattr(_local, "factories", 0) + 1
    try:
        yield
    finally:
        _local.factories -= 1


def _install_compile_hook() -> bool:
    """Wraps Keras' `Trainer.compile` once; False (with a warning) if it is not there."""
    global _hook_installed
    with _hook_lock:
        if _hook_installed:
            return True
        try:  # The base class, not keras.Model: Keras compares the two on `load_model`.
            from keras.src.trainers.trainer import Trainer
        except ImportError:
            logger.warning(
                "keras-mirror-kit: Keras %s has no keras.src.trainers.trainer.Trainer, so "
                "models compiled inside `with kmk.distributed(...)` are not checked; use the "
                "decorator form",
                keras.__version__,
            )
            return False
        original = Trainer.compile

        @functools.wraps(original)
        def compile(self: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: A001
            result = original(self, *args, **kwargs)
            blocks = _blocks()
            if blocks and not getattr(_local, "factories", 0):
                dist, options = blocks[-1]
                origin = f"{self.name!r} compiled inside `with kmk.distributed(...)`"
                prepare_model(self, dist, options, name=self.name, origin=origin)
            return result

        Trainer.compile = compile  # type: ignore[method-assign]
        _hook_installed = True
        return True


@contextmanager
def compiled_models_prepared(dist: Distribution, options: ModelOptions) -> Iterator[None]:
    """Inside the block, every model compiled in this thread is prepared for `dist`.

    Args:
        dist: The block's distribution.
        options: The block's `distributed()` knobs.

    Returns:
        A context manager.

    Example:

    ```python
    with compiled_models_prepared(dist, ModelOptions()):
        model.compile(...)      # checked, registered, wrapped
    ```
    """
    _install_compile_hook()
    blocks = _blocks()
    blocks.append((dist, options))
    try:
        yield
    finally:
        blocks.pop()


def check_callback_model(model: Any, callback_name: str) -> Distribution | None:
    """At `on_train_begin`: checks that the model being fit belongs to a distribution.

    Args:
        model: The callback's model.
        callback_name: The callback's class name, for messages.

    Returns:
        The model's `Distribution`, or None for a model the kit did not build.

    Raises:
        ValueError: If `fit` runs inside `with kmk.distributed(...)` on a model that was
            not built under that block's strategy (it would train on one device).

    Example:

    ```python
    dist = check_callback_model(self.model, "ThroughputMonitor")
    ```
    """
    dist = distribution_of(model)
    if dist is None:
        blocks = _blocks()
        if blocks:
            raise ValueError(
                f"{callback_name}: the model {model.name!r} is trained inside `with "
                "kmk.distributed(...)` but was not built under its strategy, so it would "
                f"train on one device instead of {blocks[-1][0].num_replicas} replicas. "
                "Build and compile the model inside the block (or in a decorated factory). "
                f"Received: model={model.name!r}"
            )
        if getattr(model, "_distribute_strategy", None) is None and any(
            count > 1 for count in known_replica_counts()
        ):
            logger.warning(
                "keras-mirror-kit: %s: the model %r was not built under any "
                "kmk.distributed() strategy, so it trains on one device although this "
                "process has a multi-replica distribution; build it in a decorated factory "
                "or inside `with kmk.distributed(...)`",
                callback_name,
                model.name,
            )
        return None
    if not is_prepared(model):
        logger.warning(
            "keras-mirror-kit: %s: the model %r was built under a kmk.distributed() strategy "
            "but compiled outside its `with` block, so its fit() runs without the kit's "
            "checks and workarounds; call compile() inside the block",
            callback_name,
            model.name,
        )
    return dist
