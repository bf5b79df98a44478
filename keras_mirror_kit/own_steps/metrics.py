"""Every metric an own step updates holds one device's figures, on every replica.

Under a strategy a metric's variables are per replica (Keras creates them `on_read`), each
replica updates its copy with its part, and `fit` logs the mean over the replicas of what
each copy gives: a loss tracker given a loss per replica averages the replicas alike,
whatever their rows. Inside an own step (`context.current()`) on several replicas:

* an `update_state` of a metric reachable from the model given one scalar value and no
  `sample_weight` (a loss tracker: `Mean` or `Sum`) weighs it by the replica's share of
  the batch's rows, as one device's `update_state(loss)` counts the batch once; a replica
  without rows (the last batch of an evaluation) adds nothing of its own;
* at the end of the step (`StepMetrics.finish`, called by `own_steps.step`), what the
  step's updates added to the metrics' variables on all replicas together is known on
  every replica: one all-reduce for every metric the step updated and every figure it
  returns. Each replica's copy of a float variable then holds 1/N of one device's value,
  so that the sum Keras reads outside the step (the epoch's logs, `evaluate`'s result) is
  one device's, and a ratio (a mean, an accuracy) read inside it too; a figure the step
  returns from `metric.result()` is read again with one device's values in place: one
  device's figure.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import keras
import tensorflow as tf

from keras_mirror_kit.own_steps.context import StepContext, current

__all__ = ["StepMetrics", "globalize"]

_GLOBAL: weakref.WeakSet[Any] = weakref.WeakSet()


class StepMetrics:
    """The metrics one replica's step updated, and the results it read, until `finish`."""

    def __init__(self) -> None:
        self._before: dict[int, tuple[Any, list[Any], list[tf.Tensor]]] = {}
        self._results: list[tuple[Any, Any, int]] = []  # (result leaf, metric, index)

    def touch(self, metric: Any) -> list[tf.Tensor]:
        """The metric's variables before the step's first update of it (read now, once)."""
        if id(metric) not in self._before:
            variables = [v.value for v in metric.variables]
            self._before[id(metric)] = (metric, variables, [tf.identity(v) for v in variables])
        return self._before[id(metric)][2]

    def read(self, metric: Any, result: Any) -> None:
        """Notes the leaves of a `metric.result()` read in the step."""
        for index, leaf in enumerate(tf.nest.flatten(result)):
            self._results.append((leaf, metric, index))

    def finish(self, step: StepContext, figures: list[tf.Tensor]) -> tuple[list[Any], Any]:
        """Makes the metrics whole (one all-reduce with the share-weighted `figures`); returns
        the summed figures and a function giving a result leaf read again with one device's
        values (or None for a leaf no result gave)."""
        touched = list(self._before.values())
        changes = [
            tf.identity(v) - b
            for _, variables, before in touched
            for v, b in zip(variables, before)
        ]
        share = step.share
        weighted = [f * tf.cast(share, f.dtype) for f in figures]
        summed = step.all_reduce([*changes, *weighted]) if changes or weighted else []
        n, position = step.replicas, 0
        whole: list[tuple[Any, Any, bool]] = []  # (variable, one device's value, split)
        for _, variables, before in touched:
            for variable, base in zip(variables, before, strict=True):
                split = variable.dtype.is_floating  # each copy holds 1/N of it
                one = base * tf.cast(n, base.dtype) if split else base
                whole.append((variable, one + summed[position], split))
                position += 1
        in_place = [variable.assign(value) for variable, value, _ in whole]
        read_back: dict[int, list[tf.Tensor]] = {}
        with tf.control_dependencies(in_place):
            for metric in {id(m): m for _, m, _ in self._results}.values():
                read_back[id(metric)] = [tf.identity(r) for r in tf.nest.flatten(metric.result())]
        reads = [r for values in read_back.values() for r in values]
        with tf.control_dependencies(reads or in_place):
            for variable, value, split in whole:
                if split:
                    variable.assign(value / tf.cast(n, value.dtype))

        def again(leaf: Any) -> Any:
            for found, metric, index in self._results:
                if found is leaf:
                    return read_back[id(metric)][index]
            return None

        return list(summed[position:]), again


def _scalar_loss(metric: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The value of a loss tracker's update (one scalar, no `sample_weight`), else None."""
    if not isinstance(metric, (keras.metrics.Mean, keras.metrics.Sum)):
        return None
    if isinstance(metric, keras.metrics.MeanMetricWrapper) or len(args) + len(kwargs) != 1:
        return None
    value = kwargs.get("values", args[0] if args else None)
    if value is None:
        return None
    value = tf.cast(tf.convert_to_tensor(value), metric.dtype)  # an int loss counts too
    return value if value.shape.rank == 0 else None


def globalize(metric: Any) -> None:
    """Makes `metric` hold one device's figures inside own steps (module docstring; once)."""
    if metric in _GLOBAL:
        return
    update_original, result_original = metric.update_state, metric.result

    @functools.wraps(update_original)
    def update_state(*args: Any, **kwargs: Any) -> Any:
        step = current()
        if step is None or step.replicas <= 1 or step.metrics is None:
            return update_original(*args, **kwargs)
        before = step.metrics.touch(metric)
        value = _scalar_loss(metric, args, kwargs)

        def update() -> Any:
            if value is None:
                update_original(*args, **kwargs)
            elif isinstance(metric, keras.metrics.Sum):
                update_original(value * tf.cast(step.share, value.dtype))
            else:
                update_original(value, sample_weight=tf.cast(step.share, value.dtype))
            return tf.constant(0)

        with tf.control_dependencies(before):
            tf.cond(step.rows > 0, update, lambda: tf.constant(0))
        return None

    @functools.wraps(result_original)
    def result() -> Any:
        found = result_original()
        step = current()
        if step is not None and step.replicas > 1 and step.metrics is not None:
            step.metrics.read(metric, found)
        return found

    object.__setattr__(metric, "update_state", update_state)
    object.__setattr__(metric, "result", result)
    _GLOBAL.add(metric)
