"""Turning Keras' batch indices into steps done, for any `steps_per_execution`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["skip_batch_end", "steps_done"]


def steps_done(batch: int, epoch_length: int | None, offset: int = 0) -> int:
    """Steps of the current epoch completed when Keras reports `batch` at a batch end.

    With `steps_per_execution=N`, Keras calls `on_train_batch_end` once per execution with
    the index of its last step, even past the end of the epoch when the last execution runs
    fewer than N steps; the count is therefore capped at the epoch length.

    Args:
        batch: The index Keras passed to `on_train_batch_end`.
        epoch_length: Steps in the epoch (`params["steps"]`), or None when unknown.
        offset: Steps of this epoch done before Keras started counting (a resumed epoch).

    Returns:
        The number of steps of the epoch done so far.

    Example:

    ```python
    steps_done(11, epoch_length=10)  # -> 10 (last execution of 3 ran 1 step)
    ```
    """
    done = offset + int(batch) + 1
    return min(done, epoch_length) if epoch_length else done


def skip_batch_end(callback: Any, fallback: Callable[..., None] | None = None) -> None:
    """Lets Keras dispatch batch ends asynchronously although `callback` defines one.

    Keras 3 runs `on_train_batch_end` in a background thread (so the main thread never
    waits for the step's logs, a device synchronisation) only when no callback overrides it.
    This replaces the callback's method, on this instance, with one Keras treats as the
    default: a no-op, or `fallback` when given (still called, but from Keras' thread).

    Args:
        callback: A `keras.callbacks.Callback` that does not need batch ends in this
            configuration.
        fallback: Optional function `(batch, logs=None)` to run instead.

    Returns:
        None.

    Example:

    ```python
    if save_freq == "epoch":
        skip_batch_end(self)
    ```
    """

    def on_train_batch_end(batch: int, logs: dict[str, Any] | None = None) -> None:
        if fallback is not None:
            fallback(batch, logs)

    on_train_batch_end._is_default = True  # type: ignore[attr-defined]  # Keras' own marker
    callback.on_train_batch_end = on_train_batch_end
