"""Datasets: CIFAR-10 from local files (verified, safely unpickled) and synthetic data.

This is a core-layer module: it depends on NumPy and the standard library only.
"""

from keras_mirror_kit.datasets.cifar10 import (
    CIFAR10_CLASS_NAMES,
    CIFAR10_SHA256,
    CIFAR10_URL,
    CIFAR10ChecksumError,
    CIFAR10FormatError,
    CIFAR10NotAvailableError,
    default_cache_dir,
    load_cifar10,
)
from keras_mirror_kit.datasets.safe_pickle import SafeUnpickler, UnsafePickleError
from keras_mirror_kit.datasets.synthetic import make_synthetic_cifar10

__all__ = [
    "CIFAR10_CLASS_NAMES",
    "CIFAR10_SHA256",
    "CIFAR10_URL",
    "CIFAR10ChecksumError",
    "CIFAR10FormatError",
    "CIFAR10NotAvailableError",
    "SafeUnpickler",
    "UnsafePickleError",
    "default_cache_dir",
    "load_cifar10",
    "make_synthetic_cifar10",
]
