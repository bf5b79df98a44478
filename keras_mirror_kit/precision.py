"""Mixed precision for the layers a factory builds, and only those.

`keras.config.set_dtype_policy` is global; `policy_scope` sets it while the factory runs and
restores the previous policy afterwards, so layers built elsewhere are unaffected. Variables
stay float32 (that is what the mixed policies do); computations run in float16 or bfloat16.
The model's output layers are kept in float32, where a softmax or a loss needs the range,
and for `mixed_float16` Keras' `compile()` wraps the optimizer in a `LossScaleOptimizer`
(dynamic loss scaling), as it does for any model built under that policy. On more than one
replica, Keras 3.15's `LossScaleOptimizer` trusts the first replica alone to say whether a
step overflowed; `keras_mirror_kit.workarounds.keras_loss_scale` makes every replica agree for the
models the kit builds (or refuses float16 there on a Keras it was not tested on).

`mixed_precision="auto"` is decided by `choose_policy` from the devices that hold this
process's replicas (`ReplicaDevice`, built by the backend once the strategy exists): a 16-bit
type only where every one of them computes it natively, float32 elsewhere (16 bits that are
emulated run slower than float32).
"""

from __future__ import annotations

import functools
import logging
import platform
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import keras

__all__ = [
    "AUTO",
    "CPU_BFLOAT16_FLAGS",
    "MIXED_PRECISION_POLICIES",
    "PrecisionChoice",
    "ReplicaDevice",
    "choose_policy",
    "keep_outputs_float32",
    "log_choice",
    "parse_cpu_flags",
    "policy_scope",
    "this_cpu",
    "validate_policy",
]

logger = logging.getLogger("keras_mirror_kit")

MIXED_PRECISION_POLICIES = ("mixed_float16", "mixed_bfloat16")
AUTO = "auto"
#: `/proc/cpuinfo` flags of x86 instructions that compute bfloat16 (AVX512-BF16, AMX-BF16).
#: `amx_tile` alone is only the tile registers; its bfloat16 arithmetic is `amx_bf16`.
CPU_BFLOAT16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
#: NVIDIA compute capabilities from which bfloat16 (Ampere) and float16 (Volta's tensor cores)
#: are native; below 7.0 TensorFlow itself warns that `mixed_float16` may run slowly.
BFLOAT16_CAPABILITY = (8, 0)
FLOAT16_CAPABILITY = (7, 0)
_logged: set[tuple[str | None, str]] = set()
_logged_lock = threading.Lock()


def validate_policy(policy: object) -> str | None:
    """`mixed_precision` if it is None, `"auto"` or in `MIXED_PRECISION_POLICIES`; else
    `ValueError`."""
    if policy is None or policy == AUTO or policy in MIXED_PRECISION_POLICIES:
        return policy  # type: ignore[return-value]
    raise ValueError(
        "`mixed_precision` must be 'auto', 'mixed_float16', 'mixed_bfloat16' or None. "
        f"Received: mixed_precision={policy!r}"
    )


@dataclass(frozen=True)
class ReplicaDevice:
    """A device holding a replica, as `choose_policy` sees it.

    Args:
        platform: `"gpu"`, `"cpu"`, `"tpu"`, or another name (never 16 bits).
        name: What the reason names it by (`"NVIDIA A100-SXM4-40GB"`, the CPU's model).
        compute_capability: An NVIDIA GPU's `(major, minor)`; None: unknown (float32).
        cpu_flags: A CPU's instruction flags (`parse_cpu_flags`); None: unknown (float32).
        no_native_bfloat16: Why the framework's kernels do not compute bfloat16 natively on
            this device although its hardware does; None: they do.

    Example:

    ```python
    ReplicaDevice("gpu", "NVIDIA A100", compute_capability=(8, 0))
    ```
    """

    platform: str
    name: str = ""
    compute_capability: tuple[int, int] | None = None
    cpu_flags: frozenset[str] | None = None
    no_native_bfloat16: str | None = None


@dataclass(frozen=True)
class PrecisionChoice:
    """What `mixed_precision="auto"` chose (`policy`; None: float32) and why (`reason`).

    Example:

    ```python
    choice = choose_policy([ReplicaDevice("cpu", cpu_flags=frozenset({"avx512_bf16"}))])
    choice.policy  # "mixed_bfloat16"
    ```
    """

    policy: str | None
    reason: str

    @property
    def label(self) -> str:
        """The policy's name, `"float32"` for None."""
        return self.policy or "float32"

    def describe(self) -> str:
        """One line: `mixed_precision="auto" chose <policy>: <reason>`."""
        return f'mixed_precision="auto" chose {self.label}: {self.reason}'


def _named(device: ReplicaDevice) -> str:
    name = f" {device.name}" if device.name else ""
    return f"{device.platform.upper()}{name}"


