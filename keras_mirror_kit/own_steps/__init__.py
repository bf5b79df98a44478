"""Models that write their own training step train on N replicas as on one device.

A model whose class overrides `train_step` (keras-io's VAE and GANs, the Keras guide's
`CustomModel`) computes its losses itself. The kit gives such a step one rule, on Keras'
TensorFlow backend: **the step computes what one device computes on the batch it
receives, and the kit makes N replicas add up to one device**:

* losses are one device's on the replica's part (`workarounds.keras_own_step_losses`:
  Keras' per-replica division is undone inside the step, `tf.nn.compute_average_loss`
  adapted);
* every optimizer the model holds (`model_parts.optimizers_of`: `model.optimizer`, a GAN's
  `d_optimizer` and `g_optimizer`, ...) weighs each replica's gradients by its share of
  the batch's rows before Keras sums them (`optimizers`), and clips, agrees on float16
  overflow and overwrites with EMA as the kit's workarounds make `model.optimizer` do;
* every metric the model holds adds one device's update on every replica (`metrics`), and
  what the step returns is one device's figure (`step`): the logs are one device's;
* random draws of the step's batch size are one device's draws (`random_draws`);
* a probe step at the first `fit` checks the rule against one replica on the first batch
  and refuses, before any training step, a step whose gradients are in another proportion
  (`probe`); it also builds the optimizers the step applies, for the checkpoints.

A model without `call()` whose layers are built (keras-io's DCGAN) trains as Keras trains
it without a strategy: it is marked built instead of being built from a batch.
`test_step`s the model writes itself get the same losses, metrics and draws.
"""

from __future__ import annotations

import functools
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

import keras

from keras_mirror_kit.model_parts import has_own_step, metrics_of, optimizers_of
from keras_mirror_kit.own_steps import metrics as own_metrics
from keras_mirror_kit.own_steps import optimizers as own_optimizers
from keras_mirror_kit.own_steps import random_draws
from keras_mirror_kit.own_steps.probe import Probe, ProbeResult, probe_batch, run_probe
from keras_mirror_kit.own_steps.step import EMPTY_PART, wrap
from keras_mirror_kit.workarounds import (
    keras_ema_overwrite,
    keras_grad_accumulation,
    keras_gradient_clipping,
    keras_loss_scale,
    keras_own_step_losses,
)

__all__ = [
    "EMPTY_PART",
    "OwnStepRecord",
    "after_build",
    "apply",
    "before_build",
    "is_applied",
    "own_state",
    "record_of",
]

logger = logging.getLogger("keras_mirror_kit")

#: The seed of the generator an own step's unseeded random draws come from.
OWN_SEED = 1337


@dataclass(eq=False)
class OwnStepRecord:
    """What the kit keeps about a model with its own step (held weakly, per model)."""

    strategy: Any
    seed_generator: Any  # the step's unseeded draws (random_draws), saved in checkpoints
    probe: list[Probe | None] = field(default_factory=lambda: [None])  # the run under way
    first_batch: tuple[Any, bool] | None = None  # (rows, compare) until the probe has run
    result: ProbeResult | None = None  # the probe's findings


_RECORDS: weakref.WeakKeyDictionary[Any, OwnStepRecord] = weakref.WeakKeyDictionary()


def record_of(model: Any) -> OwnStepRecord | None:
    """The kit's record of a model with its own `train_step` (None for any other model)."""
    try:
        return _RECORDS.get(model)
    except TypeError:
        return None


def own_state(model: Any) -> list[Any]:
    """The state the kit adds to a model with its own step: its seed generator's state."""
    record = record_of(model)
    return [] if record is None else [record.seed_generator.state]


def is_applied(model: Any) -> bool:
    """Whether `apply` gave this model the own-step rule (it trains exactly on any split)."""
    return record_of(model) is not None


