"""Turning Keras' batch indices into steps done, for any `steps_per_execution`."""

from __future__ import annotations

__all__ = ["steps_done"]


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
