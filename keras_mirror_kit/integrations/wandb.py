"""Weights & Biases logging for distributed Keras training: `WandbLogger`.

Needs the `wandb` extra (`pip install "keras-mirror-kit[wandb]"`). This is the only module
of the kit that imports `wandb`.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import keras

try:
    import wandb
except ImportError as err:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "keras_mirror_kit.integrations.wandb needs the `wandb` package, which is not "
        'installed. Install the extra with: pip install "keras-mirror-kit[wandb]"'
    ) from err

from keras_mirror_kit import backends, fit_hooks
from keras_mirror_kit._version import __version__
from keras_mirror_kit.callbacks.keras_loop import steps_done
from keras_mirror_kit.checkpoint.lock import LOCK_FILE
from keras_mirror_kit.distribution import Distribution
from keras_mirror_kit.model_record import distribution_of, is_chief
from keras_mirror_kit.multi_worker import NETWORK_ENV
from keras_mirror_kit.validation import positive_int

__all__ = ["WandbLogger"]

logger = logging.getLogger("keras_mirror_kit")

_ARTIFACT_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_BATCH_PREFIX = "batch/"
_BATCH_STEP = "batch/step"
_FAILED = 1  # the exit code a run is finished with when its fit() raised
_UPLOAD_ATTEMPTS = 3  # listings of the checkpoint directory per upload


@dataclass(eq=False)
class _OpenRun:
    """A run a `WandbLogger` started for a `fit()` that has not reached `on_train_end`."""

    run: wandb.Run
    thread: int


_open_runs: list[_OpenRun] = []
_open_runs_lock = threading.Lock()


class WandbLogger(keras.callbacks.Callback):
    """Logs a (distributed) Keras training run to Weights & Biases, from the chief only.

    At the start of `fit()` the callback starts a W&B run, or joins the one already active
    (`wandb.run`, or the `run` you pass in), and records in the run's config how the model
    is distributed: strategy, devices, replicas and workers, per-replica and global batch
    size, all-reduce implementation, the learning-rate scaling rule and, when
    `Distribution.scale_learning_rate` was called, the base and scaled learning rates
    (everything in `Distribution.as_config()`), plus the TensorFlow, Keras and
    keras-mirror-kit versions.

    At the end of every epoch it logs each value in the epoch's logs (loss, metrics,
    validation metrics, and whatever earlier callbacks added, such as `samples_per_sec`
    from `ThroughputMonitor`) together with `epoch`, the number of epochs completed.
    Every epoch-level key is plotted against `epoch`. Because the values are read from
    the logs at `on_epoch_end`, place this callback *after* the callbacks that add to
    the logs (`ThroughputMonitor`) and after the one that writes checkpoints
    (`SyncedCheckpoint`) in the `callbacks` list.

    With `log_every_n_batches=N` it also logs the training batch logs every N steps,
    under `batch/<name>` and plotted against `batch/step`, the number of training steps
    since the run started, so batch-level and epoch-level values never collide.

    With `upload_checkpoints=True`, the files in `checkpoint_dir` (hidden files and
    `*.tmp` files skipped) are logged as a W&B artifact of type `"model"` at the end of
    every epoch in which they changed and at the end of training, with the aliases
    `latest` and `epoch_<n>`.

    Only the chief process (`Distribution.is_chief`; a model not built by the kit counts
    as chief) logs anything. Other workers never call `wandb.init()` and log nothing. The
    run is finished at the end of `fit()` only if this callback started it; a run that
    you started, or passed in, is left open.

    If `fit()` raises, a run this callback started is finished as failed (exit code 1).
    Keras calls no callback when `fit()` raises, so this happens: at once, for a model
    built by the kit (its `fit()` calls `on_fit_exception`; you can call it yourself in an
    `except` block for other models); otherwise at the next `on_train_begin` of any
    `WandbLogger` in the process (so a new `fit()` never joins the failed run), or at the
    latest when the process exits.

    All of this works in offline mode (`WANDB_MODE=offline` or `mode="offline"`): the run
    is written to `<dir>/wandb/offline-run-*` and can be uploaded later with
    `wandb sync`.

    Args:
        project: W&B project of a run this callback starts.
        name: Display name of a run this callback starts.
        config: Your own hyperparameters, added to the run's config (also when joining
            a run).
        dir: Directory under which W&B writes its `wandb/` folder (created if missing).
            Defaults to W&B's default (the working directory).
        mode: `"online"`, `"offline"` or `"disabled"`; defaults to W&B's own setting
            (`WANDB_MODE`).
        log_every_n_batches: If set, also log the training batch logs every this many
            steps. `None` logs per epoch only.
        upload_checkpoints: Whether to log the files of `checkpoint_dir` as a `"model"`
            artifact.
        checkpoint_dir: The directory checkpoints are written to (by `SyncedCheckpoint`
            or `keras.callbacks.ModelCheckpoint`). Required with `upload_checkpoints`.
        run: A run to log to instead of the active one or a new one. It is not finished
            at the end of training.
        artifact_name: Name of the checkpoint artifact; defaults to
            `"run_<run id>_checkpoints"`.
        **init_kwargs: Further keyword arguments for `wandb.init()` (for example
            `entity`, `tags`, `group`, `id`, `resume`, `settings`).

    Raises:
        TypeError: If `log_every_n_batches` is not an integer or `config` is not a mapping.
        ValueError: If `log_every_n_batches` is not positive, `upload_checkpoints` is set
            without `checkpoint_dir`, `artifact_name` has characters W&B does not allow,
            or `run` is combined with arguments that only apply to a new run.

    Example:

    ```python
    import keras_mirror_kit as kmk
    from keras_mirror_kit.callbacks import ThroughputMonitor
    from keras_mirror_kit.integrations.wandb import WandbLogger

    @kmk.distributed(per_replica_batch_size=64)
    def build_model():
        lr = kmk.current().scale_learning_rate(1e-3, base_batch_size=64)
        ...

    model = build_model()
    model.fit(
        train_ds,
        epochs=10,
        callbacks=[
            ThroughputMonitor(),  # adds samples_per_sec to the logs ...
            WandbLogger(project="cifar", log_every_n_batches=50),  # ... then log them
        ],
    )
    ```
    """

    def __init__(
        self,
        project: str | None = None,
        name: str | None = None,
        config: Mapping[str, Any] | None = None,
        dir: str | os.PathLike[str] | None = None,
        mode: str | None = None,
        log_every_n_batches: int | None = None,
        upload_checkpoints: bool = False,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        run: wandb.Run | None = None,
        artifact_name: str | None = None,
        **init_kwargs: Any,
    ) -> None:
        super().__init__()
        fit_hooks.install()  # any model's fit() then tells this logger when it raised
        if log_every_n_batches is not None:
            positive_int("log_every_n_batches", log_every_n_batches)
        if upload_checkpoints and checkpoint_dir is None:
            raise ValueError(
                "`upload_checkpoints=True` needs the directory the checkpoints are written "
                "to. Pass `checkpoint_dir=...`. Received: checkpoint_dir=None"
            )
        if artifact_name is not None and not _ARTIFACT_NAME.match(artifact_name):
            raise ValueError(
                "`artifact_name` may only contain letters, digits, '-', '_' and '.'. "
                f"Received: artifact_name={artifact_name!r}"
            )
        if config is not None and not isinstance(config, Mapping):
            raise TypeError(
                f"`config` must be a dict (or another mapping). Received: config={config!r}"
            )
        if run is not None:
            new_run_args = {"project": project, "name": name, "dir": dir, "mode": mode}
            given = {k: v for k, v in new_run_args.items() if v is not None}
            given.update(init_kwargs)
            if given:
                raise ValueError(
                    "`run` joins an existing W&B run, so arguments that only apply to a "
                    "new run (passed to wandb.init()) cannot be combined with it. "
                    f"Received: run={run!r} and {given!r}"
                )
        self.project = project
        self.name = name
        self.config = dict(config) if config is not None else None
        self.dir = os.fspath(dir) if dir is not None else None
        self.mode = mode
        self.log_every_n_batches = log_every_n_batches
        self.upload_checkpoints = bool(upload_checkpoints)
        self.checkpoint_dir = os.fspath(checkpoint_dir) if checkpoint_dir is not None else None
        self.artifact_name = artifact_name
        self.init_kwargs = dict(init_kwargs)
        self._run_arg = run
        self._run: wandb.Run | None = None
        self._active = False
        self._owns_run = False
        self._epoch_metrics: set[str] = set()
        self._batch_step = 0
        self._epoch_start_step = 0
        self._last_logged_step = 0
        self._last_epoch = 0
        self._uploaded_fingerprint: tuple[tuple[str, int, int], ...] | None = None
        self._open: _OpenRun | None = None

    @property
    def run(self) -> wandb.Run | None:
        """The W&B run logged to during the last `fit()`, or None (non-chief, not started)."""
        return self._run

    @property
    def owns_run(self) -> bool:
        """Whether this callback started the current run (and so finishes it)."""
        return self._owns_run

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Starts or joins the run (chief only) and records the distribution in its config."""
        if not is_chief(self.model):
            logger.debug("WandbLogger: not the chief worker, logging nothing to W&B.")
            self._active = False
            self._owns_run = False
            return
        self._finish_abandoned_runs()
        run = self._run_arg if self._run_arg is not None else wandb.run
        if run is None:
            run = self._start_run()
            self._owns_run = True
            self._track(run)
        else:
            self._owns_run = False
            if self.config:
                run.config.update(self.config, allow_val_change=True)
        if run is not self._run:
            self._batch_step = 0
            self._last_logged_step = 0
            self._epoch_metrics = set()
            self._uploaded_fingerprint = None
        self._run = run
        self._active = True
        self._epoch_start_step = self._batch_step
        run.config.update(_run_config(distribution_of(self.model)), allow_val_change=True)
        run.define_metric("epoch")
        if self.log_every_n_batches is not None:
            run.define_metric(_BATCH_STEP)
            run.define_metric(_BATCH_PREFIX + "*", step_metric=_BATCH_STEP)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Logs the batch logs under `batch/` every `log_every_n_batches` steps."""
        n = self.log_every_n_batches
        if not self._active or n is None:
            return
        self._batch_step = self._epoch_start_step + steps_done(
            batch,
            (self.params or {}).get("steps"),
            0,
            getattr(self.model, "steps_per_execution", 1),
        )
        if self._batch_step - self._last_logged_step < n:
            return
        run = self._run
        assert run is not None
        values = _scalar_logs(logs)
        data = {_BATCH_PREFIX + key: value for key, value in values.items()}
        data[_BATCH_STEP] = self._batch_step
        run.log(data)
        self._last_logged_step = self._batch_step

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """Remembers the step count at the start of the epoch."""
        self._epoch_start_step = self._batch_step

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """Logs `epoch` and every scalar in the epoch logs; uploads changed checkpoints."""
        if not self._active:
            return
        run = self._run
        assert run is not None
        values = _scalar_logs(logs)
        values.pop("epoch", None)
        for key in values:
            if key not in self._epoch_metrics:
                run.define_metric(key, step_metric="epoch")
                self._epoch_metrics.add(key)
        self._last_epoch = int(epoch) + 1
        run.log({"epoch": self._last_epoch, **values})
        if self.upload_checkpoints:
            self._upload_checkpoints(self._last_epoch)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        """Uploads changed checkpoints and finishes the run if this callback started it."""
        if not self._active:
            return
        run = self._run
        assert run is not None
        if self.upload_checkpoints:
            self._upload_checkpoints(self._last_epoch, final=True)
        self._active = False
        if self._open is not None:
            _untrack(self._open)
            self._open = None
            run.finish()

    def on_fit_exception(self, exception: BaseException) -> None:
        """Finishes the run this callback started as failed, because `fit()` raised.

        Keras calls no callback when `fit()` raises; once a `WandbLogger` exists, `fit()`
        calls this method of every callback that has it, with the exception, before the
        exception propagates (`keras_mirror_kit.fit_hooks`). In a loop that drives the
        callbacks by hand, call it yourself in an `except` block; otherwise the run is
        finished as failed at the next `on_train_begin` of a `WandbLogger` in another
        thread, or when the process exits. A run this callback did not start is left open.
        Calling it when no `fit()` of this callback is under way does nothing.

        Args:
            exception: The exception `fit()` raised.

        Raises:
            Nothing: an error while finishing the run is logged, so that the exception
                of `fit()` is the one that propagates.

        Example:

        ```python
        wandb_logger = WandbLogger(project="cifar10")
        try:
            model.fit(train_ds, epochs=10, callbacks=[wandb_logger])
        except BaseException as err:
            wandb_logger.on_fit_exception(err)  # run finished as failed, now
            raise
        ```
        """
        if not self._active:
            return
        self._active = False
        opened, self._open = self._open, None
        reason = f"fit() raised {type(exception).__name__}: {exception}"
        if opened is None:
            logger.warning(
                "WandbLogger: %s; the W&B run %s was not started by this logger, so it is "
                "left open.",
                reason,
                getattr(self._run, "id", None),
            )
            return
        _finish_failed(opened, reason)

    def _track(self, run: wandb.Run) -> None:
        """Registers `run` as open until on_train_end, for `_finish_abandoned_runs` and exit."""
        self._open = _OpenRun(run, threading.get_ident())
        with _open_runs_lock:
            _open_runs.append(self._open)
        # Registered after wandb.init(), so it runs before wandb's own exit teardown.
        atexit.unregister(_finish_open_runs_at_exit)
        atexit.register(_finish_open_runs_at_exit)

    def _finish_abandoned_runs(self) -> None:
        """Finishes, as failed, the runs loggers started for fit() calls that raised."""
        with _open_runs_lock:
            records = list(_open_runs)
        for record in records:
            if record is self._open or _fit_has_ended(record):
                _finish_failed(
                    record, "the fit() it was started for ended without on_train_end (it raised)"
                )
        self._open = None

    def _start_run(self) -> wandb.Run:
        if self.dir is not None:
            os.makedirs(self.dir, exist_ok=True)
        kwargs: dict[str, Any] = {
            "project": self.project,
            "name": self.name,
            "config": self.config,
            "dir": self.dir,
            "mode": self.mode,
        }
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        kwargs.update(self.init_kwargs)
        if not _can_reach_wandb(kwargs.get("mode")):
            logger.warning(
                "WandbLogger: this worker runs in keras-mirror-kit launch's network namespace, "
                "which has no network, so W&B online cannot reach its server. Pass "
                "--network host to launch, or log offline (WANDB_MODE=offline) and run "
                "`wandb sync` afterwards."
            )
        run = wandb.init(**kwargs)
        logger.info("WandbLogger: started W&B run %s in %s", run.id, run.dir)
        return run

    def _upload_checkpoints(self, epoch: int, final: bool = False) -> None:
        run = self._run
        assert run is not None and self.checkpoint_dir is not None
        later = (
            "not uploaded at the end of training" if final else "will retry at the next epoch end"
        )
        for _ in range(_UPLOAD_ATTEMPTS):
            files = _checkpoint_files(self.checkpoint_dir)
            if not files:
                logger.debug("WandbLogger: no checkpoint files in %s yet.", self.checkpoint_dir)
                return
            try:
                staged = self._stage_artifact(run, files, epoch)
            except _Vanished as gone:
                logger.warning(
                    "WandbLogger: checkpoint file %r disappeared from %s while it was read for "
                    "upload (rotated away by a newer checkpoint?); listing the directory again.",
                    gone.name,
                    self.checkpoint_dir,
                )
                continue
            except OSError as exc:
                logger.warning(
                    "WandbLogger: could not read the checkpoints in %s (%s); %s.",
                    self.checkpoint_dir,
                    exc,
                    later,
                )
                return
            break
        else:
            logger.warning(
                "WandbLogger: checkpoint files in %s kept disappearing while they were read "
                "(%d listings); %s.",
                self.checkpoint_dir,
                _UPLOAD_ATTEMPTS,
                later,
            )
            return
        if staged is None:  # unchanged since the last upload
            return
        artifact, fingerprint = staged
        aliases = ["latest", f"epoch_{epoch}"] if epoch else ["latest"]
        run.log_artifact(artifact, aliases=aliases)
        self._uploaded_fingerprint = fingerprint
        logger.info(
            "WandbLogger: logged %d checkpoint file(s) from %s as artifact %r (epoch %d).",
            len(files),
            self.checkpoint_dir,
            artifact.name,
            epoch,
        )

    def _stage_artifact(
        self, run: wandb.Run, files: list[str], epoch: int
    ) -> tuple[wandb.Artifact, tuple[tuple[str, int, int], ...]] | None:
        """The artifact of `files` (None if unchanged); `_Vanished` if one of them is gone."""
        assert self.checkpoint_dir is not None
        root = Path(self.checkpoint_dir)
        fingerprint = tuple((rel, *_size_and_mtime(root, rel)) for rel in files)
        if fingerprint == self._uploaded_fingerprint:
            return None
        artifact = wandb.Artifact(
            self.artifact_name or f"run_{run.id}_checkpoints",
            type="model",
            metadata={"epoch": epoch, "checkpoint_dir": str(root), "files": list(files)},
        )
        try:
            for rel in files:
                _add_file(artifact, root, rel)
        except BaseException:
            _discard_staged_copies(artifact, root)
            raise
        return artifact, fingerprint


class _Vanished(Exception):
    """A checkpoint file listed for upload was gone when it was read."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def _size_and_mtime(root: Path, rel: str) -> tuple[int, int]:
    """Size and modification time (ns) of `root / rel`; `_Vanished` if it is gone."""
    try:
        info = (root / rel).stat()
    except FileNotFoundError:
        raise _Vanished(rel) from None
    return info.st_size, info.st_mtime_ns


