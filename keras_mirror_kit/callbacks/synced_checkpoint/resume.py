"""Resuming a `fit()`: which checkpoint, where to go on, whether the data still matches."""

from __future__ import annotations

import logging
import os
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

from keras_mirror_kit.callbacks.synced_checkpoint.state import apply_state
from keras_mirror_kit.checkpoint_store import CheckpointError, CheckpointStore, LoadedCheckpoint
from keras_mirror_kit.data import DatasetCursor
from keras_mirror_kit.model_record import distribution_of

__all__ = [
    "Resume",
    "check_workers_agree",
    "data_description",
    "mid_epoch_skip",
    "restore_latest",
]

logger = logging.getLogger("keras_mirror_kit")


class Resume(NamedTuple):
    """Where a `fit()` goes on from, as found by `restore_latest`.

    Attributes:
        restored: The checkpoint whose state was restored, or None.
        initial_epoch: The epoch the `fit()` starts at (`model._initial_epoch`), or None
            for its own first epoch.
        epoch: The epoch resumed part-way, or None.
        skip: Batches of that epoch already trained (0: the epoch starts at its beginning).
        callback_states: The saved callback states and the checkpoint's arrays, to give the
            other callbacks before the first epoch, or None.
        fit_index: The number the starting `fit()` takes as its own, when it resumes the
            unfinished checkpoint of a later `fit()` with the same `epochs` (a rerun of
            that stage alone), else None.

    Example:

    ```python
    resume = restore_latest(store, model, cursor, fit_index=0, epochs=10, strict=False,
                            directory=store.directory)
    model._initial_epoch = resume.initial_epoch
    ```
    """

    restored: LoadedCheckpoint | None = None
    initial_epoch: int | None = None
    epoch: int | None = None
    skip: int = 0
    callback_states: tuple[dict[str, Any], dict[str, np.ndarray]] | None = None
    fit_index: int | None = None


