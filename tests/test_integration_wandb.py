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
import os
import struct
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
from keras_mirror_kit.distribution import Distribution
from tests.subproc import REPO, last_json, run_python

wandb = pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2  # noqa: E402

from keras_mirror_kit.integrations.wandb import WandbLogger  # noqa: E402

SAMPLES = 32


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


def read_run(root: Path) -> SimpleNamespace:
    """Config, history rows, summary, metric definitions and artifacts of the one run."""
    files = sorted(root.glob("wandb/*run-*/run-*.wandb"))
    assert len(files) == 1, files
    run = SimpleNamespace(
        config={}, history=[], summary={}, metrics={}, artifacts=[], exited=False
    )
    for record in _finished_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "run":
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
                    metadata=json.loads(record.artifact.metadata or "{}"),
                )
            )
        elif kind == "exit":
            run.exited = True
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


class WritesCheckpoints(keras.callbacks.Callback):
    """Stands in for SyncedCheckpoint: weights, a manifest, and files to skip."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = directory

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.directory.mkdir(exist_ok=True)
        self.model.save_weights(str(self.directory / f"ckpt-{epoch + 1}.weights.h5"))
        (self.directory / "manifest.json").write_text(json.dumps({"latest": epoch + 1}))
        (self.directory / "ckpt-next.weights.h5.tmp").write_text("partial")
        (self.directory / ".lock").write_text("")


# --- import guard ------------------------------------------------------------------------


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


def test_uploads_checkpoints_as_model_artifacts(tmp_path):
    model, _ = kit_model()
    checkpoints = tmp_path / "ckpt"
    logger = WandbLogger(
        dir=tmp_path / "runs",
        mode="offline",
        upload_checkpoints=True,
        checkpoint_dir=checkpoints,
        artifact_name="tiny-model",
        settings=quiet_settings(),
    )
    fit(model, [WritesCheckpoints(checkpoints), logger], epochs=2)

    artifacts = read_run(tmp_path / "runs").artifacts
    # One per epoch; on_train_end sees no change and logs no duplicate.
    assert len(artifacts) == 2
    assert all(a.name == "tiny-model" and a.type == "model" for a in artifacts)
    assert artifacts[0].paths == ["ckpt-1.weights.h5", "manifest.json"]
    assert artifacts[1].paths == ["ckpt-1.weights.h5", "ckpt-2.weights.h5", "manifest.json"]
    assert set(artifacts[1].aliases) >= {"latest", "epoch_2"}
    assert artifacts[1].metadata["epoch"] == 2


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
