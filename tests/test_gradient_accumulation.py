"""Gradient accumulation: `distributed(gradient_accumulation_steps=N)` on 2 replicas.

The accumulating run (per-replica batch 16, N = 4) must follow the large-batch run
(per-replica batch 64, N = 1) on the same data order; the batch and learning-rate
arithmetic, warmup, throughput and checkpoints must count optimizer updates. The crash and
the SIGKILL trials resume to the weights of one uninterrupted run of the same job, made once
here (`uninterrupted`).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mirror_kit as kmk
from keras_mirror_kit.callbacks.synced_checkpoint import SyncedCheckpoint
from keras_mirror_kit.callbacks.throughput_monitor import ThroughputMonitor
from keras_mirror_kit.checkpoint.divergence import check_replicas
from keras_mirror_kit.checkpoint.state import state_variables
from keras_mirror_kit.schedules import WarmupSchedule
from keras_mirror_kit.workarounds import keras_grad_accumulation
from tests import forkserver
from tests.ckpt_helpers import StopAt, dataset, max_diff
from tests.subproc import REPO

UPDATES = 20
X = np.random.default_rng(0).normal(size=(UPDATES * 128, 6)).astype("float32")
Y = (X[:, :2].sum(axis=1, keepdims=True) + 0.1 * X[:, 2:3]).astype("float32")


def build(per_replica, accumulate, optimizer, warmup=False, **knobs):
    @kmk.distributed(per_replica, gradient_accumulation_steps=accumulate, **knobs)
    def factory():
        keras.utils.set_random_seed(7)
        model = keras.Sequential(
            [keras.Input((6,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)]
        )
        lr = kmk.current().scale_learning_rate(0.01, base_batch_size=128)
        if warmup:  # 10 updates; created in the factory, so it takes N from it
            lr = WarmupSchedule(lr, warmup_steps=10, start_learning_rate=0.0)
        opt = keras.optimizers.SGD(lr) if optimizer == "sgd" else keras.optimizers.Adam(lr)
        model.compile(optimizer=opt, loss="mse")
        return model

    return factory()


def fit(model):
    batch = kmk.distribution_of(model).global_batch_size
    ds = tf.data.Dataset.from_tensor_slices((X, Y)).batch(batch)  # same order in both runs
    model.fit(ds, epochs=1, verbose=0)
    return model


def train(per_replica, accumulate, optimizer, **kwargs):
    return fit(build(per_replica, accumulate, optimizer, **kwargs))


@pytest.mark.slow
@pytest.mark.parametrize(("optimizer", "tolerance"), [("sgd", 1e-5), ("adam", 2e-4)])
def test_accumulating_16x4_follows_the_large_batch_64x1(optimizer, tolerance):
    large = build(64, 1, optimizer, warmup=optimizer == "sgd")
    initial = large.get_weights()
    fit(large)
    small = train(16, 4, optimizer, warmup=optimizer == "sgd")
    assert int(large.optimizer.iterations.numpy()) == UPDATES
    assert int(small.optimizer.iterations.numpy()) == UPDATES  # updates, not micro-batches
    assert int(small.optimizer._iterations.numpy()) == 4 * UPDATES
    moved = max_diff(large.get_weights(), initial)
    assert moved > 100 * tolerance  # the runs really trained
    assert max_diff(small.get_weights(), large.get_weights()) <= tolerance


@pytest.mark.slow
def test_steps_per_execution_with_accumulation_follows_the_large_batch():
    large = train(64, 1, "sgd", steps_per_execution=3)
    small = train(16, 4, "sgd", steps_per_execution=3)  # updates straddle executions
    assert max_diff(small.get_weights(), large.get_weights()) <= 1e-5


@pytest.mark.slow
def test_float16_loss_scaling_with_accumulation_follows_the_large_batch():
    large = train(64, 1, "sgd", mixed_precision="mixed_float16")
    small = train(16, 4, "sgd", mixed_precision="mixed_float16")
    inner = keras_grad_accumulation.accumulating_optimizer(small.optimizer)
    assert isinstance(small.optimizer, keras.optimizers.LossScaleOptimizer)
    assert inner.gradient_accumulation_steps == 4 and keras_grad_accumulation.is_fixed(inner)
    assert int(small.optimizer.iterations.numpy()) == UPDATES
    assert max_diff(small.get_weights(), large.get_weights()) <= 1e-4  # float16 forward


def test_plain_keras_accumulation_still_fails_under_mirrored_strategy():
    """keras-team/keras#20582 with plain Keras (no kit). If this fails, Keras fixed it:
    limit keras_mirror_kit.workarounds.keras_grad_accumulation to the affected versions."""
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), "mse")
    with pytest.raises(RuntimeError, match="merge_call"):
        model.fit(X[:64], Y[:64], batch_size=16, verbose=0)


@pytest.mark.slow
def test_keras_passes_micro_batches_to_a_schedule_and_warmup_counts_updates():
    """What Keras gives a schedule under accumulation (read, not guessed): the micro-batch
    count `_iterations`, not `iterations`; `WarmupSchedule` divides it by N."""
    decay = keras.optimizers.schedules.PolynomialDecay(1.0, decay_steps=100, end_learning_rate=0)
    for schedule in (decay, WarmupSchedule(1.0, warmup_steps=100, gradient_accumulation_steps=4)):

        @kmk.distributed(8, gradient_accumulation_steps=4)
        def factory(schedule=schedule):
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
            model.compile(keras.optimizers.SGD(schedule), "mse")
            return model

        model = factory()
        model.fit(X[: 16 * 8], Y[: 16 * 8], verbose=0)  # 8 micro-batches = 2 updates
        optimizer = model.optimizer
        assert (int(optimizer._iterations.numpy()), int(optimizer.iterations.numpy())) == (8, 2)
        used = float(optimizer.learning_rate.numpy())
        if schedule is decay:
            assert used == pytest.approx(1.0 - 8 / 100)  # Keras: micro-batches
        else:
            assert used == pytest.approx(2 / 100)  # the kit's warmup: updates


def test_warmup_schedule_takes_n_from_the_factory_and_is_checked():
    with kmk.distributed(8, gradient_accumulation_steps=4):
        inside = WarmupSchedule(0.1, warmup_steps=10)
    assert inside.gradient_accumulation_steps == 4
    assert WarmupSchedule(0.1, warmup_steps=10).gradient_accumulation_steps == 1
    clone = WarmupSchedule.from_config(inside.get_config())
    assert clone.gradient_accumulation_steps == 4
    assert float(clone(7)) == pytest.approx(float(WarmupSchedule(0.1, 10)(1)))
    outside = WarmupSchedule(0.1, warmup_steps=10)  # made for N = 1

    @kmk.distributed(8, gradient_accumulation_steps=4)
    def factory():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(outside), "mse")
        return model

    with pytest.raises(ValueError, match="counts updates of 1 micro-batch"):
        factory()


def test_an_optimizer_given_another_value_is_refused():
    def factory_for(knob, given):
        @kmk.distributed(8, gradient_accumulation_steps=knob)
        def factory():
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
            model.compile(keras.optimizers.SGD(0.1, gradient_accumulation_steps=given), "mse")
            return model

        return factory

    with pytest.raises(ValueError, match=r"created with gradient_accumulation_steps=2.*=4\)"):
        factory_for(4, 2)()
    with pytest.raises(ValueError, match="Pass it to distributed"):
        factory_for(1, 4)()  # the default: the kit's batch arithmetic would not know
    assert factory_for(4, 4)().optimizer.gradient_accumulation_steps == 4  # agreeing
    with pytest.raises(ValueError, match="gradient_accumulation_steps=0"):
        kmk.distributed(8, gradient_accumulation_steps=0)
    with pytest.raises(TypeError, match="gradient_accumulation_steps"):
        kmk.distributed(8, gradient_accumulation_steps=2.0)


def test_distribution_reports_the_effective_batch_and_scales_by_it():
    with kmk.distributed(16, gradient_accumulation_steps=4) as dist:
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.1), "mse")  # the with form sets it too
    assert model.optimizer.gradient_accumulation_steps == 4
    assert (dist.global_batch_size, dist.effective_batch_size) == (32, 128)
    assert "effective batch 128 = 32 x 4 accumulation steps" in dist.describe()
    assert dist.as_config()["effective_batch_size"] == 128
    assert "effective_batch_size=128" in repr(dist)
    assert dist.scale_learning_rate(0.1, base_batch_size=32) == pytest.approx(0.4)
    assert dist.scale_learning_rate(0.1, 32, rule="sqrt") == pytest.approx(0.2)
    plain = kmk.distributed(16).distribution
    assert plain.effective_batch_size == plain.global_batch_size == 32
    assert "effective" not in plain.describe()


def test_info_shows_the_effective_batch():
    from keras_mirror_kit.cli import info

    shown = info.collect(per_replica_batch_size=16, gradient_accumulation_steps=4)
    chosen = shown["would_choose"]
    assert (chosen["global_batch_size"], chosen["effective_batch_size"]) == (32, 128)


@pytest.mark.slow
def test_throughput_counts_micro_batches_and_reports_updates():
    model = build(16, 4, "sgd")
    monitor = ThroughputMonitor(warmup_steps=4)
    ds = tf.data.Dataset.from_tensor_slices((X[: 32 * 24], Y[: 32 * 24])).batch(32)
    model.fit(ds, epochs=1, verbose=0, callbacks=[monitor])
    last = monitor.last
    assert monitor.summary()["measured_steps"] == 20  # micro-batches
    assert last["samples_per_sec"] == pytest.approx(32 * last["steps_per_sec"])
    assert last["updates_per_sec"] == pytest.approx(last["steps_per_sec"] / 4)
    plain = build(16, 1, "sgd")
    plain.fit(ds, epochs=1, verbose=0, callbacks=[monitor])
    assert "updates_per_sec" not in monitor.last


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[np.ndarray]:
    """The weights of the checkpointed job run to its end (3 epochs of 6 micro-batches, N = 4,
    a save every 3): `python -m tests.ckpt_child DIR OUT --epochs 3 --save-freq 3
    --accumulate 4` without a kill, on this process's 2 replicas."""
    from tests.accum_helpers import SAVE_FREQ, build_accumulating

    reference = build_accumulating("adam", ACCUMULATE)
    ds = dataset()  # the same data order: a checkpoint callback drives the dataset's epochs
    directory = tmp_path_factory.mktemp("uninterrupted")
    checkpoint = SyncedCheckpoint(directory, save_freq=SAVE_FREQ, dataset=ds)
    reference.fit(ds, epochs=3, verbose=0, callbacks=[checkpoint])
    assert int(reference.optimizer._iterations.numpy()) == STEPS
    return reference.get_weights()


