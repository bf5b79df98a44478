"""What Keras' training loop does not hand a callback: its `CallbackList`, and steps done."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where the list is looked for: steps_done needs no Keras
    import keras

__all__ = ["find_callback_list", "steps_done"]


def find_callback_list(
    callback: keras.callbacks.Callback, max_frames: int = 8
) -> keras.callbacks.CallbackList | None:
    """The `CallbackList` whose loop is calling `callback` now, found in the call stack.

    Keras gives a callback no handle on the list that drives it (`fit()` wraps `callbacks` in
    a list of its own), yet `SyncedCheckpoint` and `WandbLogger` need it: to see the other
    callbacks of the same `fit()`, to change their order, or to tell later whether that
    `fit()` still runs. The walk starts at the caller of the hook that calls this (the
    `CallbackList` method) and looks at `max_frames` frames; None for a hand-driven loop.
    """
    import keras

    frame = sys._getframe(2)  # noqa: SLF001
    for _ in range(max_frames):
        if frame is None:
            return None
        candidate: Any = frame.f_locals.get("self")
        if isinstance(candidate, keras.callbacks.CallbackList) and any(
            c is callback for c in candidate.callbacks
        ):
            return candidate
        frame = frame.f_back
    return None


def steps_done(batch: int, epoch_length: int | None, offset: int = 0) -> int:
    """Steps of the epoch done when Keras reports `batch` at a batch end (`offset`: resumed).

    With `steps_per_execution=N` Keras reports once per execution with the index of its last
    step, even past the epoch's end when the last execution runs fewer than N steps, so the
    count is capped at the epoch length.
    """
    done = offset + int(batch) + 1
    return min(done, epoch_length) if epoch_length else done
