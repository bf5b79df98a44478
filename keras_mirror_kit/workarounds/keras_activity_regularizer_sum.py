"""A layer's activity regularizer on several replicas, before Keras 3.14: refused before any step.

No upstream report found; Keras 3.14 changed it (`Layer.__call__` divides each activity
regularizer's value by the batch size). Before 3.14 Keras adds a layer's
`activity_regularizer(output)` as a *sum* over the rows of the batch. Under a
`tf.distribute` strategy each replica's term is the sum over its own part, divided by the
number of replicas like every loss, so N replicas train with 1/N of one device's penalty
(measured on Keras 3.12.1: 0.013 in the weights after one step of a 13-row batch on 2
replicas; plain Keras differs the same way). The kit cannot tell these terms from a
model's other `add_loss` terms once they are added, so it refuses such a model on several
replicas where Keras still sums them, with what to write instead; from Keras 3.14 the term
is a mean over the replica's part and the kit weighs it exactly (`keras_replica_shares`,
`own_steps`). Keras' JAX backend computes each step over the global batch: nothing to
refuse there. Remove this module when the oldest supported Keras is 3.14.
"""

from __future__ import annotations

import inspect
from typing import Any

import keras

from keras_mirror_kit.upstream import versions

__all__ = ["check", "sums_over_the_batch"]


def sums_over_the_batch() -> bool:
    """Whether this Keras adds an activity regularizer's value as a sum over the batch (its
    `Layer.__call__` does not divide it by the batch size: Keras before 3.14)."""
    try:
        source = inspect.getsource(keras.layers.Layer.__call__)
    except (OSError, TypeError):
        return not versions.keras_version_in(((3, 14, 0), (99, 0, 0)))
    return "activity_regularizer" in source and "batch_size" not in source


def check(model: Any, replicas: int, origin: str) -> None:
    """Refuses (`ValueError`) a model with activity regularizers on several replicas where
    Keras sums them over the batch."""
    if replicas <= 1:
        return
    flatten = getattr(model, "_flatten_layers", None)
    layers = list(flatten(include_self=True)) if callable(flatten) else []
    regularized = [layer.name for layer in layers if getattr(layer, "activity_regularizer", None)]
    if not regularized or not sums_over_the_batch():
        return
    raise ValueError(
        f"The model {origin} has layers with an activity_regularizer ({', '.join(regularized)}),"
        f" which Keras {keras.__version__} adds as a sum over the batch (Keras 3.14 and later "
        f"divide it by the batch size). On {replicas} replicas each replica sums its own "
        "part and Keras divides that by the number of replicas, so the penalty would not be "
        "one device's, and the kit cannot tell it from the model's other add_loss terms. "
        "Upgrade to Keras >= 3.14 (pip install 'keras>=3.14'), train on one device "
        "(kmk.distributed(..., devices=['/gpu:0'])), or add the penalty yourself as a mean "
        "over the batch (self.add_loss(1e-4 * ops.mean(ops.sum(ops.abs(h), axis=-1)))). "
        f"Received: activity_regularizer layers={regularized}, keras=={keras.__version__}, "
        f"replicas={replicas}"
    )
