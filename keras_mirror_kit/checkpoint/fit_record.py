"""Which `fit()` of a script a checkpoint belongs to, recorded, and what a new `fit()` makes of it.

A script may call `fit()` several times with one checkpoint directory (a frozen stage, then
fine-tuning). Every checkpoint records the `FitRecord` of the `fit()` that wrote it: that
`fit()`'s number in its script (0 for the first) and the `epochs` of every `fit()` of the
script up to it. A process records its own: `FitLedger` keeps, per model and directory, the
`epochs` of each `fit()` that completed there, and `FitLedger.starting` is the record of the
next one. `place` compares the two records and says what the starting `fit()` does with the
checkpoint (`Placement`); `SyncedCheckpoint` and `resume.restore_latest` follow it.

In a checkpoint file the record is the keys `fit_index`, `fit_epochs` and
`script_fit_epochs` (`meta.CheckpointMeta`); a file without `fit_index` (written before
keras-mirror-kit recorded it) belongs to the `fit()` that reads it.

Nothing here imports NumPy, Keras or TensorFlow.
"""

from __future__ import annotations

import enum
import os
import weakref
from dataclasses import dataclass
from typing import Any

__all__ = ["FitLedger", "FitRecord", "Placement", "place"]


@dataclass(frozen=True)
class FitRecord:
    """One `fit()` of a script: its number, its `epochs`, and those of the `fit()`s before it.

    Args:
        index: The `fit()`'s number in its script (0 for the first).
        epochs: Its `epochs` (None when unknown).
        history: The `epochs` of the script's `fit()` calls before it, in order (None where
            unknown); `index` of them once complete (older checkpoints may hold fewer).

    Example:

    ```python
    first = FitRecord(index=0, epochs=2)
    second = first.then(epochs=4)  # FitRecord(index=1, epochs=4, history=(2,))
    ```
    """

    index: int = 0
    epochs: int | None = None
    history: tuple[int | None, ...] = ()

    @property
    def script_epochs(self) -> tuple[int | None, ...]:
        """The `epochs` of every `fit()` of the script up to and including this one."""
        return (*self.history, self.epochs)

    def then(self, epochs: int | None) -> FitRecord:
        """The record of the script's next `fit()`, with these `epochs`."""
        return FitRecord(self.index + 1, epochs, self.script_epochs)

    def as_stage_of(self, saved: FitRecord) -> FitRecord:
        """This `fit()` under the number of the later stage `saved` that it reruns alone."""
        history = list(saved.history or [None] * saved.index)[: saved.index]
        return FitRecord(saved.index, self.epochs, tuple(history))

    def _unfinished(self, epoch: int, stopped: bool, epochs: int | None) -> bool:
        """Whether this `fit()` had these `epochs` and neither ended nor was stopped at `epoch`."""
        if epochs is None or self.epochs is None or self.epochs != int(epochs):
            return False
        return not stopped and epoch < self.epochs


class Placement(enum.Enum):
    """What a starting `fit()` does with the newest checkpoint, as `place` decides.

    * `EARLIER`: an earlier `fit()` of the script wrote it and the model went on from it:
      the starting `fit()` starts from its own first epoch, restoring nothing.
    * `OWN`: the starting `fit()` wrote it: it resumes from it.
    * `STAGE_ALONE`: a later `fit()` with the same `epochs`, unfinished, wrote it, and the
      script's `fit()` at this number had other `epochs`: that stage is rerun alone
      (earlier `fit()` calls commented out, a notebook cell after a restart), so the
      starting `fit()` takes the later number as its own and resumes.
    * `STOPPED`: the starting `fit()` wrote it after a callback stopped it (same `epochs`):
      its state is restored and it trains nothing.
    * `LATER`: another later `fit()` wrote it: this one counts as finished, trains nothing.
    """

    EARLIER = "earlier"
    OWN = "own"
    STAGE_ALONE = "stage_alone"
    STOPPED = "stopped"
    LATER = "later"


def place(saved: FitRecord | None, starting: FitRecord, *, epoch: int, stopped: bool) -> Placement:
    """What the starting `fit()` does with a checkpoint that `saved`'s `fit()` wrote.

    A full rerun of a script goes stage by stage: each `fit()` finds the checkpoint of a
    later one and trains nothing, until the one that was interrupted resumes. A later
    stage rerun alone carries its own number in the checkpoint but another in the process;
    it is told from a full rerun by the `epochs` the checkpoint records for the script's
    `fit()` at the starting number.

    Args:
        saved: The record in the checkpoint, or None for a file written before records
            (then it is the starting `fit()`'s own).
        starting: The starting `fit()`'s record (`FitLedger.starting`).
        epoch: The checkpoint's epoch (the next one at an epoch end).
        stopped: Whether the `fit()` that wrote it had been asked to stop.

    Returns:
        The `Placement`.

    Example:

    ```python
    saved = FitRecord(index=1, epochs=4, history=(2,))  # stage 2, interrupted at epoch 3
    place(saved, FitRecord(0, epochs=2), epoch=3, stopped=False)  # Placement.LATER
    place(saved, FitRecord(0, epochs=4), epoch=3, stopped=False)  # Placement.STAGE_ALONE
    ```
    """
    if saved is None or saved.index == starting.index:
        if saved is not None and stopped and starting.epochs is not None:
            if saved.epochs == starting.epochs:
                return Placement.STOPPED
        return Placement.OWN
    if saved.index < starting.index:
        return Placement.EARLIER
    # The script's fit() at the starting number had these epochs too: a full rerun.
    history = saved.history
    same_in_script = starting.index < len(history) and history[starting.index] == starting.epochs
    if saved._unfinished(epoch, stopped, starting.epochs) and not same_in_script:  # noqa: SLF001
        return Placement.STAGE_ALONE
    return Placement.LATER


class FitLedger:
    """The `fit()` calls of each model that completed on each checkpoint directory.

    What numbers a process's `fit()` calls: the next `fit()` of a model on a directory is
    number `len(completed)`. Models are held weakly.

    Example:

    ```python
    ledger = FitLedger()
    first = ledger.starting(model, "ckpts", epochs=2)  # FitRecord(0, 2)
    ledger.completed(model, "ckpts", first)  # at the end of that fit()
    ledger.starting(model, "ckpts", epochs=4)  # FitRecord(1, 4, history=(2,))
    ```
    """

    def __init__(self) -> None:
        self._fits: weakref.WeakKeyDictionary[Any, dict[str, FitRecord]] = (
            weakref.WeakKeyDictionary()
        )

    def starting(
        self, model: Any, directory: str | os.PathLike[str], epochs: int | None
    ) -> FitRecord:
        """The record of the `fit()` of `model` on `directory` that starts now.

        Args:
            model: The model.
            directory: The checkpoint directory.
            epochs: The starting `fit()`'s `epochs`.

        Returns:
            Its `FitRecord`: the number after the last completed one (0 for the first).
        """
        last = self._fits.get(model, {}).get(os.path.abspath(directory))
        return FitRecord(0, epochs) if last is None else last.then(epochs)

    def completed(self, model: Any, directory: str | os.PathLike[str], fit: FitRecord) -> None:
        """Records that `fit` (as it ended: perhaps under a later stage's number) completed.

        Args:
            model: The model.
            directory: The checkpoint directory.
            fit: The record of the `fit()` that completed.
        """
        self._fits.setdefault(model, {})[os.path.abspath(directory)] = fit
