"""The JAX backend: `keras.distribution.DataParallel` over this process's devices.

Keras' JAX trainer compiles one SPMD program for the whole global batch: the batch is
sharded over the devices along the mesh's `batch` axis and the variables are replicated.
Gradients, their clipping, BatchNormalization's batch statistics and float16 loss scaling
are therefore computed over the global batch by construction, which is why none of the
kit's TensorFlow workarounds (or `sync_batch_norm=`) has anything to do here. What the kit
adds: the choice of devices (all GPUs, else the CPU devices; simulated CPU devices through
XLA's host-platform device count), the check that a model's variables are replicated over
them, and that `fit`, `evaluate` and `predict` run under the distribution (Keras' JAX
trainer shards the data only while one is active).

What has no JAX meaning is refused before any step: an all-reduce choice, a
`tf.distribute` strategy, multi-worker training (`TF_CONFIG`, a cluster resolver,
`strategy="multi_worker"`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

from keras_mirror_kit import precision
from keras_mirror_kit.backends.jax_state import (  # the checkpoints' reads and checks
    differing_copies,
    finite_check,
    finite_flags,
    gather_rows,
    host_layout,
    host_value,
    read_value,
    reads_collectively,
    replica_copies,
)
from keras_mirror_kit.validation import pick_devices, positive_int

__all__ = [
    "NAME",
    "Engine",
    "create_engine",
    # the checkpoints' reads and checks (`jax_state`)
    "differing_copies",
    "finite_check",
    "finite_flags",
    "gather_rows",
    "host_layout",
    "host_value",
    "read_value",
    "reads_collectively",
    "replica_copies",
]

logger = logging.getLogger("keras_mirror_kit")

#: Whether every batch must split evenly over the devices.
SHARDS_EACH_BATCH = True  # XLA shards a batch only in equal parts
NAME = "jax"
OWN_OBJECT = "a keras.distribution.Distribution"  # what `strategy=` may be besides a name
STRATEGIES = ("auto", "data_parallel", "mirrored", "multi_worker")  # the last: refused
XLA_FLAGS_ENV = "XLA_FLAGS"
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
_simulated: dict[str, int] = {}  # {"cpu": n} once simulate_replicas(n) ran
_noted_batch_norm = threading.Event()


def _device_name(device: Any) -> str:
    """`"cpu:0"`, `"gpu:1"`: the names `keras.distribution.list_devices()` gives."""
    return f"{device.platform.lower()}:{device.id}"


class Engine:
    """A `keras.distribution.DataParallel` behind the kit's engine interface."""

    def __init__(self, strategy: Any, cross_device_ops: str = "xla-spmd") -> None:
        self.strategy = strategy
        self.cross_device_ops = cross_device_ops

    @property
    def strategy_name(self) -> str:
        return type(self.strategy).__name__

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(str(d) for d in self.strategy.device_mesh.devices.ravel())

    @property
    def num_replicas(self) -> int:
        return int(self.strategy.device_mesh.devices.size)

    @property
    def is_chief(self) -> bool:
        import jax

        return jax.process_index() == 0

    def scope(self) -> AbstractContextManager[Any]:
        return self.strategy.scope()

    def active_elsewhere(self) -> Any:
        import keras

        active = keras.distribution.distribution()
        return active if active is not None and active is not self.strategy else None


def _distribution_class() -> type:
    from keras_mirror_kit.upstream import keras_private

    return keras_private.distribution_class()


class _OneDevice:
    """No distribution: what a model outside any runs on (JAX's default device)."""

    @property
    def device_mesh(self) -> Any:
        import jax
        import numpy as np

        class _Mesh:
            devices = np.array([_device_name(jax.devices()[0])])

        return _Mesh()

    def scope(self) -> AbstractContextManager[Any]:
        return contextlib.nullcontext()


def engine_of_model(model: Any) -> Engine:
    """The distribution a model the kit did not build runs under (the active one, or none)."""
    del model
    import keras

    active = keras.distribution.distribution()
    return Engine(active if active is not None else _OneDevice())


def is_own_object(strategy: Any) -> bool:
    """Whether `strategy` is a data-parallel object of this backend (a Keras Distribution)."""
    return isinstance(strategy, _distribution_class())


def foreign_object_hint(strategy: Any) -> str:
    """A sentence for a `tf.distribute` strategy given on JAX, else ''."""
    if not type(strategy).__module__.startswith("tensorflow"):
        return ""
    return (
        " A tf.distribute strategy runs on Keras' TensorFlow backend only: run with "
        "KERAS_BACKEND=tensorflow, or leave `strategy` to the kit on jax."
    )