def _add_file(artifact: wandb.Artifact, root: Path, rel: str) -> None:
    """Adds `root / rel` to `artifact` as `rel`; `_Vanished` if it is gone."""
    path = root / rel
    try:
        artifact.add_file(str(path), name=rel)
    except FileNotFoundError:  # removed while wandb read it
        raise _Vanished(rel) from None
    except ValueError:  # wandb's "Path is not a file" when it was removed before
        if path.is_file():
            raise
        raise _Vanished(rel) from None


def _discard_staged_copies(artifact: wandb.Artifact, root: Path) -> None:
    """Deletes the staging copies wandb made for an artifact that will not be logged."""
    for entry in artifact.manifest.entries.values():
        local = getattr(entry, "local_path", None)
        if not local or Path(local).resolve().is_relative_to(root.resolve()):
            continue  # not a copy (policy "immutable" keeps the original path)
        try:
            os.remove(local)
        except OSError as exc:
            logger.debug("WandbLogger: could not delete staged copy %s: %s", local, exc)


def _fit_has_ended(record: _OpenRun) -> bool:
    """Whether the fit() `record` was opened for is over (False when it cannot tell).

    A `fit()` that raised finished its runs itself (`on_fit_exception`); what is left open
    here belongs to an enclosing `fit()`, to callbacks driven by hand, or to a thread.
    """
    if record.thread != threading.get_ident():  # over once that thread has gone
        return all(thread.ident != record.thread for thread in threading.enumerate())
    return False  # an enclosing fit(), or callbacks driven by hand


