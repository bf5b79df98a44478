"""WandbLogger against real wandb in offline mode: what lands in the offline run file.

wandb 0.31 writes no `wandb-summary.json` / `config.yaml` in offline mode and ships no
Python reader for its `run-<id>.wandb` file, so `read_run` below decodes that file (a
LevelDB-style record log of `wandb.proto.wandb_internal_pb2.Record` messages) to check
the config, the per-step history, metric definitions and artifact records.

`run.finish()` can return before the wandb-core service has flushed the file, so
`read_run` waits (bounded) for the run's final `exit` record.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import keras
import numpy as np
import psutil
import pytest
import tensorflow as tf

import keras_mirror_kit as kmk
from keras_mirror_kit.checkpoint.lock import LOCK_FILE
from keras_mirror_kit.distribution import Distribution
from tests.subproc import REPO, last_json, run_python

wandb = pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2  # noqa: E402
from wandb.sdk.lib.hashutil import md5_file_b64  # noqa: E402

from keras_mirror_kit.integrations.wandb import WandbLogger  # noqa: E402

SAMPLES = 32
CKPT_FILE = re.compile(r"ckpt-\d{8}\.npz")  # SyncedCheckpoint's checkpoint files


def quiet_settings() -> Any:
    return wandb.Settings(silent=True, console="off", x_disable_stats=True, disable_git=True)


@pytest.fixture(scope="module", autouse=True)
def wandb_home(tmp_path_factory: pytest.TempPathFactory):
    """Keeps wandb's data, cache and config dirs out of $HOME; tears wandb down after."""
    home = tmp_path_factory.mktemp("wandb_home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        for var, sub in [
            ("WANDB_DATA_DIR", "data"),
            ("WANDB_CACHE_DIR", "cache"),
            ("WANDB_CONFIG_DIR", "config"),
            ("WANDB_ARTIFACT_DIR", "artifacts"),
        ]:
            mp.setenv(var, str(home / sub))
        yield home
        wandb.teardown()


@pytest.fixture(autouse=True)
def no_leftover_run():
    assert wandb.run is None, "a previous test leaked an unfinished wandb run"
    yield
    if wandb.run is not None:
        wandb.run.finish()
        pytest.fail("the test left a wandb run active")


# --- reading an offline run back ---------------------------------------------------------

_BLOCK, _HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(path: Path):
    """Yields the Record messages of a run-<id>.wandb file."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, pending = 7, b""
    while True:
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # block trailer padding
            pos += left
            continue
        if pos + _HEADER > len(data):
            return
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if (kind == 0 and length == 0) or pos + _HEADER + length > len(data):
            return  # end of what has been written so far
        chunk = data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind in (_FULL, _FIRST):
            pending = chunk
        else:
            pending += chunk
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


def _finished_records(path: Path, timeout: float = 60.0) -> list[Any]:
    """The file's records once the final `exit` record is on disk."""
    deadline = time.monotonic() + timeout
    while True:
        records = list(_records(path))
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        if time.monotonic() > deadline:
            kinds = [r.WhichOneof("record_type") for r in records]
            raise AssertionError(f"{path} has no exit record after {timeout}s: {kinds}")
        time.sleep(0.05)


def run_files(root: Path) -> list[Path]:
    """The `run-<id>.wandb` files under `root`, oldest first."""
    return sorted(root.glob("wandb/*run-*/run-*.wandb"))


def read_run(root: Path) -> SimpleNamespace:
    """Config, history rows, summary, metric definitions and artifacts of the one run."""
    files = run_files(root)
    assert len(files) == 1, files
    return read_run_file(files[0])


def read_run_file(path: Path) -> SimpleNamespace:
    """What `read_run` returns, for one `run-<id>.wandb` file."""
    run = SimpleNamespace(
        id=None,
        config={},
        history=[],
        summary={},
        metrics={},
        artifacts=[],
        exited=False,
        exit_code=None,
    )
    for record in _finished_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.id = record.run.run_id
            for item in record.run.config.update:
                run.config[_key(item)] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                run.config[_key(item)] = json.loads(item.value_json)
        elif kind == "history":
            row = {_key(item): json.loads(item.value_json) for item in record.history.item}
            run.history.append(row)
        elif kind == "summary":
            for item in record.summary.update:
                run.summary[_key(item)] = json.loads(item.value_json)
        elif kind == "metric":
            name = record.metric.name or record.metric.glob_name
            run.metrics[name] = record.metric.step_metric
        elif kind == "artifact":
            run.artifacts.append(
                SimpleNamespace(
                    name=record.artifact.name,
                    type=record.artifact.type,
                    aliases=list(record.artifact.aliases),
                    paths=sorted(entry.path for entry in record.artifact.manifest.contents),
                    digests={e.path: e.digest for e in record.artifact.manifest.contents},
                    metadata=json.loads(record.artifact.metadata or "{}"),
                )
            )
        elif kind == "exit":
            run.exited = True
            run.exit_code = record.exit.exit_code
    return run


