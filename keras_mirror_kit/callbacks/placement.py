"""Where `SyncedCheckpoint` puts itself and its hooks in a `fit()`'s callbacks.

It saves the other callbacks' state, so it must run after the stateful ones at each epoch
end, and two hooks of its own run first and last in the list (`LoopHook`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import keras

from keras_mirror_kit.checkpoint.callback_state import is_stateful

__all__ = ["LoopHook", "place_after_stateful"]

logger = logging.getLogger("keras_mirror_kit")


class LoopHook(keras.callbacks.Callback):
    """Runs the steps of `SyncedCheckpoint` it is given, first (head) or last (tail) in the list.

    The head restores the other callbacks' state before any of them starts an epoch and
    clears the stop request that ended a resumed epoch early before they see it; the tail
    asks to end a resumed epoch after every other callback had its say about stopping.
    """

    def __init__(
        self,
        epoch_begin: Callable[[], None] | None = None,
        epoch_end: Callable[[], None] | None = None,
        batch_end: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self._epoch_begin, self._epoch_end, self._batch_end = epoch_begin, epoch_end, batch_end

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self._epoch_begin is not None:
            self._epoch_begin()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self._epoch_end is not None:
            self._epoch_end()

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self._batch_end is not None:
            self._batch_end()


def place_after_stateful(
    owner: Any, callbacks: list[Any], head: LoopHook, tail: LoopHook
) -> tuple[list[tuple[str, Any]], list[Any]]:
    """`callbacks` with `owner` after the stateful ones, and `head` and `tail` around all.

    Returns the stateful callbacks as `(key, callback)` (keys such as `"EarlyStopping#0"`:
    the class name, then its number among those of that class) and the new list (hooks an
    earlier `fit()` left in a reused `CallbackList` are dropped).
    """
    callbacks = [c for c in callbacks if c is owner or not isinstance(c, LoopHook)]
    tracked: list[tuple[str, Any]] = []
    counts: dict[str, int] = {}
    last, mine = -1, callbacks.index(owner)
    for i, callback in enumerate(callbacks):
        if callback is owner or not is_stateful(callback):
            continue
        name = type(callback).__name__
        tracked.append((f"{name}#{counts.get(name, 0)}", callback))
        counts[name] = counts.get(name, 0) + 1
        last = i
    if last > mine:
        callbacks.remove(owner)
        callbacks.insert(last, owner)
        logger.debug(
            "keras-mirror-kit: SyncedCheckpoint runs after %s so that their state at "
            "each epoch end is saved",
            ", ".join(key for key, _ in tracked),
        )
    return tracked, [head, *callbacks, tail]