def _native(device: ReplicaDevice) -> tuple[frozenset[str], str]:
    """The 16-bit policies `device` computes natively, and why."""
    bf16, fp16 = "mixed_bfloat16", "mixed_float16"
    named = _named(device)
    if device.platform == "gpu":
        capability = device.compute_capability
        if capability is None:
            return frozenset(), f"{named}: compute capability unknown"
        cc = ".".join(map(str, capability))
        if tuple(capability) >= BFLOAT16_CAPABILITY:
            return frozenset({bf16, fp16}), f"{named} (compute capability {cc}) has bfloat16"
        if tuple(capability) >= FLOAT16_CAPABILITY:
            return frozenset({fp16}), (
                f"{named} (compute capability {cc}) has float16 tensor cores but no "
                "bfloat16 (8.0+)"
            )
        return frozenset(), f"{named} (compute capability {cc}) has no fast 16-bit (7.0+)"
    if device.platform == "cpu":
        if device.cpu_flags is None:
            return frozenset(), f"{named}: instruction flags unknown (no /proc/cpuinfo)"
        found = sorted(device.cpu_flags & CPU_BFLOAT16_FLAGS)
        if not found:
            return frozenset(), (
                f"{named} has no bfloat16 instructions (neither "
                f"{' nor '.join(sorted(CPU_BFLOAT16_FLAGS))})"
            )
        if device.no_native_bfloat16:
            return frozenset(), f"{named} has {', '.join(found)}, but {device.no_native_bfloat16}"
        return frozenset({bf16}), f"{named} has {', '.join(found)}"
    if device.platform == "tpu":
        return frozenset({bf16}), f"{named} computes bfloat16 natively"
    return frozenset(), f"{named}: no 16-bit type known to be native"


def choose_policy(devices: Sequence[ReplicaDevice]) -> PrecisionChoice:
    """What `mixed_precision="auto"` means on the devices holding the replicas.

    `mixed_bfloat16` where every device computes bfloat16 natively (NVIDIA GPUs of compute
    capability 8.0+, CPUs with AVX512-BF16 or AMX-BF16 whose framework uses them, TPUs);
    else `mixed_float16` (with Keras' loss scaling) where every device has float16 tensor
    cores (compute capability 7.0+); else float32 (None): unknown devices, CPUs without
    bfloat16 instructions, or devices that share no native 16-bit type. Pure: the devices
    are described by the caller.

    Args:
        devices: The replicas' devices (`ReplicaDevice`), one per replica or one per kind.

    Returns:
        A `PrecisionChoice`.

    Example:

    ```python
    choose_policy([ReplicaDevice("gpu", "Tesla V100", compute_capability=(7, 0))]).policy
    # "mixed_float16"
    ```
    """
    if not devices:
        return PrecisionChoice(None, "no replica device is known")
    verdicts = list(dict.fromkeys(_native(device) for device in devices))
    common = frozenset.intersection(*(supported for supported, _ in verdicts))
    for policy in ("mixed_bfloat16", "mixed_float16"):
        if policy in common:
            lacking = [why for supported, why in verdicts if "mixed_bfloat16" not in supported]
            return PrecisionChoice(policy, "; ".join(lacking or [why for _, why in verdicts]))
    lacking = [why for supported, why in verdicts if not supported]
    if lacking:
        return PrecisionChoice(None, "; ".join(lacking))
    return PrecisionChoice(
        None, "the devices share no native 16-bit type: " + "; ".join(w for _, w in verdicts)
    )


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The instruction flags in the text of `/proc/cpuinfo` (x86 `flags`, Arm `Features`).

    Args:
        cpuinfo: The file's text; the first processor's flags are read.

    Returns:
        The flags (empty when the text has none).

    Example:

    ```python
    parse_cpu_flags("flags\t: fpu avx512f avx512_bf16\n")  # {"fpu", "avx512f", "avx512_bf16"}
    ```
    """
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def _cpu_model(cpuinfo: str) -> str:
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return ""


@functools.lru_cache(maxsize=1)
def this_cpu() -> ReplicaDevice:
    """This host's CPU as `choose_policy` sees it.

    Returns:
        A `ReplicaDevice("cpu", model name, cpu_flags=...)` read from `/proc/cpuinfo` once
        per process; its flags are None (unknown: float32) where there is no such file.

    Example:

    ```python
    choose_policy([this_cpu()]).describe()
    ```
    """
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ReplicaDevice("cpu", platform.processor() or platform.machine())
    return ReplicaDevice("cpu", _cpu_model(text), cpu_flags=parse_cpu_flags(text))


def log_choice(choice: PrecisionChoice) -> None:
    """Logs `choice.describe()` at INFO on the `keras_mirror_kit` logger, once per process.

    Args:
        choice: What "auto" chose; the same policy and reason are not logged again.

    Example:

    ```python
    log_choice(choose_policy([this_cpu()]))
    ```
    """
    key = (choice.policy, choice.reason)
    with _logged_lock:
        if key in _logged:
            return
        _logged.add(key)
    logger.info(choice.describe())


@contextmanager
def policy_scope(policy: str | None) -> Iterator[None]:
    """Sets the global Keras dtype policy inside the block (None: left alone), then restores it."""
    if policy is None:
        yield
        return
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


def _output_operations(model: keras.Model) -> list[Any]:
    try:
        outputs = model.outputs
    except (AttributeError, ValueError):  # subclassed models have no symbolic outputs
        return []
    operations = []
    for tensor in keras.tree.flatten(outputs or []):
        history = getattr(tensor, "_keras_history", None)
        if history is not None:
            operations.append(history.operation)
    return operations


def keep_outputs_float32(model: keras.Model) -> list[str]:
    """Switches the layers producing the model's outputs to float32; returns their names.

    A subclassed model has no symbolic outputs, so nothing is switched: its last layer needs
    `dtype="float32"` from the user.
    """
    switched = []
    pending = _output_operations(model)
    while pending:
        operation = pending.pop()
        if isinstance(operation, keras.Model):
            pending.extend(_output_operations(operation))
            continue
        if isinstance(operation, keras.layers.Layer) and operation.compute_dtype in (
            "float16",
            "bfloat16",
        ):
            operation.dtype_policy = "float32"
            switched.append(operation.name)
    return switched
