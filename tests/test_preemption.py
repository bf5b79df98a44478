"""Saving on a stop signal: `SyncedCheckpoint(preemption_signals=...)` and `Preempted`.

In this process (signals other than SIGTERM, raised by a callback at a known step): the
step reached is saved, `fit` ends with `Preempted` (status 75), a second signal during the
save changes nothing, the previous handlers come back after `fit` (also after a `fit` that
raised), and outside the main thread training goes on with a warning.

In subprocesses, SIGTERM at seeded moments (follows the jobs' progress markers, never the
clock): one process, and one worker of two under `launch` (the other one saves at the same
step). Each run exits with status 75 and its newest checkpoint is the step it reached;
each next run resumes from there; the last run ends with the uninterrupted weights (1e-6).
The 2-worker chain then goes on under `launch --max-restarts 3`, a seeded worker SIGKILLed
at seeded moments in 3 attempts (every worker restarts, from the last checkpoint), and its
4th attempt is that last run. The suite chains 3 trials of each kind;
benchmarks/preemption_trials.py runs 10 separate ones.
"""

from __future__ import annotations

import ctypes
import json
import logging
import random
import signal
import threading

import keras
import numpy as np
import pytest

from keras_mirror_kit.callbacks.synced_checkpoint import SyncedCheckpoint
from keras_mirror_kit.checkpoint import preemption as preemption_module
from keras_mirror_kit.checkpoint.preemption import (
    PREEMPTED_EXIT_CODE,
    Preempted,
)
from keras_mirror_kit.checkpoint.store import CheckpointStore
from tests import preemption_runs as runs
from tests.ckpt_helpers import build, dataset, max_diff
from tests.processes import assert_none_left

SEED = 20261130
TOLERANCE = 1e-6


class RaiseSignal(keras.callbacks.Callback):
    """Raises `sig` in this process at the end of the `at`-th step of the fit (from 1)."""

    def __init__(self, at: int, sig: int = signal.SIGUSR1) -> None:
        super().__init__()
        self.at, self.sig, self.steps = at, sig, 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.steps == self.at:
            signal.raise_signal(self.sig)


