"""Resuming a `fit()`: which checkpoint, where to go on, whether the data still matches.

`restore_latest` restores the newest usable checkpoint into the model and returns the
`ResumePlan` of the starting `fit()`; `mid_epoch_skip` decides whether a checkpoint
written mid-epoch resumes exactly (`MidEpochSkip`), and `data_description` records what
it compares.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from keras_mirror_kit import backends
from keras_mirror_kit.checkpoint.callback_state import apply_callback_states, note_epoch_start
from keras_mirror_kit.checkpoint.fit_record import FitRecord, Placement, place
from keras_mirror_kit.checkpoint.meta import CheckpointMeta, DataDescription
from keras_mirror_kit.checkpoint.optimizer_match import check_optimizer_state
from keras_mirror_kit.checkpoint.state import (
    apply_state,
    assign_metrics,
    auto_name_prefixes,
    saved_metrics,
)
from keras_mirror_kit.checkpoint.store import CheckpointError, CheckpointStore, LoadedCheckpoint
from keras_mirror_kit.fit_inputs import KitPipeline, kit_pipeline
from keras_mirror_kit.model_record import distribution_of, engine_of

if TYPE_CHECKING:  # data.cursor imports TensorFlow: not for a JAX-only install
    from keras_mirror_kit.data import DatasetCursor

__all__ = [
    "MidEpochSkip",
    "adopt_seed",
    "begin_epoch",
    "ResumePlan",
    "check_fit_dataset",
    "check_whole_epochs",
    "check_workers_agree",
    "data_description",
    "found_cursor",
    "mid_epoch_skip",
    "other_dataset_error",
    "restore_latest",
]

logger = logging.getLogger("keras_mirror_kit")


@dataclass(frozen=True)
class ResumePlan:
    """Where a `fit()` goes on from, as `restore_latest` found it (all unset: from scratch).

    Attributes:
        restored: The checkpoint whose state was restored, or None.
        initial_epoch: The epoch the `fit()` starts at (`model._initial_epoch`), or None
            for its own first epoch.
        epoch: The epoch resumed part-way, or None.
        skip: Batches of that epoch already trained (0: the epoch starts at its beginning).
        callback_states: The saved callback states and the checkpoint's arrays, to give the
            other callbacks before the first epoch, or None.
        fit: The record the starting `fit()` takes as its own when it resumes the
            unfinished checkpoint of a later `fit()` with the same `epochs` (a rerun of
            that stage alone: `fit_record.Placement.STAGE_ALONE`), else None.
        metrics: `(variable, saved value)` of the model's metrics, to put back at the start
            of the epoch resumed part-way (`state.assign_metrics`), or `()`.
    """

    restored: LoadedCheckpoint | None = None
    initial_epoch: int | None = None
    epoch: int | None = None
    skip: int = 0
    callback_states: tuple[Mapping[str, Any], Mapping[str, np.ndarray]] | None = None
    fit: FitRecord | None = None
    metrics: tuple[tuple[Any, Any], ...] = ()


def begin_epoch(plan: ResumePlan | None, tracked: list[tuple[str, Any]], model: Any) -> None:
    """Runs as each epoch begins, before any callback's `on_epoch_begin` (`plan` None
    after the first epoch of the `fit()`).

    Puts back, as the first epoch of a resumed `fit()` begins, what the checkpoint holds of
    the other callbacks (`tracked`, by their keys) and, for an epoch resumed part-way, the
    metrics' sums up to its batch (Keras reset them just before) and the learning rate
    that epoch began with (which a `LearningRateScheduler` reads); then notes the rate
    each epoch begins with (`callback_state.note_epoch_start`), which checkpoints save.
    """
    if plan is not None:
        if plan.callback_states is not None:
            states, arrays = plan.callback_states
            apply_callback_states(tracked, states, arrays, mid_epoch=plan.skip > 0)
        assign_metrics(plan.metrics)
    note_epoch_start(tracked, model)


@dataclass(frozen=True)
class MidEpochSkip:
    """Whether a checkpoint written mid-epoch resumes exactly, as `mid_epoch_skip` found.

    Attributes:
        skip: Batches of the saved epoch to skip now, or None when an exact resume is
            impossible.
        reason: Why it is impossible.
        data_changed: Whether that is because the data no longer matches the checkpoint
            (another number of samples, epoch length or seed): `strict=True` refuses then.
    """

    skip: int | None = None
    reason: str = ""
    data_changed: bool = False
    fix: str = ""  # what makes the next run resume exactly


def restore_latest(
    store: CheckpointStore,
    model: Any,
    cursor: DatasetCursor | None,
    *,
    fit: FitRecord,
    strict: bool,
    directory: str | os.PathLike[str],
) -> ResumePlan:
    """Restores the newest usable checkpoint into `model` and says where the `fit()` goes on.

    What the starting `fit()` does with a checkpoint of another `fit()` of the script is
    `fit_record.place`'s decision: one written by an earlier `fit()` is left alone (the
    model went on from it); one written by a later stage rerun alone is taken as this
    `fit()`'s own; one written by another later `fit()`, or by this one when it had been
    stopped with the same `epochs`, is restored and the `fit()` trains nothing (a WARNING
    for a later `fit()`). Otherwise the `fit()` resumes where the checkpoint was written:
    mid-epoch when `mid_epoch_skip` allows it, else from the newest checkpoint written at
    an epoch boundary. The cursor adopts the checkpoint's data seed when the dataset's seed
    was drawn at random.

    Args:
        store: The checkpoint directory's store.
        model: The model to restore into.
        cursor: The cursor of the kit dataset the `fit()` resumes by, or None.
        fit: The starting `fit()`'s record (`fit_record.FitLedger.starting`).
        strict: Refuse, instead of falling back to an epoch boundary, when the data no
            longer matches a mid-epoch checkpoint.
        directory: The directory, for messages.

    Returns:
        The `ResumePlan` (all unset: from scratch).

    Raises:
        CheckpointError: When the checkpoint was written by another model or optimizer
            (`optimizer_match.OptimizerMismatchError`, also a `ValueError`, for another
            optimizer or one built for other variables: a recompile or trainable flags
            unlike the run's that wrote it), or (with `strict=True`) when the data no
            longer matches a mid-epoch checkpoint.
    """
    had_any = bool(store.entries())
    newest = store.load_latest() if had_any else None
    if newest is None:
        if had_any:
            logger.warning(
                "keras-mirror-kit: no usable checkpoint in %s; training from the start",
                directory,
            )
        return ResumePlan()
    meta, taken = newest.meta, None
    placement = place(meta.fit, fit, epoch=meta.epoch, stopped=meta.stopped)
    if placement is Placement.EARLIER:
        return ResumePlan()  # an earlier fit() of this process wrote it; the model went on
    if placement in (Placement.LATER, Placement.STOPPED):
        return _restore_finished(
            model, newest, placement is Placement.LATER, fit.epochs, directory
        )
    if placement is Placement.STAGE_ALONE and meta.fit is not None:
        taken = fit.as_stage_of(meta.fit)
        logger.warning(
            "keras-mirror-kit: the newest checkpoint %s was written by fit() number %d of "
            "the script (epochs=%s, stopped at epoch %s, unfinished), but this is fit() "
            "number %d of the process; with the same epochs, this fit() takes it as its "
            "own and resumes it",
            newest.path,
            meta.fit.index + 1,
            meta.fit.epochs,
            meta.epoch,
            fit.index + 1,
        )
    loaded, skip = newest, 0
    if not meta.epoch_end:
        found = mid_epoch_skip(meta, cursor, model)
        can_resume = getattr(cursor, "can_resume", None)
        if found.skip is not None and can_resume is not None and not can_resume(newest.arrays):
            found = MidEpochSkip(
                reason="it holds no batch order of this PyDataset (written by an earlier "
                "version, or for another one)",
                fix="The checkpoints written from now on hold it.",
            )
        if found.skip is not None:
            skip = found.skip
        else:
            if found.data_changed:
                if strict:
                    raise CheckpointError(
                        f"The checkpoint {str(newest.path)!r} was written mid-epoch, and "
                        f"{found.reason}, so the position cannot be carried over. Restore "
                        "the data the run was started with, or pass strict=False to "
                        "resume from the newest epoch boundary. Received: strict=True"
                    )
                logger.warning(
                    "keras-mirror-kit: %s, so the resume starts at the newest epoch "
                    "boundary, not mid-epoch",
                    found.reason,
                )
            else:  # exact resume impossible by construction: say what it costs, and the fix
                logger.warning(
                    "keras-mirror-kit: the checkpoint %s was written mid-epoch (epoch %d, "
                    "batch %d), but %s, so the resume starts at the newest epoch boundary: "
                    "epoch %d is trained again from its start, and a pipeline that reshuffles "
                    "each epoch ends elsewhere than an uninterrupted run would. %s",
                    newest.path,
                    meta.epoch,
                    meta.step,
                    found.reason,
                    meta.epoch,
                    found.fix,
                )
            loaded = store.load_latest(require_epoch_end=True)
    if loaded is None:
        logger.warning(
            "keras-mirror-kit: no usable checkpoint in %s; training from the start",
            directory,
        )
        return ResumePlan()
    _apply(model, loaded, directory)
    meta = loaded.meta
    epoch = meta.epoch
    own = taken or fit
    if meta.fit is not None and meta.fit.index < own.index:  # the previous fit()'s end
        logger.info(
            "keras-mirror-kit: restored %s, the end of the previous fit(); this fit() "
            "starts at its own first epoch",
            loaded.path,
        )
        return ResumePlan(restored=loaded, fit=taken)
    adopt_seed(cursor, meta)
    resume_from = getattr(cursor, "resume_from", None)  # a PyDataset's order and random state
    if resume_from is not None:
        resume_from(loaded.arrays)
    logger.info(
        "keras-mirror-kit: resumed from %s (epoch %d, batch %d, saved with %s replica(s))",
        loaded.path,
        epoch,
        skip,
        meta.num_replicas,
    )
    metrics: list[tuple[Any, Any]] = []
    why = ""
    if skip and meta.stopped:  # saved at the epoch's end, after validation had reset them
        why = "it was saved when a callback stopped fit(), after validation"
    elif skip:
        metrics, why = saved_metrics(model, loaded)
    if skip and why:
        logger.info(
            "keras-mirror-kit: epoch %d's logged loss and metrics cover its batches from "
            "batch %d on only: %s",
            epoch,
            skip,
            why,
        )
    return ResumePlan(
        restored=loaded,
        initial_epoch=epoch,
        epoch=epoch if skip else None,
        skip=skip,
        callback_states=(meta.callbacks, loaded.arrays),
        fit=taken,
        metrics=tuple(metrics),
    )


def _apply(model: Any, loaded: LoadedCheckpoint, directory: str | os.PathLike[str]) -> None:
    """Restores `loaded` into `model`, once its optimizer is known to be the checkpoint's
    (`optimizer_match`: the same kind, built for the same variables, across a recompile)."""
    check_optimizer_state(model, loaded, directory, auto_name_prefixes(model))
    apply_state(model, loaded, directory)


def _restore_finished(
    model: Any,
    loaded: LoadedCheckpoint,
    later_fit: bool,
    epochs: int | None,
    directory: str | os.PathLike[str],
) -> ResumePlan:
    """This fit() had finished in the earlier run: its state, and no training."""
    restored = None
    try:
        _apply(model, loaded, directory)
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
            (meta.fit.index if meta.fit else 0) + 1,
            meta.fit.epochs if meta.fit else None,
            meta.epoch,
            epochs,
            "restored" if restored is not None else "left for that later fit()",
        )
    else:
        logger.info(
            "keras-mirror-kit: this fit() had been stopped at epoch %s (epochs=%s) by a "
            "callback's request; training nothing",
            meta.epoch,
            meta.fit.epochs if meta.fit else None,
        )
    return ResumePlan(restored=restored, initial_epoch=max(int(epochs or 0), 1))


def adopt_seed(cursor: DatasetCursor | None, meta: CheckpointMeta) -> None:
    """Takes the checkpoint's data seed when the dataset's was drawn at random.

    Args:
        cursor: The cursor of the kit dataset the `fit()` trains on, or None (nothing done).
        meta: The checkpoint's metadata.

    Returns:
        None.

    Example:

    ```python
    adopt_seed(cursor, loaded.meta)  # a resumed fit(x, y, shuffle=True): the run's order
    ```
    """
    saved_seed = meta.data.seed
    if cursor is None or saved_seed is None:
        return
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
) -> DataDescription:
    """What a checkpoint records of the data, for `mid_epoch_skip` to compare.

    `cursor` is that of `SyncedCheckpoint(dataset=)` (or None), `epoch_length` the
    batches per epoch (None when unknown).
    """
    return DataDescription(
        global_batch_size=_global_batch_size(model),
        epoch_length=epoch_length,
        steps_per_execution=_steps_per_execution(model),
        seed=cursor.seed if cursor is not None else None,
        samples=cursor.num_samples if cursor is not None else None,
    )


def mid_epoch_skip(meta: CheckpointMeta, cursor: DatasetCursor | None, model: Any) -> MidEpochSkip:
    """Batches of the saved epoch to skip now, or why an exact resume is impossible.

    The order is a permutation of samples, so consumed *samples* carry over to another
    global batch size (another replica count) when they fill whole new batches.
    """
    if cursor is None:
        return MidEpochSkip(
            reason="SyncedCheckpoint was given no dataset=",
            fix="For an exact mid-epoch resume, build the training data with the kit "
            "(kmk.make_dataset, kmk.image_dataset_from_directory, ...) and pass the same "
            "object to fit() and to SyncedCheckpoint(directory, dataset=train_ds).",
        )
    per_execution = _steps_per_execution(model)
    if cursor.num_batches % per_execution:
        return MidEpochSkip(
            reason=f"{cursor.num_batches} batches per epoch is not a multiple of "
            f"steps_per_execution={per_execution}",
            fix="Choose a batch size or steps_per_execution whose epoch is a whole number "
            "of executions.",
        )
    saved, step, batch = meta.data, meta.step, _global_batch_size(model)
    if getattr(cursor, "own_batches", False):  # a PyDataset's batches, whatever the batch size
        saved = replace(saved, global_batch_size=None)
        batch = None
    samples = cursor.num_samples
    if saved.samples is not None and samples is not None and saved.samples != samples:
        # Fewer samples than a batch apart give the same batches, but another permutation.
        return _data_changed(
            f"the dataset holds {samples} samples now but held {saved.samples} at save time"
        )
    if saved.epoch_length is not None:
        if saved.global_batch_size is not None and batch is not None:
            before = saved.epoch_length * saved.global_batch_size
            now, unit = cursor.num_batches * batch, "samples"
        else:
            before, now, unit = saved.epoch_length, cursor.num_batches, "batches"
        if before != now:
            return _data_changed(
                f"the epoch holds {now} {unit} now but held {before} at save time"
            )
    if saved.seed is not None and cursor.seed_given and saved.seed != cursor.seed:
        return _data_changed(
            f"the dataset's seed {cursor.seed} differs from the checkpoint's {saved.seed} "
            "(another order)"
        )
    saved_batch = saved.global_batch_size
    if saved_batch is None or batch is None or saved_batch == batch:
        skip = step  # same batches (a model the kit did not build: assumed unchanged)
    elif (step * saved_batch) % batch:
        return MidEpochSkip(
            reason=f"the {step} batches of {saved_batch} consumed at save time are not a "
            f"whole number of batches of {batch}"
        )
    else:
        skip = step * saved_batch // batch
    if skip % per_execution or skip >= cursor.num_batches:
        return MidEpochSkip(
            reason=f"{skip} consumed batches do not end on a steps_per_execution="
            f"{per_execution} boundary inside the {cursor.num_batches}-batch epoch"
        )
    return MidEpochSkip(skip=skip)


def _data_changed(reason: str) -> MidEpochSkip:
    return MidEpochSkip(reason=reason, data_changed=True)


def found_cursor(cursor: Any, steps: int | None, model: Any) -> Any:
    """The cursor a `fit()` found (not `dataset=`'s) that it resumes by, or None: not when
    it runs another number of batches per epoch, nor a `PyDataset`'s that Keras reads
    itself (`steps_per_epoch`) or that several workers read."""
    if cursor is None or (steps is not None and steps != cursor.num_batches):
        return None
    if getattr(cursor, "own_batches", False):
        engine = engine_of(model)
        if not cursor.claimed or engine.num_replicas > len(engine.devices):
            return None
    return cursor


def check_whole_epochs(cursor: DatasetCursor | None, steps: int | None) -> None:
    """Refuses a `fit()` of `steps` per epoch that is not a whole epoch of `dataset=`."""
    if cursor is not None and steps is not None and steps != cursor.num_batches:
        raise ValueError(
            f"SyncedCheckpoint(dataset=...) needs fit() to run whole epochs of that "
            f"dataset ({cursor.num_batches} batches); fit() runs {steps} steps "
            "per epoch. Remove `steps_per_epoch` from fit(), or drop `dataset=`. "
            f"Received: steps_per_epoch={steps}"
        )


def other_dataset_error(cursor: DatasetCursor, why: str) -> ValueError:
    """The error for a `fit()` that trains on another dataset than `dataset=` (`why`).

    The position saved and restored would not be the position of the data trained.
    """
    return ValueError(
        "fit() is training on another dataset than the one given to "
        f"SyncedCheckpoint(dataset=...): {why}, so the position it saves and restores "
        "would not be the position of the data trained (for example two calls of "
        "kmk.make_dataset). Pass the same object to fit() and to "
        "SyncedCheckpoint(dataset=...). No checkpoint was written. "
        f"Received: dataset={type(cursor).__name__} of "
        f"{cursor.num_batches} batches not iterated by fit()"
    )


def check_fit_dataset(cursor: DatasetCursor | None, x: Any, strict: bool = False) -> Any:
    """The cursor a `fit()` on `x` resumes by: `dataset=`'s, checked, or the one `x` is built on.

    With `cursor` (the kit dataset `SyncedCheckpoint(dataset=)` names), `x` must be that
    dataset or a pipeline of steps after it that keep its batches. Without, the kit dataset
    `x` is, or is built on through maps and prefetches (`train_ds.map(f).prefetch(2)`), is
    found; other pipelines resume at epoch boundaries (None). Either way a map after the kit
    dataset that draws from shared random state is warned about (`strict`: refused).

    Raises:
        ValueError: For another kit dataset than `dataset=`, a pipeline built on it that
            rebatches it, caches it or reorders it (naming the step and what to write
            instead), or, with `strict`, a map after it with stateful random ops.
    """
    pipeline = kit_pipeline(x)
    if cursor is None:
        if pipeline is None:  # a PyDataset's cursor (its batches are addressable), or None
            return backends.current().py_dataset_cursor(x)
        if not pipeline.exact:
            logger.info(
                "keras-mirror-kit: SyncedCheckpoint resumes at epoch boundaries: fit() trains "
                "on %s after a kit dataset, %s",
                " -> ".join(pipeline.steps),
                pipeline.breaks or "which changes which batches an epoch holds",
            )
            return None
        _check_maps(pipeline, strict)
        return pipeline.cursor
    if pipeline is not None and pipeline.cursor is not cursor:
        raise other_dataset_error(cursor, "fit() was given another kmk.make_dataset object")
    if pipeline is None:
        return cursor  # a generator or a zip over it, say: checked at the first batch end
    received = f"Received: x={type(x).__name__} ({' -> '.join(['kit dataset', *pipeline.steps])})"
    if pipeline.breaks:
        raise ValueError(
            "fit() was given a pipeline built on the dataset of SyncedCheckpoint(dataset=...) "
            f"that cannot resume mid-epoch exactly: {pipeline.breaks}. Or leave out dataset= "
            f"(the checkpoints then resume at epoch boundaries). No step was trained. {received}"
        )
    if not pipeline.exact:
        raise ValueError(
            "fit() was given a pipeline built on the dataset of SyncedCheckpoint(dataset=...): "
            f"{' -> '.join(pipeline.steps)} after it. A checkpoint saves the kit dataset's "
            "position, and these steps change which batches an epoch holds or their order, "
            "so the kit cannot resume that pipeline exactly. Map and prefetch after the kit "
            "dataset as you like; do the batching and shuffling in the kit dataset "
            "(make_dataset(..., batch_size, seed=...), its preprocess=, or augment= for a "
            "folder's training subset; it repeats every epoch by itself), or leave out "
            f"dataset= (the checkpoints then resume at epoch boundaries). No step was trained. "
            f"{received}"
        )
    _check_maps(pipeline, strict)
    return cursor


def _check_maps(pipeline: KitPipeline, strict: bool) -> None:
    """Warns about (`strict`: refuses) maps after the kit dataset with stateful random ops."""
    from keras_mirror_kit.data.augment import check_deterministic, describe  # TensorFlow

    for function, graph in pipeline.maps:
        check_deterministic(
            graph,
            f"The .map({describe(function)}) after the kit dataset that fit() trains on",
            strict,
            remedy=(
                "Move the random work into the kit dataset, where every draw is keyed on "
                "(seed, epoch, batch): make_dataset(preprocess=...), or augment= of "
                "image_dataset_from_directory / text_dataset_from_directory for the training "
                "subset only (Keras' random layers as they are)."
            ),
        )


def check_workers_agree(
    model: Any, restored: LoadedCheckpoint | None, skip: int, directory: str | os.PathLike[str]
) -> None:
    """Checks that every worker resumes from the same point (else collectives mismatch or hang).

    Returns at once with a single worker or a model the kit did not build.

    Raises:
        CheckpointError: When the workers found different checkpoints.
    """
    dist = distribution_of(model)
    if dist is None or dist.num_workers < 2:
        return
    meta = restored.meta if restored is not None else None
    mine = [
        meta.epoch if meta is not None else -1,
        skip,
        (meta.global_step if meta is not None else None) or -1,
    ]
    rows = backends.current().gather_rows(model, mine)
    if not (rows == rows[0]).all():
        raise CheckpointError(
            "The workers would resume from different checkpoints (epoch, batch, step "
            f"per replica: {rows.tolist()}). Every worker must see the same checkpoint "
            f"directory: put {str(directory)!r} on a filesystem shared by all "
            f"workers. Received: directory={str(directory)!r}"
        )
