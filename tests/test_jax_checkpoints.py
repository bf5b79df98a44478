"""SyncedCheckpoint on Keras' JAX backend (2 simulated CPU devices), and across backends.

Every JAX case runs in one child (`tests/jax_ckpt_child.py`, forked from the tests' JAX
zygote as a new interpreter would run it, ending with a real
SIGTERM and `Preempted`'s exit status 75); the TensorFlow side of the cross-backend cases
runs here, in this test process (2 logical CPU replicas). The seeded SIGKILL trials reuse
`tests/test_checkpoint_crash.py`'s harness with `KERAS_BACKEND=jax` children: 2 with
synchronous saves and 1 with `async_save=True` here (`KMK_JAX_SIGKILL_TRIALS=10`, or
`benchmarks/checkpoint_sigkill_trials.py --backend jax`, runs 10 of each).
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import shutil
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

import keras_mirror_kit as kmk
from keras_mirror_kit.checkpoint.state import state_variables
from keras_mirror_kit.checkpoint.store import CheckpointStore
from tests import forkserver
from tests import test_checkpoint_crash as crash
from tests.ckpt_helpers import build, dataset, max_diff
from tests.subproc import REPO

pytestmark = [
    pytest.mark.slow,  # a JAX child (or a module fixture running one) per module
    pytest.mark.skipif(
        importlib.util.find_spec("jax") is None,
        reason="jax is not installed (keras-mirror-kit[dev])",
    ),
]

WIDE_STEP = 2**40  # an optimizer step count past int32, JAX's default integer


def weights(path: str) -> list[np.ndarray]:
    return crash.weights(path)


@pytest.fixture(scope="module")
def tf_written(tmp_path_factory) -> dict[str, Path]:
    """Checkpoints written here on TensorFlow: one epoch of a model with random layers; and
    one more epoch of the same model (no second trace), run past 2**40 optimizer steps."""
    root = tmp_path_factory.mktemp("tf-written")

    class Wide(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.model.optimizer.iterations.assign(WIDE_STEP)

    model = build("adam", random_layers=True)
    for name, extra in (("tf", []), ("tf-wide", [Wide()])):
        ds = dataset()
        checkpoint = kmk.SyncedCheckpoint(root / name, dataset=ds)
        model.fit(ds, epochs=1, verbose=0, callbacks=[checkpoint, *extra])
    return {"tf": root / "tf", "tf-wide": root / "tf-wide"}


@pytest.fixture(scope="module")
def jax_run(tmp_path_factory, tf_written) -> dict:
    root = tmp_path_factory.mktemp("jax-checkpoints")
    env = {k: v for k, v in os.environ.items() if k not in ("KMK_SIMULATE_REPLICAS", "XLA_FLAGS")}
    env.update(PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="jax")
    env.update(WANDB_MODE="offline", WANDB_SILENT="true")
    for var, sub in (("DATA", "data"), ("CACHE", "cache"), ("CONFIG", "config")):
        env[f"WANDB_{var}_DIR"] = str(root / "wandb-home" / sub)
    env["WANDB_ARTIFACT_DIR"] = str(root / "wandb-home" / "artifacts")
    proc = forkserver.run(
        [sys.executable, "-m", "tests.jax_ckpt_child", str(root), str(tf_written["tf"]),
         str(tf_written["tf-wide"])],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    # The last case is a SIGTERM: the child ends with Preempted's status.
    assert proc.returncode == kmk.PREEMPTED_EXIT_CODE, proc.stderr[-6000:]
    result = json.loads((root / "result.json").read_text())
    assert result["backend"] == "jax" and result["devices"] == 2
    return result


def reference(jax_run) -> list[np.ndarray]:
    return weights(jax_run["reference"]["weights"])


def test_saves_resume_exactly_mid_epoch_synchronous_and_async(jax_run):
    ref = reference(jax_run)
    run = jax_run["async"]
    assert run["backend"] == "jax"  # recorded in the metadata
    # The background writes hold exactly the synchronous saves' arrays, at the same steps.
    assert run["steps"] == run["sync_steps"] and run["same_arrays"]
    assert max_diff(weights(run["weights"]), ref) == 0.0
    assert jax_run["reference"]["saves"] == [4, 6, 8, 12, 16, 18]
    for mode, resumed in jax_run["resumed"].items():
        assert resumed["crashed"], mode
        assert resumed["restored"] == [1, 2] and resumed["iterations"] == 18, mode
        assert max_diff(weights(resumed["weights"]), ref) <= 1e-6, mode
        # ...whose epoch, resumed part-way, logs the uninterrupted run's loss: the loss
        # tracker's sums were saved and put back as it began.
        assert resumed["loss"] == pytest.approx(jax_run["reference"]["loss"][1], rel=1e-6), mode


def test_the_replica_check_compares_each_devices_copy(jax_run):
    found = jax_run["replicas"]
    assert found["copies"] == 2 and found["clean"] == 0.0
    kind, message = found["bumped"]
    assert kind == "ReplicaDivergenceError"
    assert "1 mirrored variable(s) differ" in message and "dense" in message
    assert "kernel (max |diff| 0.5)" in message
    assert found["bumped_within_atol"] == 0.0
    kind, message = found["nan"]
    assert kind == "ReplicaDivergenceError" and "NaN or Inf on replica [1]" in message
    # Unsynchronised BatchNormalization statistics would be reported, not raised; under
    # SPMD they never differ (tests/test_jax_backend.py): here a copy was changed by hand.
    assert found["batch_norm_gap"] == pytest.approx(0.25)
    assert found["big_slices"] >= 3  # compared a slice at a time; the last one differs
    kind, message = found["big"]
    assert kind == "ReplicaDivergenceError" and "big (max |diff| 0.5)" in message
    kind, message = found["in_fit"]
    assert kind == "ReplicaDivergenceError"
    assert found["in_fit_saved"] == [3]  # changed at step 6: its epoch-end save refused


def test_a_non_finite_state_is_refused_unless_allowed(jax_run):
    refused, allowed = jax_run["non_finite"]["False"], jax_run["non_finite"]["True"]
    kind, message = refused["error"]
    assert kind == "CheckpointError" and "holds NaN or Inf" in message
    assert refused["saved"] == [[2, True], [4, True]]
    assert allowed["error"] is None and allowed["saved"][-1] == [6, False]


def test_keep_best_restore_and_export_of_a_jax_checkpoint(jax_run):
    best = jax_run["keep_best"]
    losses = best["val_loss"]
    epoch = int(np.argmax(losses)) + 1  # mode="max"
    assert best["best_epoch"] == epoch and best["best_score"] == pytest.approx(max(losses))
    assert best["newest_epoch"] == 5 and epoch < 3  # kept for its score alone
    assert [e for e, _ in best["kept"]] == [epoch, 3, 4, 5]
    assert best["restored_equal"] and best["iterations"] == 6 * epoch
    done = jax_run["restore_export"]
    assert done["plain_vs_reference"] == 0.0  # into a model the kit did not build
    assert done["cli_code"] == 0 and done["exported_vs_reference"] == 0.0
    # The exported .keras file loads with plain Keras on TensorFlow too.
    loaded = keras.saving.load_model(done["exported"])
    prediction = loaded.predict(np.asarray(done["sample"], "float32"), verbose=0)
    assert np.allclose(prediction, done["prediction"], atol=1e-5, rtol=0)


def test_the_wandb_logger_on_jax(jax_run):
    from tests.test_integration_wandb import CKPT_FILE, read_run

    logged = read_run(Path(jax_run["wandb"]["runs"]))
    assert logged.exited and logged.exit_code == 0
    config = logged.config
    assert config["keras_backend"] == "jax" and config["jax_version"]
    assert config["strategy"] == "DataParallel" and config["num_replicas"] == 2
    assert config["global_batch_size"] == 16 and "tensorflow_version" not in config
    epochs = [row for row in logged.history if "loss" in row and "epoch" in row]
    assert len(epochs) == 2 and all(row["samples_per_sec"] > 0 for row in epochs)
    assert len(logged.artifacts) == 2  # the checkpoints, at each epoch end
    for number, artifact in enumerate(logged.artifacts, start=1):
        assert len([p for p in artifact.paths if CKPT_FILE.fullmatch(p)]) == number


def test_gradient_accumulation_and_mixed_precision_resume_between_updates(jax_run):
    run = jax_run["accumulate"]
    assert run["crashed"] and [1, 3] in run["saved"]
    assert run["restored"] == [1, 3]  # 9 micro-steps: an update's gradients half summed
    assert any("accumulat" in path for path in run["variables"])
    assert run["iterations"] == 9  # 18 micro-steps, one update every 2
    ref = weights(run["reference"])
    assert max_diff(weights(run["weights"]), ref) <= 1e-6


def test_a_tensorflow_checkpoint_restores_exactly_on_jax(jax_run):
    cross = jax_run["cross"]
    assert cross["written_on"] == "tensorflow"
    assert all(equal for *_, equal in cross["compared"]), cross["compared"]
    converted = {
        path: (saved, here) for path, saved, here, _ in cross["compared"] if saved != here
    }
    steps = [v for p, v in converted.items() if p.endswith("/iteration")]
    assert steps == [("int64", "int32")]
    seeds = [v for p, v in converted.items() if p.endswith("/seed_generator_state")]
    assert seeds == [("int64", "uint32")] * 2  # Dropout's, GaussianNoise's
    assert len(converted) == 3
    # SyncedCheckpoint resumes it there: epoch 1 of 2 trained on JAX.
    assert cross["resumed_epoch"] == 1 and cross["resumed_iterations"] == 12
    kind, message = cross["wide"]
    assert kind == "CheckpointError" and "written on the tensorflow backend" in message
    assert re.search(
        r"optimizer:adam[_0-9]*/iteration \(int64 in the checkpoint, int32 here\)", message
    )
    assert "JAX_ENABLE_X64=1" in message and "Nothing was restored" in message
    assert cross["wide_untouched"]


def test_a_jax_checkpoint_restores_exactly_on_tensorflow(jax_run, tmp_path, caplog):
    directory = Path(jax_run["cross"]["jax_dir"])
    model = build("adam", random_layers=True, seed=321)
    with caplog.at_level("INFO", logger="keras_mirror_kit"):
        loaded = kmk.restore(model, directory, optimizer=True)
    assert loaded.meta.backend == "jax"
    assert any(
        "written on the jax backend, on the tensorflow backend" in r.message
        for r in caplog.records
    )
    for i, (group, variable) in enumerate(state_variables(model)):
        if group == "metrics":  # a fit's sums: restore() puts back weights and optimizer
            continue
        saved, here = loaded.arrays[f"{group}/{i:05d}"], np.asarray(variable)
        assert saved.shape == here.shape and np.array_equal(
            saved.astype(np.float64), here.astype(np.float64)
        ), variable.path
    assert int(model.optimizer.iterations.numpy()) == 6
    shutil.copytree(directory, tmp_path / "copy")
    model, ds = build("adam", random_layers=True, seed=322), dataset()
    checkpoint = kmk.SyncedCheckpoint(tmp_path / "copy", dataset=ds)
    model.fit(ds, epochs=2, verbose=0, callbacks=[checkpoint])
    assert checkpoint.last_restored.meta.epoch == 1
    assert int(model.optimizer.iterations.numpy()) == 12
    assert CheckpointStore(tmp_path / "copy").load_latest().meta.backend == "tensorflow"


def test_sigterm_saves_the_step_reached_and_exits_75(jax_run):
    stopped = jax_run["preempted"]
    assert stopped["signal"] == "SIGTERM" and stopped["code"] == kmk.PREEMPTED_EXIT_CODE
    assert stopped["where"] == stopped["saved"] == [1, 3, 9]  # the step after the signal
    assert stopped["handler_back"]
    assert max_diff(weights(stopped["weights"]), reference(jax_run)) <= 1e-6


def _trials() -> tuple[int, int]:
    """(synchronous, asynchronous) seeded kills: 2 and 1, or KMK_JAX_SIGKILL_TRIALS of each."""
    raw = os.environ.get("KMK_JAX_SIGKILL_TRIALS")
    return (int(raw), int(raw)) if raw else (2, 1)


def test_seeded_sigkills_resume_to_the_uninterrupted_weights(tmp_path, jax_run):
    """Kill -9 at seeded points in training progress (a file write and its stage, a step, a
    moment while training runs on), with synchronous and background saves; every trial
    resumes from the newest good checkpoint before the kill and ends as the reference."""
    reference_run = {**jax_run["reference"], "weights": reference(jax_run)}
    sync_trials, async_trials = _trials()
    plan = crash._plan(random.Random(crash.SEED + 2), reference_run, sync_trials)
    kinds = [("run-on", "write", "step")[t % 3] for t in range(async_trials)]
    plan += crash._plan(
        random.Random(crash.SEED + 3), reference_run, async_trials, async_save=True, kinds=kinds
    )
    modes = [False] * sync_trials + [True] * async_trials
    crash._kill_and_resume_all(tmp_path, reference_run, plan, async_save=modes, backend="jax")
