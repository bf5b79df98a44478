"""SIGKILL between two optimizer updates (gradient accumulation, N = 4): all seeded trials.

Runs the uninterrupted job and 10 jobs each killed (SIGKILL) right after a seeded training
step that is not an update boundary, on 2 simulated replicas, with checkpoints every 3
steps (so the newest checkpoint also holds a partial accumulation); resumes them all and
prints, per trial, where it was killed, the checkpoint it resumed from and the largest
absolute weight difference to the uninterrupted run. The test suite runs 3 of these trials
(`tests/test_gradient_accumulation.py`).

    python benchmarks/accumulation_kill_trials.py [--trials 10] [--seed 20261201]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    from tests.test_gradient_accumulation import ALL_TRIALS, SEED, kill_trials

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=ALL_TRIALS)
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kmk-accum-kill-") as root:
        rows = kill_trials(Path(root), args.trials, seed=args.seed)
    print(f"{'trial':>5} {'killed after step':>17} {'resumed from step':>17} {'max |diff|':>11}")
    for i, row in enumerate(rows):
        restored = "-" if row["restored_step"] is None else row["restored_step"]
        print(f"{i:>5} {row['killed_after_step']:>17} {restored:>17} {row['max_abs_diff']:>11.3g}")
    worst = max(row["max_abs_diff"] for row in rows)
    ok = worst <= 1e-6 and all(row["micro_steps"] == 18 for row in rows)
    print(f"{len(rows)} trials, worst max |diff| {worst:.3g} ({'<=' if ok else '>'} 1e-6)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
