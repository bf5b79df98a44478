"""Scaling: training samples/sec of the tutorial's CNN on 1 replica versus 2, fresh processes.

Each run is one `keras-mirror-kit bench` (keras_mirror_kit/cli/bench.py) process: the tutorial's
CNN, synthetic CIFAR-shaped data through `kmk.make_dataset`, `ThroughputMonitor` (3 warm-up
steps left out), one epoch of `--steps` steps. The runs of a round go in an order that
rotates from round to round; the figures are the median over the rounds, the spread, and
the median of the per-round ratios.

Devices:

* default: the CPU (GPUs hidden), 2 replicas simulated by splitting the CPU into 2 logical
  devices (`kmk.simulate_replicas(2)`). Both replicas share the same cores, so they add no
  compute: this shows what the replication costs or saves (all-reduce, split batches, a
  larger global batch), not a multi-device speed-up.
* `--gpu-split`: the first GPU alone (others hidden) for 1 replica, versus the same GPU split
  into 2 logical GPUs (`kmk.simulate_replicas(2)` splits the first GPU; 2048 MiB each) for
  2 replicas. Needs a GPU host; also informational (one chip either way).

Three runs per round: 1 replica at the per-replica batch (64), 1 replica at twice that
(128, the 2-replica run's global batch) and 2 replicas at 64 each. 2 replicas versus the
first is the usual (weak) scaling figure; versus the second, at the same global batch, it
isolates what the replication itself costs. There is no pass/fail target: the figures are
informational.

Usage:

    python benchmarks/scaling.py                   # CPU, 4 rounds of 200 steps
    python benchmarks/scaling.py --rounds 3 --steps 100
    python benchmarks/scaling.py --gpu-split       # on a GPU host

This is a script, not a test: it prints its figures and asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _fresh import child_env, run_fresh  # benchmarks/_fresh.py (run from there)
from _report import say  # benchmarks/_report.py


def visible_gpus(env: dict[str, str]) -> int:
    """How many GPUs TensorFlow sees with `env` (asked in a throwaway process)."""
    probe = (
        "import os; os.environ['TF_CPP_MIN_LOG_LEVEL'] = '3'; import tensorflow as tf; "
        "print(len(tf.config.list_physical_devices('GPU')))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=False
    )
    try:
        return int(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return 0


def describe_device(env: dict[str, str], gpu_split: bool) -> str:
    """A one-line description of the device the replicas run on."""
    if gpu_split:
        probe = (
            "import os; os.environ['TF_CPP_MIN_LOG_LEVEL'] = '3'; import tensorflow as tf; "
            "g = tf.config.list_physical_devices('GPU')[0]; "
            "print(tf.config.experimental.get_device_details(g).get('device_name', g.name))"
        )
        proc = subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=False
        )
        name = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "GPU"
        return f"GPU: {name} (2 replicas = this GPU split into 2 logical GPUs)"
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU: {model}, {os.cpu_count()} cores (2 replicas = the CPU split into 2)"


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark and prints its figures.

    Args:
        argv: Command-line arguments (default: `sys.argv[1:]`).

    Returns:
        The exit status: 0, 1 if a run failed, 2 if `--gpu-split` finds no GPU.

    Example:

    ```python
    main(["--rounds", "2", "--steps", "50"])
    ```
    """
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--rounds", type=int, default=4, help="rotating rounds")
    parser.add_argument("--steps", type=int, default=200, help="measured steps per run")
    parser.add_argument("--per-replica-batch-size", type=int, default=64)
    parser.add_argument(
        "--gpu-split",
        action="store_true",
        help="1 GPU versus the same GPU split into 2 logical GPUs (needs a GPU)",
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds allowed per run")
    args = parser.parse_args(argv)
    if args.rounds <= 0 or args.steps <= 0 or args.per_replica_batch_size <= 0:
        parser.error("--rounds, --steps and --per-replica-batch-size must be positive")

    from importlib.metadata import version

    env = child_env(args.gpu_split)
    if args.gpu_split and visible_gpus(env) < 1:
        sys.stderr.write("error: --gpu-split needs a GPU, and TensorFlow sees none here\n")
        return 2
    say(f"command: python benchmarks/scaling.py {' '.join(sys.argv[1:])}".rstrip())
    say(
        f"TensorFlow {version('tensorflow')}, Keras {version('keras')}, load average "
        f"{os.getloadavg()[0]:.2f}; {describe_device(env, args.gpu_split)}; per-replica batch "
        f"{args.per_replica_batch_size}, {args.steps} steps per run, {args.rounds} rounds"
    )
    b = args.per_replica_batch_size
    conditions = {  # label: (replicas, per-replica batch)
        f"1 replica, batch {b}": (1, b),
        f"1 replica, batch {2 * b}": (1, 2 * b),
        f"2 replicas, batch {b} each": (2, b),
    }
    labels = list(conditions)
    rates: dict[str, list[float]] = {label: [] for label in labels}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = labels[r % len(labels) :] + labels[: r % len(labels)]
            for label in order:
                replicas, batch = conditions[label]
                out = Path(tmp) / f"round{r}-{replicas}-{batch}.json"
                command = [
                    sys.executable, "-m", "keras_mirror_kit.cli", "bench",
                    "--replicas", str(replicas), "--steps", str(args.steps),
                    "--per-replica-batch-size", str(batch),
                    "--timeout", str(args.timeout), "--json", str(out),
                ]  # fmt: skip
                result, error, _ = run_fresh(command, out, env=env)
                if error is not None:
                    say(f"round {r + 1}, {label} failed ({error})")
                    return 1
                rates[label].append(float(result[0]["samples_per_sec"]))
            say(f"round {r + 1}: " + ", ".join(f"{k}: {rates[k][-1]:.0f}" for k in labels))
    say(f"load average at the end: {os.getloadavg()[0]:.2f}")

    say()
    say("training samples per second (ThroughputMonitor, 3 warm-up steps excluded)")
    weak, same_global, two = labels
    say(
        f"  {'run':<26} {'global':>6} {'median':>8} {'min-max':>12} {'per replica':>12} "
        f"{'vs 1st':>7} {'vs 2nd':>7}"
    )
    for label in labels:
        replicas, batch = conditions[label]
        values = rates[label]
        median = statistics.median(values)
        vs = [
            statistics.median(v / w for v, w in zip(values, rates[ref], strict=True))
            for ref in (weak, same_global)
        ]
        say(
            f"  {label:<26} {replicas * batch:>6} {median:>8.0f} "
            f"{f'{min(values):.0f}-{max(values):.0f}':>12} {median / replicas:>12.0f} "
            f"{vs[0]:>7.3f} {vs[1]:>7.3f}"
        )
    say(
        "vs 1st / vs 2nd: median over rounds of the run's samples/sec over the 1st / 2nd "
        "run's in the same round."
    )
    for ref, what in (
        (weak, "the same per-replica batch (weak scaling)"),
        (same_global, "the same global batch (the cost of replication)"),
    ):
        per_round = [v / w for v, w in zip(rates[two], rates[ref], strict=True)]
        ratio = statistics.median(per_round)
        say(
            f"2 replicas vs 1 at {what}: {ratio:.3f} ({min(per_round):.3f}-"
            f"{max(per_round):.3f}), {abs(1 - ratio) * 100:.0f}% "
            f"{'slower' if ratio < 1 else 'faster'}"
        )
    say(
        "target: none (informational): "
        + (
            "one GPU either way."
            if args.gpu_split
            else "both replicas share the same CPU cores, so 2 replicas cannot add compute."
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