class MidAccumulation(keras.callbacks.Callback):
    """After step 3 (epoch 0, batch 2: 3 of 4 micro-batches, no update yet), reads what a
    save would: the state variables' paths, the replicas' copies (`check_replicas` raises
    ReplicaDivergenceError where they differ) and the largest accumulated gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.epoch = 0
        self.seen: dict | None = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) != (0, 2):
            return
        named = state_variables(self.model)
        check_replicas(self.model, named, atol=0.0)
        optimizer = self.model.optimizer
        self.seen = {
            "paths": [v.path for _, v in named],
            "iterations_path": optimizer._iterations.path,
            "micro_steps": int(optimizer._iterations.numpy()),
            "accumulated": [np.abs(v.numpy()).max() for v in optimizer._accumulated_gradients],
        }


@pytest.mark.slow
def test_a_partial_accumulation_is_saved_alike_on_every_replica_and_resumed(
    tmp_path, uninterrupted
):
    """A crash between two updates: the accumulators (equal on both replicas) and the
    micro-batch counter are in the checkpoint; the resume ends on the uninterrupted run.
    The crashed run's state is read after its 3rd step (`MidAccumulation`), mid-update."""
    from tests.accum_helpers import SAVE_FREQ, build_accumulating

    crashed = build_accumulating("adam", 4)
    ds = dataset()
    checkpoint = SyncedCheckpoint(tmp_path / "ckpt", save_freq=SAVE_FREQ, dataset=ds)
    probe = MidAccumulation()
    with pytest.raises(KeyboardInterrupt):  # after step 8 (epoch 1, batch 1): saved at 6
        crashed.fit(ds, epochs=3, verbose=0, callbacks=[checkpoint, probe, StopAt(1, 1)])
    seen = probe.seen
    assert seen is not None and seen["micro_steps"] == 3  # 3 of 4 micro-batches
    assert any("gradient_accumulator" in p for p in seen["paths"])
    assert seen["iterations_path"] in seen["paths"]
    assert max(seen["accumulated"]) > 0  # mid-accumulation: something to lose

    resumed = build_accumulating("adam", 4, seed=99)
    ds = dataset()
    checkpoint = SyncedCheckpoint(tmp_path / "ckpt", save_freq=SAVE_FREQ, dataset=ds)
    resumed.fit(ds, epochs=3, verbose=0, callbacks=[checkpoint])
    assert checkpoint.last_restored.meta["global_step"] == 1  # 6 micro-batches: mid-update
    assert int(resumed.optimizer._iterations.numpy()) == 18
    assert max_diff(resumed.get_weights(), uninterrupted) <= 1e-6