def _untrack(record: _OpenRun) -> None:
    """Removes `record` from the open runs."""
    with _open_runs_lock:
        if record in _open_runs:
            _open_runs.remove(record)


def _finish_failed(record: _OpenRun, reason: str) -> None:
    """Finishes `record.run` with exit code 1 (failed) and says so; errors are logged."""
    _untrack(record)
    run = record.run
    if getattr(run, "_is_finished", False):  # finished meanwhile (by you, or wandb.finish())
        return
    logger.warning(
        "WandbLogger: %s; finishing W&B run %s as failed (exit code %d).", reason, run.id, _FAILED
    )
    try:
        run.finish(exit_code=_FAILED)
    except Exception as exc:  # e.g. wandb.teardown() already ran
        logger.warning("WandbLogger: could not finish W&B run %s: %r", run.id, exc)


def _finish_open_runs_at_exit() -> None:
    """At exit: finishes, as failed, the runs whose fit() never reached on_train_end."""
    with _open_runs_lock:
        records = list(_open_runs)
    for record in records:
        _finish_failed(
            record, "the process is exiting while the fit() it was started for has not ended"
        )


def _run_config(dist: Distribution | None) -> dict[str, Any]:
    """The run-config entries: `Distribution.as_config()` (if any), the Keras backend and
    the versions (`tensorflow_version` or `jax_version`: the backend's)."""
    config: dict[str, Any] = dict(dist.as_config()) if dist is not None else {}
    backend = backends.current()
    config.update(
        {
            "keras_backend": backend.NAME,
            f"{backend.NAME}_version": backend.version(),
            "keras_version": keras.__version__,
            "keras_mirror_kit_version": __version__,
        }
    )
    return config


