"""What a replica check found: `ReplicaCheck`, its causes, and the comparison behind it.

Nothing here imports TensorFlow: the calling process compares the two runs' variables with
NumPy, and the command line prints the record.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["ReplicaCause", "ReplicaCheck", "VariableDifference", "compare_variables"]

#: How many variables `describe()` lists (the record holds them all).
DESCRIBE_VARIABLES = 10


@dataclass(frozen=True)
class ReplicaCause:
    """A known reason for N replicas to train differently from one, found in the model.

    `code` is a short stable name (`"batch_norm_unsynchronized"`, `"random_layers"`, ...),
    `explanation` says what happens, naming the layers or options concerned, and `fix`
    what to do (or why a difference is expected).
    """

    code: str
    explanation: str
    fix: str


@dataclass(frozen=True)
class VariableDifference:
    """The largest absolute difference of one variable between the two runs."""

    path: str
    difference: float
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ReplicaCheck:
    """The result of `kmk.check_replicas`: one replica against N, from the same weights.

    Attributes:
        replicas: N, the replica count compared with one replica.
        layout: Where the N replicas ran, e.g. `"2 GPUs"` or `"2 replicas simulated on the
            CPU"`.
        steps: Optimizer updates trained in each run.
        global_batch_size: Samples per training step (the same in both runs).
        tolerance: The largest absolute difference still counted as equal.
        max_difference: The largest absolute difference over all variables (`inf` where
            one run has a NaN or infinity the other has not; NaN in both counts as equal).
        differences: Every variable of the model and of its optimizer, largest
            difference first.
        first_divergent: The first variable, in the model's order (the model's variables,
            then the optimizer's), whose difference is above `tolerance`, or None.
        losses: The training loss of each step (of each execution, with
            `steps_per_execution` > 1) by replica count: `{1: [...], N: [...]}`.
        causes: The known causes of a difference found in the model (present whether or
            not they made a difference here).
        error: Why the N-replica run failed, or None when it trained.
        passed: True when the N-replica run trained and `max_difference <= tolerance`.

    Each entry of `differences` is a `VariableDifference` (`path`, `difference`, `shape`),
    each cause a `ReplicaCause` (`code`, `explanation`, `fix`); both live in
    `keras_mirror_kit.replica_check`.

    Example:

    ```python
    result = kmk.check_replicas(build_model, training_data)
    if not result.passed:
        print(result.describe())          # the verdict, the losses, the causes
        print([c.code for c in result.causes], result.first_divergent)
    ```
    """

    replicas: int
    layout: str
    steps: int
    global_batch_size: int
    tolerance: float
    max_difference: float
    differences: tuple[VariableDifference, ...]
    first_divergent: str | None
    losses: Mapping[int, tuple[float, ...]]
    causes: tuple[ReplicaCause, ...]
    error: str | None
    passed: bool

    def as_dict(self) -> dict[str, Any]:
        """The record as plain values for JSON (what `doctor --model ... --json` prints).

        Returns:
            A dict of the fields; `losses` is keyed by the replica count as a string, and
            an infinite difference or a NaN loss is None (JSON has no such numbers).
        """
        out = dataclasses.asdict(self)
        out["losses"] = {str(k): list(v) for k, v in self.losses.items()}
        return _finite_or_none(out)

    def describe(self) -> str:
        """The report as text (what `doctor --model ...` prints).

        Returns:
            The verdict, the loss of each step, the ten largest differences per variable
            (those above the tolerance marked `*`) and each cause with its fix.
        """
        lines = [
            f"Replica check: 1 replica against {self.replicas} ({self.layout}), {self.steps} "
            f"step(s) of {self.global_batch_size} samples from the same weights"
        ]
        if self.error is not None:
            lines.append(f"  FAILED: the {self.replicas}-replica run did not train: {self.error}")
        elif self.passed:
            lines.append(
                f"  passed: largest difference {self.max_difference:.1e} "
                f"(tolerance {self.tolerance:g})"
            )
        else:
            lines.append(
                f"  FAILED: largest difference {self.max_difference:.1e} above the tolerance "
                f"{self.tolerance:g}; first variable to diverge: {self.first_divergent}"
            )
        for count, losses in self.losses.items():
            shown = " ".join(f"{loss:.6g}" for loss in losses) or "(none)"
            lines.append(f"  loss per step, {count} replica(s): {shown}")
        if self.differences:
            lines.append("  largest difference per variable:")
            for diff in self.differences[:DESCRIBE_VARIABLES]:
                mark = " *" if diff.difference > self.tolerance else ""
                shape = "x".join(map(str, diff.shape)) or "scalar"
                lines.append(f"    {diff.difference:9.2e}  {diff.path} ({shape}){mark}")
            hidden = len(self.differences) - DESCRIBE_VARIABLES
            if hidden > 0:
                lines.append(f"    ... {hidden} more, each at most the ones above")
        if self.causes:
            lines.append("  known causes found in the model:")
            for cause in self.causes:
                lines.append(f"    {cause.code}: {cause.explanation}")
                lines.append(f"      fix: {cause.fix}")
        elif not self.passed:
            lines.append(
                "  no known cause found in the model: see docs/troubleshooting.md, "
                "'Check your own model'"
            )
        return "\n".join(lines)


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite_or_none(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(item) for item in value]
    return value


def _difference(a: np.ndarray, b: np.ndarray) -> float:
    """The largest absolute difference; inf where only one side is NaN or infinite."""
    if a.shape != b.shape:
        return math.inf
    if a.size == 0:
        return 0.0
    if a.dtype.kind not in "fiub" or b.dtype.kind not in "fiub":
        return 0.0 if np.array_equal(a, b) else math.inf
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    with np.errstate(invalid="ignore"):
        gap = np.abs(a64 - b64)
    equal = (a64 == b64) | (np.isnan(a64) & np.isnan(b64))
    gap = np.where(equal, 0.0, gap)
    return float(np.max(np.where(np.isnan(gap), math.inf, gap)))


def compare_variables(
    paths: Sequence[str],
    one: Sequence[np.ndarray],
    many: Sequence[np.ndarray],
    tolerance: float,
) -> tuple[tuple[VariableDifference, ...], str | None, float]:
    """(differences largest first, the first path above `tolerance` in order, the maximum)."""
    found = [
        VariableDifference(path, _difference(a, b), tuple(int(d) for d in a.shape))
        for path, a, b in zip(paths, one, many)
    ]
    first = next((d.path for d in found if d.difference > tolerance), None)
    largest = max((d.difference for d in found), default=0.0)
    ordered = tuple(sorted(found, key=lambda d: -d.difference))
    return ordered, first, largest
