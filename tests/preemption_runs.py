"""Runs for the preemption and restart trials (tests/test_preemption.py,
benchmarks/preemption_trials.py).

Every wait follows the jobs' progress markers; the time bounds only end a stuck job. The
seconds from a signal to the exit are measured for the benchmark's figures, never asserted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from tests import forkserver
from tests.processes import kill, worker_env
from tests.subproc import REPO, last_json

STUCK_S = 300  # a bound for a stuck job, not a measurement
CKPT_EPOCHS = 5  # tests.ckpt_child: 6 steps per epoch
CKPT_STEPS = CKPT_EPOCHS * 6
MW_EPOCHS = 4  # tests.mw_child --tiny: 8 steps per epoch
MW_STEPS = MW_EPOCHS * 8


def _wait_for(path: Path, proc: subprocess.Popen[str], what: str) -> None:
    deadline = time.monotonic() + STUCK_S
    while not path.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(
                f"{what}: exited with {proc.returncode}\n{out[-2000:]}{err[-4000:]}"
            )
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{what}: no marker {path.name} in {STUCK_S} s")
        time.sleep(0.02)


def _finish(proc: subprocess.Popen[str], pids: list[int] | None = None) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=STUCK_S)
    except subprocess.TimeoutExpired:
        with_group = getattr(proc, "kmk_group", False)
        if with_group:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.kill()
        kill(pids or [])
        out, err = proc.communicate(timeout=60)
        raise AssertionError(f"stuck job killed\n{out[-2000:]}\n{err[-6000:]}") from None


def weights_of(path: Path, prefix: str | None = None) -> list[np.ndarray]:
    """Arrays of an .npz in order (`prefix`: only keys `<prefix><i>`, as mw_child writes)."""
    with np.load(path) as data:
        if prefix is None:
            keys = sorted(data.files, key=lambda k: int(k.split("_")[1]))
        else:
            keys = sorted(
                (k for k in data.files if k.startswith(prefix)),
                key=lambda k: int(k[len(prefix) :]),
            )
        return [data[k] for k in keys]


def max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """Largest absolute difference between two lists of arrays."""
    assert len(a) == len(b) and a
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


# -- one process (tests.ckpt_child, 2 simulated replicas) -------------------------------------


def ckpt_child(directory: Path, out: Path, *extra: str) -> subprocess.Popen[str]:
    """Starts tests.ckpt_child for CKPT_EPOCHS epochs, saving every 4 steps."""
    command = [sys.executable, "-m", "tests.ckpt_child", str(directory), str(out)]
    command += ["--epochs", str(CKPT_EPOCHS), "--save-freq", "4", *extra]
    return forkserver.popen(
        command,
        cwd=REPO,
        env=worker_env(KMK_SIMULATE_REPLICAS="2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def ckpt_to_the_end(directory: Path, out: Path) -> dict[str, Any]:
    """Runs (or resumes) the one-process job to its end; its RESULT."""
    proc = ckpt_child(directory, out)
    stdout, stderr = _finish(proc)
    assert proc.returncode == 0, stderr[-4000:]
    return last_json(subprocess.CompletedProcess([], 0, stdout, stderr))


def ckpt_sigterm(directory: Path, marker_step: int) -> dict[str, Any]:
    """Runs the one-process job and sends SIGTERM once its optimizer step `marker_step` ended.

    Returns:
        The child's RESULT (where it stopped) plus `returncode`, `exit_s` (seconds from
        the SIGTERM to the exit) and the newest checkpoint's `manifest` entry.
    """
    marker = directory.parent / f"marker-{marker_step}"
    proc = ckpt_child(directory, directory.parent / "unused.npz", "--preempt-after-step",
                      str(marker_step), "--marker", str(marker))  # fmt: skip
    _wait_for(marker, proc, f"ckpt_child until step {marker_step}")
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = _finish(proc)
    exit_s = time.monotonic() - sent
    result = last_json(subprocess.CompletedProcess([], proc.returncode, stdout, stderr))
    manifest = json.loads((directory / "manifest.json").read_text())
    return {
        **result,
        "returncode": proc.returncode,
        "exit_s": exit_s,
        "latest": manifest["checkpoints"][-1],
        "stderr": stderr[-4000:],
    }


# -- two workers (tests.mw_child --tiny through `keras-mirror-kit launch`) -------------------


def mw_args(out: Path, ckpt: Path, *extra: str) -> list[str]:
    """tests.mw_child's arguments for the 2-worker trials."""
    return [str(out), "--tiny", "--epochs", str(MW_EPOCHS), "--ckpt", str(ckpt),
            "--save-freq", "2", *extra]  # fmt: skip


