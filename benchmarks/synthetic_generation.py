"""Speed of `kmk.datasets.make_synthetic_cifar10()`: CIFAR-10's sizes, 60,000 images.

Generates the default 50,000 training and 10,000 test images (32x32x3 uint8) `--rounds`
times in this process and prints the seconds and images per second of each round, with
their median. The test suite checks what the data is (tests/test_datasets_synthetic.py);
how fast it is made depends on the machine and its load, so it is measured here.

Target: 60,000 images in under 30 s on the reference machine (2 vCPUs, see
docs/benchmarks.md); the figure users wait for when `--data auto` falls back to synthetic
data.

Usage:

    python benchmarks/synthetic_generation.py              # 3 rounds
    python benchmarks/synthetic_generation.py --rounds 1

This is a script, not a test: it prints its figures and asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from _fresh import ROOT  # benchmarks/_fresh.py (scripts run from benchmarks/)
from _report import say  # benchmarks/_report.py

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(ROOT))  # run from a checkout

TARGET_S = 30.0


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark and prints its report.

    Args:
        argv: Command-line arguments (default: `sys.argv[1:]`).

    Returns:
        0.

    Example:

    ```
    python benchmarks/synthetic_generation.py --rounds 3
    ```
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="generations to time")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1. Received: --rounds {args.rounds}")

    from keras_mirror_kit.datasets import make_synthetic_cifar10

    say(
        f"make_synthetic_cifar10(): 50,000 + 10,000 images, {args.rounds} round(s); "
        f"load average at the start: {os.getloadavg()[0]:.2f}"
    )
    seconds: list[float] = []
    for round_ in range(1, args.rounds + 1):
        start = time.perf_counter()
        (x_train, _), (x_test, _) = make_synthetic_cifar10()
        elapsed = time.perf_counter() - start
        images = len(x_train) + len(x_test)
        seconds.append(elapsed)
        say(f"round {round_}: {elapsed:.2f} s, {images / elapsed:,.0f} images/s")
    median = statistics.median(seconds)
    verdict = "PASS" if median < TARGET_S else "FAIL"
    say(
        f"median {median:.2f} s ({60000 / median:,.0f} images/s), min-max "
        f"{min(seconds):.2f}-{max(seconds):.2f} s; target < {TARGET_S:g} s: {verdict}"
    )
    say(f"load average at the end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
