"""`keep_best`: the score each save records, and the ranking retention keeps the best by.

The direction (`mode`) is found as Keras' `ModelCheckpoint` finds it: `"min"` or `"max"`
as given; with `"auto"`, `loss` and `val_loss` are minimized and another metric by the
direction the model gives it (the caller looks that up, where the model is known); a
metric whose direction is unknown is refused with `ValueError` asking for `mode="min"` or
`mode="max"`. Nothing here imports Keras or TensorFlow.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from keras_mirror_kit.checkpoint.meta import ManifestEntry, Score
from keras_mirror_kit.validation import non_empty_str, non_negative_int, one_of

__all__ = ["BestKeeper", "best_entries", "check_best_args", "metric_direction"]

logger = logging.getLogger("keras_mirror_kit")

_MODES = ("auto", "min", "max")


def best_entries(entries: Iterable[ManifestEntry], monitor: str) -> list[ManifestEntry]:
    """The finite entries ranked by `monitor`, best first (the earliest of equal scores first)."""
    ranked = [
        e
        for e in entries
        if e.score is not None and e.score.monitor == monitor and e.score.ranked and e.finite_state
    ]

    def key(entry: ManifestEntry) -> tuple[float, int]:
        score = entry.score
        assert score is not None and score.value is not None
        return (score.value if score.mode == "min" else -score.value, entry.index)

    return sorted(ranked, key=key)


def check_best_args(monitor: object, mode: object, keep_best: object) -> None:
    """Refuses bad `monitor`, `mode` and `keep_best` arguments (TypeError, ValueError)."""
    non_negative_int("keep_best", keep_best)
    non_empty_str(
        "monitor",
        monitor,
        "the non-empty name of a value in fit()'s logs, such as 'val_loss' or 'val_accuracy'",
    )
    one_of("mode", mode, _MODES, "(as for keras.callbacks.ModelCheckpoint)")


class BestKeeper:
    """What each save records for `keep_best`, and the warnings about the metric.

    `begin` takes the lookup of a metric's direction in the model being fit (`"min"`,
    `"max"` or None for a metric name), used with `mode="auto"` for metrics other than
    the losses; the lookup is tried again at a save while it finds nothing (a metric is
    built at the first step).
    """

    def __init__(self, monitor: str, mode: str, keep_best: int) -> None:
        check_best_args(monitor, mode, keep_best)
        self.monitor, self.mode, self.keep_best = monitor, mode, keep_best
        self._direction_of: Callable[[str], str | None] = lambda name: None
        self._resolved: str | None = None
        self._warned = False

    def begin(self, direction_of: Callable[[str], str | None]) -> None:
        """Resets the per-`fit` warning and finds the direction if it is already known."""
        self._warned = False
        self._direction_of = direction_of
        self._resolved = self._resolve()

    def _resolve(self) -> str | None:
        if self.mode != "auto":
            return self.mode
        name = self.monitor.removeprefix("val_")
        return "min" if name == "loss" else self._direction_of(name)

    def score(self, logs: Mapping[str, Any] | None, epoch_end: bool, epoch: int) -> Score | None:
        """The score to record for a save with these logs; None when `keep_best` is 0.

        The score's value is None when the logs lack a scalar finite value (warned once per
        `fit` at an epoch end, as Keras' `ModelCheckpoint` warns).

        Raises:
            ValueError: When `mode="auto"` and the metric's direction is unknown.
        """
        if not self.keep_best:
            return None
        value = (logs or {}).get(self.monitor)
        score = _scalar(value)
        if score is None or not math.isfinite(score):
            self._missing(logs, value, epoch_end, epoch)
            return Score(self.monitor, self._resolved, None)
        if self._resolved is None:
            self._resolved = self._resolve()
        if self._resolved is None:
            raise ValueError(
                f"SyncedCheckpoint(keep_best={self.keep_best}) received monitor="
                f"{self.monitor!r}, but Keras cannot tell whether that metric should be "
                "maximized or minimized. Pass mode='max' to keep the highest values or "
                "mode='min' to keep the lowest. The checkpoints written so far are intact. "
                f"Received: mode={self.mode!r}"
            )
        return Score(self.monitor, self._resolved, score)

    def _missing(
        self, logs: Mapping[str, Any] | None, value: Any, epoch_end: bool, epoch: int
    ) -> None:
        """Warns (once per fit, at an epoch end) that a checkpoint was not scored."""
        what = "is not in the logs" if value is None else f"is not a finite scalar ({value!r})"
        message = (
            f"SyncedCheckpoint(keep_best={self.keep_best}) can rank checkpoints only with "
            f"{self.monitor!r} available; it {what} at epoch {epoch}, so this checkpoint is "
            "kept only as one of the newest. Logged values: "
            f"{', '.join(sorted(logs or {})) or 'none'}. Pass monitor= one of them (val_ "
            "values need validation_data in fit())."
        )
        if epoch_end and not self._warned:
            self._warned = True
            warnings.warn(message, UserWarning, stacklevel=3)
        else:
            logger.debug("keras-mirror-kit: %s", message)


def _scalar(value: Any) -> float | None:
    """`value` as a float when it is a real scalar (a number, a 0-d array or tensor)."""
    if value is None:
        return None
    array = np.asarray(value)
    return float(array) if array.ndim == 0 and array.dtype.kind in "fiu" else None


def metric_direction(model: Any, name: str) -> str | None:
    """The direction of a model's metric, for `mode="auto"` (built or given to compile).

    Args:
        model: A compiled Keras model (duck-typed: its `metrics` and compiled metrics).
        name: The metric's name, as in `logs` without `val_`.

    Returns:
        `"max"` for a metric Keras says goes up (accuracy), `"min"` for one that goes
        down, None when no metric of that name says.

    Example:

    ```python
    metric_direction(model, "accuracy")  # "max"
    ```
    """
    candidates: list[Any] = []
    for metric in getattr(model, "metrics", None) or []:
        candidates.append(metric)
        candidates.extend(getattr(metric, "metrics", None) or [])
    compiled = getattr(model, "_compile_metrics", None)
    pending = list(getattr(compiled, "_user_metrics", None) or [])
    while pending:  # metric objects given to compile(), before Keras builds them
        item = pending.pop()
        if isinstance(item, Mapping):
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
        else:
            candidates.append(item)
    for metric in candidates:
        if getattr(metric, "name", None) == name and hasattr(metric, "_direction"):
            return "max" if metric._direction == "up" else "min"  # noqa: SLF001
    return None
