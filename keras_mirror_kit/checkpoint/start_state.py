"""The state a `fit()` started from, kept in memory until its first checkpoint is written.

A `fit()` that raises before its first checkpoint (an exception in a callback, a bad batch)
leaves the model in memory with the steps it trained. Retried in the same process with
the same model and `SyncedCheckpoint`, the directory holds nothing to resume from, so the
retry would train those batches again on top of them. `StartState` is what the retry goes
back to instead: a host copy of every variable a checkpoint holds (the model's, the
optimizer's, the random layers' and Keras' global seed generator's), taken at
`on_train_begin` of a `fit()` that starts from scratch and dropped once that `fit()` wrote
a checkpoint (a retry then resumes from the checkpoint) or ended.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import numpy as np

from keras_mirror_kit import backends
from keras_mirror_kit.checkpoint.state import global_seed_variable, state_variables

__all__ = ["StartState"]

logger = logging.getLogger("keras_mirror_kit")


class StartState:
    """A host copy of a model's checkpointed state at the start of one `fit()`.

    Args:
        model: The model (held weakly: the copy never keeps a model alive).
        fit_index: Which `fit()` of the script on `model` it belongs to (0 for the first).

    Example:

    ```python
    kept = StartState(model, fit_index=0)  # at on_train_begin, before the first step
    ...  # fit() raised at step 2, before any checkpoint
    if kept.belongs_to(model, 0):
        kept.restore()  # the model is as that fit() found it
    ```
    """

    def __init__(self, model: Any, fit_index: int) -> None:
        self._model = weakref.ref(model)
        self.fit_index = int(fit_index)
        state = backends.current()
        self._variables = [variable for _, variable in state_variables(model)]
        self._seed = global_seed_variable()  # None: Keras' global generator not made yet
        self._kept = self._variables + ([self._seed] if self._seed is not None else [])
        self._values = [np.array(state.host_value(v), copy=True) for v in self._kept]

    def belongs_to(self, model: Any, fit_index: int) -> bool:
        """Whether this is the start of `fit()` number `fit_index` of this very `model`.

        Args:
            model: The model whose `fit()` starts now.
            fit_index: That `fit()`'s number in the script.

        Returns:
            True for the same model object and `fit()` number.
        """
        return self._model() is model and self.fit_index == fit_index

    def restore(self) -> bool:
        """Assigns every kept value back to its variable (the model as the `fit()` began).

        Returns:
            False, with a WARNING and nothing assigned, when the model's variables are no
            longer those kept (a layer or an optimizer slot was added since).
        """
        model = self._model()
        now = [variable for _, variable in state_variables(model)] if model is not None else []
        if len(now) != len(self._variables) or any(
            a is not b for a, b in zip(now, self._variables, strict=True)
        ):
            logger.warning(
                "keras-mirror-kit: the model's variables changed since this fit() first "
                "started (%d then, %d now), so its start state cannot be put back: the "
                "batches it trained before it raised are trained again",
                len(self._variables),
                len(now),
            )
            return False
        for variable, value in zip(self._kept, self._values, strict=True):
            variable.assign(value)
        if self._seed is None and global_seed_variable() is not None:
            logger.info(
                "keras-mirror-kit: Keras' global seed generator was first used by the "
                "attempt that raised; unseeded random draws of the retry may differ from "
                "an uninterrupted run's"
            )
        return True