class Fail(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 1:
            raise RuntimeError("a failing callback")


@pytest.fixture()
def usr1_recorder():
    """A Python handler for SIGUSR1 that records what reaches it; the old one put back."""
    received: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
    try:
        yield received
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_preemption_signals_are_checked():
    with pytest.raises(ValueError, match="SIGKILL cannot be caught"):
        SyncedCheckpoint("unused", preemption_signals=[signal.SIGKILL])
    with pytest.raises(ValueError, match="unknown signal 'SIGNOPE'"):
        SyncedCheckpoint("unused", preemption_signals=["SIGNOPE"])
    with pytest.raises(TypeError, match="list or tuple of signals"):
        SyncedCheckpoint("unused", preemption_signals=signal.SIGTERM)
    with pytest.raises(TypeError, match="signal numbers or names, not float"):
        SyncedCheckpoint("unused", preemption_signals=[15.0])
    checkpoint = SyncedCheckpoint("unused", preemption_signals=["usr1", signal.SIGTERM, 15])
    assert checkpoint.preemption_signals == (signal.SIGUSR1, signal.SIGTERM)
    assert SyncedCheckpoint("unused").preemption_signals == (signal.SIGTERM,)
    assert PREEMPTED_EXIT_CODE == 75 and issubclass(Preempted, SystemExit)


@pytest.mark.slow
def test_a_signal_saves_the_step_reached_and_ends_fit_with_status_75(
    tmp_path, usr1_recorder, monkeypatch, caplog
):
    reference_model, reference_ds = build("adam"), dataset()
    # With SyncedCheckpoint(dataset=), which sets each epoch's order as a resume does.
    reference_checkpoint = SyncedCheckpoint(tmp_path / "ref", dataset=reference_ds)
    reference_model.fit(reference_ds, epochs=2, verbose=0, callbacks=[reference_checkpoint])
    reference = reference_model.get_weights()

    # A second SIGUSR1 arrives in the middle of the preemption save's file write.
    real_write = CheckpointStore.write
    saves: list[int] = []

    def write_with_a_second_signal(self, arrays, meta, *more, **options):
        saves.append(int(meta["global_step"]))
        if meta["global_step"] == 10:
            signal.raise_signal(signal.SIGUSR1)
        return real_write(self, arrays, meta, *more, **options)

    monkeypatch.setattr(CheckpointStore, "write", write_with_a_second_signal)
    directory = tmp_path / "ckpt"
    model, ds = build("adam"), dataset()  # as the reference started
    checkpoint = SyncedCheckpoint(
        directory, save_freq=4, dataset=ds, preemption_signals=[signal.SIGUSR1]
    )
    with caplog.at_level(logging.WARNING, logger="keras_mirror_kit"):
        with pytest.raises(Preempted) as stop:
            # Raised after the checkpoint's turn at step 9: the kit finishes step 10.
            model.fit(ds, epochs=2, verbose=0, callbacks=[checkpoint, RaiseSignal(9)])
    assert stop.value.code == PREEMPTED_EXIT_CODE
    assert (stop.value.epoch, stop.value.step, stop.value.global_step) == (1, 4, 10)
    assert stop.value.signal_name == "SIGUSR1"
    assert int(model.optimizer.iterations.numpy()) == 10  # nothing trained after the save
    assert saves == [4, 6, 8, 10]
    assert "1 more stop signal(s) arrived during the save" in caplog.text
    assert "training stopped on SIGUSR1 after saving epoch 1, batch 4" in caplog.text
    latest = CheckpointStore(directory).load_latest()
    assert (latest.meta["epoch"], latest.meta["step"], latest.meta["global_step"]) == (1, 4, 10)
    # The handler from before fit() is back, and no signal reached it during fit().
    assert signal.getsignal(signal.SIGUSR1) is not checkpoint._preemption._on_signal
    assert usr1_recorder == []
    signal.raise_signal(signal.SIGUSR1)
    assert usr1_recorder == [signal.SIGUSR1]

    monkeypatch.setattr(CheckpointStore, "write", real_write)
    resumed, resumed_ds = build("adam", seed=9), dataset()
    resumed_checkpoint = SyncedCheckpoint(directory, save_freq=4, dataset=resumed_ds)
    resumed.fit(resumed_ds, epochs=2, verbose=0, callbacks=[resumed_checkpoint])
    assert int(resumed.optimizer.iterations.numpy()) == 12
    assert max_diff(reference, resumed.get_weights()) <= TOLERANCE


@pytest.mark.slow
def test_handlers_come_back_after_a_fit_that_raised(tmp_path, usr1_recorder):
    raw_before = preemption_module._save_action(signal.SIGUSR1)
    # A kit model: its fit() tells the callback (on_fit_exception).
    model, ds = build("adam"), dataset()
    checkpoint = SyncedCheckpoint(tmp_path / "a", preemption_signals=["SIGUSR1"])
    with pytest.raises(RuntimeError, match="a failing callback"):
        model.fit(ds, epochs=1, verbose=0, callbacks=[checkpoint, Fail()])
    assert signal.getsignal(signal.SIGUSR1) is not checkpoint._preemption._on_signal
    if raw_before is not None:  # the C-level handler too (struct sigaction's first field)
        size = ctypes.sizeof(ctypes.c_void_p)
        assert preemption_module._save_action(signal.SIGUSR1).raw[:size] == raw_before.raw[:size]

    # A plain Keras model: nothing tells the callback, so its handler is still there; a
    # signal now finds no fit() running and goes to the handler from before.
    plain = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    plain.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))
    x, y = np.ones((32, 6), "float32"), np.zeros((32,), "int32")
    checkpoint = SyncedCheckpoint(tmp_path / "b", preemption_signals=["SIGUSR1"])
    with pytest.raises(RuntimeError, match="a failing callback"):
        plain.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[checkpoint, Fail()])
    assert usr1_recorder == []
    signal.raise_signal(signal.SIGUSR1)
    assert usr1_recorder == [signal.SIGUSR1]
    assert signal.getsignal(signal.SIGUSR1) is not checkpoint._preemption._on_signal


@pytest.mark.slow
def test_fit_outside_the_main_thread_trains_and_says_it_cannot_save_on_a_signal(tmp_path, caplog):
    model, ds = build("adam"), dataset()
    errors: list[BaseException] = []

    def train() -> None:
        try:
            model.fit(ds, epochs=1, verbose=0, callbacks=[SyncedCheckpoint(tmp_path / "c")])
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    with caplog.at_level(logging.WARNING, logger="keras_mirror_kit"):
        thread = threading.Thread(target=train)
        thread.start()
        thread.join(timeout=300)
    assert not thread.is_alive() and errors == []
    assert int(model.optimizer.iterations.numpy()) == 6
    assert "SyncedCheckpoint cannot save on SIGTERM here: fit() runs outside the main" in (
        caplog.text
    )
    assert "preemption_signals=()" in caplog.text


# -- SIGTERM at seeded moments, in subprocesses ------------------------------------------------