def _prepare_fit(model: Any, record: OwnStepRecord, probe: bool) -> None:
    """At each fit (`probe`) or evaluate: the model's optimizers and metrics get the rule;
    the probe runs once, at a fit."""
    strategy = record.strategy
    replicas = int(strategy.num_replicas_in_sync)
    if replicas > 1 and not keras_own_step_losses.install():
        keras_own_step_losses.require(
            f"{type(model).__name__}'s own train_step on {replicas} replicas"
        )
    random_draws.install()
    for optimizer in optimizers_of(model):
        own_optimizers.weigh(optimizer)
        if optimizer is not getattr(model, "optimizer", None):  # the kit fixed that one
            inner = keras_grad_accumulation.accumulating_optimizer(optimizer)
            if inner is not None:
                keras_grad_accumulation.apply(inner)
            keras_gradient_clipping.apply(optimizer, replicas)
            keras_ema_overwrite.apply(optimizer)
            if replicas > 1:
                keras_loss_scale.fix_optimizer(optimizer, replicas)
    for metric in metrics_of(model):
        own_metrics.globalize(metric)
    first, record.first_batch = record.first_batch, None
    if not probe or first is None or record.result is not None:
        return
    if not has_own_step(model, "train_step"):  # its own test_step only: Keras trains it
        return
    whole, compare = first
    record.result = run_probe(model, whole, compare, strategy, record.probe, own_state(model))
    with strategy.scope():
        for optimizer, variables in record.result.optimizer_variables:
            if not optimizer.built and variables:
                optimizer.build(variables)
    if record.result.stateful_random:
        logger.info(
            "keras-mirror-kit: %s's train_step draws random numbers with stateful "
            "TensorFlow ops (%s): each replica draws its own, and no checkpoint holds "
            "their state",
            type(model).__name__,
            ", ".join(record.result.stateful_random),
        )


def before_build(model: Any) -> None:
    """Before Keras builds a model with its own step from a batch: a model without `call()`
    whose layers are built is marked built (as Keras leaves it without a strategy);
    `ValueError` when some of its layers are not built."""
    if record_of(model) is None or model.built:
        return
    if getattr(type(model), "call", None) is not getattr(keras.Model, "call", None):
        return  # Keras builds it by calling it
    unbuilt = [
        layer.name for layer in model._flatten_layers(include_self=False) if not layer.built
    ]  # noqa: SLF001
    if unbuilt:
        raise ValueError(
            f"{type(model).__name__} defines no call() and its layers {unbuilt[:5]} are not "
            "built, so Keras cannot build it from a batch under a distribution strategy "
            "(and their variables would be created outside it). Build them in the factory "
            "(give each sub-model a keras.Input, or call it once on a batch), or define "
            f"call(). Received: model={model.name!r}"
        )
    model.built = True


def after_build(model: Any, batch: Any, iterator: Any = None) -> None:
    """Keeps rows of `fit`'s first batch for the probe (`probe.probe_batch`: where Keras'
    build took none, a `PyDataset`'s first batch or rows made from the data's spec)."""
    record = record_of(model)
    if record is None or record.result is not None or iterator is None:
        return
    if not has_own_step(model, "train_step"):
        return
    whole, compare = probe_batch(iterator, record.strategy, batch)
    record.first_batch = None if whole is None else (whole, compare)


def apply(model: Any, strategy: Any) -> bool:
    """Gives a model that writes its own `train_step` (or `test_step`) the rule (idempotent).

    Its own steps are wrapped on the instance (`step.wrap`); at each `fit` and `evaluate`
    (Keras' `make_train_function`, `make_test_function`) its optimizers and metrics are made
    to follow the rule, and the probe runs once, on `fit`'s first batch. True when the
    model has its own step.
    """
    if record_of(model) is not None:
        return True
    own = [name for name in ("train_step", "test_step") if has_own_step(model, name)]
    if not own:
        return False
    with strategy.scope():  # mirrored; created now, before any trace or restore
        # A fixed seed: drawing one from Python's `random` would move every later draw of
        # the script (a PyDataset's shuffle) away from plain Keras'.
        generator = keras.random.SeedGenerator(seed=OWN_SEED, name="own_step_seed_generator")
    record = _RECORDS[model] = OwnStepRecord(strategy, generator)

    def probe_of() -> Probe | None:
        return record.probe[0]

    for name in own:
        step = wrap(
            getattr(model, name),
            training=name == "train_step",
            probe_of=probe_of,
            seed_generator=generator,
        )
        object.__setattr__(model, name, step)
    for name in ("make_train_function", "make_test_function"):
        function = _preparing(model, record, getattr(model, name), name == "make_train_function")
        object.__setattr__(model, name, function)
    return True


def _preparing(model: Any, record: OwnStepRecord, original: Any, probe: bool) -> Any:
    """`original` (Keras' `make_train_function` or `make_test_function`) after `_prepare_fit`."""

    @functools.wraps(original)
    def make_function(*args: Any, **kwargs: Any) -> Any:
        _prepare_fit(model, record, probe)
        return original(*args, **kwargs)

    return make_function