# -- SIGKILL between two updates (N = 4), seeded trials -------------------------------------

SEED, SUITE_TRIALS, ALL_TRIALS, ACCUMULATE, STEPS = 20261201, 3, 10, 4, 18
# Steps after which a kill lands between two updates (not a multiple of N), with a save
# (every 3 steps) between updates as the newest checkpoint, or none yet (steps 1, 2).
KILL_STEPS = [1, 2, 3, 5, 6, 7, 9, 10, 11, 14, 15, 17]


def _env():
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "KMK_SIMULATE_REPLICAS": "2",
    }


def _child(directory, out, *extra):
    command = [
        sys.executable, "-m", "tests.ckpt_child", str(directory), str(out), "--epochs", "3",
        "--save-freq", "3", "--accumulate", str(ACCUMULATE), *map(str, extra),
    ]  # fmt: skip
    return forkserver.popen(
        command, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _weights(path):
    with np.load(path) as npz:
        return [npz[k] for k in sorted(npz.files, key=lambda k: int(k.split("_")[1]))]


def kill_trials(root, trials: int, seed: int = SEED, expected=None) -> list[dict]:
    """Runs the uninterrupted job (unless its final weights are given as `expected`), then
    `trials` jobs each killed (SIGKILL) right after a seeded step between two updates,
    resumes them all in one process and compares."""
    steps = random.Random(seed).sample(KILL_STEPS, trials)
    if expected is None:
        reference = _child(root / "ref" / "ckpt", root / "ref.npz")
        _, err = reference.communicate(timeout=300)
        assert reference.returncode == 0, err[-3000:]
        expected = _weights(root / "ref.npz")
    directories = []
    for trial, step in enumerate(steps):
        directory, marker = root / f"t{trial}" / "ckpt", root / f"t{trial}" / "marker"
        directory.parent.mkdir(parents=True)
        proc = _child(directory, root / f"t{trial}.npz", "--step-marker", step,
                      "--block-at-marker", "--marker", marker)  # fmt: skip
        try:
            deadline = time.monotonic() + 240  # a bound for a stuck child, not a kill time
            while not marker.exists():
                assert proc.poll() is None, proc.communicate()[1][-3000:]
                assert time.monotonic() < deadline, f"trial {trial} never reached step {step}"
                time.sleep(0.02)
        finally:
            proc.kill()  # SIGKILL
            proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL
        directories.append(str(directory))
    out = root / "results.json"
    done = forkserver.run(
        [sys.executable, "-m", "tests.accum_helpers", str(out), str(ACCUMULATE), *directories],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    rows = []
    for step, directory in zip(steps, directories):
        result = results[directory]
        restored = result["restored"]
        saved_step = None if restored is None else restored[0] * 6 + restored[1]
        rows.append(
            {
                "killed_after_step": step,
                "restored_step": saved_step,
                "micro_steps": result["micro_steps"],
                "batches": result["batches"],
                "max_abs_diff": max_diff(expected, _weights(result["weights"])),
            }
        )
    return rows


@pytest.mark.slow
def test_sigkill_between_two_updates_resumes_to_the_uninterrupted_weights(tmp_path, uninterrupted):
    """3 seeded trials here; `benchmarks/accumulation_kill_trials.py` runs all 10."""
    rows = kill_trials(tmp_path, SUITE_TRIALS, expected=uninterrupted)
    assert any(r["restored_step"] is not None and r["restored_step"] % ACCUMULATE for r in rows)
    for row in rows:
        killed = row["killed_after_step"]
        saves = range(3, STEPS, 3)
        # A save at the killed step itself (an epoch's end: written after the step's
        # callbacks) may or may not exist when the kill lands.
        newest = {max((s for s in saves if s < killed), default=None),
                  max((s for s in saves if s <= killed), default=None)}  # fmt: skip
        assert row["restored_step"] in newest, row
        assert row["micro_steps"] == STEPS, row
        assert row["batches"] == STEPS - (row["restored_step"] or 0), row
        assert row["max_abs_diff"] <= 1e-6, row
