"""All ten seeded SIGKILL trials of tests/test_checkpoint_crash.py in both save modes.

The test suite runs the ten seeded kills with synchronous saves and three with
`async_save=True` (to keep the suite's time); this script runs the asynchronous test with all
ten (`KMK_ASYNC_SIGKILL_TRIALS=10`) next to the synchronous one, and prints pytest's verdict
and time for each. Each trial kills a training process with SIGKILL at a seeded point (a
file write and its stage, or a training step), then resumes it and checks that it resumes
from a good checkpoint and ends with the uninterrupted run's weights.

Usage:

    python benchmarks/checkpoint_sigkill_trials.py        # about 5-10 minutes on 2 CPUs

This is a script, not a test: it prints its figures and asserts nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from _fresh import ROOT, child_env  # benchmarks/_fresh.py (scripts run from benchmarks/)
from _report import say  # benchmarks/_report.py

TESTS = {
    "sync, 10 trials": "test_ten_seeded_random_sigkills_all_resume_to_the_uninterrupted_weights",
    "async, 10 trials": "test_seeded_random_sigkills_during_background_saves_resume_to_the_same"
    "_weights",
}


def main() -> int:
    """Runs both tests with ten trials each and prints their outcome.

    Returns:
        0 when both passed, else 1.

    Example:

    ```python
    main()
    ```
    """
    say(f"command: python benchmarks/checkpoint_sigkill_trials.py; load {os.getloadavg()[0]:.2f}")
    env = {**child_env(), "KMK_ASYNC_SIGKILL_TRIALS": "10"}
    failed = 0
    for label, name in TESTS.items():
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             f"tests/test_checkpoint_crash.py::{name}"],
            cwd=ROOT, env=env, capture_output=True, text=True, check=False,
        )  # fmt: skip
        seconds = time.perf_counter() - start
        verdict = "passed" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
        failed += proc.returncode != 0
        say(f"{label}: {verdict} in {seconds:.0f} s")
        if proc.returncode:
            say("\n".join(proc.stdout.strip().splitlines()[-20:]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
