"""Which GPUs are visible, read as CUDA reads them, without importing TensorFlow.

Shared by the launcher (`--gpus-per-worker`) and `cluster` (a Slurm task's GPUs).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping

__all__ = ["GPU_ENV", "visible_gpus"]

GPU_ENV = "CUDA_VISIBLE_DEVICES"
NVIDIA_SMI_TIMEOUT_S = 30.0


def _parse_visible_devices(value: str) -> list[str]:
    """CUDA's reading of CUDA_VISIBLE_DEVICES: the entries before an empty or negative one."""
    gpus: list[str] = []
    for entry in (part.strip() for part in value.split(",")):
        if not entry or entry.startswith("-"):
            break
        gpus.append(entry)
    return gpus


def visible_gpus(
    environ: Mapping[str, str] | None = None, nvidia_smi: str | None = "nvidia-smi"
) -> list[str]:
    """The GPUs the launcher can hand out, as `CUDA_VISIBLE_DEVICES` entries (TensorFlow unused).

    When `CUDA_VISIBLE_DEVICES` is set, its entries, read as CUDA reads them (up to the
    first empty or negative entry, so `-1` and `""` mean no GPU; indexes and `GPU-...`
    UUIDs are kept as written). Otherwise the `GPU <i>:` lines of `nvidia-smi -L` as indexes
    `"0"`, `"1"`, ...; none when `nvidia-smi` is missing or fails (`nvidia_smi=None`: not asked).
    """
    environ = os.environ if environ is None else environ
    if GPU_ENV in environ:
        return _parse_visible_devices(environ[GPU_ENV])
    program = shutil.which(nvidia_smi) if nvidia_smi else None
    if program is None:
        return []
    try:
        listing = subprocess.run(
            [program, "-L"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    if listing.returncode != 0:
        return []
    gpus = []
    for line in listing.stdout.splitlines():
        head = line.split(":", 1)[0].split()
        if len(head) == 2 and head[0] == "GPU" and head[1].isdigit():
            gpus.append(head[1])
    return gpus
