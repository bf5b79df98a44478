"""Weights & Biases logging for distributed Keras training: `WandbLogger`.

Needs the `wandb` extra (`pip install "keras-mirror-kit[wandb]"`). This is the only module
of the kit that imports `wandb`.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import keras
import tensorflow as tf

try:
    import wandb
except ImportError as err:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "keras_mirror_kit.integrations.wandb needs the `wandb` package, which is not "
        'installed. Install the extra with: pip install "keras-mirror-kit[wandb]"'
    ) from err

from keras_mirror_kit._version import __version__
from keras_mirror_kit.batching import validate_positive_int
from keras_mirror_kit.callbacks.progress import steps_done
from keras_mirror_kit.distribution import Distribution, distribution_of, is_chief

__all__ = ["WandbLogger"]

logger = logging.getLogger("keras_mirror_kit")

_ARTIFACT_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_BATCH_PREFIX = "batch/"
_BATCH_STEP = "batch/step"


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
        if log_every_n_batches is not None:
            validate_positive_int("log_every_n_batches", log_every_n_batches)
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
        run = self._run_arg if self._run_arg is not None else wandb.run
        if run is None:
            run = self._start_run()
            self._owns_run = True
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
            batch, (self.params or {}).get("steps")
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
            self._upload_checkpoints(self._last_epoch)
        self._active = False
        if self._owns_run:
            run.finish()

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
        run = wandb.init(**kwargs)
        logger.info("WandbLogger: started W&B run %s in %s", run.id, run.dir)
        return run

    def _upload_checkpoints(self, epoch: int) -> None:
        run = self._run
        assert run is not None and self.checkpoint_dir is not None
        files = _checkpoint_files(self.checkpoint_dir)
        if not files:
            logger.debug("WandbLogger: no checkpoint files in %s yet.", self.checkpoint_dir)
            return
        root = Path(self.checkpoint_dir)
        try:
            fingerprint = tuple(
                (rel, (root / rel).stat().st_size, (root / rel).stat().st_mtime_ns)
                for rel in files
            )
            if fingerprint == self._uploaded_fingerprint:
                return
            artifact = wandb.Artifact(
                self.artifact_name or f"run_{run.id}_checkpoints",
                type="model",
                metadata={
                    "epoch": epoch,
                    "checkpoint_dir": str(root),
                    "files": list(files),
                },
            )
            for rel in files:
                artifact.add_file(str(root / rel), name=rel)
        except OSError as exc:  # a checkpoint was rotated away while we read the folder
            logger.warning(
                "WandbLogger: could not read the checkpoints in %s (%s); will retry at the "
                "next epoch end.",
                self.checkpoint_dir,
                exc,
            )
            return
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


def _run_config(dist: Distribution | None) -> dict[str, Any]:
    """The run-config entries: `Distribution.as_config()` (if any) plus the versions."""
    config: dict[str, Any] = dict(dist.as_config()) if dist is not None else {}
    config.update(
        tensorflow_version=tf.__version__,
        keras_version=keras.__version__,
        keras_mirror_kit_version=__version__,
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

    Hidden files and folders (`.name`) and partial writes (`*.tmp`) are skipped; a missing
    directory has no files.
    """
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for filename in filenames:
            if filename.startswith(".") or filename.endswith(".tmp"):
                continue
            found.append(Path(dirpath, filename).relative_to(root).as_posix())
    return sorted(found)