def user_rows(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in row.items() if not k.startswith("_")} for row in history]


# --- models and callbacks ----------------------------------------------------------------


def kit_model() -> tuple[keras.Model, Distribution]:
    @kmk.distributed(per_replica_batch_size=4)
    def build() -> keras.Model:
        lr = kmk.current().scale_learning_rate(0.01, base_batch_size=4)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse", metrics=["mae"])
        return model

    return build(), build.distribution


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.random((SAMPLES, 3), dtype="float32"), rng.random((SAMPLES, 1), dtype="float32")


def fit(model: keras.Model, callbacks: list[keras.callbacks.Callback], epochs: int = 2) -> None:
    x, y = data()
    model.fit(x, y, batch_size=8, epochs=epochs, verbose=0, callbacks=callbacks)


class AddsThroughput(keras.callbacks.Callback):
    """Stands in for ThroughputMonitor: adds values (a tensor and a NumPy float) to logs."""

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        logs["samples_per_sec"] = tf.constant(100.0 + epoch)
        logs["step_time_ms"] = np.float32(2.5)
        logs["note"] = "not a number"


class SeesCheckpoints(keras.callbacks.Callback):
    """Listed between SyncedCheckpoint and WandbLogger: at each epoch end, adds a partial
    write and a hidden file (both to be skipped), then records what the logger will find."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = directory
        self.seen: list[dict[str, str]] = []

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        (self.directory / "ckpt-next.npz.tmp").write_text("partial")
        (self.directory / ".lock").write_text("")
        self.seen.append(uploadable(self.directory))


def uploadable(directory: Path) -> dict[str, str]:
    """The files an upload of `directory` should hold (no hidden, no `*.tmp`, no lock), with
    MD5s."""
    found = {}
    for path in sorted(directory.rglob("*")):
        rel = path.relative_to(directory)
        if path.is_file() and not path.name.endswith(".tmp") and path.name != LOCK_FILE:
            if not any(part.startswith(".") for part in rel.parts):
                found[rel.as_posix()] = md5_file_b64(str(path))
    return found


class TrainingFailed(RuntimeError):
    pass


class RaisesAtBatch(keras.callbacks.Callback):
    """Raises TrainingFailed from on_train_batch_end at (epoch, batch), both 0-based."""

    def __init__(self, epoch: int, batch: int) -> None:
        super().__init__()
        self.at = (epoch, batch)
        self._epoch = 0

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if (self._epoch, batch) == self.at:
            raise TrainingFailed(f"failed at epoch {self._epoch}, batch {batch}")


def plain_model() -> keras.Model:
    """A model the kit did not build: no kit `fit()` wrapper, no on_fit_exception call."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    return model


# --- import guard ------------------------------------------------------------------------


@pytest.mark.slow
def test_import_without_wandb_names_the_extra():
    proc = run_python(
        """
        import json, sys
        sys.modules["wandb"] = None  # makes `import wandb` fail
        import keras_mirror_kit, keras_mirror_kit.integrations  # fine without wandb
        try:
            import keras_mirror_kit.integrations.wandb
        except ImportError as err:
            print("RESULT " + json.dumps([type(err).__name__, str(err)]))
        else:
            print("RESULT null")
        """,
        timeout=240,
    )
    result = last_json(proc)
    assert result is not None, "importing the integration without wandb did not fail"
    name, message = result
    assert name in ("ImportError", "ModuleNotFoundError")
    assert 'pip install "keras-mirror-kit[wandb]"' in message