def version() -> str:
    """JAX's version."""
    import jax

    return str(jax.__version__)


def _backends_initialized() -> bool:
    from jax._src import xla_bridge

    check = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(check()) if callable(check) else bool(getattr(xla_bridge, "_backends", None))


def simulate_replicas(
    n: int, *, device_type: str | None = None, memory_limit_mb: int | None = None
) -> None:
    """`n` JAX CPU devices (XLA's host-platform device count), before JAX initialises."""
    n = positive_int("n", n)
    kind = str(device_type or "CPU").upper()
    if kind != "CPU":
        raise ValueError(
            "On the JAX backend simulate_replicas splits the CPU only (XLA's host platform); "
            "a GPU cannot be split into several JAX devices. Pass device_type='CPU' (the "
            f"default), or use the GPUs as they are. Received: device_type={device_type!r}"
        )
    del memory_limit_mb  # a TensorFlow setting: JAX's CPU devices share the host's memory
    if _simulated.get("cpu") == n:
        return
    flags = os.environ.get(XLA_FLAGS_ENV, "")
    given = re.search(rf"{_DEVICE_COUNT_FLAG}=(\d+)", flags)
    if _backends_initialized():
        import jax

        have = len(jax.devices("cpu"))
        if have == n:
            _simulated["cpu"] = n
            return
        raise RuntimeError(
            f"simulate_replicas({n}) was called after JAX initialised its devices (it now "
            f"has {have} CPU device(s)). Call kmk.simulate_replicas({n}) at the very top of "
            "your script, before any JAX array, Keras model or distribution is created, or "
            f"set KMK_SIMULATE_REPLICAS={n} (or {XLA_FLAGS_ENV}={_DEVICE_COUNT_FLAG}={n}) "
            "before starting Python."
        )
    if given:
        flags = flags.replace(given.group(0), f"{_DEVICE_COUNT_FLAG}={n}")
    else:
        flags = f"{flags} {_DEVICE_COUNT_FLAG}={n}".strip()
    os.environ[XLA_FLAGS_ENV] = flags
    _simulated["cpu"] = n
    logger.info("keras-mirror-kit: simulating %d JAX CPU devices (%s)", n, flags)


def _canonical(name: str) -> tuple[str, int]:
    """`"/gpu:1"`, `"gpu:1"`, `"/job:localhost/replica:0/task:0/device:GPU:1"` -> `("gpu", 1)`."""
    match = re.search(r"(?:device:)?([A-Za-z]+):(\d+)$", name.strip())
    if not match:
        raise ValueError(f"Not a device name (expected e.g. 'gpu:0'). Received: {name!r}")
    return match.group(1).lower(), int(match.group(2))


def replica_devices(devices: Sequence[str] | None = None) -> list[Any]:
    """The JAX devices that get one replica each (default: every GPU, else the CPU devices)."""
    import jax

    if devices is None:
        if _simulated:
            return list(jax.devices("cpu"))
        return list(jax.devices())
    if isinstance(devices, str) or not isinstance(devices, Sequence):
        raise TypeError(
            "`devices` must be a list of device names such as ['gpu:0', 'gpu:1'] (what "
            f"keras.distribution.list_devices() returns). Received: devices={devices!r}"
        )
    if not devices:
        raise ValueError("`devices` must name at least one device. Received: devices=[]")
    available: dict[tuple[str, int], Any] = {}
    for platform in ("cpu", "gpu", "tpu"):
        try:
            for device in jax.devices(platform):
                available[(platform, device.id)] = device
        except RuntimeError:  # no such platform here
            continue
    shown = sorted(f"{platform}:{index}" for platform, index in available)
    return pick_devices(devices, _canonical, available, shown)


def _refuse(what: str, received: str) -> ValueError:
    return ValueError(
        f"{what} has no meaning on Keras' JAX backend, where the kit trains with "
        "keras.distribution.DataParallel over this process's devices (one SPMD program, no "
        "all-reduce to choose, one process). Leave it at its default, or select the "
        f"TensorFlow backend (KERAS_BACKEND=tensorflow). Received: {received}"
    )


