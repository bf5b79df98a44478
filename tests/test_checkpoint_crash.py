"""Real failures of a training subprocess: SIGKILL during checkpoint writes, disk full,
a directory that turns read-only. Every wait is bounded; every process is reaped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from tests.subproc import REPO, last_json

EPOCHS = 3  # 6 batches each, 18 optimizer steps; save every 4 batches


def child(directory, out, *extra, wait=True):
    env = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2",
           "KMK_SIMULATE_REPLICAS": "2"}
    command = [sys.executable, "-m", "tests.ckpt_child", str(directory), str(out),
               "--epochs", str(EPOCHS), "--save-freq", "4", *map(str, extra)]
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    if not wait:
        return proc
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def weights(path):
    with np.load(path) as npz:
        return [npz[k] for k in sorted(npz.files, key=lambda k: int(k.split("_")[1]))]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("reference")
    proc = child(root / "ckpt", root / "w.npz")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert last_json(proc)["iterations"] == EPOCHS * 6
    return weights(root / "w.npz")


@pytest.mark.parametrize(
    ("pause_at", "mode"),
    [
        (1, "partial"),        # half of the first checkpoint file written
        (3, "after-tmp"),      # second checkpoint complete in its temp file, not replaced
        (4, "after-tmp"),      # checkpoint in place, its manifest not yet replaced
        (6, "after-replace"),  # third checkpoint and manifest written, killed right after
        (7, "partial"),        # half of the checkpoint at the end of epoch 1 ... and so on
    ],
)
def test_sigkill_during_a_checkpoint_write_then_resume(tmp_path, reference, pause_at, mode):
    directory, marker = tmp_path / "ckpt", tmp_path / "marker"
    proc = child(directory, tmp_path / "dead.npz", "--pause-at", pause_at,
                 "--pause-mode", mode, "--marker", marker, wait=False)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the child never reached the write"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    leftovers = [n for n in os.listdir(directory) if n.endswith(".tmp")]
    if mode != "after-replace":
        assert leftovers  # the kill really left a half-done write behind

    resumed = child(directory, tmp_path / "w.npz")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    result = last_json(resumed)
    assert result["iterations"] == EPOCHS * 6
    if pause_at > 1:
        assert result["restored"] is not None  # resumed from an earlier checkpoint
    assert not [n for n in os.listdir(directory) if n.endswith(".tmp")]  # orphans cleaned
    final = weights(tmp_path / "w.npz")
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(reference, final))
    assert diff <= 1e-6


def _manifest(directory: Path):
    return json.loads((directory / "manifest.json").read_text())


def test_disk_full_during_a_save_is_a_clear_error_and_keeps_earlier_checkpoints(tmp_path):
    directory = tmp_path / "ckpt"
    # After epoch 0's checkpoint (~6 KB), files may not grow past 2 KB: the next save fails.
    proc = child(directory, tmp_path / "w.npz", "--fsize-limit-after-epoch", 0)
    assert proc.returncode == 3, proc.stderr[-3000:]
    result = last_json(proc)
    assert result["error"] == "CheckpointWriteError"
    assert "File too large" in result["message"] and "Earlier checkpoints are intact" in (
        result["message"]
    )
    manifest = _manifest(directory)
    assert manifest["latest"] == manifest["checkpoints"][-1]["file"]
    assert not [n for n in os.listdir(directory) if n.endswith(".tmp")]
    from keras_mirror_kit.checkpoint_store import CheckpointStore

    store = CheckpointStore(directory)
    for entry in store.entries():
        assert store.read(entry).meta["file"] == entry["file"]  # every one verifies
    assert store.load_latest().meta["epoch"] == 1  # the end-of-epoch-0 checkpoint


def test_directory_turning_read_only_is_a_clear_error_and_keeps_checkpoints():
    # Outside pytest's 0700 tmp tree, so that an unprivileged child can still read it.
    root = Path(tempfile.mkdtemp(prefix="kmk-ro-"))
    os.chmod(root, 0o755)
    directory = root / "ckpt"
    try:
        proc = child(directory, root / "w.npz", "--read-only-after-epoch", 0)
        assert proc.returncode == 3, proc.stderr[-3000:]
        result = last_json(proc)
        assert result["error"] == "CheckpointWriteError"
        assert "Permission denied" in result["message"]
        os.chmod(directory, 0o755)
        from keras_mirror_kit.checkpoint_store import CheckpointStore

        latest = CheckpointStore(directory).load_latest()
        assert latest is not None and latest.meta["epoch"] == 1
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=False)


def test_ten_seeded_random_sigkills_all_resume_to_the_uninterrupted_weights(
    tmp_path, reference
):
    """Kill -9 at seeded random moments (a random time, or inside a random file write),
    then resume every trial: each resumes from a good checkpoint and ends equal."""
    import random

    rng = random.Random(20261129)
    directories = []
    plan = []
    for trial in range(10):
        directory, marker = tmp_path / f"t{trial}" / "ckpt", tmp_path / f"t{trial}" / "m"
        directory.parent.mkdir()
        started = tmp_path / f"t{trial}" / "started"
        if trial % 2 == 0:  # inside a write: which file write, and at what stage
            how = ("write", rng.randint(1, 20), rng.choice(["partial", "after-tmp",
                                                             "after-replace"]))
            extra = ["--pause-at", how[1], "--pause-mode", how[2], "--marker", marker]
        else:  # at a random time after training started
            how = ("time", round(rng.uniform(0.0, 1.5), 3))
            extra = ["--started-marker", started]
        plan.append(how)
        proc = child(directory, tmp_path / f"t{trial}" / "w.npz", *extra, wait=False)
        try:
            deadline = time.monotonic() + 240
            target = marker if how[0] == "write" else started
            while not target.exists() and proc.poll() is None:
                assert time.monotonic() < deadline, f"trial {trial} never got going"
                time.sleep(0.02)
            if how[0] == "time":
                time.sleep(how[1])
        finally:
            proc.kill()  # SIGKILL
            proc.communicate(timeout=60)
        directories.append(str(directory))
    out = tmp_path / "results.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2",
           "KMK_SIMULATE_REPLICAS": "2"}
    done = subprocess.run([sys.executable, "-m", "tests.resume_many", str(out), *directories],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    resumed_mid_training = 0
    for how, directory in zip(plan, directories):
        result = results[directory]
        assert result["iterations"] == EPOCHS * 6, (how, result)
        assert result["batches"] == EPOCHS * 6 - (
            0 if result["restored"] is None
            else result["restored"][0] * 6 + result["restored"][1]), (how, result)
        assert result["leftovers"] == [], (how, result)
        diff = max(float(np.max(np.abs(a - b)))
                   for a, b in zip(reference, weights(result["weights"])))
        assert diff <= 1e-6, (how, diff)
        resumed_mid_training += result["restored"] is not None
    assert resumed_mid_training >= 5  # the kills really interrupted training
