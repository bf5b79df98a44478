"""What Keras' training loop does not hand a callback: the steps done in the epoch."""

from __future__ import annotations

from typing import Any

from keras_mirror_kit.upstream import keras_private

__all__ = ["steps_done"]


def steps_done(
    batch: int, epoch_length: int | None, offset: int = 0, steps_per_execution: Any = 1
) -> int:
    """Steps of the epoch done when Keras reports `batch` at a batch end (`offset`: resumed).

    With `steps_per_execution=N` Keras reports once per execution with the index of its last
    step (Keras 3.10: its first, made the last here), even past the epoch's end when the
    last execution runs fewer than N steps, so the count is capped at the epoch length.
    """
    done = offset + keras_private.last_step_of_execution(batch, steps_per_execution) + 1
    return min(done, epoch_length) if epoch_length else done
