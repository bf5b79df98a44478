"""`DirectoryLock` on its own, without TensorFlow: who may take a checkpoint directory's lock.

Lock files written here stand for other processes (a pid that no longer runs, a live one,
another host, an earlier run of a requeued Slurm job); the end-to-end cases, with real
processes and `fit()`, are in `tests/test_checkpoint_lock.py`.
"""

from __future__ import annotations

import json
import os
import socket

import pytest

from keras_mirror_kit.checkpoint.lock import (
    LOCK_FILE,
    CheckpointLockedError,
    DirectoryLock,
    StaleLockWarning,
)


def _write(directory, **record):
    directory.mkdir(parents=True, exist_ok=True)
    base = {"pid": 1, "host": socket.gethostname(), "token": "feedface", "since": "then"}
    (directory / LOCK_FILE).write_text(json.dumps({**base, **record}))


@pytest.fixture(scope="module")
def dead_pid():
    """A pid no process runs under now (looked up, not made: no child is started)."""
    for pid in range(4_000_000, 3_000_000, -997):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            continue  # someone else's live process
    pytest.skip("no free pid found to stand for a process that ended")


def test_a_free_directory_is_locked_released_and_taken_again(tmp_path):
    lock = DirectoryLock(tmp_path / "ckpt")
    lock.acquire()
    record = lock.read()
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    lock.acquire()  # this process's own lock: taken again (a later fit() here)
    lock.release()
    assert lock.read() is None
    lock.release()  # idempotent


def test_a_lock_of_a_process_that_no_longer_runs_is_taken_over_with_a_warning(tmp_path, dead_pid):
    _write(tmp_path, pid=dead_pid)
    lock = DirectoryLock(tmp_path)
    with pytest.warns(StaleLockWarning, match=f"process {dead_pid} on .*no longer runs"):
        lock.acquire()
    assert lock.read()["pid"] == os.getpid()
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]  # nothing left aside
    lock.release()


@pytest.mark.parametrize(
    ("record", "who"),
    [
        ({"pid": os.getppid()}, "on this host"),  # alive: the process that started pytest
        ({"pid": 12345, "host": "elsewhere.example"}, "on host 'elsewhere.example'"),
    ],
    ids=["live-process", "other-host"],
)
def test_a_lock_that_may_be_alive_is_refused_naming_its_holder(tmp_path, record, who):
    _write(tmp_path, **record)
    with pytest.raises(CheckpointLockedError) as info:
        DirectoryLock(tmp_path).acquire()
    message = str(info.value)
    assert f"process {record['pid']} {who}" in message and "since then" in message
    assert "delete the lock file" in message
    assert f"Received: directory={str(tmp_path)!r}" in message
    assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == "feedface"  # untouched


def test_a_requeued_slurm_job_takes_over_its_earlier_runs_lock_on_another_node(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    _write(tmp_path, pid=12345, host="node-7", slurm_job_id="4242", slurm_restart_count=1)
    lock = DirectoryLock(tmp_path)
    with pytest.warns(StaleLockWarning, match="restart 1.*Slurm job 4242 on node-7"):
        lock.acquire()
    lock.release()
    # The same restart (another task of this very run) is not an earlier run: refused.
    _write(tmp_path, pid=12345, host="node-7", slurm_job_id="4242", slurm_restart_count=2)
    with pytest.raises(CheckpointLockedError):
        DirectoryLock(tmp_path).acquire()


def test_an_unreadable_lock_is_refused_not_taken(tmp_path):
    (tmp_path / LOCK_FILE).write_text("{half a rec")
    with pytest.raises(CheckpointLockedError, match="process \\? on"):
        DirectoryLock(tmp_path).acquire()
