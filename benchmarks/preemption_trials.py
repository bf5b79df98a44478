"""Preemption and restart trials: SIGTERM mid-training, and SIGKILL under `launch --max-restarts`.

Three kinds of seeded trials (10 each by default), every one a separate job from an empty
checkpoint directory, each kill point chosen in training progress (a step marker), never
in seconds:

1. one process (tests.ckpt_child: 2 simulated replicas, Adam, 5 epochs of 6 steps, saves
   every 4): SIGTERM once a seeded step has ended; the process must exit with status 75
   within (longest step + its last save + 5 s), its newest checkpoint must be the step it
   reached, and a resumed run must end within 1e-6 of the uninterrupted weights;
2. two workers (tests.mw_child --tiny through `keras-mirror-kit launch -n 2`, 4 epochs of 8
   steps, saves every 2): SIGTERM to a seeded worker after a seeded number of steps; both
   workers must save at the same step and exit with status 75 within the same bound, and a
   resumed 2-worker run must end within 1e-6 of the uninterrupted run;
3. `launch -n 2 --max-restarts 3`: a seeded worker SIGKILLed after a seeded number of
   steps; the job must end with status 0, the uninterrupted weights (1e-6), and no process
   left behind.

Usage: python benchmarks/preemption_trials.py [--trials 10] [--kinds single,workers,restart]
Prints one line per trial and a summary per kind. About 40-60 s per trial on 2 CPUs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests import preemption_runs as runs  # noqa: E402
from tests.processes import alive  # noqa: E402

SEED = 20261130
SLACK_S = 5.0


def _single(root: Path, rng: random.Random, trials: int) -> list[dict]:
    reference = runs.ckpt_to_the_end(root / "reference" / "ckpt", root / "reference.npz")
    assert reference["iterations"] == runs.CKPT_STEPS
    ref_weights = runs.weights_of(root / "reference.npz")
    rows = []
    for trial in range(trials):
        directory = root / f"single-{trial}" / "ckpt"
        directory.parent.mkdir(parents=True)
        marker = rng.randint(1, runs.CKPT_STEPS - 3)
        stop = runs.ckpt_sigterm(directory, marker)
        epoch, step, global_step = stop["preempted"]
        latest = stop["latest"]
        named = (latest["epoch"], latest["step"], latest["global_step"]) == (
            epoch,
            step,
            global_step,
        ) and global_step == stop["iterations"] >= marker
        bound = stop["step_s"] + stop["save_s"] + SLACK_S
        final = runs.ckpt_to_the_end(directory, directory.parent / "final.npz")
        diff = runs.max_diff(ref_weights, runs.weights_of(directory.parent / "final.npz"))
        rows.append(
            {
                "trial": trial,
                "at": f"after step {marker}",
                "status": stop["returncode"],
                "saved": global_step,
                "exit_s": stop["exit_s"],
                "bound_s": bound,
                "named": named,
                "diff": diff,
                "ok": stop["returncode"] == 75
                and named
                and stop["exit_s"] <= bound
                and final["iterations"] == runs.CKPT_STEPS
                and diff <= 1e-6,
            }
        )
        _print_row("single", rows[-1])
    return rows


def _workers(root: Path, rng: random.Random, trials: int, reference: list) -> list[dict]:
    rows = []
    for trial in range(trials):
        victim, after = rng.randint(0, 1), rng.randint(1, runs.MW_STEPS - 4)
        ckpt = root / f"workers-{trial}" / "ckpt"
        stop = runs.mw_sigterm(root / f"workers-{trial}" / "stop", ckpt, after, victim)
        chief, worker = stop["workers"]
        same = chief is not None and worker is not None and chief["saved"] == worker["saved"]
        latest = stop["latest"]
        named = (
            same and [latest["epoch"], latest["step"], latest["global_step"]] == (chief["saved"])
        )
        bound = (
            max(chief["step_s"], worker["step_s"]) + max(chief["save_s"], worker["save_s"])
            if same
            else 0.0
        ) + SLACK_S
        out = root / f"workers-{trial}" / "final"
        done = runs.mw_to_the_end(out, ckpt)
        last = f"e{runs.MW_EPOCHS - 1}_"
        diff = (
            runs.max_diff(reference, runs.weights_of(out / "weights-0.npz", last))
            if done.returncode == 0
            else float("inf")
        )
        left = [pid for pid in stop["pids"] + runs.recorded_pids(out) if alive(pid)]
        rows.append(
            {
                "trial": trial,
                "at": f"worker {victim} after {after} steps",
                "status": stop["returncode"],
                "saved": chief["saved"][2] if same else None,
                "exit_s": stop["exit_s"],
                "bound_s": bound,
                "named": named,
                "diff": diff,
                "ok": stop["returncode"] == 75
                and named
                and stop["exit_s"] <= bound
                and diff <= 1e-6
                and not left,
            }
        )
        _print_row("workers", rows[-1])
    return rows


def _restart(root: Path, rng: random.Random, trials: int, reference: list) -> list[dict]:
    rows = []
    for trial in range(trials):
        victim, after = rng.randint(0, 1), rng.randint(1, runs.MW_STEPS - 4)
        out, ckpt = root / f"restart-{trial}" / "job", root / f"restart-{trial}" / "ckpt"
        began = time.monotonic()
        job = runs.restart_job(out, ckpt, [(after, victim)], max_restarts=3)
        last = f"e{runs.MW_EPOCHS - 1}_"
        diff = (
            runs.max_diff(reference, runs.weights_of(out / "weights-0.npz", last))
            if job["returncode"] == 0
            else float("inf")
        )
        left = [pid for pid in job["pids"] if alive(pid)]
        rows.append(
            {
                "trial": trial,
                "at": f"worker {victim} after {after} steps",
                "status": job["returncode"],
                "job_s": time.monotonic() - began,
                "left": len(left),
                "diff": diff,
                "ok": job["returncode"] == 0 and diff <= 1e-6 and not left,
            }
        )
        _print_row("restart", rows[-1])
    return rows


def _print_row(kind: str, row: dict) -> None:
    shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}
    print(f"  {kind:8s} " + " ".join(f"{k}={v}" for k, v in shown.items()), flush=True)


def _summary(kind: str, rows: list[dict]) -> None:
    if not rows:
        return
    passed = sum(r["ok"] for r in rows)
    line = f"{kind:8s} {passed}/{len(rows)} passed; max |dw| {max(r['diff'] for r in rows):.3g}"
    if "exit_s" in rows[0]:
        exits = [r["exit_s"] for r in rows]
        margins = [r["bound_s"] - r["exit_s"] for r in rows]
        line += (
            f"; SIGTERM to exit: median {statistics.median(exits):.2f} s, max "
            f"{max(exits):.2f} s; smallest margin to (step + save + 5 s): {min(margins):.2f} s; "
            f"checkpoint = step reached: {sum(r['named'] for r in rows)}/{len(rows)}"
        )
    else:
        line += (
            f"; job time median {statistics.median(r['job_s'] for r in rows):.1f} s; "
            f"processes left: {sum(r['left'] for r in rows)}"
        )
    print(line, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--kinds", default="single,workers,restart")
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    rng = random.Random(SEED)
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="kmk-preemption-") as tmp:
        root = Path(tmp)
        if "single" in kinds:
            results["single"] = _single(root, rng, args.trials)
        reference = None
        if "workers" in kinds or "restart" in kinds:
            reference = runs.mw_reference(root / "mw-reference")
        if "workers" in kinds:
            results["workers"] = _workers(root, rng, args.trials, reference)
        if "restart" in kinds:
            results["restart"] = _restart(root, rng, args.trials, reference)
    print()
    for kind, rows in results.items():
        _summary(kind, rows)
    return 0 if all(r["ok"] for rows in results.values() for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