def restore_latest(
    store: CheckpointStore,
    model: Any,
    cursor: DatasetCursor | None,
    *,
    fit_index: int,
    epochs: int | None,
    strict: bool,
    directory: str | os.PathLike[str],
) -> Resume:
    """Restores the newest usable checkpoint into `model` and says where the `fit()` goes on.

    A checkpoint written by an earlier `fit()` of the script is left alone (the model went
    on from it). One written by a later `fit()` with the same `epochs` that had not
    finished is taken as this `fit()`'s own (that stage rerun alone). One written by
    another later `fit()`, or by this one when it had been stopped with the same `epochs`,
    is restored and the `fit()` trains nothing (a WARNING for a later `fit()`). Otherwise
    the `fit()`
    resumes where the checkpoint was written: mid-epoch when `mid_epoch_skip` allows it,
    else from the newest checkpoint written at an epoch boundary. The cursor adopts the
    checkpoint's data seed when the dataset's seed was drawn at random.

    Args:
        store: The checkpoint directory.
        model: The model being fit (its optimizer built).
        cursor: The cursor of `SyncedCheckpoint(dataset=)`, or None.
        fit_index: How many `fit()` calls of this script on `model` completed with this
            directory before the one starting.
        epochs: The `epochs` of the starting `fit()`, or None.
        strict: Refuse instead of falling back to an epoch boundary when the data no
            longer matches a mid-epoch checkpoint.
        directory: The checkpoint directory, for messages.

    Returns:
        The `Resume` (all None and 0 when nothing was restored).

    Raises:
        CheckpointError: When the checkpoint was written by another model or optimizer,
            or (with `strict=True`) when the data no longer matches a mid-epoch checkpoint.

    Example:

    ```python
    resume = restore_latest(store, model, None, fit_index=0, epochs=10, strict=False,
                            directory=store.directory)
    ```
    """
    had_any = bool(store.entries())
    newest = store.load_latest() if had_any else None
    if newest is None:
        if had_any:
            logger.warning(
                "keras-mirror-kit: no usable checkpoint in %s; training from the start",
                directory,
            )
        return Resume()
    meta, k = newest.meta, fit_index
    written_by = int(meta.get("fit_index", k))  # v1 files: the running fit
    if written_by < k:
        # An earlier fit() of this process wrote it, and the model went on from there.
        return Resume()
    if written_by > k and _unfinished_with(meta, epochs) and not _same_fit(meta, k, epochs):
        # The stage that wrote it is rerun alone (earlier fit() calls commented out, a
        # notebook cell after a kernel restart): it is this fit()'s own checkpoint.
        logger.warning(
            "keras-mirror-kit: the newest checkpoint %s was written by fit() number %d of "
            "the script (epochs=%s, stopped at epoch %s, unfinished), but this is fit() "
            "number %d of the process; with the same epochs, this fit() takes it as its "
            "own and resumes it",
            newest.path,
            written_by + 1,
            meta.get("fit_epochs"),
            meta.get("epoch"),
            k + 1,
        )
        k = written_by
    elif written_by > k or (
        meta.get("stopped") and meta.get("fit_epochs") == epochs and epochs is not None
    ):
        return _restore_finished(model, newest, written_by > k, epochs, directory)
    loaded, skip = newest, 0
    if not meta.get("epoch_end"):
        reason = mid_epoch_skip(meta, cursor, model)
        if isinstance(reason, int):
            skip = reason
        else:
            if reason.startswith("!"):  # the data no longer matches the checkpoint
                reason = reason[1:]
                if strict:
                    raise CheckpointError(
                        f"The checkpoint {str(newest.path)!r} was written mid-epoch, and "
                        f"{reason}, so the position cannot be carried over. Restore "
                        "the data the run was started with, or pass strict=False to "
                        "resume from the newest epoch boundary. Received: strict=True"
                    )
                logger.warning(
                    "keras-mirror-kit: %s, so the resume starts at the newest epoch "
                    "boundary, not mid-epoch",
                    reason,
                )
            else:
                logger.info(
                    "keras-mirror-kit: %s, so the resume starts at the newest epoch boundary",
                    reason,
                )
            loaded = store.load_latest(require_epoch_end=True)
    if loaded is None:
        logger.warning(
            "keras-mirror-kit: no usable checkpoint in %s; training from the start",
            directory,
        )
        return Resume()
    apply_state(model, loaded, directory)
    meta = loaded.meta
    epoch = int(meta["epoch"])
    if int(meta.get("fit_index", k)) < k:  # the final state of the previous fit()
        logger.info(
            "keras-mirror-kit: restored %s, the end of the previous fit(); this fit() "
            "starts at its own first epoch",
            loaded.path,
        )
        return Resume(restored=loaded, fit_index=k if k != fit_index else None)
    _adopt_seed(cursor, meta)
    logger.info(
        "keras-mirror-kit: resumed from %s (epoch %d, batch %d, saved with %s replica(s))",
        loaded.path,
        epoch,
        skip,
        meta.get("num_replicas"),
    )
    return Resume(
        restored=loaded,
        initial_epoch=epoch,
        epoch=epoch if skip else None,
        skip=skip,
        callback_states=(meta.get("callbacks") or {}, loaded.arrays),
        fit_index=k if k != fit_index else None,
    )


def _same_fit(meta: dict[str, Any], k: int, epochs: int | None) -> bool:
    """Whether fit() number `k` of the script that wrote `meta` had these `epochs` too.

    Then this fit() may be that one in a full rerun of the script, and taking a later
    stage's checkpoint as its own would be wrong: the rerun goes stage by stage instead.
    """
    history = meta.get("script_fit_epochs")
    return isinstance(history, list) and k < len(history) and history[k] == epochs


def _unfinished_with(meta: dict[str, Any], epochs: int | None) -> bool:
    """Whether a checkpoint's fit() had the given `epochs` and neither ended nor was stopped."""
    fit_epochs = meta.get("fit_epochs")
    if epochs is None or fit_epochs is None or int(fit_epochs) != int(epochs):
        return False
    return not meta.get("stopped") and int(meta.get("epoch", 0)) < int(fit_epochs)


