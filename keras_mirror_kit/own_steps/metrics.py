"""Every metric an own step updates holds one device's figures, on every replica.

Under a strategy a metric's variables are per replica (Keras creates them `on_read`), each
replica updates its copy with its part, and `fit` logs the mean over the replicas of what
each copy gives: a loss tracker given a loss per replica averages the replicas alike,
whatever their rows. Inside an own step (`context.current()`) on several replicas, each
`update_state` of a metric reachable from the model:

* given one scalar value and no `sample_weight` (a loss tracker: `Mean` or `Sum`), weighs
  it by the replica's share of the batch's rows, as one device's `update_state(loss)` counts
  the batch once;
* then adds to every replica's copy what the update added on all replicas together (one
  all-reduce of the update's change to the metric's variables), so every copy holds what
  one device's metric holds and `fit`'s mean over the replicas is that figure.

A replica without rows (the last batch of an evaluation) adds nothing of its own.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import keras
import tensorflow as tf

from keras_mirror_kit.own_steps.context import StepContext, current

__all__ = ["globalize"]

_GLOBAL: weakref.WeakSet[Any] = weakref.WeakSet()


def _scalar_loss(metric: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this is a loss tracker's update: one scalar value, no `sample_weight`."""
    if not isinstance(metric, (keras.metrics.Mean, keras.metrics.Sum)):
        return False
    if isinstance(metric, keras.metrics.MeanMetricWrapper):
        return False
    values = kwargs.get("values", args[0] if args else None)
    if values is None or len(args) + len(kwargs) != 1:
        return False
    return getattr(tf.convert_to_tensor(values), "shape", None) is not None and not (
        tf.convert_to_tensor(values).shape.rank
    )


def _weighted_update(metric: Any, original: Any, step: StepContext, value: Any) -> None:
    value = tf.convert_to_tensor(value)
    share = tf.cast(step.share, value.dtype)
    if isinstance(metric, keras.metrics.Sum):
        original(value * share)
    else:
        original(value, sample_weight=share)


def globalize(metric: Any) -> None:
    """Makes `metric.update_state` add one device's update on every replica (once)."""
    if metric in _GLOBAL:
        return
    original = metric.update_state

    @functools.wraps(original)
    def update_state(*args: Any, **kwargs: Any) -> Any:
        step = current()
        if step is None or step.replicas <= 1:
            return original(*args, **kwargs)
        variables = [v.value for v in metric.variables]
        before = [tf.identity(v) for v in variables]
        with tf.control_dependencies(before):
            if _scalar_loss(metric, args, kwargs):
                value = kwargs.get("values", args[0] if args else None)

                def update() -> Any:
                    _weighted_update(metric, original, step, value)
                    return tf.constant(0)
            else:

                def update() -> Any:
                    original(*args, **kwargs)
                    return tf.constant(0)

            done = tf.cond(step.rows > 0, update, lambda: tf.constant(0))
        with tf.control_dependencies([done]):
            added = [tf.identity(v) - b for v, b in zip(variables, before, strict=True)]
        every = step.all_reduce(added)
        for variable, base, change in zip(variables, before, every, strict=True):
            variable.assign(base + change)
        return None

    object.__setattr__(metric, "update_state", update_state)
    _GLOBAL.add(metric)
