"""Every optimizer an own step applies: each replica's gradients weighted by its share.

Keras' TensorFlow optimizer sums the replicas' gradients (`_all_reduce_sum_gradients`).
Inside an own step (`context.current()`), the optimizer's `apply` (which `apply_gradients`
calls) first multiplies the replica's gradients by its share of the batch's rows, so the
sum is the share-weighted mean of what each replica's step computed: one device's
gradient, when the step computes one device's loss on its part. In a probe step
(`own_steps.probe`) it applies nothing and records what it would apply instead.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import tensorflow as tf

from keras_mirror_kit.own_steps.context import current
from keras_mirror_kit.workarounds.tf_grappler_update_order import after_all

__all__ = ["weigh"]

_WEIGHED: weakref.WeakSet[Any] = weakref.WeakSet()


def _weighted(gradient: Any, share: tf.Tensor) -> Any:
    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(
            gradient.values * tf.cast(share, gradient.values.dtype),
            gradient.indices,
            gradient.dense_shape,
        )
    return gradient * tf.cast(share, gradient.dtype)


def weigh(optimizer: Any) -> None:
    """Makes `optimizer.apply` weigh each replica's gradients inside own steps (once)."""
    if optimizer in _WEIGHED:
        return
    original = optimizer.apply

    @functools.wraps(original)
    def apply(grads: Any, trainable_variables: Any = None) -> Any:
        step = current()
        if step is None:
            return original(grads, trainable_variables)
        grads = list(grads)
        variables = list(trainable_variables) if trainable_variables is not None else None
        if step.probe is not None:
            step.probe.applied(optimizer, grads, variables, step)
            return None
        if step.replicas > 1:
            share = after_all(grads, step.share)  # every update after every gradient
            grads = [_weighted(g, share) for g in grads]
        return original(grads, variables)

    object.__setattr__(optimizer, "apply", apply)
    _WEIGHED.add(optimizer)
