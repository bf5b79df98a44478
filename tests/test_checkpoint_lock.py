"""One writer per checkpoint directory (issue 12, item 4): a real second process is refused
at `on_train_begin`, a lock left by a killed process is taken over with a warning, and the
lock goes at the end of `fit` and when `fit` raises. Every wait is bounded by progress
markers; every process is reaped."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import keras
import pytest

from keras_mirror_kit.callbacks.synced_checkpoint import SyncedCheckpoint
from keras_mirror_kit.checkpoint.lock import (
    LOCK_FILE,
    CheckpointLockedError,
    DirectoryLock,
    StaleLockWarning,
)
from keras_mirror_kit.checkpoint.store import CheckpointError
from tests import forkserver
from tests.ckpt_helpers import CountBatches, build, dataset
from tests.subproc import REPO


def _reaped_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)
    return proc.pid


def _write_lock(directory, **record) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / LOCK_FILE).write_text(json.dumps(record))


class LockSeen(keras.callbacks.Callback):
    """Records the lock file's pid at the first batch end; raises at `raise_at` if set."""

    def __init__(self, directory, raise_at=None) -> None:
        super().__init__()
        self.directory, self.raise_at, self.pid = directory, raise_at, None

    def on_train_batch_end(self, batch, logs=None):
        if self.pid is None:
            self.pid = json.loads((self.directory / LOCK_FILE).read_text())["pid"]
        if batch == self.raise_at:
            raise RuntimeError("failure inside fit")


@pytest.mark.slow
def test_a_second_process_is_refused_and_a_killed_ones_lock_is_taken_over(tmp_path):
    directory, marker = tmp_path / "ckpt", tmp_path / "marker"
    env = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2"}
    env["KMK_SIMULATE_REPLICAS"] = "2"
    command = [sys.executable, "-m", "tests.ckpt_child", str(directory), str(tmp_path / "w")]
    command += ["--step-marker", "1", "--block-at-marker", "--marker", str(marker)]
    proc = forkserver.popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 240  # a bound for a stuck child, not a timing
        while not marker.exists():  # the child is training, inside its fit()
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the child never reached its first step"
            time.sleep(0.05)
        model, ds, counter = build("adam"), dataset(), CountBatches()
        with pytest.raises(CheckpointLockedError) as info:
            model.fit(ds, epochs=1, verbose=0, callbacks=[SyncedCheckpoint(directory), counter])
        message = str(info.value)
        assert f"process {proc.pid} on this host" in message
        assert "Another run is writing checkpoints" in message and "another directory" in message
        assert counter.batches == 0 and int(model.optimizer.iterations.numpy()) == 0
        assert json.loads((directory / LOCK_FILE).read_text())["pid"] == proc.pid  # kept
    finally:
        proc.kill()  # SIGKILL: no chance to release the lock
        proc.communicate(timeout=60)
    assert (directory / LOCK_FILE).exists()
    model, ds, seen = build("adam"), dataset(), LockSeen(directory)
    with pytest.warns(StaleLockWarning, match=f"process {proc.pid} on .*no longer runs"):
        model.fit(ds, epochs=1, verbose=0, callbacks=[SyncedCheckpoint(directory), seen])
    assert seen.pid == os.getpid()  # this process held it while training
    assert not (directory / LOCK_FILE).exists()  # released at the end of fit
    assert (directory / "manifest.json").exists()


@pytest.mark.slow
def test_the_lock_is_released_when_fit_raises_and_a_rerun_proceeds(tmp_path):
    model, ds = build("adam"), dataset()
    seen = LockSeen(tmp_path, raise_at=2)
    with pytest.raises(RuntimeError, match="failure inside fit"):
        model.fit(ds, epochs=2, verbose=0, callbacks=[SyncedCheckpoint(tmp_path), seen])
    assert seen.pid == os.getpid()
    assert not (tmp_path / LOCK_FILE).exists()
    # Refused at on_train_begin (restore=False over existing checkpoints): released too.
    model.fit(ds, epochs=1, verbose=0, callbacks=[SyncedCheckpoint(tmp_path)])
    with pytest.raises(CheckpointError, match="restore=False"):
        build("adam").fit(
            ds, epochs=1, verbose=0, callbacks=[SyncedCheckpoint(tmp_path, restore=False)]
        )
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_stale_lock_of_a_dead_pid_is_taken_over_with_a_warning(tmp_path):
    pid = _reaped_pid()
    _write_lock(tmp_path, pid=pid, host=socket.gethostname(), token="old", since="then")
    lock = DirectoryLock(tmp_path)
    with pytest.warns(StaleLockWarning, match=f"process {pid} .* no longer runs"):
        lock.acquire()
    record = json.loads((tmp_path / LOCK_FILE).read_text())
    assert record["pid"] == os.getpid() and record["token"] != "old"
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_a_live_process_or_another_host_keeps_its_lock(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        _write_lock(tmp_path, pid=sleeper.pid, host=socket.gethostname(), token="live")
        with pytest.raises(CheckpointLockedError, match=f"process {sleeper.pid} on this host"):
            DirectoryLock(tmp_path).acquire()
    finally:
        sleeper.kill()
        sleeper.wait(timeout=60)
    pid = _reaped_pid()  # dead here, but on another host nothing can be told
    _write_lock(tmp_path, pid=pid, host="elsewhere.example", token="remote")
    with pytest.raises(CheckpointLockedError, match="on host 'elsewhere.example'") as info:
        DirectoryLock(tmp_path).acquire()
    assert "delete the lock file" in str(info.value)
    assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == "remote"


def test_a_requeued_slurm_job_takes_over_its_earlier_runs_lock_from_another_node(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    pid = _reaped_pid()
    # The same job's first run, on another node, SIGKILLed before it could release the lock.
    _write_lock(tmp_path, pid=pid, host="node-a", token="first-run",
                slurm_job_id="4242", slurm_restart_count=0)  # fmt: skip
    with pytest.warns(StaleLockWarning, match="Slurm job 4242"):
        lock = DirectoryLock(tmp_path)
        lock.acquire()
    record = json.loads((tmp_path / LOCK_FILE).read_text())
    assert record["pid"] == os.getpid() and record["slurm_restart_count"] == 1
    lock.release()
    # Another job (or the same run) on another node still keeps its lock.
    for job, restarts in (("9999", 0), ("4242", 1)):
        _write_lock(tmp_path, pid=pid, host="node-a", token="other",
                    slurm_job_id=job, slurm_restart_count=restarts)  # fmt: skip
        with pytest.raises(CheckpointLockedError, match="on host 'node-a'"):
            DirectoryLock(tmp_path).acquire()
