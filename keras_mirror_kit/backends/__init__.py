"""The Keras backend the kit runs on: the one place that asks, and everything that differs.

The kit runs data-parallel on two of Keras 3's backends:

* `tensorflow` (`backends.tensorflow`): `tf.distribute` (`MirroredStrategy` on one host,
  `MultiWorkerMirroredStrategy` beyond it), with the kit's workarounds for Keras' TensorFlow
  trainer and its replica-side preprocessing;
* `jax` (`backends.jax`): `keras.distribution.DataParallel` over this process's devices.
  Under SPMD the whole global batch is one computation: gradients, batch statistics and
  clipping are global by construction, so none of the TensorFlow workarounds applies.

Everything else in the kit asks `current()` for the backend's module and talks to an
`Engine` (the backend's data-parallel object behind one small interface); no other module
calls `keras.backend.backend()`. What the checkpoints ask of a backend (a variable's value
and its host copy, the finite check on the devices, the replicas' copies and their
comparison) lives in `tensorflow_state` and `jax_state`, exported by the backend's module.
Torch and NumPy are refused (Keras has no distribution API for NumPy, and the kit does not
support the one Keras 3.16 added for torch).
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from types import ModuleType
from typing import Any, Protocol

__all__ = [
    "SUPPORTED",
    "Engine",
    "check_supported",
    "configure_from_environment",
    "current",
    "engine_for",
    "name",
    "simulate_replicas",
]

#: The Keras backends the kit distributes on.
SUPPORTED = ("tensorflow", "jax")
SIMULATE_REPLICAS_ENV = "KMK_SIMULATE_REPLICAS"


class Engine(Protocol):
    """A backend's data-parallel object (a `tf.distribute.Strategy`, a `DataParallel`)."""

    @property
    def strategy(self) -> Any: ...  # what models are built under (the backend's own object)

    @property
    def strategy_name(self) -> str: ...

    @property
    def devices(self) -> tuple[str, ...]: ...  # this process's devices that hold a replica

    @property
    def num_replicas(self) -> int: ...  # over all workers

    @property
    def is_chief(self) -> bool: ...

    def scope(self) -> AbstractContextManager[Any]: ...

    def active_elsewhere(self) -> Any: ...  # another data-parallel object in scope, or None


def name() -> str:
    """The backend Keras runs on (`keras.backend.backend()`)."""
    import keras

    return str(keras.backend.backend())


def check_supported() -> str:
    """The backend's name, or a `RuntimeError` saying how to choose a supported one."""
    backend = name()
    if backend not in SUPPORTED:
        from keras_mirror_kit.upstream import versions

        if backend == "torch" and versions.keras_version_in(((3, 16, 0), (4, 0, 0))):
            why = (
                f"Keras {versions.keras_version()} has a data-parallel API for torch "
                "(keras.distribution on the torch backend), which the kit does not support "
                "yet"
            )
        else:
            why = f"Keras 3 has no data-parallel API for the {backend!r} backend"
        raise RuntimeError(
            "keras-mirror-kit distributes training on Keras' TensorFlow backend "
            "(tf.distribute) and its JAX backend (keras.distribution.DataParallel); "
            f"{why}. Select one before Keras "
            "is imported: set the environment variable KERAS_BACKEND=tensorflow (or jax), or "
            '"backend": "tensorflow" in ~/.keras/keras.json. '
            f"Received: keras.backend.backend()={backend!r}"
        )
    return backend


def current() -> ModuleType:
    """The module of the backend Keras runs on: `backends.tensorflow` or `backends.jax`."""
    backend = check_supported()
    if backend == "jax":
        from keras_mirror_kit.backends import jax as module
    else:
        from keras_mirror_kit.backends import tensorflow as module  # type: ignore[no-redef]
    return module


def engine_for(strategy: Any, cross_device_ops: str) -> Engine:
    """The `Engine` around a backend's own data-parallel object."""
    engine: Engine = current().Engine(strategy, cross_device_ops)
    return engine


def simulate_replicas(
    n: int, *, device_type: str | None = None, memory_limit_mb: int | None = None
) -> None:
    """Splits this host into `n` devices, one replica each, so multi-replica code runs anywhere.

    Call it at the top of a script, before the backend creates any tensor, model or
    strategy. Then `distributed()` finds `n` devices and builds `n` replicas.

    * TensorFlow: one physical device is split into `n` logical ones. On a host with GPUs the
      first GPU is split and the other GPUs are hidden from this process; each logical GPU
      gets `memory_limit_mb` of memory (2048 MiB by default, so `n` x 2048 MiB must fit on
      the first GPU). Otherwise the CPU is split.
    * JAX: XLA's host platform gets `n` CPU devices
      (`XLA_FLAGS=--xla_force_host_platform_device_count=n`), which `distributed()` then uses
      even on a host with GPUs; `device_type` may only be `"CPU"` and `memory_limit_mb` is
      not used.

    Calling it again with the same `n` is a no-op. `KMK_SIMULATE_REPLICAS=n` in the
    environment does the same when the first `distributed()` runs.

    Args:
        n: Number of devices (replicas) to create; a positive integer.
        device_type: `"CPU"` or `"GPU"`; defaults to `"GPU"` when TensorFlow sees a GPU.
        memory_limit_mb: Memory per logical GPU in MiB (TensorFlow and GPU only).

    Raises:
        TypeError: If `n` is not an integer.
        ValueError: If `n` is not positive or `device_type` is unknown, absent or (JAX)
            not `"CPU"`.
        RuntimeError: If the backend has already initialised its devices with another
            layout; the message says how to call it earlier.

    Example:

    ```python
    import keras_mirror_kit as kmk
    kmk.simulate_replicas(2)          # first thing in the script
    ```
    """
    current().simulate_replicas(n, device_type=device_type, memory_limit_mb=memory_limit_mb)


def configure_from_environment() -> None:
    """Applies `KMK_SIMULATE_REPLICAS=n` if set (`ValueError` unless a positive integer)."""
    raw = os.environ.get(SIMULATE_REPLICAS_ENV, "").strip()
    if not raw:
        return
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n <= 0:
        raise ValueError(
            f"The environment variable {SIMULATE_REPLICAS_ENV} must be a positive integer. "
            f"Received: {SIMULATE_REPLICAS_ENV}={raw!r}"
        )
    simulate_replicas(n)