@pytest.mark.slow
def test_sigterm_at_seeded_moments_one_process(tmp_path):
    """3 chained trials: SIGTERM a seeded number of steps after the previous save."""
    rng = random.Random(SEED)
    reference = runs.ckpt_to_the_end(tmp_path / "reference" / "ckpt", tmp_path / "ref.npz")
    assert reference["iterations"] == runs.CKPT_STEPS
    directory = tmp_path / "trials" / "ckpt"
    directory.parent.mkdir()
    saved = 0
    for trial in range(3):
        marker_step = saved + rng.randint(1, 4)
        stop = runs.ckpt_sigterm(directory, marker_step)
        assert stop["returncode"] == PREEMPTED_EXIT_CODE, (trial, stop["stderr"])
        epoch, step, global_step = stop["preempted"]
        assert stop["signal"] == "SIGTERM"
        assert global_step == stop["iterations"] >= marker_step  # nothing after the save
        if stop["observed"] is not None:  # seen before a step began: that step, then save
            assert global_step == stop["observed"] + 1, stop
        assert (stop["latest"]["epoch"], stop["latest"]["step"]) == (epoch, step)
        assert stop["latest"]["global_step"] == global_step
        assert epoch * 6 + step == global_step
        assert stop["restored_step"] == (saved or None), stop  # resumed where it stopped
        assert global_step < runs.CKPT_STEPS - 1, "the seed left no room for the next trial"
        saved = global_step
    final = runs.ckpt_to_the_end(directory, tmp_path / "final.npz")
    assert (
        final["restored"] is not None and final["restored"][0] * 6 + final["restored"][1] == saved
    )
    assert final["iterations"] == runs.CKPT_STEPS
    diff = runs.max_diff(runs.weights_of(tmp_path / "ref.npz"),
                         runs.weights_of(tmp_path / "final.npz"))  # fmt: skip
    assert diff <= TOLERANCE


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_sigterms_then_sigkills_of_two_workers_at_seeded_moments(tmp_path):
    """One 2-worker job (tests.mw_child --tiny) under `launch`, stopped at seeded moments:

    - 3 chained launches: a seeded worker gets SIGTERM a seeded number of steps into the
      run; both save at the same step and exit with status 75 (the launcher's status too);
    - then `launch --max-restarts 3` resumes from there: in each of 3 attempts a seeded
      worker is SIGKILLed after a seeded number of steps and every worker restarts; the
      4th attempt trains to the end: the uninterrupted 2-worker weights (1e-6), and no
      process of any run is left.

    (The SIGKILL attempts were a job of their own, from an empty checkpoint, in
    tests/test_launch_restarts.py; the SIGTERM chain ended with a launch of its own to
    the end. Both ends were the same run of the same job: one run now ends both.)"""
    rng = random.Random(SEED + 1)
    reference = runs.mw_reference(tmp_path / "reference")
    ckpt = tmp_path / "ckpt"
    saved = None
    for trial in range(3):
        victim = rng.randint(0, 1)
        stop = runs.mw_sigterm(tmp_path / f"t{trial}", ckpt, rng.randint(1, 3), victim)
        assert stop["returncode"] == PREEMPTED_EXIT_CODE, stop["stderr"]
        assert "(it saved its state on a stop signal)" in stop["stderr"]
        chief, worker = stop["workers"]
        assert chief is not None and worker is not None, stop["stderr"]
        assert chief["saved"] == worker["saved"], stop  # the same step on both workers
        assert [chief["signal"], worker["signal"]][victim] == "SIGTERM"
        assert [chief["signal"], worker["signal"]][1 - victim] == "another worker's signal"
        epoch, step, global_step = chief["saved"]
        assert chief["iterations"] == worker["iterations"] == global_step
        latest = stop["latest"]
        assert (latest["epoch"], latest["step"], latest["global_step"]) == (
            epoch,
            step,
            global_step,
        )
        assert chief["restored_from"] == worker["restored_from"] == saved
        assert global_step < runs.MW_STEPS - 1, "the seed left no room for the next trial"
        saved = global_step
        assert_none_left(stop["pids"])

    # The SIGKILLs: seeded as when they were a test of their own (random.Random(SEED)).
    kills_rng = random.Random(SEED)
    kills = [(kills_rng.randint(1, 4), kills_rng.randint(0, 1)) for _ in range(3)]
    out = tmp_path / "job"
    job = runs.restart_job(out, ckpt, kills, max_restarts=3)
    assert job["returncode"] == 0, job["stderr"][-6000:]
    err = job["stderr"]
    for attempt, (_, victim) in enumerate(kills):
        assert f"worker {victim} was killed by SIGKILL; restarting all 2 worker(s)" in err
        assert f"(restart {attempt + 1} of --max-restarts 3)" in err
    assert "attempt 4 of 4: starting 2 worker(s)" in err
    # Its first attempt resumed where the last SIGTERM saved: the step count its victim
    # wrote at the kill's marker is that step plus the steps it trained.
    steps, victim = kills[0]
    assert int((out / f"reached-0-{victim}").read_text()) == saved + steps
    results = [json.loads((out / f"result-{rank}.json").read_text()) for rank in (0, 1)]
    assert results[0]["restored_from"] is not None  # the last attempt resumed
    assert results[0]["restored_from"] == results[1]["restored_from"]
    assert results[0]["iterations"] == results[1]["iterations"] == runs.MW_STEPS
    last = f"e{runs.MW_EPOCHS - 1}_"
    w0 = runs.weights_of(out / "weights-0.npz", last)
    w1 = runs.weights_of(out / "weights-1.npz", last)
    assert runs.max_diff(w0, w1) == 0.0
    assert runs.max_diff(w0, reference) <= TOLERANCE
    assert len(set(job["pids"])) >= 8  # 2 workers in each of 4 attempts
    assert_none_left(job["pids"])