def test_wandb_is_imported_only_by_the_integration_module():
    package = REPO / "keras_mirror_kit"
    allowed = package / "integrations" / "wandb.py"
    offenders = []
    for path in package.rglob("*.py"):
        if path == allowed:
            continue
        for line in path.read_text().splitlines():
            stripped = line.strip()
            if stripped.startswith(("import wandb", "from wandb")):
                offenders.append(f"{path.relative_to(REPO)}: {stripped}")
    assert offenders == []


# --- arguments ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"log_every_n_batches": 0}, ValueError, "Received: log_every_n_batches=0"),
        ({"log_every_n_batches": "10"}, TypeError, "log_every_n_batches='10'"),
        ({"log_every_n_batches": True}, TypeError, "log_every_n_batches=True"),
        ({"upload_checkpoints": True}, ValueError, "checkpoint_dir=None"),
        ({"artifact_name": "my ckpt/1"}, ValueError, "artifact_name='my ckpt/1'"),
        ({"config": [("lr", 1)]}, TypeError, "config="),
    ],
)
def test_rejects_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match.replace("[", r"\[").replace("(", r"\(")):
        WandbLogger(**kwargs)


def test_w_and_b_online_in_an_isolated_launch_worker_is_warned_about():
    """`launch` (default --network auto) runs the workers without network: W&B online
    cannot work there (the logger then warns before wandb.init); offline can."""
    from keras_mirror_kit.integrations.wandb import _can_reach_wandb

    isolated = {"KMK_LAUNCH_NETWORK": "isolated"}
    assert not _can_reach_wandb(None, isolated)  # W&B's default: online
    assert not _can_reach_wandb(None, {**isolated, "WANDB_MODE": "online"})
    assert not _can_reach_wandb("online", {**isolated, "WANDB_MODE": "offline"})
    for mode in ("offline", "disabled", "dryrun"):
        assert _can_reach_wandb(mode, isolated)
        assert _can_reach_wandb(None, {**isolated, "WANDB_MODE": mode.upper()})
    assert _can_reach_wandb(None, {"KMK_LAUNCH_NETWORK": "host"})
    assert _can_reach_wandb("online", {})


@pytest.mark.slow
def test_rejects_new_run_arguments_together_with_a_run(tmp_path):
    run = wandb.init(dir=str(tmp_path), mode="offline", settings=quiet_settings())
    try:
        with pytest.raises(ValueError, match="project"):
            WandbLogger(run=run, project="p")
        with pytest.raises(ValueError, match="tags"):
            WandbLogger(run=run, tags=["a"])
    finally:
        run.finish()


# --- what gets logged --------------------------------------------------------------------


@pytest.mark.slow
def test_config_records_distribution_and_versions(tmp_path):
    model, dist = kit_model()
    logger = WandbLogger(
        project="kmk-tests",
        name="config",
        config={"dropout": 0.1},
        dir=tmp_path / "runs",
        mode="offline",
        settings=quiet_settings(),
    )
    fit(model, [logger], epochs=1)

    assert logger.owns_run and wandb.run is None  # started it, so finished it
    logged = read_run(tmp_path / "runs")
    assert logged.exited
    config = logged.config
    assert config["dropout"] == 0.1
    assert config["strategy"] == "MirroredStrategy"
    assert config["devices"] == list(dist.devices) and len(config["devices"]) == 2
    assert config["num_replicas"] == 2
    assert config["per_replica_batch_size"] == 4
    assert config["global_batch_size"] == 8
    assert config["base_learning_rate"] == pytest.approx(0.01)
    assert config["scaled_learning_rate"] == pytest.approx(0.02)
    assert config["rule"] == config["lr_scaling_rule"] == "linear"
    assert config["tensorflow_version"] == tf.__version__
    assert config["keras_version"] == keras.__version__
    assert config["keras_mirror_kit_version"] == kmk.__version__
    assert logger.run.config["global_batch_size"] == 8  # the in-memory run agrees