def mw_reference(out: Path) -> list[np.ndarray]:
    """The uninterrupted run: one process, 2 replicas (equal to 2 workers, tested)."""
    proc = forkserver.popen(
        [sys.executable, "-m", "tests.mw_child", *mw_args(out, out / "ckpt")],
        cwd=REPO,
        env=worker_env(KMK_SIMULATE_REPLICAS="2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, stderr = _finish(proc)
    assert proc.returncode == 0, stderr[-4000:]
    return weights_of(out / "weights-0.npz", f"e{MW_EPOCHS - 1}_")


def launch(out: Path, child_args: list[str], *launcher_args: str) -> subprocess.Popen[str]:
    """Starts `python -m keras_mirror_kit.multi_worker.launch -n 2 ... -m tests.mw_child ...`."""
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "keras_mirror_kit.multi_worker.launch", "-n", "2",
               "--grace", "30", "--finish-window", "120", *launcher_args, "-m", "tests.mw_child",
               *child_args]  # fmt: skip
    proc = forkserver.popen(
        command,
        cwd=REPO,
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    proc.kmk_group = True  # type: ignore[attr-defined]
    return proc


def recorded_pids(out: Path) -> list[int]:
    """Every worker pid the job recorded (pids-<rank>.json, the latest attempt's)."""
    return [json.loads(p.read_text())["pid"] for p in sorted(out.glob("pids-*.json"))]


def mw_sigterm(out: Path, ckpt: Path, after_steps: int, victim: int) -> dict[str, Any]:
    """Launches 2 workers and sends SIGTERM to worker `victim` after it trained `after_steps`.

    Returns:
        `returncode`, `exit_s` (SIGTERM to the launcher's exit), `stderr`, and per rank the
        worker's preempted-0-<rank>.json.
    """
    go = out / "go"
    proc = launch(out, mw_args(out, ckpt, "--mark-step", str(after_steps), "--hold-last-step",
                               str(go)))  # fmt: skip
    _wait_for(out / f"reached-0-{victim}", proc, f"worker {victim} until {after_steps} steps")
    pid = json.loads((out / f"pids-{victim}.json").read_text())["pid"]
    sent = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    go.write_text("the signal was sent")  # the last step may start now
    stdout, stderr = _finish(proc, recorded_pids(out))
    exit_s = time.monotonic() - sent
    ranks = [json.loads((out / f"preempted-0-{r}.json").read_text())
             if (out / f"preempted-0-{r}.json").exists() else None for r in (0, 1)]  # fmt: skip
    manifest = json.loads((ckpt / "manifest.json").read_text())
    return {
        "returncode": proc.returncode,
        "exit_s": exit_s,
        "stderr": stderr[-6000:],
        "workers": ranks,
        "latest": manifest["checkpoints"][-1],
        "pids": recorded_pids(out),
    }


def mw_to_the_end(out: Path, ckpt: Path, *launcher_args: str) -> subprocess.CompletedProcess[str]:
    """Launches (or resumes) the 2-worker job to its end."""
    proc = launch(out, mw_args(out, ckpt), *launcher_args)
    stdout, stderr = _finish(proc, recorded_pids(out))
    return subprocess.CompletedProcess([], proc.returncode, stdout, stderr)


def restart_job(
    out: Path, ckpt: Path, kills: list[tuple[int, int]], max_restarts: int
) -> dict[str, Any]:
    """`launch -n 2 --max-restarts K`: in attempt a, SIGKILL worker kills[a][1] once it
    trained kills[a][0] steps; the last attempt runs to the end.

    Returns:
        `returncode`, `stderr`, `killed` (pids), `pids` (every worker pid seen).
    """
    marks = ",".join(str(steps) for steps, _ in kills)
    hold = out / "go-{attempt}"
    (out).mkdir(parents=True, exist_ok=True)
    (out / f"go-{len(kills)}").write_text("no kill planned in this attempt")
    proc = launch(out, mw_args(out, ckpt, "--mark-step", marks, "--hold-last-step", str(hold)),
                  "--max-restarts", str(max_restarts))  # fmt: skip
    seen: list[int] = []
    killed: list[int] = []
    try:
        for attempt, (_, victim) in enumerate(kills):
            _wait_for(out / f"reached-{attempt}-{victim}", proc, f"attempt {attempt}")
            pids = recorded_pids(out)
            seen += pids
            pid = json.loads((out / f"pids-{victim}.json").read_text())["pid"]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            (out / f"go-{attempt}").write_text("the kill was sent")
        stdout, stderr = _finish(proc, seen)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=60)
    seen += recorded_pids(out)
    return {"returncode": proc.returncode, "stderr": stderr, "killed": killed, "pids": seen}
