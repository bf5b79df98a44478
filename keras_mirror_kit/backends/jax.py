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
from typing import Any

from keras_mirror_kit.validation import positive_int

__all__ = ["NAME", "Engine", "create_engine"]

logger = logging.getLogger("keras_mirror_kit")

#: Whether every batch must split evenly over the devices.
SHARDS_EACH_BATCH = True  # XLA shards a batch only in equal parts
NAME = "jax"
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
    from keras.src.distribution.distribution_lib import Distribution

    return Distribution


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
            "keras.distribution.list_devices() returns). Received: devices={devices!r}"
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
    chosen, seen = [], set()
    for item in devices:
        if not isinstance(item, str):
            raise TypeError(
                f"`devices` must contain device-name strings. Received: devices={devices!r}"
            )
        key = _canonical(item)
        if key in seen:
            raise ValueError(f"`devices` names {item!r} twice. Received: devices={devices!r}")
        seen.add(key)
        if key not in available:
            names = sorted(f"{p}:{i}" for p, i in available)
            raise ValueError(
                f"Device {item!r} does not exist on this host. Available devices: {names}. "
                f"Received: devices={list(devices)!r}"
            )
        chosen.append(available[key])
    return chosen


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


@contextlib.contextmanager
def call(
    model: Any, engine: Engine, method: str, arguments: dict[str, Any]
) -> Iterator[None]:
    """Keras' JAX trainer shards the data only while the distribution is active."""
    del model, method, arguments
    with engine.scope():
        yield


def block_contexts() -> list[AbstractContextManager[Any]]:
    """Nothing besides the distribution's scope."""
    return []
