"""All ten seeded SIGKILL trials of the checkpoint tests in both save modes, on either backend.

The test suite runs three of the seeded kills with synchronous saves and three with
`async_save=True` on TensorFlow (tests/test_checkpoint_crash.py), and two synchronous and
one asynchronous on JAX (tests/test_jax_checkpoints.py), to keep the suite's time; this
script runs ten in each mode (`KMK_SIGKILL_TRIALS=10`, `KMK_ASYNC_SIGKILL_TRIALS=10`,
`KMK_JAX_SIGKILL_TRIALS=10`)
and prints pytest's verdict and time for each. Each trial kills a training process
(2 replicas: logical CPU devices on TensorFlow, simulated CPU devices on JAX) with SIGKILL
at a seeded point (a file write and its stage, or a training step), then resumes it and
checks that it resumes from a good checkpoint and ends with the uninterrupted run's weights.

Usage:

    python benchmarks/checkpoint_sigkill_trials.py                  # TensorFlow, 5-10 min
    python benchmarks/checkpoint_sigkill_trials.py --backend jax    # JAX, 10-15 min

This is a script, not a test: it prints its figures and asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from _fresh import ROOT, child_env  # benchmarks/_fresh.py (scripts run from benchmarks/)
from _report import say  # benchmarks/_report.py

TESTS = {
    "tensorflow": {
        "sync, 10 trials": "tests/test_checkpoint_crash.py::"
        "test_seeded_random_sigkills_all_resume_to_the_uninterrupted_weights",
        "async, 10 trials": "tests/test_checkpoint_crash.py::"
        "test_seeded_random_sigkills_during_background_saves_resume_to_the_same_weights",
    },
    # One test: 10 synchronous, then 10 asynchronous kills, resumed in one process.
    "jax": {
        "sync and async, 10 trials each": "tests/test_jax_checkpoints.py::"
        "test_seeded_sigkills_resume_to_the_uninterrupted_weights",
    },
}


def main(argv: list[str] | None = None) -> int:
    """Runs the tests of one backend with ten trials in each save mode; prints the outcome.

    Returns:
        0 when every test passed, else 1.

    Example:

    ```python
    main(["--backend", "jax"])
    ```
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=sorted(TESTS), default="tensorflow")
    backend = parser.parse_args(argv).backend
    say(
        f"command: python benchmarks/checkpoint_sigkill_trials.py --backend {backend}; "
        f"load {os.getloadavg()[0]:.2f}"
    )
    trials = {
        "KMK_SIGKILL_TRIALS": "10",
        "KMK_ASYNC_SIGKILL_TRIALS": "10",
        "KMK_JAX_SIGKILL_TRIALS": "10",
    }
    env = {**child_env(), **trials}
    failed = 0
    for label, name in TESTS[backend].items():
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", name],
            cwd=ROOT, env=env, capture_output=True, text=True, check=False,
        )  # fmt: skip
        seconds = time.perf_counter() - start
        verdict = "passed" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
        failed += proc.returncode != 0
        say(f"{backend}, {label}: {verdict} in {seconds:.0f} s")
        if proc.returncode:
            say("\n".join(proc.stdout.strip().splitlines()[-20:]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