@pytest.mark.slow
def test_epoch_logs_include_values_added_by_earlier_callbacks(tmp_path):
    model, _ = kit_model()
    logger = WandbLogger(dir=tmp_path, mode="offline", settings=quiet_settings())
    history = model.fit(
        *data(), batch_size=8, epochs=2, verbose=0, callbacks=[AddsThroughput(), logger]
    )

    logged = read_run(tmp_path)
    rows = user_rows(logged.history)
    assert [row["epoch"] for row in rows] == [1, 2]
    for epoch, row in enumerate(rows):
        assert set(row) == {"epoch", "loss", "mae", "samples_per_sec", "step_time_ms"}
        assert row["loss"] == pytest.approx(history.history["loss"][epoch], rel=1e-5)
        assert row["samples_per_sec"] == pytest.approx(100.0 + epoch)
        assert row["step_time_ms"] == pytest.approx(2.5)
    for key in ("loss", "mae", "samples_per_sec"):
        assert logged.metrics[key] == "epoch"
    assert logged.summary["epoch"] == 2
    assert logged.summary["samples_per_sec"] == pytest.approx(101.0)


@pytest.mark.slow
def test_a_logger_listed_before_the_monitor_still_logs_its_figures(tmp_path):
    """Users append the kit's callbacks to lists they already have: the kit's fit runs the
    monitor first, so the W&B rows carry its figures (issue: callback order)."""
    model, _ = kit_model()
    logger = WandbLogger(dir=tmp_path, mode="offline", settings=quiet_settings())
    history = model.fit(
        *data(),
        batch_size=8,
        epochs=2,
        verbose=0,
        callbacks=[logger, kmk.ThroughputMonitor(warmup_steps=1)],
    )
    rows = user_rows(read_run(tmp_path).history)
    assert [row["epoch"] for row in rows] == [1, 2]
    for epoch, row in enumerate(rows):
        for key in (
            "samples_per_sec",
            "samples_per_sec_per_replica",
            "step_time_ms",
            "flops_per_sec",
            "flops_per_sec_per_replica",
        ):
            assert row[key] == pytest.approx(history.history[key][epoch], rel=1e-5)


@pytest.mark.slow
def test_batch_logs_every_n_steps_without_colliding_with_epoch_logs(tmp_path):
    model, _ = kit_model()
    logger = WandbLogger(
        dir=tmp_path, mode="offline", log_every_n_batches=3, settings=quiet_settings()
    )
    fit(model, [logger], epochs=2)  # 4 steps per epoch -> steps 1..8

    rows = user_rows(read_run(tmp_path).history)
    batch_rows = [row for row in rows if "batch/step" in row]
    epoch_rows = [row for row in rows if "epoch" in row]
    assert [row["batch/step"] for row in batch_rows] == [3, 6]  # counts across epochs
    assert all(set(row) == {"batch/step", "batch/loss", "batch/mae"} for row in batch_rows)
    assert [row["epoch"] for row in epoch_rows] == [1, 2]
    assert all(not any(k.startswith("batch/") for k in row) for row in epoch_rows)
    metrics = read_run(tmp_path).metrics
    assert metrics["batch/*"] == "batch/step"
    assert metrics["loss"] == "epoch"


def test_model_not_built_by_the_kit_counts_as_chief(tmp_path):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    logger = WandbLogger(dir=tmp_path, mode="offline", settings=quiet_settings())
    fit(model, [logger], epochs=1)

    logged = read_run(tmp_path)
    assert "strategy" not in logged.config
    assert logged.config["keras_version"] == keras.__version__
    assert [row["epoch"] for row in user_rows(logged.history)] == [1]


# The non-chief case runs for real, with two workers on loopback:
# tests/test_multi_worker.py::test_throughput_and_wandb_in_a_real_two_worker_run.


@pytest.mark.slow
def test_uploads_synced_checkpoints_as_model_artifacts(tmp_path):
    model, _ = kit_model()
    checkpoints = tmp_path / "ckpt"
    seen = SeesCheckpoints(checkpoints)
    logger = WandbLogger(
        dir=tmp_path / "runs",
        mode="offline",
        upload_checkpoints=True,
        checkpoint_dir=checkpoints,
        artifact_name="tiny-model",
        settings=quiet_settings(),
    )
    fit(model, [kmk.SyncedCheckpoint(checkpoints, keep=3), seen, logger], epochs=2)

    artifacts = read_run(tmp_path / "runs").artifacts
    # One per epoch; on_train_end sees no change and logs no duplicate.
    assert len(artifacts) == 2
    assert all(a.name == "tiny-model" and a.type == "model" for a in artifacts)
    for epoch, (artifact, on_disk) in enumerate(zip(artifacts, seen.seen), start=1):
        # Exactly the checkpoint files as they were at that epoch end, contents included.
        assert artifact.digests == on_disk
        assert artifact.metadata["files"] == artifact.paths
        assert artifact.metadata["epoch"] == epoch
        assert set(artifact.aliases) >= {"latest", f"epoch_{epoch}"}
        assert "manifest.json" in artifact.paths
        assert len([p for p in artifact.paths if CKPT_FILE.fullmatch(p)]) == epoch
        assert not any(p.endswith(".tmp") or p.startswith(".") for p in artifact.paths)


