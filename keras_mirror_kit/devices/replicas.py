"""Replica devices: which devices get a replica, and simulated replicas.

`simulate_replicas(n)` splits the CPU (or the first GPU) into `n` logical devices so
multi-replica code runs on a laptop or in CI; it must run before TensorFlow initialises its
devices, which is also when the `KMK_SIMULATE_REPLICAS` environment variable is read.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import tensorflow as tf

from keras_mirror_kit.validation import pick_devices, positive_int

__all__ = [
    "SIMULATE_REPLICAS_ENV",
    "replica_devices",
    "simulate_replicas",
]

logger = logging.getLogger("keras_mirror_kit")

SIMULATE_REPLICAS_ENV = "KMK_SIMULATE_REPLICAS"
DEFAULT_GPU_MEMORY_LIMIT_MB = 2048


def simulate_replicas(
    n: int, *, device_type: str | None = None, memory_limit_mb: int | None = None
) -> None:
    """TensorFlow's side of `kmk.simulate_replicas` (`keras_mirror_kit.backends`): `n` logical
    devices of the first GPU (the other GPUs hidden), else of the CPU."""
    n = positive_int("n", n)
    gpus = tf.config.list_physical_devices("GPU")
    if device_type is None:
        device_type = "GPU" if gpus else "CPU"
    device_type = str(device_type).upper()
    if device_type not in ("CPU", "GPU"):
        raise ValueError(
            f"`device_type` must be 'CPU' or 'GPU'. Received: device_type={device_type!r}"
        )
    physical = tf.config.list_physical_devices(device_type)
    if not physical:
        raise ValueError(
            f"simulate_replicas: no physical {device_type} is visible to TensorFlow. "
            f"Received: device_type={device_type!r}"
        )
    if device_type == "GPU":
        limit = memory_limit_mb or DEFAULT_GPU_MEMORY_LIMIT_MB
        configs = [tf.config.LogicalDeviceConfiguration(memory_limit=limit)] * n
    else:
        configs = [tf.config.LogicalDeviceConfiguration()] * n
    # Only the split device keeps replicas: on a host with G GPUs, hide GPUs 1..G-1, or
    # the default device list would hold n + G - 1 replicas.
    visible = [physical[0]] if device_type == "GPU" else None
    existing = tf.config.get_logical_device_configuration(physical[0])
    already_visible = visible is None or tf.config.get_visible_devices("GPU") == visible
    if existing is not None and len(existing) == n and already_visible:
        return
    try:
        if visible is not None:
            tf.config.set_visible_devices(visible, "GPU")
        tf.config.set_logical_device_configuration(physical[0], configs)
    except RuntimeError as err:
        have = len(tf.config.list_logical_devices(device_type))
        if have == n:
            return
        raise RuntimeError(
            f"simulate_replicas({n}) was called after TensorFlow initialised its devices "
            f"(it now has {have} logical {device_type} device(s)). Call "
            f"kmk.simulate_replicas({n}) at the very top of your script, before any "
            f"TensorFlow tensor, model or strategy is created, or set the environment "
            f"variable {SIMULATE_REPLICAS_ENV}={n} before starting Python."
        ) from err
    hidden = len(physical) - 1 if visible is not None else 0
    logger.info(
        "keras-mirror-kit: simulating %d %s replicas on %s%s",
        n,
        device_type,
        physical[0].name,
        f" ({hidden} other GPU(s) hidden from this process)" if hidden else "",
    )


def _canonical(name: str) -> tuple[str, int]:
    spec = tf.DeviceSpec.from_string(name)
    if spec.device_type is None:
        raise ValueError(f"Not a device name (expected e.g. '/gpu:0'). Received: {name!r}")
    return spec.device_type.upper(), int(spec.device_index or 0)


def replica_devices(devices: Sequence[str] | None = None) -> list[str]:
    """Full names of the devices that get one replica each (default: every GPU, else the CPUs).

    Without GPUs that is one CPU, unless `simulate_replicas` configured several. Explicit
    `devices` (`["/gpu:0", "/gpu:1"]`) are checked: `TypeError` for a string or non-strings,
    `ValueError` for an empty list, a repeat or a device that does not exist.
    """
    gpus = tf.config.list_logical_devices("GPU")
    if devices is None:
        chosen = gpus or tf.config.list_logical_devices("CPU")
        return [d.name for d in chosen]
    if isinstance(devices, str) or not isinstance(devices, Sequence):
        raise TypeError(
            "`devices` must be a list of device names such as ['/gpu:0', '/gpu:1']. "
            f"Received: devices={devices!r}"
        )
    if not devices:
        raise ValueError("`devices` must name at least one device. Received: devices=[]")
    available = {_canonical(d.name): d.name for d in tf.config.list_logical_devices()}
    return pick_devices(devices, _canonical, available, sorted(available.values()))
