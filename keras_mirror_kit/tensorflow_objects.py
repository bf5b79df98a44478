"""Whether an object is a TensorFlow one, without importing TensorFlow.

On Keras' JAX backend TensorFlow may be absent (a GPU machine with JAX alone) or installed
but unused. An object can only be a `tf.data.Dataset` or a tensor if TensorFlow has been
imported, so these checks read `sys.modules` and import nothing: the core stays importable,
and fast to import, without TensorFlow.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

__all__ = ["is_dataset", "is_distributed_dataset", "is_tensor", "tensorflow_if_imported"]


def tensorflow_if_imported() -> ModuleType | None:
    """The `tensorflow` module if this process has imported it, else None."""
    module = sys.modules.get("tensorflow")
    return module if isinstance(module, ModuleType) else None


def is_dataset(x: Any) -> bool:
    """Whether `x` is a `tf.data.Dataset`."""
    tf = tensorflow_if_imported()
    return tf is not None and isinstance(x, tf.data.Dataset)


def is_distributed_dataset(x: Any) -> bool:
    """Whether `x` is a `tf.distribute.DistributedDataset` (already split over replicas)."""
    tf = tensorflow_if_imported()
    return tf is not None and isinstance(x, tf.distribute.DistributedDataset)


def is_tensor(x: Any) -> bool:
    """Whether `x` is a TensorFlow tensor."""
    tf = tensorflow_if_imported()
    return tf is not None and isinstance(x, tf.Tensor)
