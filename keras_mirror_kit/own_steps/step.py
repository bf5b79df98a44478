"""The kit's wrapper of a model's own `train_step` and `test_step`.

On each replica (tf.distribute runs the step once per replica) the wrapper makes the
step's `StepContext` from the replica's part of the data, refuses a training part without
rows, runs the model's step with one device's losses
(`workarounds.keras_own_step_losses`) in that context (read by the optimizers, metrics
and random draws of this package), and gives `fit` one device's figures for what the
step returns: the metrics it updated are made whole on every replica, a metric result it
returns is read again from them, and each other scalar float it returns becomes the
share-weighted sum over the replicas (identical on every replica): one all-reduce.
"""

from __future__ import annotations

import functools
from typing import Any

import tensorflow as tf

from keras_mirror_kit.own_steps.context import StepContext, stepping
from keras_mirror_kit.own_steps.metrics import StepMetrics
from keras_mirror_kit.upstream import keras_private
from keras_mirror_kit.workarounds import rows_of
from keras_mirror_kit.workarounds.keras_own_step_losses import one_device_losses
from keras_mirror_kit.workarounds.keras_replica_shares import EMPTY_PART

__all__ = ["wrap"]


def _one_device_outputs(step: StepContext, outputs: Any) -> Any:
    """`outputs` as one device's: the metrics the step updated made whole on every replica
    (`metrics.StepMetrics`), each metric result it returns read again from them, and each
    other scalar float it returns replaced by its share-weighted sum over the replicas; one
    all-reduce for all of it."""
    if step.replicas <= 1:
        return outputs
    leaves = tf.nest.flatten(outputs)
    scalars = [
        i
        for i, leaf in enumerate(leaves)
        if isinstance(leaf, tf.Tensor) and leaf.dtype.is_floating and leaf.shape.rank == 0
    ]
    present = step.rows > 0
    figures = [tf.where(present, leaves[i], tf.zeros_like(leaves[i])) for i in scalars]
    summed, again = step.metrics.finish(step, figures)
    for i, value in zip(scalars, summed, strict=True):
        read = again(leaves[i])
        leaves[i] = value if read is None else read
    return tf.nest.pack_sequence_as(outputs, leaves)


def wrap(original: Any, *, training: bool, probe_of: Any, seed_generator: Any) -> Any:
    """The kit's step around `original` (a bound `train_step` or `test_step`).

    `probe_of()` returns the probe under way (`own_steps.probe`) or None; `seed_generator`
    draws the step's unseeded random numbers (`own_steps.random_draws`).
    """
    data_adapter_utils = keras_private.data_adapter_utils()

    @functools.wraps(original)
    def own_step(data: Any) -> Any:
        replica_context = tf.distribute.get_replica_context()
        if replica_context is None:  # cross-replica: not a step of fit()
            return original(data)
        x = data_adapter_utils.unpack_x_y_sample_weight(data)[0]
        rows = rows_of(x if x is not None else data)
        step = StepContext(rows, replica_context, probe_of(), seed_generator)
        step.metrics = StepMetrics() if step.replicas > 1 else None
        if training and step.replicas > 1 and not step.even:
            check = tf.debugging.assert_positive(step.rows, message=EMPTY_PART)
            data = tf.nest.map_structure(
                lambda leaf: _after(check, leaf) if isinstance(leaf, tf.Tensor) else leaf, data
            )
        with stepping(step), one_device_losses(step.rows_and_total):
            outputs = original(data)
        return _one_device_outputs(step, outputs)

    return own_step


def _after(check: Any, leaf: tf.Tensor) -> tf.Tensor:
    with tf.control_dependencies([check]):
        return tf.identity(leaf)
