"""Synchronized batch normalization for models built by a factory.

With data parallelism each replica normalizes with the statistics of its own slice of the
batch, so BatchNormalization's moving statistics drift apart between replicas and the
effective normalization batch shrinks with the replica count. Keras 3's
`BatchNormalization(synchronized=True)` all-reduces the batch moments across replicas;
`synchronize_batch_norm` switches it on for every such layer of a model, nested and
Functional models included, without the factory having to pass the argument.
"""

from __future__ import annotations

import logging
from typing import Any

import keras

__all__ = ["synchronize_batch_norm"]

logger = logging.getLogger("keras_mirror_kit")


def _looks_like_batch_norm(layer: Any) -> bool:
    name = type(layer).__name__.lower().replace("_", "")
    return "batchnorm" in name


def synchronize_batch_norm(model: keras.Model) -> int:
    """Makes every `keras.layers.BatchNormalization` in `model` use cross-replica statistics.

    The layer reads `synchronized` when it is called, so this works on a built model as
    long as its train function has not been traced yet (for example right after the
    factory returns, before `fit`); the setting is part of the layer config, so a saved
    `.keras` model keeps it. Masked inputs are normalized per replica by Keras itself.

    Args:
        model: A Keras model (Sequential, Functional or subclassed, possibly nested).

    Returns:
        How many layers were switched to synchronized statistics.

    A layer whose class name says batch normalization but that is not a
    `keras.layers.BatchNormalization` (a custom layer, a layer from another library) is
    left as it is, with one WARNING naming it: its statistics stay per replica.

    Raises:
        TypeError: If `model` is not a `keras.Model`.

    Example:

    ```python
    model = build_model()
    kmk.synchronize_batch_norm(model)     # or distributed(sync_batch_norm=True)
    ```
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"synchronize_batch_norm() takes a keras.Model. Received: {type(model).__name__}"
        )
    switched = 0
    for layer in model._flatten_layers(include_self=False, recursive=True):  # noqa: SLF001
        if isinstance(layer, keras.layers.BatchNormalization):
            if not layer.synchronized:
                layer.synchronized = True
                switched += 1
        elif _looks_like_batch_norm(layer):
            logger.warning(
                "keras-mirror-kit: sync_batch_norm: layer %r (%s) looks like batch "
                "normalization but is not a keras.layers.BatchNormalization, so it was left "
                "as it is and its statistics stay per replica. Use "
                "keras.layers.BatchNormalization, or make the layer all-reduce its moments "
                "itself.",
                layer.name,
                type(layer).__name__,
            )
    return switched
