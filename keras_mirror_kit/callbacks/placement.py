"""Where `SyncedCheckpoint` puts itself and its hooks in a `fit()`'s callbacks.

It saves the other callbacks' state, so it must run after the stateful ones at each epoch
end, and two hooks of its own run first and last in the list (`LoopHook`). A callback that
restores a training state of its own at `on_train_begin` (Keras' `BackupAndRestore`) must
run before it, so that the checkpoint's newer state wins: `BackupAndRestore` is moved
there, and any other callback listed after it that sets the start epoch
(`model._initial_epoch`, as `BackupAndRestore` does) over a restored state is refused by
the tail hook, before any step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import keras

from keras_mirror_kit.checkpoint.callback_state import is_stateful

__all__ = [
    "EpochMark",
    "LoopHook",
    "check_start_epoch",
    "mark_start_epoch",
    "place_after_stateful",
    "restoring_callbacks",
    "train_beginners_after",
]

logger = logging.getLogger("keras_mirror_kit")


class LoopHook(keras.callbacks.Callback):
    """Runs the steps of `SyncedCheckpoint` it is given, first (head) or last (tail) in the list.

    The head clears a start epoch left by an interrupted `fit()` before any callback sets
    one, restores the other callbacks' state before any of them starts an epoch and clears
    the stop request that ended a resumed epoch early before they see it; the tail checks,
    after every callback's `on_train_begin`, that none after `SyncedCheckpoint` restored a
    state over the checkpoint's, and asks to end a resumed epoch after every other callback
    had its say about stopping.
    """

    def __init__(
        self,
        owner: Any,
        train_begin: Callable[[], None] | None = None,
        epoch_begin: Callable[[], None] | None = None,
        epoch_end: Callable[[], None] | None = None,
        batch_end: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self.owner = owner  # the SyncedCheckpoint whose steps these are
        self._train_begin = train_begin
        self._epoch_begin, self._epoch_end, self._batch_end = epoch_begin, epoch_end, batch_end

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if self._train_begin is not None:
            self._train_begin()

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
    earlier `fit()` of `owner`, or of a callback no longer listed, left in a reused
    `CallbackList` are dropped; those of another listed owner stay).
    """
    callbacks = [
        c
        for c in callbacks
        if not isinstance(c, LoopHook)
        or (c.owner is not owner and any(c.owner is other for other in callbacks))
    ]
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
    mine = callbacks.index(owner)
    later = [c for c in callbacks[mine + 1 :] if _restores(c)]
    if later:  # their on_train_begin restores first, and the checkpoint's state wins
        callbacks = [c for c in callbacks if not any(c is r for r in later)]
        mine = callbacks.index(owner)
        callbacks[mine:mine] = later
        logger.debug(
            "keras-mirror-kit: %s restored before SyncedCheckpoint, whose newer state wins",
            ", ".join(type(c).__name__ for c in later),
        )
    return tracked, [head, *callbacks, tail]


def _restores(callback: Any) -> bool:
    """Whether `callback` is known to restore a training state at `on_train_begin`: Keras'
    `BackupAndRestore` and its subclasses (others are told by the start epoch they set)."""
    return isinstance(callback, keras.callbacks.BackupAndRestore)


def restoring_callbacks(callbacks: list[Any]) -> list[str]:
    """The class names of the callbacks known to restore a state at `on_train_begin`."""
    return [type(c).__name__ for c in callbacks if _restores(c)]


def train_beginners_after(owner: Any, callbacks: list[Any]) -> list[str]:
    """The class names of the callbacks after `owner` that define their own `on_train_begin`."""
    base = keras.callbacks.Callback.on_train_begin
    after = callbacks[callbacks.index(owner) + 1 :]
    return [
        type(c).__name__
        for c in after
        if not isinstance(c, LoopHook) and getattr(type(c), "on_train_begin", base) is not base
    ]


class EpochMark(int):
    """The start epoch `SyncedCheckpoint` set with a restored state: an int object of its
    own, so that any later assignment to `model._initial_epoch` is seen, even of the same
    number."""


def check_start_epoch(
    model: Any, mark: EpochMark | None, directory: Any, later: list[str]
) -> None:
    """Refuses (`ValueError`) a start epoch set again after `mark` was set with a restored
    state: a callback in `later` restored a training state of its own over it."""
    now = model._initial_epoch  # noqa: SLF001
    if mark is not None and now is not mark:
        raise ValueError(
            "A callback listed after SyncedCheckpoint set the epoch fit() starts at "
            f"(model._initial_epoch) again after SyncedCheckpoint restored {str(directory)!r} "
            f"at epoch {int(mark)}: it restored a training state of its own over the "
            "checkpoint's, so batches would be lost or trained twice. List it before "
            "SyncedCheckpoint (the checkpoint's state then wins, as for Keras' "
            "BackupAndRestore, which is moved there), or keep only one of the two "
            "(SyncedCheckpoint also saves the optimizer, the other callbacks' states and the "
            f"position within the epoch). Received: model._initial_epoch={now}, callbacks "
            f"after SyncedCheckpoint with an on_train_begin: {later}"
        )


def mark_start_epoch(model: Any, resume: Any, directory: Any, restorers: list[str]) -> Any:
    """Sets the start epoch of a restored `ResumePlan` as an `EpochMark` (returned); when
    nothing was restored, leaves the one another callback set (INFO) and returns None."""
    if resume.restored is not None or resume.initial_epoch is not None:
        # This state and epoch replace what a callback listed before restored.
        model._initial_epoch = EpochMark(resume.initial_epoch or 0)  # noqa: SLF001 (0: fit's)
        return model._initial_epoch  # noqa: SLF001
    if model._initial_epoch:  # noqa: SLF001
        logger.info(
            "keras-mirror-kit: no checkpoint of this fit() in %s; it starts at epoch %d, from "
            "the state another callback restored at on_train_begin (%s)",
            directory,
            model._initial_epoch,  # noqa: SLF001
            ", ".join(restorers) or "a callback of this fit()",
        )
    return None
