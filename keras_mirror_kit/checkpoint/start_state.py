"""The state a `fit()` started from, on disk until its first checkpoint, for a retry of it.

A `fit()` that raises before its first checkpoint (an exception in a callback, a bad batch)
leaves the model in memory with the steps it trained. Retried in the same process with
the same model and `SyncedCheckpoint`, the directory holds nothing of that `fit()` to
resume from, so the retry would train those batches again on top of them. So at
`on_train_begin` of a `fit()` that starts from scratch (nothing restored), the chief writes
the whole state a checkpoint holds (the model's variables, every optimizer's, the random
layers' and Keras' global seed state) to `fit-start.kmk` in the checkpoint directory
(`store.START_FILE`): streamed one variable at a time like a checkpoint, so no host copy
of the state is kept (with `async_save=True`, from the staging arrays, in the background).
`StartPoint` records on every worker that the file belongs to that `fit()`; the retry
reads it back (`return_to_start`) on every worker, as a resume reads a checkpoint. The
file is deleted once that `fit()` wrote a checkpoint a retry resumes from, or ended.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import TYPE_CHECKING, Any

from keras_mirror_kit.checkpoint.resume import adopt_seed
from keras_mirror_kit.checkpoint.state import apply_state, global_seed_variable
from keras_mirror_kit.checkpoint.store import START_FILE, CheckpointError, CheckpointStore

if TYPE_CHECKING:  # data.cursor imports TensorFlow: not for a JAX-only install
    from keras_mirror_kit.data import DatasetCursor

__all__ = ["StartPoint", "return_to_start"]

logger = logging.getLogger("keras_mirror_kit")


class StartPoint:
    """That one `fit()` of a model wrote its start state (`fit-start.kmk`) and no checkpoint since.

    Args:
        model: The model (held weakly: the record never keeps a model alive).
        fit_index: Which `fit()` of the script on `model` it belongs to (0 for the first).

    Example:

    ```python
    start = StartPoint(model, fit_index=0)  # at on_train_begin, once the file is written
    ...  # fit() raised at step 2, before any checkpoint; fit() again:
    if start.belongs_to(model, 0):
        return_to_start(store, model, cursor, directory)  # as that fit() began
    ```
    """

    def __init__(self, model: Any, fit_index: int) -> None:
        self._model = weakref.ref(model)
        self.fit_index = int(fit_index)

    def belongs_to(self, model: Any, fit_index: int) -> bool:
        """Whether this is the start of `fit()` number `fit_index` of this very `model`.

        Args:
            model: The model whose `fit()` starts now.
            fit_index: That `fit()`'s number in the script.

        Returns:
            True for the same model object and `fit()` number.
        """
        return self._model() is model and self.fit_index == fit_index


def return_to_start(
    store: CheckpointStore,
    model: Any,
    cursor: DatasetCursor | None,
    directory: str | os.PathLike[str],
) -> bool:
    """Puts the state of `fit-start.kmk` back into `model` (every worker calls it).

    Args:
        store: The checkpoint directory's store.
        model: The model whose `fit()` is retried.
        cursor: The cursor of the kit dataset the `fit()` trains on, or None: a seed drawn
            at random (`fit(x, y, shuffle=True)` of a model the kit built) is taken back.
        directory: The directory, for messages.

    Returns:
        False, with a WARNING and nothing assigned, when the file cannot be read or the
        model's variables are no longer those saved (a layer or an optimizer was added).
    """
    try:
        loaded = store.read_start()
        with loaded.arrays:
            apply_state(model, loaded, directory)
    except (ValueError, CheckpointError) as err:
        logger.warning(
            "keras-mirror-kit: this fit() raised before its first checkpoint in %s, but the "
            "state it started from cannot be put back (%s): the batches it trained before "
            "it raised are trained again",
            directory,
            err,
        )
        return False
    adopt_seed(cursor, loaded.meta)
    logger.info(
        "keras-mirror-kit: this fit() raised before its first checkpoint in %s; the model, "
        "its optimizers and random state are back at the state that fit() started from "
        "(%s), so no batch is trained twice",
        directory,
        START_FILE,
    )
    if "random/global" not in loaded.arrays and global_seed_variable() is not None:
        logger.info(
            "keras-mirror-kit: Keras' global seed generator was first used by the attempt "
            "that raised; unseeded random draws of the retry may differ from an "
            "uninterrupted run's"
        )
    return True