def _restore_finished(
    model: Any,
    loaded: LoadedCheckpoint,
    later_fit: bool,
    epochs: int | None,
    directory: str | os.PathLike[str],
) -> Resume:
    """This fit() had finished in the earlier run: its state, and no training."""
    restored = None
    try:
        apply_state(model, loaded, directory)
    except CheckpointError as err:
        if not later_fit:
            raise
        logger.info(
            "keras-mirror-kit: not restoring %s into this fit() (%s); the later fit() "
            "that wrote it will",
            loaded.path,
            err,
        )
    else:
        restored = loaded
    meta = loaded.meta
    if later_fit:
        # Expected when the whole script reruns; a surprise when this fit() runs alone.
        logger.warning(
            "keras-mirror-kit: the newest checkpoint %s was written by a later fit() of the "
            "script (number %d, epochs=%s, at epoch %s), so this fit() (epochs=%s) counts "
            "as finished: its state is %s and it trains nothing. If this fit() was meant "
            "to train (a stage rerun alone with other epochs, or a new run), use a new "
            "checkpoint directory",
            loaded.path,
            int(meta["fit_index"]) + 1,
            meta.get("fit_epochs"),
            meta.get("epoch"),
            epochs,
            "restored" if restored is not None else "left for that later fit()",
        )
    else:
        logger.info(
            "keras-mirror-kit: this fit() had been stopped at epoch %s (epochs=%s) by a "
            "callback's request; training nothing",
            meta.get("epoch"),
            meta.get("fit_epochs"),
        )
    return Resume(restored=restored, initial_epoch=max(int(epochs or 0), 1))


def _adopt_seed(cursor: DatasetCursor | None, meta: dict[str, Any]) -> None:
    """Takes the checkpoint's data seed when the dataset's was drawn at random."""
    if cursor is None or meta.get("data_seed") is None:
        return
    saved_seed = int(meta["data_seed"])
    if not cursor.seed_given:
        cursor.set_seed(saved_seed)  # a seed drawn at random: the run's own
    elif saved_seed != cursor.seed:
        logger.warning(
            "keras-mirror-kit: the dataset's seed %d differs from the checkpoint's %d; "
            "the epochs from now on are shuffled with %d, as given",
            cursor.seed,
            saved_seed,
            cursor.seed,
        )


def _global_batch_size(model: Any) -> int | None:
    """The global batch size of a model the kit built, else None."""
    dist = distribution_of(model)
    if dist is not None:
        return dist.global_batch_size
    return None


def _steps_per_execution(model: Any) -> int:
    """The model's `steps_per_execution` (1 when unset)."""
    return int(getattr(model, "steps_per_execution", 1) or 1)


def data_description(
    model: Any, cursor: DatasetCursor | None, epoch_length: int | None
) -> dict[str, Any]:
    """The description of the data a checkpoint records, for `mid_epoch_skip` to compare.

    Args:
        model: The model being fit.
        cursor: The cursor of `SyncedCheckpoint(dataset=)`, or None.
        epoch_length: Batches per epoch, or None when unknown.

    Returns:
        The metadata entries `global_batch_size`, `epoch_length`, `steps_per_execution`,
        `data_seed` and `data_samples` (the samples the epoch's order permutes), in that
        order.

    Example:

    ```python
    meta = {"epoch": 3, "step": 40, **data_description(model, cursor, 60)}
    ```
    """
    return {
        "global_batch_size": _global_batch_size(model),
        "epoch_length": epoch_length,
        "steps_per_execution": _steps_per_execution(model),
        "data_seed": cursor.seed if cursor is not None else None,
        "data_samples": cursor.num_samples if cursor is not None else None,
    }


