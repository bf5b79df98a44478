"""Devices: where the replicas run, how they all-reduce, and what the GPUs can do.

Everything here runs before or while the strategy is created.

- `replicas`: the replica devices, and `simulate_replicas` / `KMK_SIMULATE_REPLICAS`, which
  split one device into several logical ones.
- `all_reduce`: the choice of cross-device ops from the device table, NCCL's availability
  and fall-back, and `mirrored_strategy`.
- `gpu_diagnostics`: NVIDIA GPUs TensorFlow does not use, and which CUDA kernels this
  TensorFlow wheel has for each GPU (`keras-mirror-kit info`).

Every public name is importable from `keras_mirror_kit.devices` (those outside `__all__`,
such as `DEFAULT_GPU_MEMORY_LIMIT_MB`, as `X as X`). The modules look names up in their
own namespace, so a test patches a function or flag in the module that defines it.
"""

from __future__ import annotations

from keras_mirror_kit.devices.all_reduce import (
    CROSS_DEVICE_OPS,
    choose_cross_device_ops,
    device_table,
    make_cross_device_ops,
    mirrored_strategy,
    nccl_available,
    nccl_fallback,
    probe_all_reduce,
)
from keras_mirror_kit.devices.all_reduce import DeviceTable as DeviceTable
from keras_mirror_kit.devices.gpu_diagnostics import PIP_CUDA_FIX as PIP_CUDA_FIX
from keras_mirror_kit.devices.gpu_diagnostics import (
    describe_gpus,
    gpu_report,
    kernel_support,
    nvidia_hardware_signs,
    unused_gpu_warning,
    warn_if_gpus_unused,
)
from keras_mirror_kit.devices.replicas import (
    DEFAULT_GPU_MEMORY_LIMIT_MB as DEFAULT_GPU_MEMORY_LIMIT_MB,
)
from keras_mirror_kit.devices.replicas import (
    SIMULATE_REPLICAS_ENV,
    replica_devices,
    simulate_replicas,
)

__all__ = [
    "CROSS_DEVICE_OPS",
    "SIMULATE_REPLICAS_ENV",
    "choose_cross_device_ops",
    "describe_gpus",
    "device_table",
    "gpu_report",
    "kernel_support",
    "make_cross_device_ops",
    "mirrored_strategy",
    "nccl_available",
    "nccl_fallback",
    "nvidia_hardware_signs",
    "probe_all_reduce",
    "replica_devices",
    "simulate_replicas",
    "unused_gpu_warning",
    "warn_if_gpus_unused",
]
