"""`SyncedCheckpoint`: crash-safe, replica-verified, resumable checkpoints for `model.fit`.

Keras' `BackupAndRestore` writes its files in place (a kill during a write destroys the
only backup), lets every worker write the same path, replays an interrupted epoch on
already-trained weights when `save_freq` is an integer, and never resets
`model._initial_epoch` (a later `fit` on the same model silently skips epochs). This
callback has none of these faults; the file format and its guarantees live in
`keras_mirror_kit.checkpoint_store`.
"""

from __future__ import annotations

import logging
import numbers
import os
import weakref
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from keras_mirror_kit.callbacks.progress import steps_done
from keras_mirror_kit.checkpoint_store import CheckpointError, CheckpointStore, LoadedCheckpoint
from keras_mirror_kit.data import DatasetCursor, cursor_of
from keras_mirror_kit.distribution import distribution_of, is_chief

__all__ = ["ReplicaDivergenceError", "SyncedCheckpoint"]

logger = logging.getLogger("keras_mirror_kit")


class ReplicaDivergenceError(ValueError):
    """Per-replica copies of a mirrored variable differ: the replicas are out of sync."""


def _is_unsynced_batch_norm(layer: Any) -> bool:
    return isinstance(layer, keras.layers.BatchNormalization) and not getattr(
        layer, "synchronized", False
    )