def _scalar_logs(logs: Mapping[str, Any] | None) -> dict[str, float]:
    """The scalar values of Keras logs as floats (numbers, 0-d arrays, tensors).

    Strings, None and multi-element values are skipped.
    """
    values: dict[str, float] = {}
    for key, value in (logs or {}).items():
        if value is None or isinstance(value, (str, bytes)):
            logger.debug("WandbLogger: not logging non-numeric %r=%r", key, value)
            continue
        try:
            values[str(key)] = float(value)
        except (TypeError, ValueError):
            logger.debug("WandbLogger: not logging non-scalar %r", key)
    return values


def _checkpoint_files(checkpoint_dir: str) -> list[str]:
    """Sorted relative paths of the files to upload from `checkpoint_dir`.

    Hidden files and folders (`.name`), partial writes (`*.tmp`) and the writer's lock file
    are skipped; a missing directory has no files.
    """
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for filename in filenames:
            if filename.startswith(".") or filename.endswith(".tmp") or filename == LOCK_FILE:
                continue
            found.append(Path(dirpath, filename).relative_to(root).as_posix())
    return sorted(found)


def _can_reach_wandb(mode: str | None, environ: Mapping[str, str] | None = None) -> bool:
    """False for W&B online in a worker that `launch` isolated (no network there)."""
    environ = os.environ if environ is None else environ
    mode = (mode or environ.get("WANDB_MODE") or "online").strip().lower()
    return environ.get(NETWORK_ENV) != "isolated" or mode in ("offline", "dryrun", "disabled")
