"""Seeded SIGKILL trials of file-source jobs, shared by the test suite and the benchmark.

Each trial SIGKILLs a training job (`tests.data_child kill`) right after a seeded training
step; one `tests.data_child finish` process then trains the uninterrupted reference twice
and resumes every killed trial's checkpoint directory.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

from tests import data_files, forkserver
from tests.subproc import REPO, last_json

STEPS = 12  # 2 epochs of 6 batches (48 samples, global batch 8)


def make_data(job: str, root: Path) -> Path:
    """The job's files: 16 images per class, or 48 records in three shards."""
    if job == "images":
        return data_files.image_folder(root / "images", per_class=16, sizes=(10, 18))
    data_files.record_shards(root / "records", counts=(20, 13, 15), size=14)
    return root / "records"


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2"}
    env["KMK_SIMULATE_REPLICAS"] = "2"
    env.pop("TF_CONFIG", None)
    return env


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return forkserver.run(
        [sys.executable, "-m", "tests.data_child", *args],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def kill_points(trials: int, seed: int) -> list[int]:
    """Seeded steps after which to kill (1 to STEPS - 1: always before the end)."""
    rng = random.Random(seed)
    return [rng.randint(1, STEPS - 1) for _ in range(trials)]


def kill(job: str, data: Path, directory: Path, step: int, async_save: bool) -> None:
    """Trains `job` into `directory` and SIGKILLs it right after training step `step`."""
    mode = ["--async-save"] if async_save else []
    args = ["kill", job, str(data), str(directory), "--kill-after-step", str(step), *mode]
    proc = _run(args, 300)
    assert proc.returncode == -signal.SIGKILL, (
        f"the {job} trial killed after step {step} ended with rc={proc.returncode}, not "
        f"SIGKILL\n{proc.stderr[-4000:]}"
    )


def run_trials(root: Path, plans: dict[str, dict]) -> dict:
    """Runs every job's kill trials, then resumes them all in one process.

    `plans` maps a job to `{"trials": [(step, async_save), ...], "twice": bool}`. Returns the
    finish RESULT, each resumed trial with its `step` and `async_save` added.
    """
    spec: dict = {"out": str(root), "jobs": {}}
    for job, plan in plans.items():
        data = make_data(job, root)
        resume = []
        for trial, (step, async_save) in enumerate(plan["trials"]):
            directory = root / f"{job}-trial-{trial}"
            kill(job, data, directory, step, async_save)
            resume.append({"directory": str(directory), "async_save": async_save})
        spec["jobs"][job] = {
            "data": str(data),
            "twice": plan.get("twice", False),
            "resume": resume,
        }
    (root / "spec.json").write_text(json.dumps(spec))
    proc = _run(["finish", str(root / "spec.json")], 900)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stderr[-6000:]}"
    result = last_json(proc)
    for job, plan in plans.items():
        for (step, async_save), resumed in zip(plan["trials"], result[job]["resumed"]):
            resumed.update(step=step, async_save=async_save)
    return result


def check_trial(resumed: dict) -> None:
    """A resumed trial: from a checkpoint of a save point no later than its kill (the newest
    one with synchronous saves; with asynchronous ones, those still being written when the
    kill came are lost), no step twice, the reference weights."""
    newest = resumed["step"] // 2 * 2 or None  # save_freq=2
    restored = resumed["restored_step"]
    if resumed["async_save"]:
        assert restored is None or (restored % 2 == 0 and restored <= (newest or 0)), resumed
    else:
        assert restored == newest, resumed
    assert resumed["trained"] == STEPS - (restored or 0), resumed
    assert resumed["iterations"] == STEPS, resumed
    assert resumed["diff"] <= 1e-6, resumed