class SyncedCheckpoint(keras.callbacks.Callback):
    """Saves and restores the full training state, atomically, from the chief only.

    Each checkpoint holds the model's weights, the optimizer's full state (iterations,
    moments, learning rate) and the training progress (epoch and batch). Files are written
    atomically and the manifest that names the newest checkpoint is replaced last, so a
    kill at any instant leaves the previous checkpoint loadable; orphaned temporary files
    are removed on the next run. The newest `keep` checkpoints are kept (and the newest one
    written at an epoch boundary).

    At `on_train_begin`, if the directory holds a good checkpoint, the weights and
    optimizer state are restored and training continues from the saved epoch. A corrupt
    newest checkpoint is reported with a warning and the previous good one is used. The
    checkpoint may come from a run with another replica count.

    With `save_freq="epoch"` the callback does nothing per batch and resumes at epoch
    boundaries. With an integer `save_freq`, checkpoints are also written every `save_freq`
    batches.
    Given `dataset=` (a dataset built by `kmk.make_dataset`), a run resumes exactly where
    it stopped, mid-epoch: the consumed batches of that epoch are skipped and the epoch
    ends after its remaining batches, so no batch is trained twice. Without it, Keras
    cannot start an epoch part-way, so the resume uses the newest checkpoint written at an
    epoch boundary (also written every epoch) and re-trains the interrupted epoch from its
    start, again without training any batch twice.

    With `steps_per_execution > 1`, saves happen at execution boundaries, and an exact
    mid-epoch resume needs the epoch length to be a multiple of `steps_per_execution`
    (otherwise the resumed epoch's last execution would read past its remaining batches):
    when it is not, the resume starts at the newest epoch boundary, as without `dataset=`.

    Only the chief process writes (`Distribution.is_chief`). After `fit` returns, a later
    `fit` on the same model behaves normally: it neither restores again nor skips epochs.

    Args:
        directory: Directory for the checkpoints; created if missing.
        save_freq: `"epoch"`, or a positive integer number of batches.
        keep: How many of the newest checkpoints to keep (>= 1).
        restore: Restore from the newest good checkpoint at the start of training.
        verify_replicas: Before each save, check that every mirrored variable's
            per-replica copies are identical and raise `ReplicaDivergenceError` naming those
            that are not. Unsynchronised BatchNormalization moving statistics legitimately
            differ per replica: they are reported in the log, not raised, and replica 0's
            values are saved.
        dataset: The training dataset, when built by `kmk.make_dataset`, for exact
            mid-epoch resume.
        verify_atol: Absolute tolerance of the replica comparison (default exact).

    Raises:
        TypeError: On a wrong argument type.
        ValueError: On a bad `save_freq`, `keep` or `dataset`; at `on_train_begin`,
            `CheckpointError` for an unusable directory or a checkpoint of another model,
            before any training step.
        CheckpointWriteError: When a save fails (disk full, read-only); earlier
            checkpoints stay intact.
        ReplicaDivergenceError: When replicas diverged (with `verify_replicas=True`).

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
    ) -> None:
        super().__init__()
        if not isinstance(directory, (str, os.PathLike)) or not str(directory):
            raise TypeError(
                "`directory` must be a non-empty path (str or os.PathLike). "
                f"Received: directory={directory!r}"
            )
        if save_freq != "epoch" and (
            isinstance(save_freq, bool)
            or not isinstance(save_freq, numbers.Integral)
            or save_freq <= 0
        ):
            raise ValueError(
                "`save_freq` must be 'epoch' or a positive integer number of batches. "
                f"Received: save_freq={save_freq!r}"
            )
        cursor = None
        if dataset is not None:
            cursor = cursor_of(dataset)
            if cursor is None:
                raise ValueError(
                    "`dataset` must be a dataset built by kmk.make_dataset (it carries the "
                    "position needed for an exact mid-epoch resume); omit it for other "
                    f"datasets. Received: dataset={type(dataset).__name__}"
                )
        self._store = CheckpointStore(directory, keep=keep)
        self.directory = self._store.directory
        self.save_freq = save_freq
        self.keep = keep
        self.restore = bool(restore)
        self.verify_replicas = bool(verify_replicas)
        self.verify_atol = float(verify_atol)
        self._cursor: DatasetCursor | None = cursor
        self._restored: weakref.WeakSet[Any] = weakref.WeakSet()
        self._reset_run_state()

    # -- lifecycle ---------------------------------------------------------------------------

    def _reset_run_state(self) -> None:
        self._is_chief = True
        self._epoch = 0
        self._resume_epoch: int | None = None
        self._resume_skip = 0
        self._epoch_skip = 0
        self._steps_in_epoch = 0
        self._steps_in_fit = 0
        self._last_save_mark = 0
        self._ending_epoch_early = False
        self._reported_batch_norm = False
        self.last_restored: LoadedCheckpoint | None = None

    @property
    def _strategy(self) -> tf.distribute.Strategy:
        return self.model.distribute_strategy

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        # A fit() interrupted by an exception never reached on_train_end: clear its epoch.
        self.model._initial_epoch = None  # noqa: SLF001
        self._reset_run_state()
        self._is_chief = is_chief(self.model)
        if self._is_chief:
            self._store.prepare()
            if not self.restore and self._store.entries():
                raise CheckpointError(
                    f"The checkpoint directory {str(self.directory)!r} already holds "
                    "checkpoints, and restore=False would start a new run whose saves rotate "
                    "them away. Use a new directory, remove the old checkpoints yourself, or "
                    f"pass restore=True to continue from them. Received: restore=False"
                )
        if self._cursor is not None:
            steps = self.params.get("steps") if self.params else None
            if steps is not None and steps != self._cursor.num_batches:
                raise ValueError(
                    f"SyncedCheckpoint(dataset=...) needs fit() to run whole epochs of that "
                    f"dataset ({self._cursor.num_batches} batches); fit() runs {steps} steps "
                    "per epoch. Remove `steps_per_epoch` from fit(), or drop `dataset=`. "
                    f"Received: steps_per_epoch={steps}"
                )
        self._build_optimizer()
        if self.restore and self.model not in self._restored:
            self._restore()
            self._check_workers_agree()
        self._restored.add(self.model)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch = epoch
        self._epoch_skip = self._resume_skip if epoch == self._resume_epoch else 0
        self._steps_in_epoch = self._epoch_skip
        if self._cursor is not None:
            self._cursor.set(epoch, self._epoch_skip)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self.save_freq == "epoch":
            return  # nothing to do per batch; resumes start at epoch boundaries
        # With steps_per_execution > 1 Keras reports the last step of each execution (past
        # the end of the epoch for a partial last execution).
        num_batches = self._epoch_length()
        done = steps_done(batch, num_batches, offset=self._epoch_skip)
        self._steps_in_fit += done - self._steps_in_epoch
        self._steps_in_epoch = done
        if self._epoch_skip and num_batches is not None and done >= num_batches:
            # The resumed epoch has run its remaining batches: end it here.
            self.model.stop_training = True
            self._ending_epoch_early = True
        if isinstance(self.save_freq, int):
            mark = self._steps_in_fit // self.save_freq
            if mark > self._last_save_mark:
                self._last_save_mark = mark
                if num_batches is None or done < num_batches:
                    self._save(epoch=self._epoch, step=done, epoch_end=False)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self._ending_epoch_early:
            self.model.stop_training = False
            self._ending_epoch_early = False
        self._epoch_skip = 0
        self._save(epoch=epoch + 1, step=0, epoch_end=True)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        # Keras' BackupAndRestore leaves this set, so a later fit() skips epochs.
        self.model._initial_epoch = None  # noqa: SLF001
        self._resume_epoch = None
        self._resume_skip = 0

    # -- helpers -----------------------------------------------------------------------------

    def _epoch_length(self) -> int | None:
        if self._cursor is not None:
            return self._cursor.num_batches
        steps = self.params.get("steps") if self.params else None
        return int(steps) if steps else None

    def _build_optimizer(self) -> None:
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and not optimizer.built:
            with self._strategy.scope():
                optimizer.build(self.model.trainable_variables)

    def _state_variables(self) -> list[tuple[str, Any]]:
        named = [("model", v) for v in self.model.weights]
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            named += [("optimizer", v) for v in optimizer.variables]
        return named

    # -- save --------------------------------------------------------------------------------

    def _save(self, epoch: int, step: int, epoch_end: bool) -> None:
        if self.verify_replicas:
            self._verify_replicas()
        named = self._state_variables()
        # Reading a SyncOnRead variable is a collective: every worker takes part, or a
        # chief-only read would hang (none exist in Keras 3 models today; defensive).
        on_read = {
            id(v): np.asarray(v.numpy())
            for _, v in named
            if getattr(getattr(v, "value", v), "synchronization", None)
            == tf.VariableSynchronization.ON_READ
        }
        if not self._is_chief:
            return
        arrays: dict[str, np.ndarray] = {}
        paths: list[str] = []
        for i, (group, variable) in enumerate(named):
            value = on_read[id(variable)] if id(variable) in on_read else variable.numpy()
            arrays[f"{group}/{i:05d}"] = np.asarray(value)
            paths.append(f"{group}:{variable.path}")
        optimizer = getattr(self.model, "optimizer", None)
        global_step = int(optimizer.iterations.numpy()) if optimizer is not None else None
        meta = {
            "epoch": int(epoch),
            "step": int(step),
            "epoch_end": bool(epoch_end),
            "global_step": global_step,
            "num_replicas": int(self._strategy.num_replicas_in_sync),
            "global_batch_size": self._global_batch_size(),
            "epoch_length": self._epoch_length(),
            "steps_per_execution": int(getattr(self.model, "steps_per_execution", 1) or 1),
            "data_seed": self._cursor.seed if self._cursor is not None else None,
            "variables": paths,
        }
        path = self._store.write(arrays, meta)
        logger.debug("keras-mirror-kit: wrote %s (epoch %d, step %d)", path, epoch, step)

    def _verify_replicas(self) -> None:
        strategy = self._strategy
        if strategy.num_replicas_in_sync < 2:
            return
        batch_norm_ids = {
            id(v)
            for layer in self.model._flatten_layers(include_self=True)  # noqa: SLF001
            if _is_unsynced_batch_norm(layer)
            for v in (layer.moving_mean, layer.moving_variance)
        }
        diverged: list[str] = []
        batch_norm_gap = 0.0
        for _, variable in self._state_variables():
            value = getattr(variable, "value", variable)
            if getattr(value, "synchronization", None) == tf.VariableSynchronization.ON_READ:
                continue
            copies = strategy.experimental_local_results(value)
            if len(copies) < 2:
                continue
            first = np.asarray(copies[0])
            gap = max(float(np.max(np.abs(np.asarray(c) - first), initial=0.0)) for c in copies)
            if gap <= self.verify_atol:
                continue
            if id(variable) in batch_norm_ids:
                batch_norm_gap = max(batch_norm_gap, gap)
            else:
                diverged.append(f"{variable.path} (max |diff| {gap:.3g})")
        if diverged:
            raise ReplicaDivergenceError(
                f"{len(diverged)} mirrored variable(s) differ between replicas, so the "
                "replicas are out of sync and no checkpoint was written: "
                f"{', '.join(diverged[:10])}{' ...' if len(diverged) > 10 else ''}. This "
                "happens when a variable is assigned per replica outside the optimizer. "
                "Set verify_replicas=False to save anyway (replica 0's values)."
            )
        if batch_norm_gap and not self._reported_batch_norm:
            self._reported_batch_norm = True
            logger.info(
                "keras-mirror-kit: BatchNormalization moving statistics differ between "
                "replicas (max |diff| %.3g), as expected without synchronized statistics; "
                "replica 0's are saved. Use BatchNormalization(synchronized=True) to keep "
                "them equal.",
                batch_norm_gap,
            )

    # -- restore -----------------------------------------------------------------------------

    def _restore(self) -> None:
        had_any = bool(self._store.entries())
        loaded = self._store.load_latest(
            require_epoch_end=self._cursor is None or self.save_freq == "epoch"
        )
        skip = 0
        if loaded is not None and loaded.meta.get("step"):
            skip_or_reason = self._mid_epoch_skip(loaded.meta)
            if isinstance(skip_or_reason, str):
                logger.info(
                    "keras-mirror-kit: %s, so the resume starts at the newest epoch boundary",
                    skip_or_reason,
                )
                loaded = self._store.load_latest(require_epoch_end=True)
            else:
                skip = skip_or_reason
        if loaded is None:
            if had_any:
                logger.warning(
                    "keras-mirror-kit: no usable checkpoint in %s; training from the start",
                    self.directory,
                )
            return
        self._apply(loaded)
        meta = loaded.meta
        epoch = int(meta["epoch"])
        if skip:
            self._resume_epoch, self._resume_skip = epoch, skip
        if self._cursor is not None and meta.get("data_seed") is not None:
            saved_seed = int(meta["data_seed"])
            if self._cursor.seed_given and saved_seed != self._cursor.seed:
                logger.warning(
                    "keras-mirror-kit: the dataset's seed %d differs from the checkpoint's "
                    "%d; the checkpoint's is used so the resumed epochs see the same order",
                    self._cursor.seed,
                    saved_seed,
                )
            self._cursor.set_seed(saved_seed)
        self.model._initial_epoch = epoch  # noqa: SLF001
        self.last_restored = loaded
        logger.info(
            "keras-mirror-kit: resumed from %s (epoch %d, batch %d, saved with %s replica(s))",
            loaded.path,
            epoch,
            skip,
            meta.get("num_replicas"),
        )

    def _mid_epoch_skip(self, meta: dict[str, Any]) -> int | str:
        """Batches of the saved epoch to skip now, or why an exact resume is impossible.

        The order is a permutation of samples, so consumed *samples* carry over to another
        global batch size (another replica count) when they fill whole new batches.
        """
        cursor = self._cursor
        assert cursor is not None
        per_execution = int(getattr(self.model, "steps_per_execution", 1) or 1)
        if cursor.num_batches % per_execution:
            return (
                f"{cursor.num_batches} batches per epoch is not a multiple of "
                f"steps_per_execution={per_execution}"
            )
        step, saved_batch = int(meta["step"]), meta.get("global_batch_size")
        batch = self._global_batch_size()
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

    def _global_batch_size(self) -> int | None:
        dist = distribution_of(self.model)
        if dist is not None:
            return dist.global_batch_size
        return None

    def _check_workers_agree(self) -> None:
        """Every worker must resume from the same point, or collectives mismatch or hang."""
        dist = distribution_of(self.model)
        if dist is None or dist.num_workers < 2:
            return
        meta = self.last_restored.meta if self.last_restored is not None else {}
        mine = [
            int(meta.get("epoch", -1)),
            self._resume_skip,
            int(meta.get("global_step") or -1),
        ]
        strategy = self._strategy
        per_replica = strategy.run(lambda: tf.constant([mine], tf.int64))
        rows = np.asarray(strategy.gather(per_replica, axis=0))
        if not (rows == rows[0]).all():
            raise CheckpointError(
                "The workers would resume from different checkpoints (epoch, batch, step "
                f"per replica: {rows.tolist()}). Every worker must see the same checkpoint "
                f"directory: put {str(self.directory)!r} on a filesystem shared by all "
                f"workers. Received: directory={str(self.directory)!r}"
            )

    def _apply(self, loaded: LoadedCheckpoint) -> None:
        named = self._state_variables()
        stored = sorted(loaded.arrays)
        saved_paths = loaded.meta.get("variables", [])
        if len(stored) != len(named):
            raise CheckpointError(
                f"The checkpoint {str(loaded.path)!r} holds {len(stored)} variables but this "
                f"model and optimizer have {len(named)}: it was written by another model or "
                "optimizer. Use a new checkpoint directory or restore=False. "
                f"Received: directory={str(self.directory)!r}"
            )
        for key, (group, variable) in zip(stored, named):
            array = loaded.arrays[key]
            if not key.startswith(group) or tuple(array.shape) != tuple(variable.shape):
                index = int(key.split("/")[1])
                was = saved_paths[index] if index < len(saved_paths) else key
                raise CheckpointError(
                    f"The checkpoint {str(loaded.path)!r} does not match this model: {was} "
                    f"has shape {tuple(array.shape)} but {group}:{variable.path} has shape "
                    f"{tuple(variable.shape)}. Use a new checkpoint directory or "
                    f"restore=False. Received: directory={str(self.directory)!r}"
                )
        for key, (_, variable) in zip(stored, named):
            variable.assign(loaded.arrays[key])
