"""The all-reduce: which cross-device ops a set of replicas gets, and the strategy with it.

The choice is a pure function of the device table (which physical device each replica runs
on) and of whether NCCL is usable; `mirrored_strategy` builds the `MirroredStrategy` and, when
NCCL was chosen, checks it can run and falls back to another all-reduce if not.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from keras_mirror_kit.devices.replicas import _canonical

__all__ = [
    "CROSS_DEVICE_OPS",
    "choose_cross_device_ops",
    "device_table",
    "make_cross_device_ops",
    "mirrored_strategy",
    "nccl_available",
    "nccl_fallback",
    "probe_all_reduce",
]

logger = logging.getLogger("keras_mirror_kit")

CROSS_DEVICE_OPS = ("auto", "nccl", "hierarchical_copy", "reduction_to_one_device")


def nccl_available() -> bool:
    """Whether NCCL all-reduce can be used: GPUs, and a CUDA (or ROCm) build on Linux.

    The NCCL library itself is loaded only at the first all-reduce, so a host without it
    passes this check; `mirrored_strategy` probes it once.

    Returns:
        True when NCCL (RCCL) ships with this TensorFlow build and a GPU is visible.

    Example:

    ```python
    ops = "nccl" if nccl_available() else "hierarchical_copy"
    ```
    """
    if not sys.platform.startswith("linux"):
        return False
    info = tf.sysconfig.get_build_info()
    built = bool(info.get("is_cuda_build") or info.get("is_rocm_build"))
    return built and bool(tf.config.list_physical_devices("GPU"))


#: One row per replica: (logical device name, the physical device it runs on, or None when
#: it cannot be told).
DeviceTable = Sequence[tuple[str, str | None]]


def _physical_ids(device_type: str) -> list[str] | None:
    """The physical device of each logical device of a type, in order; None if unclear."""
    ids: list[str] = []
    for physical in tf.config.get_visible_devices(device_type):
        configs = tf.config.get_logical_device_configuration(physical)
        ids += [physical.name.split("physical_device:")[-1]] * (len(configs) if configs else 1)
    if len(ids) != len(tf.config.list_logical_devices(device_type)):
        return None
    return ids


def device_table(devices: Sequence[str]) -> list[tuple[str, str | None]]:
    """`[(replica device, physical id such as "GPU:0", or None when TensorFlow does not tell)]`.

    Logical devices are made from the visible physical devices in order, each split into as
    many as its logical configuration says (`simulate_replicas` splits one).
    """
    table: list[tuple[str, str | None]] = []
    known: dict[str, list[str] | None] = {}
    for name in devices:
        device_type, index = _canonical(name)
        if device_type not in known:
            known[device_type] = _physical_ids(device_type)
        ids = known[device_type]
        table.append((name, ids[index] if ids is not None and index < len(ids) else None))
    return table


def _shared_physical(table: DeviceTable) -> dict[str, list[str]]:
    by_physical: dict[str, list[str]] = {}
    for name, physical in table:
        if physical is not None:
            by_physical.setdefault(physical, []).append(name)
    return {physical: names for physical, names in by_physical.items() if len(names) > 1}


def _check_ops_name(name: object) -> None:
    if name not in CROSS_DEVICE_OPS:
        raise ValueError(
            f"Unknown `cross_device_ops`. Expected one of {', '.join(map(repr, CROSS_DEVICE_OPS))}"
            f" or a tf.distribute.CrossDeviceOps. Received: cross_device_ops={name!r}"
        )


def choose_cross_device_ops(name: str, table: DeviceTable, *, nccl_usable: bool) -> str:
    """Picks the all-reduce for a set of replicas: a pure function of the device table.

    `"auto"`: NCCL when every replica is a distinct physical GPU and NCCL is usable (NCCL
    refuses two ranks on one GPU, so a GPU split by `simulate_replicas` never gets it);
    otherwise, for 2+ GPU replicas, hierarchical copy when their number is even, and
    reduction to one device in all other cases. TensorFlow's hierarchical copy sums two
    groups of `n // 2` replicas, so with an odd number one replica's gradient is left out.
    An explicit name that cannot work here (`"nccl"` on anything but distinct GPUs with NCCL
    usable, `"hierarchical_copy"` on an odd number of 3+ replicas) raises `ValueError`.
    """
    _check_ops_name(name)
    names = [logical for logical, _ in table]
    count = len(names)
    all_gpu = bool(names) and all(_canonical(d)[0] == "GPU" for d in names)
    shared = _shared_physical(table)
    if name == "nccl":
        if not (all_gpu and nccl_usable):
            raise ValueError(
                "`cross_device_ops='nccl'` needs GPU replicas and a CUDA build of TensorFlow "
                f"on Linux; here the replicas are {names}. Use cross_device_ops='auto'. "
                f"Received: cross_device_ops={name!r}"
            )
        if shared:
            physical, split = next(iter(shared.items()))
            raise ValueError(
                f"`cross_device_ops='nccl'` needs one replica per physical GPU, but {len(split)} "
                f"replicas run on the physical GPU {physical} ({', '.join(split)}); NCCL "
                "refuses two ranks on one device. Use cross_device_ops='auto' (it picks "
                "'hierarchical_copy' or 'reduction_to_one_device' here), or one replica per "
                f"GPU. Received: cross_device_ops={name!r}, replicas={count}"
            )
    if name == "hierarchical_copy" and count > 1 and count % 2:
        raise ValueError(
            "`cross_device_ops='hierarchical_copy'` needs an even number of replicas: "
            "TensorFlow's HierarchicalCopyAllReduce sums two groups of n // 2 replicas, so "
            f"with {count} the gradient of one replica is left out of every step. Use "
            "'reduction_to_one_device' or 'auto', or an even number of replicas. "
            f"Received: cross_device_ops={name!r}, replicas={count}"
        )
    if name != "auto":
        return name
    if not all_gpu or count < 2:
        return "reduction_to_one_device"
    distinct = not shared and all(physical is not None for _, physical in table)
    if distinct and nccl_usable:
        return "nccl"
    return nccl_fallback(count)


def nccl_fallback(replicas: int) -> str:
    """The all-reduce instead of NCCL: hierarchical copy for an even count, else to one device."""
    return "hierarchical_copy" if replicas % 2 == 0 else "reduction_to_one_device"


def _build_ops(name: str) -> tf.distribute.CrossDeviceOps:
    if name == "nccl":
        return tf.distribute.NcclAllReduce()
    if name == "hierarchical_copy":
        return tf.distribute.HierarchicalCopyAllReduce()
    return tf.distribute.ReductionToOneDevice()


def make_cross_device_ops(
    name: str | tf.distribute.CrossDeviceOps,
    devices: Sequence[str],
    *,
    table: DeviceTable | None = None,
    nccl_usable: bool | None = None,
) -> tuple[tf.distribute.CrossDeviceOps, str]:
    """`(cross_device_ops, name)` for a set of replica devices, as `choose_cross_device_ops` picks.

    A `tf.distribute.CrossDeviceOps` instance given as `name` is used as it is.
    """
    if isinstance(name, tf.distribute.CrossDeviceOps):
        return name, type(name).__name__
    _check_ops_name(name)
    table = device_table(devices) if table is None else table
    usable = nccl_available() if nccl_usable is None else nccl_usable
    chosen = choose_cross_device_ops(name, table, nccl_usable=usable)
    return _build_ops(chosen), chosen


def probe_all_reduce(strategy: tf.distribute.Strategy) -> None:
    """Runs one tiny all-reduce under `strategy` and checks its sum (`RuntimeError` if wrong).

    TensorFlow loads the NCCL library only at the first NCCL all-reduce, so a host without it
    would fail at the first training step; this finds out when the strategy is made. Whatever
    TensorFlow raises when the all-reduce cannot run (`NotFoundError`, `InternalError`) passes.
    """
    replicas = int(strategy.num_replicas_in_sync)

    @tf.function
    def step() -> Any:
        def one() -> tf.Tensor:
            context = tf.distribute.get_replica_context()
            return context.all_reduce(tf.distribute.ReduceOp.SUM, tf.ones([1]))

        return strategy.run(one)

    sums = [float(t.numpy()[0]) for t in strategy.experimental_local_results(step())]
    if any(total != replicas for total in sums):
        raise RuntimeError(f"the all-reduce of 1 on {replicas} replicas gave {sums}")


def mirrored_strategy(
    devices: Sequence[str],
    cross_device_ops: str | tf.distribute.CrossDeviceOps = "auto",
    *,
    table: DeviceTable | None = None,
    nccl_usable: bool | None = None,
    probe: Callable[[tf.distribute.Strategy], None] = probe_all_reduce,
) -> tuple[tf.distribute.MirroredStrategy, str]:
    """`(MirroredStrategy, all-reduce name)` for the replica devices, with a working all-reduce.

    When NCCL is chosen, one tiny all-reduce runs at once (`probe`): if NCCL cannot run
    (typically "Unable to load NCCL library"), a WARNING says so and the strategy is rebuilt
    with `nccl_fallback(n)` for `"auto"`, while an explicit `"nccl"` raises `RuntimeError`. No
    probe runs for any other all-reduce (so never on CPUs).
    """
    ops, name = make_cross_device_ops(
        cross_device_ops, devices, table=table, nccl_usable=nccl_usable
    )
    strategy = tf.distribute.MirroredStrategy(devices=list(devices), cross_device_ops=ops)
    if name != "nccl":
        return strategy, name
    try:
        probe(strategy)
    except Exception as err:  # noqa: BLE001 - any failure means NCCL cannot run here
        reason = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err) else ''}"
        if cross_device_ops == "nccl":
            raise RuntimeError(
                f"`cross_device_ops='nccl'` was asked for, but an NCCL all-reduce on "
                f"{len(devices)} GPUs fails here ({reason}). Install NCCL (pip install "
                "\"tensorflow[and-cuda]\" brings it), or use cross_device_ops='auto' to fall "
                f"back to another all-reduce. Received: cross_device_ops={cross_device_ops!r}"
            ) from err
        fallback = nccl_fallback(len(devices))
        logger.warning(
            "keras-mirror-kit: NCCL all-reduce fails on this host (%s); using %r instead, "
            'which is slower. Install NCCL (pip install "tensorflow[and-cuda]" brings it) '
            "to use it",
            reason,
            fallback,
        )
        strategy = tf.distribute.MirroredStrategy(
            devices=list(devices), cross_device_ops=_build_ops(fallback)
        )
        name = fallback
    return strategy, name
