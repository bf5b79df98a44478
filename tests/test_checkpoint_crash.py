"""Real failures of a training subprocess: SIGKILL during checkpoint writes, disk full,
a directory that turns read-only. Every wait is bounded; every process is reaped.

Each kind of failure runs with synchronous saves and with `async_save=True` (the write in a
background thread while training goes on): three of the ten seeded kills in each save mode
(KMK_SIGKILL_TRIALS=10 and KMK_ASYNC_SIGKILL_TRIALS=10, or
benchmarks/checkpoint_sigkill_trials.py, run all ten).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from tests import forkserver
from tests.subproc import REPO, last_json

pytestmark = pytest.mark.slow  # every test here starts children or trains for long

EPOCHS = 3  # 6 batches each, 18 optimizer steps; save every 4 batches


def child_env(backend=None):
    """The children's environment; `backend`: their KERAS_BACKEND (default: this process's)."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "KMK_SIMULATE_REPLICAS": "2",
    }
    if backend is not None:
        env["KERAS_BACKEND"] = backend
        env.pop("XLA_FLAGS", None)
    return env


def child(directory, out, *extra, wait=True, async_save=False, backend=None):
    env = child_env(backend)
    command = [
        sys.executable,
        "-m",
        "tests.ckpt_child",
        str(directory),
        str(out),
        "--epochs",
        str(EPOCHS),
        "--save-freq",
        "4",
        *map(str, extra),
        *(["--async-save"] if async_save else []),
    ]
    proc = forkserver.popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
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
def reference_run(tmp_path_factory):
    """The uninterrupted run: its weights, its file writes and its checkpoints' steps."""
    root = tmp_path_factory.mktemp("reference")
    proc = child(root / "ckpt", root / "w.npz")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = last_json(proc)
    assert result["iterations"] == EPOCHS * 6
    assert result["saves"] and result["writes"].count("manifest.json") == len(result["saves"])
    return {"weights": weights(root / "w.npz"), **result}


@pytest.fixture(scope="module")
def reference(reference_run):
    return reference_run["weights"]


# Kills inside a file write of the store: (write number, stage, async_save).
WRITE_KILLS = [
    (1, "partial", False),  # half of the first checkpoint file written
    (3, "after-tmp", False),  # second checkpoint complete in its temp file, not replaced
    (4, "after-tmp", False),  # checkpoint in place, its manifest not yet replaced
    (6, "after-replace", False),  # third checkpoint and manifest written, killed then
    (7, "partial", False),  # half of the checkpoint at the end of epoch 1 ... and so on
    # Inside a background write, training going on meanwhile (more: the seeded kills).
    (4, "after-tmp", True),
]


@pytest.fixture(scope="module")
def write_kills(tmp_path_factory, reference_run):
    """Each kill of WRITE_KILLS in its own child, then every directory resumed in one more
    child (with the trial's save mode): what each kill left, and how each resumed."""
    plan = [_write_trial(reference_run, k, mode) for k, mode, _ in WRITE_KILLS]
    modes = [async_save for *_, async_save in WRITE_KILLS]
    seen: list[dict] = []
    root = tmp_path_factory.mktemp("write-kills")
    _kill_and_resume_all(
        root, reference_run, plan, async_save=modes, seen=seen, resume_async=modes
    )
    return seen


@pytest.mark.parametrize(
    "trial",
    range(len(WRITE_KILLS)),
    ids=[f"{k}-{mode}-{('sync', 'async')[a]}" for k, mode, a in WRITE_KILLS],
)
def test_sigkill_during_a_checkpoint_write_then_resume(write_kills, trial):
    """The resume checks (from the newest good checkpoint, the rest trained exactly, no
    orphan left, the uninterrupted weights) run in `_kill_and_resume_all`; here, what
    this trial's kill itself shows."""
    pause_at, mode, _ = WRITE_KILLS[trial]
    row = write_kills[trial]
    if mode != "after-replace":
        assert row["leftovers_after_kill"]  # the kill really left a half-done write behind
    if pause_at > 1:
        assert row["result"]["restored"] is not None  # resumed from an earlier checkpoint
    assert row["result"]["iterations"] == EPOCHS * 6
    assert row["result"]["leftovers"] == []  # orphans cleaned


def _manifest(directory: Path):
    return json.loads((directory / "manifest.json").read_text())


