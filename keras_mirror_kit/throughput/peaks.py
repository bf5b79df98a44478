"""Peak FLOP/s per device: a table of GPUs, and the measured matmul roof of a CPU.

The table is keyed by the GPU's name as TensorFlow reports it
(`tf.config.experimental.get_device_details(gpu)["device_name"]`, e.g.
`"NVIDIA A100-SXM4-80GB"`) and by compute dtype: `"fp32"` (CUDA cores), `"tf32"` (tensor
cores on float32 matmuls, which TensorFlow uses by default on Ampere and newer), `"bf16"` and
`"fp16"` (tensor cores, float32 accumulation, as Keras' mixed precision runs them). Every
figure is the vendor's **dense** peak (no 2:4 structured sparsity: the datasheets' "with
sparsity" figures are halved) at boost clock, with the document it comes from. A name the
table does not know gives no peak; `ThroughputMonitor(peak_flops=...)` gives one.

CPUs have no datasheet figure worth the name, so the kit measures one:
`keras-mirror-kit bench --roof` times large matmuls in each dtype on all cores
(`measure_matmul_roof`) and stores the best rate per CPU model in a JSON file
(`roof_path()`: `$KMK_ROOF_FILE`, else `$XDG_CACHE_HOME/keras-mirror-kit/roof.json`, else
`~/.cache/keras-mirror-kit/roof.json`), where `ThroughputMonitor` finds it.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keras_mirror_kit.atomic_files import atomic_write_bytes
from keras_mirror_kit.validation import positive_int

__all__ = [
    "COMPUTE_DTYPES",
    "GPU_PEAKS",
    "ROOF_FILE_ENV",
    "GpuPeak",
    "PeakResolution",
    "compute_dtype_key",
    "cpu_has_bfloat16",
    "cpu_name",
    "gpu_peak_flops",
    "load_roof",
    "lookup_gpu",
    "measure_matmul_roof",
    "resolve_peak",
    "roof_path",
    "store_roof",
]

logger = logging.getLogger("keras_mirror_kit")

#: The compute dtypes of the table, in this order.
COMPUTE_DTYPES = ("fp32", "tf32", "bf16", "fp16")

#: Environment variable naming the file `bench --roof` writes and the monitor reads.
ROOF_FILE_ENV = "KMK_ROOF_FILE"

_T = 1e12


@dataclass(frozen=True)
class GpuPeak:
    """Dense peak FLOP/s of one GPU model, per compute dtype, with its source."""

    model: str  # e.g. "A100 SXM4"
    names: tuple[str, ...]  # names TensorFlow reports (`get_device_details()["device_name"]`)
    # Matched against the normalized name (lower case, without "nvidia", "tesla" and
    # "geforce"), for variants not listed in `names`.
    pattern: str
    flops: dict[str, float]  # by dtype key; a dtype the GPU has no fast path for is absent
    source: str  # where the figures come from


_AMPERE_WP = (
    "NVIDIA Ampere GA102 GPU Architecture whitepaper, Appendix A (dense figures): "
    "https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf"
)
_ADA_WP = (
    "NVIDIA Ada GPU Architecture whitepaper, Appendix A (dense, FP32 accumulate): "
    "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf"
)
_H100_DS = (
    "NVIDIA H100 Tensor Core GPU datasheet (sparse figures halved): "
    "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
)

#: The table: Blackwell, Hopper, Ada Lovelace, Ampere (datacenter and workstation), and
#: the Volta/Turing cards still common in clouds.
GPU_PEAKS: tuple[GpuPeak, ...] = (
    GpuPeak(
        "B200",
        ("NVIDIA B200",),
        r"^b200\b",
        {"fp32": 75 * _T, "tf32": 1125 * _T, "bf16": 2250 * _T, "fp16": 2250 * _T},
        "NVIDIA HGX B200 specifications, per GPU (8-GPU totals divided by 8, sparse "
        "figures halved): https://www.nvidia.com/en-us/data-center/hgx/",
    ),
    GpuPeak(
        "H200 NVL",
        ("NVIDIA H200 NVL",),
        r"^h200 nvl",
        {"fp32": 60 * _T, "tf32": 417.5 * _T, "bf16": 835.5 * _T, "fp16": 835.5 * _T},
        "NVIDIA H200 datasheet, H200 NVL column (sparse figures halved): "
        "https://www.nvidia.com/en-us/data-center/h200/",
    ),
    GpuPeak(
        "H200 SXM",
        ("NVIDIA H200",),
        r"^h200\b",
        {"fp32": 67 * _T, "tf32": 494.7 * _T, "bf16": 989.4 * _T, "fp16": 989.4 * _T},
        "NVIDIA H200 datasheet, H200 SXM column (sparse figures halved): "
        "https://www.nvidia.com/en-us/data-center/h200/",
    ),
    GpuPeak(
        "GH200",
        ("NVIDIA GH200 480GB", "NVIDIA GH200 144G HBM3e"),
        r"^gh200\b",
        {"fp32": 67 * _T, "tf32": 494.7 * _T, "bf16": 989.4 * _T, "fp16": 989.4 * _T},
        "NVIDIA GH200 Grace Hopper Superchip datasheet (the H100 SXM's tensor cores; "
        "sparse figures halved): https://www.nvidia.com/en-us/data-center/grace-hopper-superchip/",
    ),
    GpuPeak(
        "H100 NVL",
        ("NVIDIA H100 NVL",),
        r"^h100 nvl",
        {"fp32": 60 * _T, "tf32": 417.5 * _T, "bf16": 835.5 * _T, "fp16": 835.5 * _T},
        _H100_DS + " (H100 NVL column, per GPU)",
    ),
    GpuPeak(
        "H100 PCIe",
        ("NVIDIA H100 PCIe",),
        r"^h100.*pcie",
        {"fp32": 51 * _T, "tf32": 378 * _T, "bf16": 756 * _T, "fp16": 756 * _T},
        _H100_DS + " (H100 PCIe column)",
    ),
    GpuPeak(
        "H100 SXM",
        ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM5 80GB"),
        r"^h100\b",
        {"fp32": 67 * _T, "tf32": 494.7 * _T, "bf16": 989.4 * _T, "fp16": 989.4 * _T},
        _H100_DS + " (H100 SXM column)",
    ),
    GpuPeak(
        "L40S",
        ("NVIDIA L40S",),
        r"^l40s\b",
        {"fp32": 91.6 * _T, "tf32": 183 * _T, "bf16": 366 * _T, "fp16": 366 * _T},
        "NVIDIA L40S datasheet (sparse figures halved): "
        "https://www.nvidia.com/en-us/data-center/l40s/",
    ),
    GpuPeak(
        "L40",
        ("NVIDIA L40",),
        r"^l40\b",
        {"fp32": 90.5 * _T, "tf32": 90.5 * _T, "bf16": 181 * _T, "fp16": 181 * _T},
        "NVIDIA L40 datasheet (sparse figures halved): "
        "https://www.nvidia.com/en-us/data-center/l40/",
    ),
    GpuPeak(
        "L4",
        ("NVIDIA L4",),
        r"^l4\b",
        {"fp32": 30.3 * _T, "tf32": 60 * _T, "bf16": 121 * _T, "fp16": 121 * _T},
        "NVIDIA L4 datasheet (sparse figures halved): "
        "https://www.nvidia.com/en-us/data-center/l4/",
    ),
    GpuPeak(
        "RTX 6000 Ada",
        ("NVIDIA RTX 6000 Ada Generation",),
        r"^rtx 6000 ada",
        {"fp32": 91.1 * _T, "tf32": 182.1 * _T, "bf16": 364.2 * _T, "fp16": 364.2 * _T},
        _ADA_WP,
    ),
    GpuPeak(
        "RTX 4090",
        ("NVIDIA GeForce RTX 4090",),
        r"^rtx 4090\b",
        {"fp32": 82.6 * _T, "tf32": 82.6 * _T, "bf16": 165.2 * _T, "fp16": 165.2 * _T},
        _ADA_WP,
    ),
    GpuPeak(
        "A100 SXM4",
        ("NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-40GB"),
        r"^a100.*sxm",
        {"fp32": 19.5 * _T, "tf32": 156 * _T, "bf16": 312 * _T, "fp16": 312 * _T},
        "NVIDIA A100 datasheet (dense figures): https://www.nvidia.com/content/dam/en-zz/"
        "Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf",
    ),
    GpuPeak(
        "A100 PCIe",
        ("NVIDIA A100 80GB PCIe", "NVIDIA A100-PCIE-40GB"),
        r"^a100\b",
        {"fp32": 19.5 * _T, "tf32": 156 * _T, "bf16": 312 * _T, "fp16": 312 * _T},
        "NVIDIA A100 datasheet (dense figures): https://www.nvidia.com/content/dam/en-zz/"
        "Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf",
    ),
    GpuPeak(
        "A40",
        ("NVIDIA A40",),
        r"^a40\b",
        {"fp32": 37.4 * _T, "tf32": 74.8 * _T, "bf16": 149.7 * _T, "fp16": 149.7 * _T},
        "NVIDIA A40 datasheet (sparse figures halved): "
        "https://images.nvidia.com/content/Solutions/data-center/a40/nvidia-a40-datasheet.pdf",
    ),
    GpuPeak(
        "A30",
        ("NVIDIA A30",),
        r"^a30\b",
        {"fp32": 10.3 * _T, "tf32": 82 * _T, "bf16": 165 * _T, "fp16": 165 * _T},
        "NVIDIA A30 datasheet (dense figures): https://www.nvidia.com/content/dam/en-zz/"
        "Solutions/data-center/products/a30-gpu/pdf/a30-datasheet.pdf",
    ),
    GpuPeak(
        "A10",
        ("NVIDIA A10",),
        r"^a10\b",
        {"fp32": 31.2 * _T, "tf32": 62.5 * _T, "bf16": 125 * _T, "fp16": 125 * _T},
        "NVIDIA A10 datasheet (dense figures): https://www.nvidia.com/content/dam/en-zz/"
        "Solutions/Data-Center/a10/pdf/a10-datasheet.pdf",
    ),
    GpuPeak(
        "RTX A6000",
        ("NVIDIA RTX A6000",),
        r"^rtx a6000\b",
        {"fp32": 38.7 * _T, "tf32": 77.4 * _T, "bf16": 154.8 * _T, "fp16": 154.8 * _T},
        _AMPERE_WP,
    ),
    GpuPeak(
        "RTX 3090",
        ("NVIDIA GeForce RTX 3090",),
        r"^rtx 3090$",
        {"fp32": 35.6 * _T, "tf32": 35.6 * _T, "bf16": 71 * _T, "fp16": 71 * _T},
        _AMPERE_WP,
    ),
    GpuPeak(
        "V100 SXM2",
        ("Tesla V100-SXM2-16GB", "Tesla V100-SXM2-32GB"),
        r"^v100.*sxm",
        {"fp32": 15.7 * _T, "fp16": 125 * _T},
        "NVIDIA V100 datasheet: https://images.nvidia.com/content/technologies/volta/pdf/"
        "volta-v100-datasheet-update-us-1165301-r5.pdf",
    ),
    GpuPeak(
        "T4",
        ("Tesla T4",),
        r"^t4\b",
        {"fp32": 8.1 * _T, "fp16": 65 * _T},
        "NVIDIA T4 datasheet: https://www.nvidia.com/content/dam/en-zz/Solutions/"
        "Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf",
    ),
)


def _normalize(name: str) -> str:
    text = re.sub(r"\b(nvidia|tesla|geforce)\b", " ", name.lower())
    return " ".join(text.split())


def lookup_gpu(device_name: str) -> GpuPeak | None:
    """The `GPU_PEAKS` entry for a GPU name as TensorFlow reports it, or None when unknown."""
    for entry in GPU_PEAKS:
        if device_name in entry.names:
            return entry
    normalized = _normalize(device_name)
    for entry in GPU_PEAKS:
        if re.search(entry.pattern, normalized):
            return entry
    return None


def gpu_peak_flops(device_name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of a GPU in a dtype key (`compute_dtype_key`), or None."""
    entry = lookup_gpu(device_name)
    return None if entry is None else entry.flops.get(dtype)