def rotation_child(root: str) -> None:
    """Run by test_checkpoint_rotated_away_mid_upload_... in a fresh interpreter.

    A checkpoint rotated away by a concurrent writer while the logger reads the directory
    cannot be timed from outside, so an audit hook (process-wide, hence the subprocess)
    deletes a real checkpoint file at the exact moment wandb first opens one for the last
    epoch's upload: in "while_read" the file being opened (wandb's read fails), in
    "before_add" the newest checkpoint, still to be added (it is gone when wandb checks it).
    The code under test and wandb run unchanged. Prints a RESULT line.
    """
    deleted: dict[str, str] = {}
    armed: list[tuple[str, Path]] = []

    def rotate_on_open(event: str, args: tuple[Any, ...]) -> None:
        if event != "open" or not armed or not isinstance(args[0], (str, bytes, os.PathLike)):
            return
        opened = Path(os.fsdecode(args[0]))
        mode, directory = armed[0]
        if opened.parent != directory or not CKPT_FILE.fullmatch(opened.name):
            return
        armed.clear()
        newest = max(p for p in directory.iterdir() if CKPT_FILE.fullmatch(p.name))
        victim = opened if mode == "while_read" else newest
        victim.unlink()
        deleted[mode] = victim.name

    class ArmsAtLastEpoch(keras.callbacks.Callback):
        def __init__(self, mode: str, directory: Path) -> None:
            super().__init__()
            self.mode, self.directory = mode, directory

        def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
            if epoch + 1 == self.params["epochs"]:
                armed.append((self.mode, self.directory))

    warnings: list[str] = []

    class Collects(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("keras_mirror_kit").addHandler(Collects(logging.WARNING))
    sys.addaudithook(rotate_on_open)

    result: dict[str, Any] = {}
    for mode in ("while_read", "before_add"):
        checkpoints = Path(root, mode, "ckpt")
        logger = WandbLogger(
            dir=Path(root, mode, "runs"),
            mode="offline",
            upload_checkpoints=True,
            checkpoint_dir=checkpoints,
            settings=quiet_settings(),
        )
        model, _ = kit_model()
        callbacks = [
            kmk.SyncedCheckpoint(checkpoints, keep=2),
            ArmsAtLastEpoch(mode, checkpoints),
            logger,
        ]
        warnings.clear()
        fit(model, callbacks, epochs=3)
        result[mode] = {
            "deleted": deleted.get(mode),
            "warnings": list(warnings),
            "on_disk": uploadable(checkpoints),
            "run_active": wandb.run is not None,
        }
    wandb.teardown()
    print("RESULT " + json.dumps(result))


@pytest.mark.slow
def test_checkpoint_rotated_away_mid_upload_is_left_out_of_the_artifact(tmp_path):
    data_dir = tmp_path / "wandb_data"  # this child's own staging area, to count its copies
    proc = run_python(
        f"from tests.test_integration_wandb import rotation_child\n"
        f"rotation_child({str(tmp_path)!r})\n",
        replicas=2,
        env={"WANDB_DATA_DIR": str(data_dir)},
        timeout=400,
    )
    result = last_json(proc)
    staged_expected = 0
    for mode in ("while_read", "before_add"):
        got = result[mode]
        gone = got["deleted"]
        assert gone is not None and CKPT_FILE.fullmatch(gone), got  # the hook did fire
        assert not got["run_active"]  # fit went on and ended normally
        # A clear line naming the file, and the upload done again from a new listing.
        lines = [w for w in got["warnings"] if "disappeared" in w]
        assert len(lines) == 1, got["warnings"]
        assert repr(gone) in lines[0] and "listing the directory again" in lines[0]
        logged = read_run(tmp_path / mode / "runs")
        assert logged.exit_code == 0
        artifacts = logged.artifacts
        assert len(artifacts) == 3  # one per epoch, the last one after the new listing
        last = artifacts[-1]
        assert set(last.aliases) >= {"latest", "epoch_3"}
        assert gone not in last.paths  # not claiming the file that is gone
        assert last.digests == got["on_disk"]  # exactly what is on disk, contents included
        assert last.metadata["files"] == last.paths
        staged_expected += sum(len(a.paths) for a in artifacts)
    # The copies staged for the abandoned attempt were deleted; the logged ones remain.
    staged = [p for p in (data_dir / "artifacts" / "staging").rglob("*") if p.is_file()]
    assert len(staged) == staged_expected


@pytest.mark.slow
def test_joins_an_active_run_and_leaves_it_open(tmp_path):
    run = wandb.init(
        dir=str(tmp_path), mode="offline", config={"user_key": 1}, settings=quiet_settings()
    )
    try:
        model, _ = kit_model()
        logger = WandbLogger(config={"extra": "x"})
        fit(model, [logger], epochs=1)
        assert logger.run is run and not logger.owns_run
        assert wandb.run is run  # not finished
        run.log({"after_fit": 1.0})  # still usable
    finally:
        run.finish()

    logged = read_run(tmp_path)
    assert logged.config["user_key"] == 1
    assert logged.config["extra"] == "x"
    assert logged.config["global_batch_size"] == 8
    rows = user_rows(logged.history)
    assert rows[0]["epoch"] == 1 and "loss" in rows[0]
    assert rows[-1] == {"after_fit": 1.0}


@pytest.mark.slow
def test_logs_to_a_run_passed_in_without_finishing_it(tmp_path):
    run = wandb.init(dir=str(tmp_path), mode="offline", settings=quiet_settings())
    try:
        model, _ = kit_model()
        logger = WandbLogger(run=run)
        fit(model, [logger], epochs=1)
        assert wandb.run is run
    finally:
        run.finish()
    assert [row["epoch"] for row in user_rows(read_run(tmp_path).history)] == [1]


# --- a fit() that raises -----------------------------------------------------------------


@pytest.mark.slow
def test_fit_that_raises_finishes_the_run_it_started_as_failed(tmp_path, caplog):
    model, _ = kit_model()  # the kit's fit() calls on_fit_exception
    logger = WandbLogger(
        dir=tmp_path, mode="offline", log_every_n_batches=1, settings=quiet_settings()
    )
    with caplog.at_level(logging.WARNING, logger="keras_mirror_kit"):
        with pytest.raises(TrainingFailed):
            fit(model, [logger, RaisesAtBatch(epoch=1, batch=1)], epochs=3)

    assert wandb.run is None  # finished at once, not left for the process exit
    assert logger.owns_run
    logged = read_run(tmp_path)
    assert logged.exit_code == 1  # failed
    rows = user_rows(logged.history)
    assert [row["epoch"] for row in rows if "epoch" in row] == [1]
    assert [row["batch/step"] for row in rows if "batch/step" in row] == [1, 2, 3, 4, 5, 6]
    assert any(
        "TrainingFailed" in r.getMessage() and logger.run.id in r.getMessage()
        for r in caplog.records
    )


def test_fit_of_a_model_not_built_by_the_kit_finishes_the_run_as_failed(tmp_path):
    logger = WandbLogger(dir=tmp_path, mode="offline", settings=quiet_settings())
    with pytest.raises(TrainingFailed) as raised:
        fit(plain_model(), [logger, RaisesAtBatch(epoch=0, batch=2)], epochs=2)
    assert wandb.run is None  # keras.Model.fit called the hook (fit_hooks.install)
    logger.on_fit_exception(raised.value)  # a second call, by hand, does nothing
    assert read_run(tmp_path).exit_code == 1


def drive_by_hand(logger: WandbLogger, model: keras.Model) -> None:
    """A hand-written loop that drives the logger and stops without on_train_end."""
    logger.set_model(model)
    logger.set_params({"epochs": 1, "steps": 2, "verbose": 0})
    logger.on_train_begin()
    logger.on_epoch_begin(0)
    logger.on_train_batch_end(0, {"loss": 1.0})


def test_the_hook_called_by_hand_in_a_loop_of_ones_own(tmp_path):
    logger = WandbLogger(dir=tmp_path, mode="offline", settings=quiet_settings())
    drive_by_hand(logger, plain_model())
    assert wandb.run is logger.run  # nothing has finished it yet
    err = TrainingFailed("the loop raised")
    logger.on_fit_exception(err)
    logger.on_fit_exception(err)  # a second call does nothing
    assert wandb.run is None
    assert read_run(tmp_path).exit_code == 1


def test_reused_logger_finishes_the_run_a_raising_fit_left_open(tmp_path):
    logger = WandbLogger(dir=tmp_path, mode="offline", settings=quiet_settings())
    model = plain_model()
    with pytest.raises(TrainingFailed):
        fit(model, [logger, RaisesAtBatch(epoch=1, batch=0)], epochs=2)
    failed_id = logger.run.id
    fit(model, [logger], epochs=1)  # the same logger, say in the next notebook cell

    assert logger.run.id != failed_id and logger.owns_run
    assert wandb.run is None
    runs = {run.id: run for run in map(read_run_file, run_files(tmp_path))}
    assert set(runs) == {failed_id, logger.run.id}
    assert runs[failed_id].exit_code == 1
    assert [row["epoch"] for row in user_rows(runs[failed_id].history)] == [1]
    assert runs[logger.run.id].exit_code == 0
    assert [row["epoch"] for row in user_rows(runs[logger.run.id].history)] == [1]


class FitsInside(keras.callbacks.Callback):
    """At the first epoch end, fits another model with another WandbLogger (nested fit)."""

    def __init__(self, inner_logger: WandbLogger) -> None:
        super().__init__()
        self.inner_logger = inner_logger

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if epoch == 0:
            fit(plain_model(), [self.inner_logger], epochs=1)


@pytest.mark.slow
def test_new_logger_does_not_join_a_run_a_thread_left_open(tmp_path):
    failed = WandbLogger(dir=tmp_path / "a", mode="offline", settings=quiet_settings())
    thread = threading.Thread(target=drive_by_hand, args=(failed, plain_model()))
    thread.start()
    thread.join()
    assert wandb.run is failed.run  # the thread's loop ended without on_train_end

    # A new logger in a new fit() finishes it instead of joining it; a logger of a fit()
    # nested in that one joins the enclosing fit()'s run, which is still going on.
    outer = WandbLogger(dir=tmp_path / "b", mode="offline", settings=quiet_settings())
    inner = WandbLogger()
    fit(plain_model(), [outer, FitsInside(inner)], epochs=2)

    assert outer.owns_run and outer.run is not failed.run
    assert inner.run is outer.run and not inner.owns_run
    assert wandb.run is None
    assert read_run(tmp_path / "a").exit_code == 1
    logged = read_run(tmp_path / "b")
    assert logged.exit_code == 0
    assert [row["epoch"] for row in user_rows(logged.history)] == [1, 1, 2]  # inner, outer


def exits_after_a_loop_left_a_run_open_child(root: str) -> None:
    """Run by the test below in a fresh interpreter: a hand-driven loop stops, Python exits."""
    logger = WandbLogger(dir=root, mode="offline", settings=quiet_settings())
    drive_by_hand(logger, plain_model())
    print("RESULT " + json.dumps({"open_at_exit": wandb.run is logger.run}))


@pytest.mark.slow
def test_run_left_open_by_a_loop_is_marked_failed_at_exit(tmp_path):
    proc = run_python(
        "from tests.test_integration_wandb import exits_after_a_loop_left_a_run_open_child\n"
        f"exits_after_a_loop_left_a_run_open_child({str(tmp_path)!r})\n",
        timeout=300,
    )
    assert last_json(proc) == {"open_at_exit": True}
    # Not W&B's own exit handling (exit code 0: "finished"), since the script exited normally.
    assert read_run(tmp_path).exit_code == 1
    assert "finishing W&B run" in proc.stderr


def _wandb_children() -> list[str]:
    found = []
    for proc in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            cmdline = " ".join(proc.cmdline()) or proc.name()
        except psutil.Error:  # exited meanwhile
            continue
        if "wandb" in cmdline:
            found.append(cmdline)
    return found


def test_teardown_leaves_no_wandb_service_process(tmp_path):
    run = wandb.init(dir=str(tmp_path), mode="offline", settings=quiet_settings())
    assert _wandb_children(), "expected wandb's service process while a run is active"
    run.finish()
    wandb.teardown()
    deadline = time.monotonic() + 30
    while _wandb_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _wandb_children() == []