def mid_epoch_skip(meta: dict[str, Any], cursor: DatasetCursor | None, model: Any) -> int | str:
    """Batches of the saved epoch to skip now, or why an exact resume is impossible.

    The order is a permutation of samples, so consumed *samples* carry over to another
    global batch size (another replica count) when they fill whole new batches.

    Args:
        meta: The metadata of a checkpoint written mid-epoch.
        cursor: The cursor of `SyncedCheckpoint(dataset=)`, or None.
        model: The model being fit.

    Returns:
        The number of batches to skip, or the reason as a string; a reason starting with
        `"!"` means the data no longer matches the checkpoint (another number of samples,
        epoch length or seed).

    Example:

    ```python
    skip = mid_epoch_skip(loaded.meta, kmk.cursor_of(train_ds), model)
    ```
    """
    if cursor is None:
        return "the checkpoint was written mid-epoch and SyncedCheckpoint has no dataset="
    per_execution = _steps_per_execution(model)
    if cursor.num_batches % per_execution:
        return (
            f"{cursor.num_batches} batches per epoch is not a multiple of "
            f"steps_per_execution={per_execution}"
        )
    step, saved_batch = int(meta["step"]), meta.get("global_batch_size")
    saved_length = meta.get("epoch_length")
    batch = _global_batch_size(model)
    saved_samples, samples = meta.get("data_samples"), cursor.num_samples
    if saved_samples is not None and samples is not None and int(saved_samples) != samples:
        # Fewer samples than a batch apart give the same batches, but another permutation.
        return (
            f"!the dataset holds {samples} samples now but held {int(saved_samples)} at save time"
        )
    if saved_length is not None:
        if saved_batch is not None and batch is not None:
            before, now = int(saved_length) * int(saved_batch), cursor.num_batches * batch
            unit = "samples"
        else:
            before, now, unit = int(saved_length), cursor.num_batches, "batches"
        if before != now:
            return f"!the epoch holds {now} {unit} now but held {before} at save time"
    if meta.get("data_seed") is not None and cursor.seed_given:
        if int(meta["data_seed"]) != cursor.seed:
            return (
                f"!the dataset's seed {cursor.seed} differs from the checkpoint's "
                f"{int(meta['data_seed'])} (another order)"
            )
    if saved_batch is None or batch is None or saved_batch == batch:
        skip = step  # same batches (a model the kit did not build: assumed unchanged)
    elif (step * saved_batch) % batch:
        return (
            f"the {step} batches of {saved_batch} consumed at save time are not a whole "
            f"number of batches of {batch}"
        )
    else:
        skip = step * saved_batch // batch
    if skip % per_execution or skip >= cursor.num_batches:
        return (
            f"{skip} consumed batches do not end on a steps_per_execution="
            f"{per_execution} boundary inside the {cursor.num_batches}-batch epoch"
        )
    return skip


def check_workers_agree(
    model: Any, restored: LoadedCheckpoint | None, skip: int, directory: str | os.PathLike[str]
) -> None:
    """Checks that every worker resumes from the same point (else collectives mismatch or hang).

    Args:
        model: The model being fit.
        restored: The checkpoint this worker restored, or None.
        skip: The batches this worker skips in the resumed epoch.
        directory: The checkpoint directory, for messages.

    Returns:
        None (at once with a single worker or a model the kit did not build).

    Raises:
        CheckpointError: When the workers found different checkpoints.

    Example:

    ```python
    check_workers_agree(model, resume.restored, resume.skip, store.directory)
    ```
    """
    dist = distribution_of(model)
    if dist is None or dist.num_workers < 2:
        return
    meta = restored.meta if restored is not None else {}
    mine = [
        int(meta.get("epoch", -1)),
        skip,
        int(meta.get("global_step") or -1),
    ]
    strategy = model.distribute_strategy
    per_replica = strategy.run(lambda: tf.constant([mine], tf.int64))
    rows = np.asarray(strategy.gather(per_replica, axis=0))
    if not (rows == rows[0]).all():
        raise CheckpointError(
            "The workers would resume from different checkpoints (epoch, batch, step "
            f"per replica: {rows.tolist()}). Every worker must see the same checkpoint "
            f"directory: put {str(directory)!r} on a filesystem shared by all "
            f"workers. Received: directory={str(directory)!r}"
        )