def compute_dtype_key(compute_dtype: str, tf32: bool = False) -> str:
    """The table's key (`"fp32"`, `"tf32"`, `"bf16"`, `"fp16"`) for a Keras compute dtype.

    `tf32`: whether float32 matmuls run as TF32 (TensorFlow's default on Ampere+ GPUs). A dtype
    other than float32, bfloat16 or float16 raises `ValueError`.
    """
    keys = {"float32": "tf32" if tf32 else "fp32", "bfloat16": "bf16", "float16": "fp16"}
    if compute_dtype not in keys:
        raise ValueError(
            "compute_dtype must be 'float32', 'bfloat16' or 'float16'. "
            f"Received: compute_dtype={compute_dtype!r}"
        )
    return keys[compute_dtype]


@functools.lru_cache(maxsize=1)
def cpu_name() -> str:
    """This machine's CPU model and logical core count (`"AMD EPYC, 2 cores"`), the roof's key."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    model = model or platform.processor() or platform.machine() or "unknown CPU"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {cores} cores"


def cpu_has_bfloat16() -> bool:
    """Whether `/proc/cpuinfo` lists bfloat16 instructions (`avx512_bf16`, `amx_bf16`)."""
    from keras_mirror_kit.precision import CPU_BFLOAT16_FLAGS, this_cpu

    return bool((this_cpu().cpu_flags or frozenset()) & CPU_BFLOAT16_FLAGS)


def roof_path() -> Path:
    """The roof file: `$KMK_ROOF_FILE`, else `keras-mirror-kit/roof.json` in the XDG cache."""

    # The XDG cache is `$XDG_CACHE_HOME`, else `~/.cache`.
    explicit = os.environ.get(ROOF_FILE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "keras-mirror-kit" / "roof.json"


def load_roof(path: Path | None = None, cpu: str | None = None) -> dict[str, Any]:
    """The stored roof of this CPU: `{"fp32": {"flops_per_sec": ...}, ...}`, `{}` if none.

    An unreadable or malformed file is treated as absent (logged at DEBUG), never raised on:
    the monitor then reports no MFU.
    """
    path = roof_path() if path is None else path
    try:
        data = json.loads(path.read_text())
        entries = data["cpus"][cpu or cpu_name()]
    except (OSError, ValueError, KeyError, TypeError):
        logger.debug("keras-mirror-kit: no CPU roof for %s in %s", cpu or cpu_name(), path)
        return {}
    if not isinstance(entries, dict):
        return {}
    return {
        key: value
        for key, value in entries.items()
        if isinstance(value, dict)
        and isinstance(value.get("flops_per_sec"), (int, float))
        and value["flops_per_sec"] > 0
    }


def store_roof(
    measured: dict[str, dict[str, Any]], path: Path | None = None, cpu: str | None = None
) -> Path:
    """Stores measured roofs for this CPU, keeping other CPUs' entries; returns the path.

    The file is replaced atomically, so a reader never sees half a file. An existing file that
    is not the kit's roof JSON is left alone (`ValueError`).
    """
    path = roof_path() if path is None else path
    data: dict[str, Any] = {"format": "keras-mirror-kit roof", "version": 1, "cpus": {}}
    if path.exists():
        try:
            existing = json.loads(path.read_text())
        except (OSError, ValueError):
            existing = None
        if not isinstance(existing, dict) or existing.get("format") != data["format"]:
            raise ValueError(
                f"{path} exists and is not a roof file written by keras-mirror-kit; it was "
                f"left as it is. Remove it or set {ROOF_FILE_ENV} to another path. "
                f"Received: path={str(path)!r}"
            )
        data["cpus"] = dict(existing.get("cpus") or {})
    key = cpu or cpu_name()
    data["cpus"][key] = {**(data["cpus"].get(key) or {}), **measured}
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=2, sort_keys=True).encode("utf-8")
    atomic_write_bytes(path, text)
    return path


def measure_matmul_roof(
    dtype: str = "float32", size: int = 1024, repeats: int = 8, rounds: int = 5
) -> dict[str, Any]:
    """This machine's matmul FLOP/s in one dtype on the CPU, all cores, as a roof entry.

    `rounds` timed calls (after one untimed) of `repeats` chained `size x size` matmuls
    (`2 size^3` FLOPs each); the fastest round is kept, since the roof is what the machine can
    do. Returns `{"flops_per_sec", "dtype", "size", "seconds", "measured_at"}`.
    """
    compute_dtype_key(dtype)  # validates
    for name, value in (("size", size), ("repeats", repeats), ("rounds", rounds)):
        positive_int(name, value)
    import tensorflow as tf

    with tf.device("/CPU:0"):
        a = tf.random.stateless_uniform((size, size), seed=(1, 2), dtype=tf.float32)
        a = tf.cast(a / size, dtype)

        @tf.function(autograph=False)
        def chain(x: tf.Tensor) -> tf.Tensor:
            for _ in range(repeats):
                x = tf.linalg.matmul(x, a)
            return x

        chain(a).numpy()
        best = float("inf")
        for _ in range(rounds):
            start = time.perf_counter()
            chain(a).numpy()
            best = min(best, time.perf_counter() - start)
    flops = 2.0 * size**3 * repeats
    return {
        "flops_per_sec": flops / best,
        "dtype": dtype,
        "size": size,
        "seconds": best,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


@dataclass(frozen=True)
class PeakResolution:
    """The peak FLOP/s of the devices a set of replicas runs on, and where it came from."""

    per_device: float | None  # one physical device (one GPU, or the whole CPU); None: unknown
    # Physical devices the replicas of all workers run on (logical devices split from one
    # GPU or from the CPU count once).
    devices: int
    dtype: str  # the table's dtype key
    device_name: str  # the GPU's name as the backend reports it, or the CPU's
    # Where `per_device` comes from ("peak_flops=", the table entry's source, or the roof
    # file), or why it is unknown.
    source: str

    @property
    def total(self) -> float | None:
        """`per_device x devices`: the peak the achieved FLOP/s are compared with."""
        return None if self.per_device is None else self.per_device * self.devices


def resolve_peak(
    devices: list[str] | tuple[str, ...],
    compute_dtype: str,
    num_workers: int = 1,
    peak_flops: float | None = None,
) -> PeakResolution:
    """Finds the peak FLOP/s of the devices holding this process's replicas.

    GPUs: the first replica's GPU name, as the backend reports it
    (`backends.current().gpu_identity`), looked up in `GPU_PEAKS` (float32 counts as TF32 on
    compute capability 8.0+ where the backend runs float32 matmuls as TF32, the default of
    TensorFlow and of JAX); logical GPUs split from one physical GPU count once. CPU: the
    roof `bench --roof` stored for this CPU and dtype, counted once however many replicas
    share it. `peak_flops` (one device) replaces the lookup.
    `per_device` is None when the peak is unknown.
    """
    gpu_indices = sorted(
        {int(m.group(1)) for d in devices if (m := re.search(r"GPU:(\d+)$", d, re.I))}
    )
    if not gpu_indices:
        key = compute_dtype_key(compute_dtype)
        name = cpu_name()
        if peak_flops is not None:
            return PeakResolution(peak_flops, num_workers, key, name, "peak_flops=")
        entry = load_roof().get(key)
        if entry is None:
            return PeakResolution(
                None, num_workers, key, name, f"no {key} roof for this CPU in {roof_path()}"
            )
        when = entry.get("measured_at", "?")
        return PeakResolution(
            float(entry["flops_per_sec"]),
            num_workers,
            key,
            name,
            f"CPU matmul roof measured {when} ({roof_path()})",
        )
    from keras_mirror_kit import backends

    name, tf32, physical = backends.current().gpu_identity(gpu_indices)
    key = compute_dtype_key(compute_dtype, tf32=tf32)
    count = physical * num_workers
    if peak_flops is not None:
        return PeakResolution(peak_flops, count, key, name, "peak_flops=")
    entry = lookup_gpu(name)
    if entry is None or key not in entry.flops:
        why = "not in the table" if entry is None else f"no {key} figure in the table"
        return PeakResolution(None, count, key, name, f"{name!r}: {why}")
    return PeakResolution(entry.flops[key], count, key, name, entry.source)