ASYNC = pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])


@ASYNC
def test_disk_full_during_a_save_is_a_clear_error_and_keeps_earlier_checkpoints(
    tmp_path, async_save
):
    directory = tmp_path / "ckpt"
    # After epoch 0's checkpoint (~6 KB), files may not grow past 2 KB: the next save fails.
    proc = child(
        directory, tmp_path / "w.npz", "--fsize-limit-after-epoch", 0, async_save=async_save
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    result = last_json(proc)
    assert result["error"] == "CheckpointWriteError"
    assert result["saves"] == [4, 6, 8]  # the save of step 8 failed ...
    if async_save:  # ... in the background: raised at a following step, before step 13
        assert 9 <= result["iterations"] <= 12
    else:
        assert result["iterations"] == 8
    assert (
        "File too large" in result["message"]
        and "Earlier checkpoints are intact" in (result["message"])
    )
    manifest = _manifest(directory)
    assert manifest["latest"] == manifest["checkpoints"][-1]["file"]
    assert not [n for n in os.listdir(directory) if n.endswith(".tmp")]
    from keras_mirror_kit.checkpoint.store import CheckpointStore

    store = CheckpointStore(directory)
    for entry in store.entries():
        assert store.read(entry).meta.file == entry.file  # every one verifies
    assert store.load_latest().meta.epoch == 1  # the end-of-epoch-0 checkpoint


@pytest.fixture()
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs mounted for the test (needs root and a mount-permitting host)."""
    if os.geteuid() != 0:
        pytest.skip("a real full disk (ENOSPC) needs a tmpfs, and mounting one needs root")
    if shutil.which("mount") is None or shutil.which("umount") is None:
        pytest.skip("a real full disk (ENOSPC) needs the mount and umount commands")
    mount_point = tmp_path / "small-disk"
    mount_point.mkdir()
    tried = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "kmk-test-tmpfs", str(mount_point)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if tried.returncode != 0:
        pytest.skip(
            "a real full disk (ENOSPC) needs a tmpfs, and this host refused the mount "
            f"(rc={tried.returncode}): {tried.stderr.strip()}"
        )
    try:
        yield mount_point
    finally:
        if subprocess.run(["umount", str(mount_point)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)


@ASYNC
def test_a_really_full_disk_during_a_save_is_a_clear_error_and_keeps_earlier_checkpoints(
    tmp_path, small_tmpfs, reference, async_save
):
    """ENOSPC, not a simulation: after epoch 0's checkpoint the child fills the tmpfs that
    holds the checkpoint directory, so the next save meets a full disk."""
    import errno

    directory = small_tmpfs / "ckpt"
    filler = small_tmpfs / "filler"
    proc = child(
        directory,
        tmp_path / "w.npz",
        "--fill-disk-after-epoch",
        0,
        "--fill-path",
        filler,
        async_save=async_save,
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    result = last_json(proc)
    # The disk really was full (now the run's writer.lock is gone: a block came free).
    assert result["free_after_fill"] == [0]
    assert (result["error"], result["errno"]) == ("CheckpointWriteError", errno.ENOSPC)
    assert "Could not write checkpoint" in result["message"]
    assert "No space left on device" in result["message"]
    assert "Earlier checkpoints are intact" in result["message"]
    assert "ckpt-00000002.npz" in result["message"] and "Free disk space" in result["message"]
    assert result["saves"] == [4, 6, 8]  # the third save (step 8) is the one that failed
    manifest = _manifest(directory)
    assert manifest["latest"] == manifest["checkpoints"][-1]["file"] == "ckpt-00000002.npz"
    assert not [n for n in os.listdir(directory) if n.endswith(".tmp")]
    from keras_mirror_kit.checkpoint.store import CheckpointStore

    store = CheckpointStore(directory)  # read while the disk is still full
    assert [e.file for e in store.entries()] == ["ckpt-00000001.npz", "ckpt-00000002.npz"]
    for entry in store.entries():
        assert store.read(entry).meta.file == entry.file  # every one verifies
    latest = store.load_latest()
    assert latest is not None and (latest.meta["epoch"], latest.meta["step"]) == (1, 0)
    # A resume from the full disk's directory, once space is freed, ends as the reference.
    filler.unlink()
    resumed = child(directory, tmp_path / "resumed.npz")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert last_json(resumed)["restored"] == [1, 0]
    diff = max(
        float(np.max(np.abs(a - b))) for a, b in zip(reference, weights(tmp_path / "resumed.npz"))
    )
    assert diff <= 1e-6


@ASYNC
def test_directory_turning_read_only_is_a_clear_error_and_keeps_checkpoints(async_save):
    # Outside pytest's 0700 tmp tree, so that an unprivileged child can still read it.
    root = Path(tempfile.mkdtemp(prefix="kmk-ro-"))
    os.chmod(root, 0o755)
    directory = root / "ckpt"
    try:
        proc = child(
            directory, root / "w.npz", "--read-only-after-epoch", 0, async_save=async_save
        )
        assert proc.returncode == 3, proc.stderr[-3000:]
        result = last_json(proc)
        assert result["error"] == "CheckpointWriteError"
        assert "Permission denied" in result["message"]
        os.chmod(directory, 0o755)
        from keras_mirror_kit.checkpoint.store import CheckpointStore

        latest = CheckpointStore(directory).load_latest()
        assert latest is not None and latest.meta["epoch"] == 1
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=False)


SEED = 20261129
TRIALS = int(os.environ.get("KMK_SIGKILL_TRIALS", "3"))
ASYNC_TRIALS = int(os.environ.get("KMK_ASYNC_SIGKILL_TRIALS", "3"))
STEPS = EPOCHS * 6


def _global_step(restored):
    return None if restored is None else restored[0] * 6 + restored[1]


def _plan(rng, reference_run, trials=TRIALS, async_save=False, kinds=None):
    """Seeded kill points, in training progress (never in seconds): which file write and
    at what stage; which step, killed right there; which step, then a seeded moment while
    training runs on (`kinds`: each trial's, default in turn). Returns (how, child args,
    lowest and highest good resume step)."""
    writes, saves = reference_run["writes"], reference_run["saves"]
    if kinds is None:
        kinds = [("write", "step", "run-on")[trial % 3] for trial in range(trials)]
    # Distinct points: which writes, which steps (each drawn without replacement).
    write_ks = iter(rng.sample(range(1, len(writes) + 1), kinds.count("write")))
    step_ks = iter(rng.sample(range(1, STEPS), trials - kinds.count("write")))
    plan = []
    for kind in kinds:
        if kind == "write":  # inside the k-th file write of the store
            k = next(write_ks)
            plan.append(_write_trial(reference_run, k, rng.choice(WRITE_STAGES)))
            continue
        # After training step k: exactly there, or a seeded moment later.
        k = next(step_ks)
        # A checkpoint of step k itself is written in this step's callbacks or, at an
        # epoch's end, just after: it may or may not exist when the marker appears.
        low = max((s for s in saves if s < k), default=None)
        if async_save:
            # Saves started by the marker (an epoch's end is saved after it); the newest
            # may still be written in the background, the one before it is complete.
            started = [s for s in saves if s < k or (s == k and k % 6)]
            low = started[-2] if len(started) >= 2 else None
        delay = round(rng.uniform(0.0, 0.5), 3) if kind == "run-on" else 0.0
        high = max((s for s in saves if s <= k), default=None)
        high = high if kind == "step" else saves[-1]
        how = (kind, k, delay)
        args = ["--step-marker", k] + (["--block-at-marker"] if kind == "step" else [])
        plan.append((how, args, low, high))
    return plan


WRITE_STAGES = ["partial", "after-tmp", "after-replace"]


def _write_trial(reference_run, k, mode):
    """A kill inside the k-th file write at `mode`: (how, child args, lowest and highest
    good resume step), from the uninterrupted run's writes and saves."""
    writes, saves = reference_run["writes"], reference_run["saves"]
    done = writes[: k - 1].count("manifest.json")  # checkpoints complete before it
    if writes[k - 1] == "manifest.json" and mode == "after-replace":
        done += 1
    # A checkpoint file in place without its manifest may or may not be used: its own write
    # just replaced, or its manifest's write not replaced yet.
    in_place = writes[k - 1].startswith("ckpt-") and mode == "after-replace"
    extra = int(in_place or (writes[k - 1] == "manifest.json" and mode != "after-replace"))
    low = saves[done - 1] if done else None
    high = saves[done + extra - 1] if done + extra else None
    return ("write", k, mode), ["--pause-at", k, "--pause-mode", mode], low, high


def test_seeded_random_sigkills_all_resume_to_the_uninterrupted_weights(tmp_path, reference_run):
    """Kill -9 at seeded points chosen in training progress (a file write and its stage, or
    a training step), then resume every trial: each resumes from the newest good
    checkpoint before the kill (or from scratch), trains exactly the rest, ends equal."""
    import random

    plan = _plan(random.Random(SEED), reference_run)
    # The seed gives kills on both sides of the first checkpoint, in every kind.
    lows = [low for *_, low, _ in plan]
    assert {how[0] for how, *_ in plan} == {"write", "step", "run-on"}
    assert any(low is None for low in lows) and any(low is not None for low in lows)
    if len(plan) >= 10:
        assert sum(low is not None for low in lows) >= 5
    _kill_and_resume_all(tmp_path, reference_run, plan)


def test_seeded_random_sigkills_during_background_saves_resume_to_the_same_weights(
    tmp_path, reference_run
):
    """The same with async_save=True: kills while a background write runs and training
    goes on. The suite runs 3 seeded trials (one of each kind); all 10 on request."""
    import random

    plan = _plan(random.Random(SEED + 1), reference_run, ASYNC_TRIALS, async_save=True)
    assert {how[0] for how, *_ in plan} == {"write", "step", "run-on"}
    _kill_and_resume_all(tmp_path, reference_run, plan, async_save=True)


def _kill_and_resume_all(
    tmp_path, reference_run, plan, async_save=False, backend=None, seen=None, resume_async=None
):
    """Runs each planned kill, then resumes every directory in one process and checks.

    `async_save`: for every trial, or a list with each trial's; `backend`: the children's
    KERAS_BACKEND (default: this process's); `resume_async`: each trial's save mode when
    resumed (default: synchronous); `seen`: a list that gets, per trial, the temporaries
    its kill left (`leftovers_after_kill`) and its resume's `result`.
    """
    modes = async_save if isinstance(async_save, list) else [async_save] * len(plan)
    resume_modes = resume_async or [False] * len(plan)
    directories, leftovers_after_kill = [], []
    for trial, ((how, args, _, _), async_mode) in enumerate(zip(plan, modes)):
        directory, marker = tmp_path / f"t{trial}" / "ckpt", tmp_path / f"t{trial}" / "m"
        directory.parent.mkdir()
        proc = child(
            directory,
            tmp_path / f"t{trial}" / "w.npz",
            *args,
            "--marker",
            marker,
            wait=False,
            async_save=async_mode,
            backend=backend,
        )
        try:
            deadline = time.monotonic() + 240  # a bound for a stuck child, not a kill time
            while not marker.exists():
                assert proc.poll() is None, (how, proc.communicate()[1][-3000:])
                assert time.monotonic() < deadline, f"trial {trial} never reached {how}"
                time.sleep(0.02)
            if how[0] == "run-on":
                time.sleep(how[2])  # the child trains on; it waits to be killed at the end
        finally:
            proc.kill()  # SIGKILL
            proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL, (how, proc.returncode)
        directories.append(str(directory))
        leftovers_after_kill.append([n for n in os.listdir(directory) if n.endswith(".tmp")])
    out = tmp_path / "results.json"
    resumed = [("async:" if a else "") + d for d, a in zip(directories, resume_modes)]
    done = forkserver.run(
        [sys.executable, "-m", "tests.resume_many", str(out), *resumed],
        cwd=REPO,
        env=child_env(backend),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    reference = reference_run["weights"]
    for trial, ((how, _, low, high), directory) in enumerate(zip(plan, directories)):
        result = results[directory]
        if seen is not None:
            seen.append({"leftovers_after_kill": leftovers_after_kill[trial], "result": result})
        restored = _global_step(result["restored"])
        if low is None:
            assert restored is None or (high is not None and restored <= high), (how, result)
        else:
            assert restored is not None and low <= restored <= high, (how, low, high, result)
        assert result["iterations"] == STEPS, (how, result)
        assert result["batches"] == STEPS - (restored or 0), (how, result)
        assert result["leftovers"] == [], (how, result)
        diff = max(
            float(np.max(np.abs(a - b))) for a, b in zip(reference, weights(result["weights"]))
        )
        assert diff <= 1e-6, (how, diff)
