"""`SyncedCheckpoint`: crash-safe, replica-verified, resumable checkpoints for `model.fit`.

This module is the callback's course through a `fit()` and its place in the
`CallbackList` (between a head and a tail hook); what a checkpoint is, and how it is
written, verified, resumed and restored, lives in `keras_mirror_kit.checkpoint`.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
from typing import TYPE_CHECKING, Any

import keras
import numpy as np

from keras_mirror_kit import backends, fit_hooks
from keras_mirror_kit.callbacks.keras_loop import steps_done
from keras_mirror_kit.callbacks.placement import (
    EpochMark,
    LoopHook,
    check_start_epoch,
    mark_start_epoch,
    place_after_stateful,
    restoring_callbacks,
    train_beginners_after,
)
from keras_mirror_kit.checkpoint.best import BestKeeper, metric_direction
from keras_mirror_kit.checkpoint.callback_state import best_weights_restored, callback_states
from keras_mirror_kit.checkpoint.divergence import (
    ReplicaDivergenceError,
    check_replicas,
    log_batch_norm_gap,
)
from keras_mirror_kit.checkpoint.fit_record import FitLedger, FitRecord
from keras_mirror_kit.checkpoint.lock import DirectoryLock
from keras_mirror_kit.checkpoint.meta import CheckpointMeta
from keras_mirror_kit.checkpoint.optimizer_match import trained_numbers
from keras_mirror_kit.checkpoint.preemption import PreemptionGuard
from keras_mirror_kit.checkpoint.restore import model_config
from keras_mirror_kit.checkpoint.resume import (
    ResumePlan,
    begin_epoch,
    check_fit_dataset,
    check_whole_epochs,
    check_workers_agree,
    data_description,
    found_cursor,
    other_dataset_error,
    restore_latest,
)
from keras_mirror_kit.checkpoint.snapshot import (
    BackgroundWriter,
    HostStaging,
    StateSnapshot,
    take_snapshot,
)
from keras_mirror_kit.checkpoint.start_state import StartPoint, return_to_start
from keras_mirror_kit.checkpoint.state import build_optimizer, check_reachable, state_variables
from keras_mirror_kit.checkpoint.store import CheckpointError, CheckpointStore, LoadedCheckpoint
from keras_mirror_kit.fit_inputs import kit_pipeline
from keras_mirror_kit.model_record import engine_of, is_chief
from keras_mirror_kit.validation import (
    check_bool,
    check_path,
    non_negative_number,
    positive_int_or,
    share_of_one,
)
from keras_mirror_kit.with_block import check_callback_model

if TYPE_CHECKING:  # data.cursor imports TensorFlow: not for a JAX-only install
    from keras_mirror_kit.data import DatasetCursor

__all__ = ["ReplicaDivergenceError", "SyncedCheckpoint"]

logger = logging.getLogger("keras_mirror_kit")

# The fit() calls of each model completed on each directory: they number the next one.
_FITS = FitLedger()


class SyncedCheckpoint(keras.callbacks.Callback):
    """Saves and restores the whole training state, atomically, from the chief only.

    Each checkpoint holds every variable the model owns (`model.variables`: weights,
    BatchNormalization statistics, random layers' state), Keras' global random state, the
    full state (iterations, learning rate, moments, loss scale) of every optimizer the model
    holds (`model.optimizer`, a GAN's `d_optimizer` and `g_optimizer`) and the variables
    each trains, the seed state of a model's own `train_step` (`own_steps`), its metrics'
    sums (an epoch resumed part-way logs the uninterrupted run's figures), the state of the
    stateful callbacks in `callbacks` (`EarlyStopping`, `ReduceLROnPlateau`,
    `ModelCheckpoint`'s best value, the rate a `LearningRateScheduler` read as the epoch
    began, any callback with `get_checkpoint_state` / `set_checkpoint_state`), and the
    progress (which `fit` of the script, epoch, batch, whether that `fit` was stopped).
    Files are written atomically, the manifest replaced last: a kill at any instant leaves
    the previous checkpoint loadable. A state holding NaN or Inf is refused
    (`CheckpointError`, nothing written) unless `allow_non_finite=True`.

    At `on_train_begin`, the newest good checkpoint (a corrupt one is reported and the
    previous used; of any replica count) is checked against the model and optimizer
    (variable paths and shapes: `CheckpointError` before any step) and restored: each `fit`
    of a rerun script goes on from it, one that had finished trains nothing, the one that
    was running resumes where it stopped (docs/checkpointing.md has every case).

    With an integer `save_freq`, checkpoints are also written every `save_freq` batches.
    On a kit dataset (`kmk.make_dataset`, the kit's loaders, maps and prefetches after
    one; `dataset=` names it, else `fit` finds it) and on arrays given to a kit-built
    model's `fit`, a run resumes exactly mid-epoch: the consumed batches are skipped and
    the epoch ends after its remaining ones. When the data changed, or for other data, the
    resume starts at the newest epoch boundary (with a WARNING where the data changed;
    `strict=True`: `CheckpointError`). Either way no batch is trained twice.

    With `steps_per_execution > 1`, saves happen at execution boundaries, and an exact
    mid-epoch resume needs the epoch length to be a multiple of `steps_per_execution`
    (otherwise the resume starts at the newest epoch boundary).

    Only the chief process writes (`Distribution.is_chief`). After `fit` returns, a later
    `fit` on the same model behaves normally: it neither restores again nor skips epochs.
    After a `fit` that raised, the same instance resumes exactly as a new one would; one
    that raised before its first checkpoint goes back to the state it started from, which a
    `fit` from scratch writes to `fit-start.kmk` in the directory at `on_train_begin`
    (streamed like a save, no host copy kept; deleted at its first checkpoint).

    It is handed `fit()`'s callbacks (`keras_mirror_kit.fit_hooks`): its epoch-end save
    runs after the stateful callbacks, a stop request is cleared only when it is its own,
    Keras' `BackupAndRestore` listed after it is moved before it (the checkpoint's newer
    state wins in either order), and another callback after it that sets the start epoch
    over a restored state is refused with a `ValueError` before any step.

    Args:
        directory: Directory for the checkpoints; created if missing.
        save_freq: `"epoch"`, or a positive integer number of batches.
        keep: How many of the newest checkpoints to keep (>= 1). Beyond the newest, the
            two newest older usable resume points are always kept too.
        restore: Restore from the newest good checkpoint at the start of training.
        verify_replicas: Before each save, check that every mirrored variable's copies are
            identical (`ReplicaDivergenceError` naming those that are not; unsynchronized
            BatchNormalization statistics are logged, and replica 0's saved).
        dataset: The kit dataset `fit` trains on (or on maps and prefetches after it);
            without it, `fit` finds the kit dataset itself.
        verify_atol: Absolute tolerance of the replica comparison, >= 0 (default exact).
        strict: Refuse (`CheckpointError`) instead of falling back to an epoch boundary
            when the data no longer matches a mid-epoch checkpoint.
        allow_non_finite: Save states holding NaN or Inf instead of refusing them (the
            newest finite checkpoint is kept regardless).
        monitor: With `keep_best`, the value of `fit()`'s logs that ranks checkpoints
            (`"val_loss"`, `"val_accuracy"`, ...). Epoch-end saves use the epoch's logs,
            mid-epoch saves the batch's; a save without the value is not ranked (a warning
            once per `fit`, as Keras' `ModelCheckpoint` warns).
        mode: `"min"`, `"max"` or `"auto"` (as `ModelCheckpoint`: losses are minimized,
            a metric by its direction; `ValueError` when it cannot be told).
        keep_best: Keep the `keep_best` best checkpoints by `monitor` besides the newest
            `keep` (like Lightning's `save_top_k` with `save_last`); 0 (default): off.
        preemption_signals: Signals that make `fit()` finish the current step, save it
            (every worker at the same step) and end the process with `Preempted` (status
            75); default `(signal.SIGTERM,)`, `()` for none (handled in the main thread).
        async_save: Write each checkpoint in a background thread while training goes on:
            the chief copies the state, up to `async_host_memory` of it, into host arrays
            at the step boundary (allocated once); the next save and the end of `fit` wait for the
            previous write (`wait_for_pending_save()` too); a failed write raises
            `CheckpointWriteError` at the next step or the end of `fit`.
        async_host_memory: With `async_save`, the most host memory those arrays take, as
            a share of the state (0 to 1; default 0.2): the last variables that fit are
            written in the background, the others before training goes on (logged at
            INFO). 1.0 writes all of it in the background, for one host copy of the state.

    Raises:
        TypeError: On a wrong argument type.
        ValueError: On a bad `directory` (empty), `save_freq`, `keep`, `keep_best`, `monitor`
            (empty), `mode`, `verify_atol`, `async_host_memory` or `dataset`; at a save with
            `mode="auto"`, for a `monitor` whose direction is unknown; after the first
            batch, when `fit` iterates another dataset than `dataset=`; before any step,
            when a callback listed after it restored a state over the checkpoint's.
        CheckpointError: At `on_train_begin`, before any training step, for an unusable
            directory or a checkpoint of another model or optimizer (or a data mismatch
            with `strict=True`), or a stateful TensorFlow random op in the model's own
            `train_step` whose state no checkpoint can hold; at a save, for a state
            holding NaN or Inf.
        CheckpointLockedError: At `on_train_begin`, when another live run holds the
            directory's lock (`writer.lock`; a stale one is taken over with a
            `StaleLockWarning`).
        CheckpointWriteError: When a save, or the write of `fit-start.kmk` at
            `on_train_begin`, fails (disk full, read-only); earlier checkpoints stay
            intact. With `async_save=True`, at the next training step or at the end of
            `fit`.
        ReplicaDivergenceError: When replicas diverged (with `verify_replicas=True`).
        Preempted: From `fit()`, after a stop signal, once the step reached is saved (a
            `SystemExit`: the process ends with status 75 unless it is caught).

    Example:

    ```python
    train_ds = kmk.make_dataset(x, y, dist.global_batch_size, seed=0)
    model.fit(train_ds, epochs=10,
              callbacks=[kmk.SyncedCheckpoint("ckpts", save_freq=100, dataset=train_ds)])
    ```
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        save_freq: str | int = "epoch",
        keep: int = 3,
        restore: bool = True,
        verify_replicas: bool = True,
        dataset: Any = None,
        verify_atol: float = 0.0,
        strict: bool = False,
        allow_non_finite: bool = False,
        monitor: str = "val_loss",
        mode: str = "auto",
        keep_best: int = 0,
        preemption_signals: Any = (signal.SIGTERM,),
        async_save: bool = False,
        async_host_memory: float = 0.2,
    ) -> None:
        super().__init__()
        fit_hooks.install()  # any model's fit() then hands over its callbacks (FitHooks)
        check_path("directory", directory)
        save_freq = positive_int_or("save_freq", save_freq, "epoch", "batches")
        cursor = None
        if dataset is not None:
            pipeline = kit_pipeline(dataset)
            if pipeline is None or not pipeline.exact:
                raise ValueError(
                    "`dataset` must be a dataset built by kmk.make_dataset, or that dataset "
                    "followed by maps and prefetches (it carries the position needed for an "
                    "exact mid-epoch resume); omit it for other datasets"
                    f"{': ' + pipeline.breaks if pipeline and pipeline.breaks else ''}. "
                    f"Received: dataset={type(dataset).__name__}"
                )
            cursor = pipeline.cursor
        self._preemption = PreemptionGuard(preemption_signals)  # validates them
        self._best = BestKeeper(monitor, mode, keep_best)
        self._store = CheckpointStore(directory, keep=keep, keep_best=keep_best)
        self._store.monitor = monitor if keep_best else None
        self.directory = self._store.directory
        self._lock = DirectoryLock(self.directory)  # one writer per directory (the chief)
        self.save_freq, self.keep = save_freq, keep
        self.restore, self.verify_replicas = bool(restore), bool(verify_replicas)
        self.verify_atol = non_negative_number("verify_atol", verify_atol)
        self.strict, self.allow_non_finite = bool(strict), bool(allow_non_finite)
        self.async_save = check_bool("async_save", async_save)
        self.async_host_memory = share_of_one("async_host_memory", async_host_memory)
        self._writer = BackgroundWriter()  # the write in progress with async_save=True
        self._staging = HostStaging()  # where async_save snapshots are copied (chief)
        self.monitor, self.mode, self.keep_best = monitor, mode, keep_best
        self._model_config: dict[str, Any] | None = None
        self.preemption_signals = self._preemption.signals
        self._given_cursor: DatasetCursor | None = cursor  # dataset='s
        self._cursor: DatasetCursor | None = cursor  # the one this fit() resumes by
        # What arrange_callbacks placed for the fit() under way: stateful callbacks, hooks.
        self._arranged: tuple[list[tuple[str, Any]], LoopHook, LoopHook] | None = None
        self._restorers: list[str] = []  # the BackupAndRestore callbacks of that fit()
        self._later: list[str] = []  # the callbacks after this one with an on_train_begin
        self._start: StartPoint | None = None  # fit-start.kmk: until this fit()'s 1st checkpoint
        self._reset_run_state()

    # -- lifecycle ---------------------------------------------------------------------------

    def _reset_run_state(self) -> None:
        self._is_chief = True
        self._epoch = 0
        self._resume_epoch: int | None = None
        self._resume_skip = self._epoch_skip = self._steps_in_epoch = 0
        self._steps_in_fit = self._last_save_mark = 0
        self._want_epoch_end = False  # the resumed epoch has run its remaining batches
        self._ending_epoch_early = False  # ...and this callback asked Keras to end it
        self._foreign_stop = False  # someone else had asked to stop at that point
        self._reported_batch_norm = False
        self._fit = FitRecord()  # which fit() of the script this is (fit_record.py)
        self._trained = self._cursor_checked = False
        self._last_save: tuple[int, int, bool, bool] | None = None  # epoch, step, end, stop
        self._tracked: list[tuple[str, Any]] = []
        self._pending: ResumePlan | None = None  # put back as the first epoch begins
        self._mark: EpochMark | None = None  # the start epoch set with a restored state
        self._head: LoopHook | None = None
        self._tail: LoopHook | None = None
        self.last_restored: LoadedCheckpoint | None = None

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._or_release(self._begin_training)

    def _or_release(self, step: Any) -> None:
        """Runs `step`; if it raises (before any step), the directory is free again."""
        try:
            step()
        except BaseException:
            self._staging.release()
            self._lock.release()
            raise

    def on_fit_exception(self, exception: BaseException) -> None:
        """Cleans up after a `fit` that raised (`fit_hooks.FitHooks`; `exception` goes on).

        Puts the previous signal handlers back, waits for a background write, and releases
        the directory's lock: Keras skips `on_train_end` when `fit` raises. In a loop driven
        by hand, call it yourself (or the lock is released by the next `fit` in this
        process, or when the process exits).
        """
        self._preemption.stop()  # the signal handlers from before this fit()
        try:
            self.wait_for_pending_save()  # a background write lands before the lock goes
        except Exception as err:  # fit() raises already: report this one, do not mask that
            logger.error(
                "keras-mirror-kit: the checkpoint written in the background failed: %s", err
            )
        self._staging.release()
        self._lock.release()

    def _begin_training(self) -> None:
        # A write an earlier fit() left running (it raised) lands before anything is read.
        self.wait_for_pending_save()
        self._reset_run_state()
        self._adopt_arrangement()
        if self._head is None:  # else the head hook did, before any callback could set it
            self._forget_initial_epoch()
        check_callback_model(self.model, "SyncedCheckpoint")
        check_reachable(self.model)  # state no checkpoint holds: named before any step
        self._fit = _FITS.starting(self.model, self.directory, self._epochs())
        self._is_chief = is_chief(self.model)
        steps = self.params.get("steps") if self.params else None
        if self._given_cursor is None:  # found, not given: part epochs resume at their starts
            self._cursor = found_cursor(self._cursor, steps, self.model)
        # Mid-epoch checkpoints are resume points for this run only when it can resume from
        # them (see resume.mid_epoch_skip): retention counts them as such only then.
        per_execution = int(getattr(self.model, "steps_per_execution", 1) or 1)
        self._store.mid_epoch_resumable = (
            self._cursor is not None and self._cursor.num_batches % per_execution == 0
        )
        if self._is_chief:
            self._lock.acquire()  # before prepare(), which removes orphaned temporaries
            self._store.prepare()
            if not self.restore and self._fit.index == 0 and self._store.entries():
                raise CheckpointError(
                    f"The checkpoint directory {str(self.directory)!r} already holds "
                    "checkpoints, and restore=False would start a new run whose saves rotate "
                    "them away. Use a new directory, remove the old checkpoints yourself, or "
                    f"pass restore=True to continue from them. Received: restore=False"
                )
        check_whole_epochs(self._cursor, steps)
        build_optimizer(self.model)
        self._best.begin(lambda name: metric_direction(self.model, name))
        self._model_config = model_config(self.model) if self._is_chief else None  # for export
        start = self._start  # this fit() raised before its first checkpoint: a retry
        retry = (
            self.restore and start is not None and start.belongs_to(self.model, self._fit.index)
        )
        if retry:
            check_workers_agree(self.model, None, 0, self.directory)  # the chief's file is in
            return_to_start(self._store, self.model, self._cursor, self.directory)
        elif self.restore:
            self._restore()
            check_workers_agree(self.model, self.last_restored, self._resume_skip, self.directory)
        if self.async_save and self._is_chief:  # host arrays for this fit, within the share
            self._staging.prepare(state_variables(self.model), self.async_host_memory)
        if not retry:  # (every worker alike, whatever each read: its snapshot is collective)
            self._write_start()
        self._preemption.start(self.model)  # save on SIGTERM (preemption.py)

    def _write_start(self) -> None:
        """A fit() from scratch writes the state it starts from (fit-start.kmk), which its retry
        goes back to if it raises before its first checkpoint (checkpoint/start_state.py)."""
        self._start = None
        resumed = self.last_restored is not None or self.model._initial_epoch is not None  # noqa: SLF001
        if not self.restore or resumed:
            if self._is_chief:
                self._store.remove_start()  # an earlier run's: nothing goes back to it
            return
        staging = self._staging if self.async_save and self._is_chief else None
        snapshot = take_snapshot(state_variables(self.model), True, staging)  # as it is
        self._start = StartPoint(self.model, self._fit.index)
        if not self._is_chief:
            snapshot.release()
            return
        meta = self._meta(snapshot, 0, 0, epoch_end=True, stopped=False, logs=None, start=True)
        write = self._store.write_start
        if self.async_save:
            self._writer.submit(lambda: write(snapshot.items(), meta), snapshot)
        else:
            write(snapshot.items(), meta)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self._steps_in_fit and self._preemption.pending():  # no collective here
            self._raise_preempted()  # the previous epoch's end was saved
        if self._head is None:
            self._before_epoch()
        self._epoch = epoch
        self._epoch_skip = self._resume_skip if epoch == self._resume_epoch else 0
        self._steps_in_epoch = self._epoch_skip
        self._want_epoch_end = False
        if self._cursor is not None:
            self._cursor.set(epoch, self._epoch_skip)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._writer.raise_if_failed()  # a background write that failed: stop here
        # With steps_per_execution > 1 Keras reports an execution's last step, past the
        # epoch's end for a partial one (Keras 3.10 its first: steps_done reads the last).
        num_batches = self._epoch_length()
        per_execution = getattr(self.model, "steps_per_execution", 1)
        done = steps_done(batch, num_batches, self._epoch_skip, per_execution)
        self._steps_in_fit += done - self._steps_in_epoch
        self._steps_in_epoch = done
        self._trained = True
        if self._cursor is not None and not self._cursor_checked:
            self._check_cursor_consumed()
        if self._epoch_skip and num_batches is not None and done >= num_batches:
            # The resumed epoch has run its remaining batches: end it here (from the tail
            # hook, after every other callback had its say about stopping).
            self._want_epoch_end = True
            if self._tail is None:
                self._request_epoch_end()
        if isinstance(self.save_freq, int):
            mark = self._steps_in_fit // self.save_freq
            if mark > self._last_save_mark:
                self._last_save_mark = mark
                if num_batches is None or done < num_batches:
                    self._save(
                        epoch=self._epoch, step=done, epoch_end=False, stopped=False, logs=logs
                    )
        guard = self._preemption  # a stop signal: one attribute read per step without one
        if self._steps_in_fit >= guard.next_check and guard.should_stop(self._steps_in_fit):
            if num_batches is None or done < num_batches:  # else: at the epoch's end save
                if self._last_save != (self._epoch, done, False, False):
                    self._save(
                        epoch=self._epoch, step=done, epoch_end=False, stopped=False, logs=logs
                    )
                self._raise_preempted()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self._head is None:
            self._clear_own_stop()
        self._want_epoch_end = False
        self._ending_epoch_early = False
        stopped = bool(self.model.stop_training)  # only others' requests are left
        num_batches = self._epoch_length()
        if stopped and num_batches is not None and self._steps_in_epoch < num_batches:
            # Stopped part-way through the epoch: record where, not a finished epoch.
            self._save(
                epoch=epoch, step=self._steps_in_epoch, epoch_end=False, stopped=True, logs=logs
            )
        else:
            self._save(epoch=epoch + 1, step=0, epoch_end=True, stopped=stopped, logs=logs)
        self._epoch_skip = 0

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        try:
            self._end_training()
        finally:
            self._staging.release()  # a write still running keeps its own reference
            self._lock.release()

    def _end_training(self) -> None:
        # Keras' BackupAndRestore leaves this set, so a later fit() skips epochs.
        self.model._initial_epoch = None  # noqa: SLF001
        if self._trained and self._last_save is not None:
            epoch, step, epoch_end, was_stopped = self._last_save
            stopped = bool(self.model.stop_training)
            if (stopped and not was_stopped) or best_weights_restored(self._tracked):
                # A callback after this one stopped the fit, or EarlyStopping put its best
                # weights back: the final state is what a rerun must find.
                self._save(epoch=epoch, step=step, epoch_end=epoch_end, stopped=stopped)
        started, self._start = self._start, None  # this fit() ended: nothing is retried
        _FITS.completed(self.model, self.directory, self._fit)
        self._resume_epoch = None
        self._resume_skip = 0
        self.wait_for_pending_save()  # fit() returns once every checkpoint is written
        if started is not None and self._is_chief:
            self._store.remove_start()
        if self._preemption.finish(self._steps_in_fit):  # a signal in the last epoch's end
            self._raise_preempted()

    def wait_for_pending_save(self) -> None:
        """Waits until the checkpoint being written in the background (if any) is written.

        With `async_save=True`, a save returns once its snapshot is taken; this waits for
        the file and the manifest to be in place. Without a write in progress (or with
        `async_save=False`) it returns at once.

        Returns:
            None.

        Raises:
            CheckpointWriteError: When that write failed (disk full, read-only); earlier
                checkpoints are intact.

        Example:

        ```python
        checkpoint = kmk.SyncedCheckpoint("ckpts", save_freq=100, async_save=True)
        ...
        checkpoint.wait_for_pending_save()  # e.g. before the process exits on SIGTERM
        ```
        """
        self._writer.wait()

    def _raise_preempted(self) -> None:
        """Ends the process after a stop signal (`Preempted`): the state is saved."""
        self.wait_for_pending_save()  # an async_save write must be in place first
        epoch, step = (self._last_save or (self._epoch, self._steps_in_epoch, False, False))[:2]
        raise self._preemption.preempted(epoch, step, self._global_step(), str(self.directory))

    def _global_step(self) -> int | None:
        optimizer = getattr(self.model, "optimizer", None)
        return int(np.asarray(optimizer.iterations)) if optimizer is not None else None

    # -- the callbacks list ------------------------------------------------------------------

    def arrange_callbacks(self, callbacks: list[Any]) -> list[Any]:
        """Runs after the stateful callbacks, with hooks first and last (`FitHooks`).

        Called by `fit()` before Keras builds its `CallbackList`: the stateful callbacks
        (EarlyStopping, ReduceLROnPlateau, ...) are found, so that their states are saved
        and restored, this callback moves after them, so that each epoch end saves their
        state of that epoch, and two hooks run first (a resumed epoch's callback states are
        put back before any callback's `on_epoch_begin`) and last (no callback restored
        another state over the checkpoint's at `on_train_begin`; the end of a resumed epoch
        is requested after every other callback's `on_train_batch_end`). Keras'
        `BackupAndRestore` listed after it is moved before it: the checkpoint's state wins.
        """
        head = LoopHook(
            self,
            train_begin=self._forget_initial_epoch,
            epoch_begin=self._before_epoch,
            epoch_end=self._clear_own_stop,
        )
        check = functools.partial(self._or_release, self._check_state_kept)
        tail = LoopHook(self, train_begin=check, batch_end=self._request_epoch_end)
        tracked, arranged = place_after_stateful(self, callbacks, head, tail)
        self._arranged = (tracked, head, tail)
        self._restorers = restoring_callbacks(callbacks)
        self._later = train_beginners_after(self, arranged)
        return arranged

    def on_fit_end(self) -> None:
        """Once `fit()` returned or raised: no signal handler, no arrangement (`FitHooks`)."""
        self._preemption.stop()  # already done by on_train_end or on_fit_exception
        self._arranged = None
        self._restorers, self._later = [], []
        self._cursor = self._given_cursor  # the next fit() finds its own

    def _adopt_arrangement(self) -> None:
        """Takes the hooks `arrange_callbacks` placed for this fit() (none outside fit())."""
        if self._arranged is None:
            logger.debug(
                "keras-mirror-kit: SyncedCheckpoint runs outside fit() (a hand-driven loop) "
                "and unhooked: other callbacks' states are not saved, and the end of a "
                "resumed epoch is requested at its own position in the list"
            )
            return
        self._tracked, self._head, self._tail = self._arranged

    def _before_epoch(self) -> None:
        # Keras read the resume epoch when the loop started; a later fit() must not.
        self.model._initial_epoch = None  # noqa: SLF001
        plan, self._pending = self._pending, None  # callbacks' states, metrics, the rate
        begin_epoch(plan, self._tracked, self.model)

    def _forget_initial_epoch(self) -> None:
        # A fit() interrupted by an exception never reached on_train_end: clear its epoch.
        self.model._initial_epoch = None  # noqa: SLF001

    def _check_state_kept(self) -> None:
        """From the tail hook: no callback after this one restored a state over the one
        restored (it would set the start epoch again), before any step."""
        check_start_epoch(self.model, self._mark, self.directory, self._later)

    def _request_epoch_end(self) -> None:
        if self._want_epoch_end and not self._ending_epoch_early:
            self._foreign_stop = bool(self.model.stop_training)
            self.model.stop_training = True
            self._ending_epoch_early = True

    def _clear_own_stop(self) -> None:
        if self._ending_epoch_early and not self._foreign_stop:
            self.model.stop_training = False
        self._ending_epoch_early = False

    def _check_cursor_consumed(self) -> None:
        """At the first batch end: the cursor of `dataset=` must have been read by this fit."""
        self._cursor_checked = True
        assert self._cursor is not None
        if self._cursor.get() == (self._epoch, self._epoch_skip):
            raise other_dataset_error(self._cursor, "the dataset given was never read")

    @property
    def resumes_mid_epoch(self) -> bool:
        """Without `dataset=`, a kit-built model's `fit(x, y)` resumes mid-epoch (`FitHooks`)."""
        return self._given_cursor is None

    def check_fit_data(self, x: Any) -> None:
        """Checks `fit`'s data against `dataset=`, or finds its kit dataset (`FitHooks`)."""
        self._cursor = check_fit_dataset(self._given_cursor, x, self.strict)

    def _epoch_length(self) -> int | None:
        if self._cursor is not None:
            return self._cursor.num_batches
        steps = self.params.get("steps") if self.params else None
        return int(steps) if steps else None

    # -- save and restore --------------------------------------------------------------------

    def _save(
        self,
        epoch: int,
        step: int,
        epoch_end: bool,
        stopped: bool,
        logs: dict[str, Any] | None = None,
    ) -> None:
        if self._is_chief:
            self.wait_for_pending_save()  # one snapshot at a time
        named = state_variables(self.model)
        # Every worker reads the state (reads of on-read variables are collectives) and
        # refuses a non-finite state alike; the chief's async snapshot is copied to staging.
        staging = self._staging if self.async_save and self._is_chief else None
        snapshot = take_snapshot(named, self.allow_non_finite, staging)
        snapshot.extra.update(getattr(self._cursor, "checkpoint_arrays", dict)())  # PyDataset
        if self.verify_replicas:
            gap = check_replicas(self.model, named, self.verify_atol)
            if gap and not self._reported_batch_norm:
                self._reported_batch_norm = True
                log_batch_norm_gap(gap)
        self._last_save = (int(epoch), int(step), bool(epoch_end), bool(stopped))
        # A retry resumes from this checkpoint, not from the start (unless it cannot).
        ends_start = self._start is not None and (
            epoch_end or stopped or self._store.mid_epoch_resumable
        )
        if not self._is_chief:
            snapshot.release()
            self._start = None if ends_start else self._start
            return
        meta = self._meta(snapshot, epoch, step, epoch_end, stopped, logs)
        if self.async_save:
            self._writer.submit(lambda: self._write(snapshot, meta, ends_start), snapshot)
        else:
            self._write(snapshot, meta, ends_start)
        self._start = None if ends_start else self._start

    def _meta(
        self,
        snapshot: StateSnapshot,
        epoch: int,
        step: int,
        epoch_end: bool,
        stopped: bool,
        logs: dict[str, Any] | None,
        start: bool = False,
    ) -> CheckpointMeta:
        """The metadata of a save of `snapshot`: with its callbacks' states and score, unless
        it is the start state (fit-start.kmk: the variables and the data seed are put back)."""
        return CheckpointMeta(
            epoch=int(epoch),
            step=int(step),
            epoch_end=bool(epoch_end),
            global_step=self._global_step(),
            fit=self._fit,  # tells a full rerun from a later stage rerun alone (fit_record)
            stopped=bool(stopped),
            finite=not snapshot.non_finite,
            num_replicas=engine_of(self.model).num_replicas,
            backend=backends.name(),
            data=data_description(self.model, self._cursor, self._epoch_length()),
            variables=tuple(snapshot.paths),
            trained=trained_numbers(self.model),  # a resume after another compile() refuses
            callbacks={} if start else callback_states(self._tracked, snapshot.extra),
            # keep_best: the metric and this save's value (none for the end-of-fit re-save)
            score=None if start else self._best.score(logs, epoch_end and logs is not None, epoch),
            model_config=self._model_config,
        )

    def _write(self, snapshot: StateSnapshot, meta: CheckpointMeta, ends_start: bool) -> None:
        """Writes a snapshot, one variable at a time (in the background with async_save)."""
        path = self._store.write(snapshot.items(), meta)
        logger.debug("keras-mirror-kit: wrote %s (epoch %d, step %d)", path, meta.epoch, meta.step)
        if ends_start:  # a retry resumes from this checkpoint now
            self._store.remove_start()

    def _epochs(self) -> int | None:
        epochs = self.params.get("epochs") if self.params else None
        return int(epochs) if epochs is not None else None

    def _restore(self) -> None:
        """Restores the newest usable checkpoint and records where this fit() goes on."""
        resume = restore_latest(
            self._store,
            self.model,
            self._cursor,
            fit=self._fit,
            strict=self.strict,
            directory=self.directory,
        )
        self.last_restored = resume.restored
        self._mark = mark_start_epoch(self.model, resume, self.directory, self._restorers)
        self._resume_epoch, self._resume_skip = resume.epoch, resume.skip
        self._pending = resume
        if resume.fit is not None:  # a later stage rerun alone: its number from now on
            self._fit = resume.fit