def create_engine(
    *,
    devices: Sequence[str] | None,
    cross_device_ops: Any,
    strategy: Any,
    cluster_resolver: Any,
    multi_worker: bool,
) -> Engine:
    """A `DataParallel` over the replica devices, behind an `Engine`."""
    import keras

    if not isinstance(cross_device_ops, str) or cross_device_ops != "auto":
        raise _refuse("An all-reduce choice", f"cross_device_ops={cross_device_ops!r}")
    if cluster_resolver is not None or multi_worker:
        raise _refuse(
            "Multi-worker training (TF_CONFIG, a cluster resolver, strategy='multi_worker', "
            "keras-mirror-kit launch)",
            f"strategy={strategy!r}, cluster_resolver={cluster_resolver!r}, "
            f"TF_CONFIG={'set' if os.environ.get('TF_CONFIG') else 'unset'}",
        )
    if is_own_object(strategy):
        if devices is not None:
            raise ValueError(
                "`devices` cannot be combined with a ready-made `strategy` (its devices are "
                f"fixed). Received: devices={devices!r}"
            )
        return Engine(strategy)
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise _refuse(f"strategy={strategy!r}", f"strategy={strategy!r}")
    chosen = replica_devices(devices)
    names = [_device_name(d) for d in chosen]
    return Engine(keras.distribution.DataParallel(devices=names))


def check_placement(model: Any, engine: Engine, origin: str) -> None:
    """`ValueError` when a variable of the model (or its optimizer) is not replicated."""
    if engine.num_replicas <= 1:
        return
    wanted = set(engine.devices)

    def outside(variables: Sequence[Any]) -> list[str]:
        found = []
        for variable in variables:
            sharding = getattr(getattr(variable, "value", None), "sharding", None)
            placed = {_device_name(d) for d in getattr(sharding, "device_set", ())}
            if placed != wanted:
                found.append(variable.path)
        return found

    missing = outside(model.variables)
    if missing:
        raise ValueError(
            f"{len(missing)} variable(s) of the model {origin} were created outside the "
            "distribution's scope (for example a layer built before the factory or block "
            "ran), so they are not replicated over the devices. Create and build every layer "
            "inside the decorated factory or the `with` block. "
            f"Received: variables={missing[:5]}{' ...' if len(missing) > 5 else ''}"
        )
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and getattr(optimizer, "built", False):
        missing = outside(optimizer.variables)
        if missing:
            raise ValueError(
                f"The optimizer of the model {origin} was built outside the distribution's "
                "scope. Create and build it inside the decorated factory or the `with` "
                f"block. Received: variables={missing[:5]}"
            )


def sync_batch_norm(model: Any) -> None:
    """Nothing to do: under SPMD the batch statistics are those of the global batch."""
    del model
    if not _noted_batch_norm.is_set():
        _noted_batch_norm.set()
        logger.info(
            "keras-mirror-kit: sync_batch_norm=True has nothing to do on the JAX backend: "
            "BatchNormalization computes its statistics over the whole global batch there"
        )


def after_compile(model: Any, engine: Engine, name: str) -> None:
    """Nothing: clipping, EMA, accumulation and XLA work as on one device under SPMD."""
    del model, engine, name


def after_prepare(model: Any, engine: Engine) -> None:
    """Nothing: float16 loss scaling decides over the global gradient under SPMD."""
    del model, engine


def install(model: Any) -> None:
    """Nothing per model: there are no replica steps to wrap."""
    del model


def trains_exactly(model: Any) -> bool:
    """False: XLA shards a batch only in equal parts (uneven batches are refused)."""
    del model
    return False


@contextlib.contextmanager
def call(model: Any, engine: Engine, method: str, arguments: dict[str, Any]) -> Iterator[None]:
    """Keras' JAX trainer shards the data only while the distribution is active."""
    del model, method, arguments
    with engine.scope():
        yield


def py_dataset_cursor(x: Any) -> None:
    """None: on JAX a `PyDataset` resumes at epoch boundaries (its order is Keras')."""
    return None


def stop_agreement(strategy: Any, wake: Any) -> Any:
    """Never needed: a JAX run has one worker (`multi_worker_choice` refuses more)."""
    raise RuntimeError(f"A JAX run has one worker; nothing to agree on. Received: {strategy!r}")


def block_contexts() -> list[AbstractContextManager[Any]]:
    """Nothing besides the distribution's scope."""
    return []


def count_training_flops(model: Any, input_specs: Any, label_spec: Any) -> Any:
    """XLA's cost analysis of the lowered training computation (`backends.jax_flops`)."""
    from keras_mirror_kit.backends import jax_flops

    return jax_flops.count_training_flops(model, input_specs, label_spec)


