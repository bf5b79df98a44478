"""GPU environment diagnostics: NVIDIA GPUs TensorFlow does not use, and CUDA kernel support.

`warn_if_gpus_unused` explains, once per process, why training runs on the CPU on a machine
that has NVIDIA GPUs; `gpu_report` is what `keras-mirror-kit info` says about the CUDA build
and each GPU.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import shutil
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

__all__ = [
    "describe_gpus",
    "gpu_report",
    "kernel_support",
    "nvidia_hardware_signs",
    "unused_gpu_warning",
    "warn_if_gpus_unused",
]

logger = logging.getLogger("keras_mirror_kit")

PIP_CUDA_FIX = 'pip install "tensorflow[and-cuda]"'
_gpu_warning_logged = False


def nvidia_hardware_signs(
    dev_dir: str = "/dev",
    proc_dir: str = "/proc/driver/nvidia",
    which: Callable[[str], str | None] = shutil.which,
) -> list[str]:
    """Signs of NVIDIA GPUs, found without TensorFlow: `/dev/nvidia0`, `nvidia-smi on PATH`..."""
    signs = sorted(glob.glob(os.path.join(glob.escape(dev_dir), "nvidia[0-9]*")))
    gpus_dir = os.path.join(proc_dir, "gpus")
    if os.path.isdir(gpus_dir) and os.listdir(gpus_dir):
        signs.append(gpus_dir)
    if which("nvidia-smi"):
        signs.append("nvidia-smi on PATH")
    return signs


def _hidden_by_environment(cuda_visible_devices: str | None) -> bool:
    if cuda_visible_devices is None:
        return False
    first = cuda_visible_devices.split(",")[0].strip()
    return first in ("", "-1")


def unused_gpu_warning(
    *,
    tf_gpus: int,
    signs: Sequence[str],
    build_info: dict[str, Any],
    cuda_visible_devices: str | None,
) -> str | None:
    """Why TensorFlow sees no GPU on a machine with NVIDIA GPUs, or None.

    None when there is nothing to warn about: TensorFlow has GPUs, no NVIDIA GPU is in sight,
    or `CUDA_VISIBLE_DEVICES` hides them on purpose.
    """
    if tf_gpus or not signs or _hidden_by_environment(cuda_visible_devices):
        return None
    seen = ", ".join(signs)
    if not build_info.get("is_cuda_build"):
        return (
            f"keras-mirror-kit: this machine has NVIDIA GPUs ({seen}) but this TensorFlow build "
            "has no CUDA support, so training runs on the CPU. On Linux, install the CUDA "
            f"build: {PIP_CUDA_FIX}"
        )
    cuda, cudnn = build_info.get("cuda_version", "?"), build_info.get("cudnn_version", "?")
    return (
        f"keras-mirror-kit: this machine has NVIDIA GPUs ({seen}) but TensorFlow registered "
        f"none, so training runs on the CPU. This TensorFlow is built for CUDA {cuda} / "
        f"cuDNN {cudnn}; most likely those CUDA libraries are missing or do not load (see "
        "TensorFlow's 'Cannot dlopen some GPU libraries' line at start-up). Fix: "
        f"{PIP_CUDA_FIX} in this environment, and check the NVIDIA driver with nvidia-smi"
    )


def warn_if_gpus_unused() -> str | None:
    """Logs `unused_gpu_warning` for this machine as a WARNING, once per process; returns it."""
    global _gpu_warning_logged
    message = unused_gpu_warning(
        tf_gpus=len(tf.config.list_physical_devices("GPU")),
        signs=nvidia_hardware_signs(),
        build_info=dict(tf.sysconfig.get_build_info()),
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
    )
    if message and not _gpu_warning_logged:
        _gpu_warning_logged = True
        logger.warning(message)
    return message


def _parse_capability(entry: str) -> tuple[str, tuple[int, int], bool] | None:
    """`"sm_86"` -> ("sm", (8, 6), False); `"sm_90a"` -> ("sm", (9, 0), True)."""
    match = re.fullmatch(r"(sm|compute)_(\d+)([a-z]?)", entry.strip())
    if match is None:
        return None
    number = int(match.group(2))
    return match.group(1), (number // 10, number % 10), bool(match.group(3))


def kernel_support(
    compute_capability: tuple[int, int], compiled: Sequence[str]
) -> tuple[str, str | None]:
    """`("native" | "ptx-jit" | "none" | "unknown", warning or None)` for a GPU's capability.

    A kernel compiled for `sm_XY` runs on GPUs of major version X and minor >= Y; PTX
    (`compute_XY`) is compiled by the driver at first use for any GPU >= X.Y, which for
    TensorFlow takes many minutes. `"unknown"`: the wheel lists no capabilities.
    """
    parsed = [p for p in map(_parse_capability, compiled) if p is not None]
    if not parsed:
        return "unknown", None
    cc = tuple(compute_capability)
    shown = f"{cc[0]}.{cc[1]}"
    listed = ", ".join(compiled)
    for kind, (major, minor), specific in parsed:
        if kind == "sm" and major == cc[0] and (minor == cc[1] if specific else minor <= cc[1]):
            return "native", None
    if any(kind == "compute" and version <= cc for kind, version, _ in parsed):
        return "ptx-jit", (
            f"the GPU's compute capability {shown} is newer than the kernels compiled into "
            f"this TensorFlow wheel ({listed}): the driver compiles TensorFlow's kernels from "
            "PTX at first use, which can take many minutes (the result is cached in "
            "~/.nv/ComputeCache; raise CUDA_CACHE_MAXSIZE so it fits). A TensorFlow release "
            "built for this GPU avoids it"
        )
    return "none", (
        f"no kernel of this TensorFlow wheel ({listed}) runs on compute capability {shown}; "
        "use a TensorFlow release built for this GPU"
    )


_BUILD_KEYS = ("is_cuda_build", "is_rocm_build", "cuda_version", "cudnn_version")


def describe_gpus(
    gpus: Sequence[tuple[str, dict[str, Any]]], build_info: dict[str, Any]
) -> tuple[dict[str, Any], list[dict[str, Any]], list[str]]:
    """`(build, rows, warnings)`: what `keras-mirror-kit info` says about the CUDA build and GPUs.

    One row per GPU (`name`, `device_name`, `compute_capability` as "9.0" or "?", `kernels` as
    `kernel_support` says), and a warning for each GPU the wheel has no native kernels for.
    """
    compiled = list(build_info.get("cuda_compute_capabilities") or [])
    build = {key: build_info[key] for key in _BUILD_KEYS if key in build_info}
    build["cuda_compute_capabilities"] = compiled
    rows: list[dict[str, Any]] = []
    warnings: list[str] = []
    for name, details in gpus:
        capability = details.get("compute_capability")
        row = {"name": name, "device_name": details.get("device_name", "?")}
        if capability is None:
            row.update(compute_capability="?", kernels="unknown")
        else:
            support, warning = kernel_support(tuple(capability), compiled)  # type: ignore[arg-type]
            row.update(compute_capability=f"{capability[0]}.{capability[1]}", kernels=support)
            if warning:
                warnings.append(f"{name}: {warning}")
        rows.append(row)
    return build, rows, warnings


def gpu_report() -> tuple[dict[str, Any], list[dict[str, Any]], list[str]]:
    """`describe_gpus` for this machine's visible physical GPUs."""
    gpus = []
    for gpu in tf.config.list_physical_devices("GPU"):
        try:
            details = dict(tf.config.experimental.get_device_details(gpu))
        except (RuntimeError, ValueError):
            details = {}
        gpus.append((gpu.name, details))
    return describe_gpus(gpus, dict(tf.sysconfig.get_build_info()))
