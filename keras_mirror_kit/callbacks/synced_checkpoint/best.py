"""`keep_best`: the score a checkpoint records for the metric it is ranked by.

The direction (`mode`) is found as Keras' `ModelCheckpoint` finds it: `"min"` or `"max"`
as given; with `"auto"`, `loss` and `val_loss` are minimized and a metric of the model is
minimized or maximized by its `_direction`; a metric whose direction is unknown is refused
with `ValueError` asking for `mode="min"` or `mode="max"`.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from keras_mirror_kit.checkpoint_store import check_keep_best

__all__ = ["BestKeeper", "validate_best_args"]

logger = logging.getLogger("keras_mirror_kit")


def validate_best_args(monitor: Any, mode: Any, keep_best: Any) -> None:
    """Refuses bad `monitor`, `mode` and `keep_best` arguments of `SyncedCheckpoint`.

    Args:
        monitor: The metric name.
        mode: `"auto"`, `"min"` or `"max"`.
        keep_best: A non-negative integer.

    Returns:
        None.

    Raises:
        ValueError: On a bad value.
        TypeError: On a `monitor` that is not a string.

    Example:

    ```python
    validate_best_args("val_loss", "auto", 2)
    ```
    """
    check_keep_best(keep_best)
    if not isinstance(monitor, str) or not monitor:
        raise TypeError(
            "`monitor` must be the non-empty name of a value in fit()'s logs, such as "
            f"'val_loss' or 'val_accuracy'. Received: monitor={monitor!r}"
        )
    if mode not in ("auto", "min", "max"):
        raise ValueError(
            "`mode` must be 'auto', 'min' or 'max' (as for keras.callbacks.ModelCheckpoint). "
            f"Received: mode={mode!r}"
        )


def _direction(model: Any, name: str) -> str | None:
    """`"min"`/`"max"` of a metric of `model` named `name` (built or given to compile)."""
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


class BestKeeper:
    """What each save records for `keep_best`, and the warnings about the metric.

    Args:
        monitor: The metric name in `fit()`'s logs.
        mode: `"auto"`, `"min"` or `"max"`.
        keep_best: How many best checkpoints to keep (0: off, nothing is recorded).

    Example:

    ```python
    keeper = BestKeeper("val_loss", "auto", 2)
    keeper.begin(model)
    meta.update(keeper.score(model, logs, epoch_end=True, epoch=3))
    ```
    """

    def __init__(self, monitor: str, mode: str, keep_best: int) -> None:
        validate_best_args(monitor, mode, keep_best)
        self.monitor, self.mode, self.keep_best = monitor, mode, keep_best
        self._resolved: str | None = None
        self._warned = False

    def begin(self, model: Any) -> None:
        """Resets the per-`fit` warning and finds the direction if it is already known."""
        self._warned = False
        self._resolved = self._resolve(model)

    def _resolve(self, model: Any) -> str | None:
        if self.mode != "auto":
            return self.mode
        name = self.monitor.removeprefix("val_")
        if name == "loss":
            return "min"
        return _direction(model, name)

    def score(
        self, model: Any, logs: Mapping[str, Any] | None, epoch_end: bool, epoch: int
    ) -> dict[str, Any]:
        """The `monitor`, `mode` and `score` to record in a checkpoint's metadata.

        Args:
            model: The model being fit.
            logs: The logs of the epoch end or batch end that saves.
            epoch_end: Whether the save is at an epoch boundary.
            epoch: The epoch it records, for messages.

        Returns:
            `{}` when `keep_best` is 0; else the fields, `score` None when the logs lack a
            scalar finite value (warned once per `fit` at an epoch end, like Keras'
            `ModelCheckpoint`).

        Raises:
            ValueError: When `mode="auto"` and the metric's direction is unknown.

        Example:

        ```python
        meta.update(keeper.score(model, logs, epoch_end=True, epoch=3))
        ```
        """
        if not self.keep_best:
            return {}
        value = (logs or {}).get(self.monitor)
        score: float | None = None
        if value is not None:
            array = np.asarray(value)
            if array.ndim == 0 and array.dtype.kind in "fiu":
                score = float(array)
        if score is None or not math.isfinite(score):
            self._missing(logs, value, epoch_end, epoch)
            return {"monitor": self.monitor, "mode": self._resolved, "score": None}
        if self._resolved is None:
            self._resolved = self._resolve(model)
        if self._resolved is None:
            raise ValueError(
                f"SyncedCheckpoint(keep_best={self.keep_best}) received monitor="
                f"{self.monitor!r}, but Keras cannot tell whether that metric should be "
                "maximized or minimized. Pass mode='max' to keep the highest values or "
                "mode='min' to keep the lowest. The checkpoints written so far are intact. "
                f"Received: mode={self.mode!r}"
            )
        return {"monitor": self.monitor, "mode": self._resolved, "score": score}

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