# `jax_default_matmul_precision` values under which float32 dots run as TF32 on a GPU
# (None: XLA's default precision, TF32 on compute capability 8.0+).
_TF32_PRECISIONS = ("default", "fastest", "tensorfloat32")


def gpu_identity(gpu_indices: Sequence[int]) -> tuple[str, bool, int]:
    """The first replica GPU's name (`device_kind`), whether float32 dots run as TF32 on it,
    and how many GPUs the replicas are on (JAX does not split a GPU)."""
    import jax

    try:
        gpus = {device.id: device for device in jax.devices("gpu")}
    except RuntimeError:  # no GPU platform
        gpus = {}
    first = gpus.get(gpu_indices[0]) if gpu_indices else None
    if first is None:
        return "unknown GPU", False, max(1, len(set(gpu_indices)))
    try:
        capability = tuple(int(p) for p in str(first.compute_capability).split("."))
    except (AttributeError, ValueError):
        capability = (0, 0)
    precision = jax.config.jax_default_matmul_precision
    as_tf32 = precision is None or str(precision).lower() in _TF32_PRECISIONS
    tf32 = capability >= (8, 0) and as_tf32
    return str(first.device_kind), tf32, len(set(gpu_indices))


#: Why "auto" keeps float32 on JAX's CPU devices even with bfloat16 instructions: measured on
#: an AVX512-BF16 CPU (JAX 0.10, the tutorial CNN), `mixed_bfloat16` trained at 0.55-0.9x
#: float32's samples/s.
_XLA_CPU_BFLOAT16 = "XLA's CPU kernels run bfloat16 slower than float32, as measured"


def precision_devices(engine: Engine) -> list[precision.ReplicaDevice]:
    """The replicas' devices as `mixed_precision="auto"` sees them (`precision.choose_policy`):
    a GPU's `device_kind` and `compute_capability` (none on ROCm: float32), a TPU, this
    host's CPU (float32 on JAX whatever its flags, `_XLA_CPU_BFLOAT16`)."""
    import jax

    found = []
    for entry in engine.strategy.device_mesh.devices.ravel():
        platform, index = _canonical(str(entry))  # Keras' mesh holds names ("gpu:0")
        platform = "gpu" if platform in ("cuda", "rocm") else platform
        if platform == "cpu":
            found.append(replace(precision.this_cpu(), no_native_bfloat16=_XLA_CPU_BFLOAT16))
            continue
        try:
            device = next(d for d in jax.devices(platform) if d.id == index)
        except (RuntimeError, StopIteration):  # unknown here: float32
            found.append(precision.ReplicaDevice(platform, str(entry)))
            continue
        capability = None
        try:
            major, minor = str(device.compute_capability).split(".")[:2]
            capability = (int(major), int(minor))
        except (AttributeError, ValueError):  # a TPU, or a ROCm GPU (float32)
            capability = None
        name = str(getattr(device, "device_kind", "") or str(entry))
        found.append(precision.ReplicaDevice(platform, name, compute_capability=capability))
    return found


#: Why `check_replicas` (`doctor --model`) does not run on this backend; None: it does.
REPLICA_CHECK_REFUSAL = (
    "kmk.check_replicas (keras-mirror-kit doctor --model) runs on Keras' TensorFlow backend "
    "only: it simulates replicas as TensorFlow logical devices and looks for the TensorFlow "
    "causes of a difference (BatchNormalization without sync_batch_norm, per-replica "
    "clipping or loss scaling). On JAX the kit trains one SPMD program over the devices, "
    "where gradients, clipping and batch statistics are global by construction, so those "
    "causes do not exist. Run the check with KERAS_BACKEND=tensorflow on the same model "
    "code, or compare 1 device with 2 yourself on JAX (kmk.simulate_replicas(2), then "
    "distributed(devices=['cpu:0']) against distributed())."
)

#: What `doctor` says the kit runs on here.
SUMMARY = "keras.distribution.DataParallel over this process's devices (one SPMD program)"
#: The framework this backend runs on, as `doctor` checks its version.
FRAMEWORK = "jax"


def framework_version() -> str:
    """JAX's version (and jaxlib's)."""
    import jax
    import jaxlib

    return f"{jax.__version__} (jaxlib {jaxlib.__version__})"


