"""Seeded SIGKILL trials of file-source jobs: an image folder and TFRecords, both save modes.

`tests/test_data_kill_trials.py` runs three; this script runs `--trials` (default 10) per
job (an augmented `kmk.image_dataset_from_directory` job, a `kmk.tfrecord_dataset` job) and
per save mode (`SyncedCheckpoint(async_save=False)` and `True`). Each trial SIGKILLs the
training process right after a seeded training step (seed 20261202 + job and mode), then
one process per job trains the uninterrupted run twice and resumes every trial: each must
resume from a save point no later than its kill (with synchronous saves, the last one
before it; with asynchronous saves, one still being written is lost), train no step
twice, and end with the uninterrupted weights.

Usage:

    python benchmarks/data_sigkill_trials.py              # about 15 minutes on 2 CPUs
    python benchmarks/data_sigkill_trials.py --trials 3

This is a script, not a test: it prints its figures (and exits 1 if a trial failed).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from _fresh import ROOT  # benchmarks/_fresh.py (scripts run from benchmarks/)
from _report import say  # benchmarks/_report.py

sys.path.insert(0, str(ROOT))  # run from a checkout
os.environ.pop("TF_CONFIG", None)

from tests.data_kill_trials import check_trial, kill_points, run_trials  # noqa: E402

SEED = 20261202


def main() -> int:
    """Runs the trials and prints one line per trial and a table (1 if any failed)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=10)
    args = parser.parse_args()
    say(f"command: python benchmarks/data_sigkill_trials.py --trials {args.trials}; "
        f"load {os.getloadavg()[0]:.2f}")  # fmt: skip
    rows, failed = [], 0
    for offset, job in enumerate(("images", "records")):
        plan = []
        for mode_offset, async_save in enumerate((False, True)):
            steps = kill_points(args.trials, SEED + 10 * offset + mode_offset)
            plan += [(step, async_save) for step in steps]
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f"kmk-{job}-kills-") as root:
            result = run_trials(Path(root), {job: {"trials": plan, "twice": True}})[job]
        seconds = time.perf_counter() - start
        say(f"{job}: two uninterrupted runs differ by {result['uninterrupted_diff']}")
        for async_save in (False, True):
            passed, diffs = 0, []
            for resumed in result["resumed"]:
                if resumed["async_save"] != async_save:
                    continue
                try:
                    check_trial(resumed)
                    passed += 1
                except AssertionError:
                    failed += 1
                    say(f"FAILED: {resumed}")
                diffs.append(resumed["diff"])
                say(f"  {job} {'async' if async_save else 'sync'}: killed after step "
                    f"{resumed['step']}, restored step {resumed['restored_step']}, trained "
                    f"{resumed['trained']}, max |dw| {resumed['diff']:.3g}")  # fmt: skip
            rows.append((job, async_save, passed, len(diffs), max(diffs), seconds))
    say()
    say("| job | save mode | exact resumes | max weight difference | job time (both modes) |")
    say("|---|---|---:|---:|---:|")
    for job, async_save, passed, total, worst, seconds in rows:
        mode = "async_save=True" if async_save else "synchronous"
        say(f"| {job} | {mode} | {passed}/{total} | {worst:.3g} | {seconds:.0f} s |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
