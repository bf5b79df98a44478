"""Where `SyncedCheckpoint` sits in a `fit()`'s `CallbackList`, between a head and a tail hook."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, NamedTuple

import keras

from keras_mirror_kit.callbacks.synced_checkpoint.callback_state import is_stateful

if TYPE_CHECKING:
    from keras_mirror_kit.callbacks.synced_checkpoint.callback import SyncedCheckpoint

__all__ = ["Hook", "Placement", "place"]

logger = logging.getLogger("keras_mirror_kit")


class Hook(keras.callbacks.Callback):
    """Runs a part of `SyncedCheckpoint` first (`head`) or last (`tail`) in the list.

    The head restores the other callbacks' state before any of them starts an epoch and
    clears the stop request that ended a resumed epoch early before they see it; the tail
    asks to end a resumed epoch after every other callback had its say about stopping.

    Args:
        owner: The `SyncedCheckpoint`.
        head: True for the hook placed first, False for the one placed last.

    Example:

    ```python
    callback_list.callbacks = [Hook(owner, True), *callbacks, Hook(owner, False)]
    ```
    """

    def __init__(self, owner: SyncedCheckpoint, head: bool) -> None:
        super().__init__()
        self.owner, self.head = owner, head

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self.head:
            self.owner._before_epoch()  # noqa: SLF001

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self.head:
            self.owner._clear_own_stop()  # noqa: SLF001

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if not self.head:
            self.owner._request_epoch_end()  # noqa: SLF001


class Placement(NamedTuple):
    """What `place` did to a `CallbackList`, for the owner to use and later undo.

    Attributes:
        tracked: `(key, callback)` for each stateful callback, keys such as
            `"EarlyStopping#0"` (class name, then its number among those of that class).
        head: The hook placed first.
        tail: The hook placed last.
        original: The list's callbacks before, without hooks of an earlier `fit()`.

    Example:

    ```python
    placement = place(owner, callback_list)
    ...
    callback_list.callbacks = placement.original
    ```
    """

    tracked: list[tuple[str, Any]]
    head: Hook
    tail: Hook
    original: list[Any]


def place(owner: SyncedCheckpoint, callback_list: Any) -> Placement:
    """Finds the stateful callbacks and places the hooks, and `owner` after those callbacks.

    The list gets a new `callbacks` list object, so Keras' loop over the old one (the
    `on_train_begin` now running) goes on unchanged.

    Args:
        owner: The `SyncedCheckpoint`, which must be in `callback_list.callbacks`.
        callback_list: The `keras.callbacks.CallbackList` of the `fit()`.

    Returns:
        The `Placement`.

    Example:

    ```python
    placement = place(self, find_callback_list(self))
    ```
    """
    callbacks = [c for c in callback_list.callbacks if c is owner or not isinstance(c, Hook)]
    callbacks_before = list(callbacks)
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
    head, tail = Hook(owner, head=True), Hook(owner, head=False)
    for hook in (head, tail):
        hook.set_model(owner.model)
    callback_list.callbacks = [head, *callbacks, tail]
    return Placement(tracked, head, tail, callbacks_before)