def _cuda_build(gpus: Sequence[Any]) -> dict[str, Any]:
    """Whether this JAX can use NVIDIA GPUs: its CUDA plugin, and the CUDA/cuDNN it loaded."""
    import importlib.util

    plugins = [
        name
        for name in ("jax_cuda13_plugin", "jax_cuda12_plugin")
        if importlib.util.find_spec(name) is not None
    ]
    build: dict[str, Any] = {"is_cuda_build": bool(gpus or plugins), "plugins": plugins}
    if gpus:  # XLA compiles for the GPU it runs on: its own capability is the kernels'
        build["cuda_compute_capabilities"] = sorted(
            {str(getattr(d, "compute_capability", "?")) for d in gpus}
        )
        try:
            from jax._src.lib import cuda_versions

            build["cuda_version"] = str(cuda_versions.cuda_runtime_get_version())
            build["cudnn_version"] = str(cuda_versions.cudnn_get_version())
        except Exception:  # noqa: BLE001 - a JAX without these helpers: versions unknown
            pass
    return build


def _nvidia_signs() -> list[str]:
    """Signs of NVIDIA GPUs found without JAX: `/dev/nvidia0`, `nvidia-smi on PATH`."""
    import glob
    import shutil

    signs = sorted(glob.glob("/dev/nvidia[0-9]*"))
    if shutil.which("nvidia-smi"):
        signs.append("nvidia-smi on PATH")
    return signs


def device_report() -> dict[str, Any]:
    """What `info` and `doctor` show of JAX's devices: GPUs, CPU devices, the CUDA plugin."""
    gpus = _devices_or_none("gpu")
    warnings = []
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES", "x").split(",")[0].strip() in ("", "-1")
    signs = _nvidia_signs()
    if not gpus and signs and not hidden:
        warnings.append(
            f"keras-mirror-kit: this machine has NVIDIA GPUs ({', '.join(signs)}) but JAX "
            "found none, so training runs on the CPU. Install JAX with its CUDA plugin "
            '(pip install -U "jax[cuda12]") and check the NVIDIA driver with nvidia-smi'
        )
    return {
        "framework": "JAX",
        "physical_gpus": [_device_name(d) for d in gpus],
        "physical_cpus": ["cpu"],  # one host CPU, however many XLA CPU devices it holds
        "nccl_usable": False,
        "all_reduce_note": "not the kit's choice on JAX: XLA runs the SPMD program's "
        "collectives (NCCL between GPUs)",
        "cuda_build": _cuda_build(gpus),
        "gpu_details": [
            {
                "name": _device_name(d),
                "device_name": str(d.device_kind),
                "compute_capability": str(getattr(d, "compute_capability", "?")),
                "kernels": "native (XLA compiles for the device)",
            }
            for d in gpus
        ],
        "warnings": warnings,
    }


def multi_worker_choice(workers: int) -> dict[str, Any]:
    """`distributed()` refuses `TF_CONFIG` on JAX: the refusal, as `info` shows it."""
    error = _refuse("Multi-worker training (TF_CONFIG)", f"TF_CONFIG with {workers} workers")
    return {"strategy": "none", "workers": workers, "all_reduce": "-", "refused": str(error)}


def logical_devices() -> list[str]:
    """Every JAX device of this process (simulated CPU devices included)."""
    return [_device_name(d) for p in ("cpu", "gpu", "tpu") for d in _devices_or_none(p)]


def time_all_reduce(engine: Engine, floats: int, repeats: int) -> tuple[float, bool]:
    """Seconds per SUM all-reduce of `floats` float32 values over the devices (after two
    untimed): one value per device, summed into a replicated result by XLA's collectives."""
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    by_name = {_device_name(d): d for p in ("cpu", "gpu", "tpu") for d in _devices_or_none(p)}
    devices = [by_name[name] for name in engine.devices]
    n = len(devices)
    mesh = Mesh(np.array(devices), ("batch",))
    parts = np.repeat(np.arange(1, n + 1, dtype=np.float32), floats).reshape(n, floats)
    values = jax.device_put(parts, NamedSharding(mesh, PartitionSpec("batch")))
    summed = jax.jit(
        lambda v: jnp.sum(v, axis=0), out_shardings=NamedSharding(mesh, PartitionSpec())
    )
    for _ in range(2):
        summed(values).block_until_ready()
    start = time.perf_counter()
    for _ in range(repeats):
        out = summed(values)
    out.block_until_ready()
    seconds = (time.perf_counter() - start) / repeats
    return seconds, float(out[0]) == n * (n + 1) / 2


def _devices_or_none(platform: str) -> list[Any]:
    """JAX's devices of a platform; none where JAX has no such platform."""
    import jax

    try:
        return list(jax.devices(platform))
    except RuntimeError:
        return []
