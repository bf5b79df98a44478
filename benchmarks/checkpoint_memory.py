"""Host memory and training time of one checkpoint save of a big model: the kit's synchronous
and asynchronous saves against Keras' own `BackupAndRestore`, on the same run.

Each configuration is a fresh Python process (peak RSS is per process), one after the
other, running the same job: 2 simulated replicas on the CPU, an MLP of 3 x Dense(4096)
layers (50.3M float32 parameters) with Adam, so the training state (weights and Adam's two
moments) is 576 MiB; a `fit` of a global batch of 16 that saves every `--save-every` steps,
`--saves` times: a fit of `--saves` x `--save-every` steps, the last save at the end of the
epoch (whose background write `fit` waits for).

* `none`: no checkpoint (the run the others are measured against).
* `kit-sync`: `kmk.SyncedCheckpoint(save_freq=N)`.
* `kit-async`: `kmk.SyncedCheckpoint(save_freq=N, async_save=True)`.
* `keras`: `keras.callbacks.BackupAndRestore(save_freq=N)` (weights and optimizer in one
  `.weights.h5`, written in place).

Figures:

* extra peak host memory of the saves = peak RSS of the process (`ru_maxrss`) minus the
  peak RSS of the `none` process of the same round, as a multiple of the state size
  (median over rounds); also from the lowest peak of each configuration over the rounds
  (TensorFlow's own peak during training varies by a 64 MiB block or two from run to run
  with the timing of its threads, in the `none` run too: that noise only adds, so the
  lowest peaks show what the saves need); and within the run: the peak after the first
  save minus the peak before it.
* the training time a save costs = the time from the first save's step to the end of `fit`
  (its last write included), minus as many steps at the median step time of the same run
  before the first save, divided by the number of saves, in seconds; and steps/s before
  the first save and over that stretch. For `kit-async` this includes the snapshot, the
  background writer's competition for the CPUs and any wait at the next save or at the end
  of `fit`. The `none` run's figure, computed alike, is the noise floor.

Targets (issue 12): synchronous extra peak <= 0.25x the state, asynchronous <= 1.1x; the
asynchronous save costs the loop <= 10% of what the synchronous one blocks it.

Usage:

    python benchmarks/checkpoint_memory.py                 # 1 round of the 4 processes
    python benchmarks/checkpoint_memory.py --rounds 3 --saves 3 --save-every 16

This is a script, not a test: it prints its figures and asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _fresh import ROOT, run_fresh  # benchmarks/_fresh.py (scripts run from benchmarks/)
from _report import say  # benchmarks/_report.py

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(ROOT))  # run from a checkout

MODES = ("none", "kit-sync", "kit-async", "keras")
REPLICAS, GLOBAL_BATCH, WIDTH, LAYERS = 2, 16, 4096, 3
MIB = 1024**2


def peak_bytes() -> int:
    """This process's peak resident set size so far, in bytes (Linux reports KiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) * (1 if sys.platform == "darwin" else 1024)


# -- child: one process, one configuration --------------------------------------------------


def child(mode: str, saves: int, save_every: int, directory: str, result_file: str) -> int:
    """Runs one configuration in this fresh process and writes its figures as JSON."""
    import keras_mirror_kit as kmk

    kmk.simulate_replicas(REPLICAS, device_type="CPU")

    import keras
    import numpy as np

    @kmk.distributed(global_batch_size=GLOBAL_BATCH)
    def build() -> keras.Model:
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((WIDTH,))]
            + [keras.layers.Dense(WIDTH, activation="relu") for _ in range(LAYERS - 1)]
            + [keras.layers.Dense(WIDTH)]
        )
        model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
        return model

    model = build()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(GLOBAL_BATCH * 4, WIDTH)).astype("float32")
    dataset = kmk.make_dataset(x, x, GLOBAL_BATCH, seed=0)

    ends: list[float] = []
    peaks: list[int] = []
    finished: list[float] = []

    class Clock(keras.callbacks.Callback):
        """Listed last: each step's end, after every callback (a save's blocking included)."""

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            ends.append(time.perf_counter())
            peaks.append(peak_bytes())

        def on_train_end(self, logs: Any = None) -> None:  # after the last write landed
            finished.append(time.perf_counter())

    callbacks: list[keras.callbacks.Callback] = []
    if mode in ("kit-sync", "kit-async"):
        callbacks.append(
            kmk.SyncedCheckpoint(
                directory, save_freq=save_every, async_save=mode == "kit-async", keep=1
            )
        )
    elif mode == "keras":
        callbacks.append(keras.callbacks.BackupAndRestore(directory, save_freq=save_every))
    start = time.perf_counter()
    model.fit(
        dataset.repeat(),
        epochs=1,
        steps_per_epoch=save_every * saves,
        verbose=0,
        callbacks=[*callbacks, Clock()],
    )
    variables = [*model.variables, *model.optimizer.variables]
    state = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables)
    result = {
        "mode": mode,
        "state_bytes": state,
        "params": int(model.count_params()),
        "step_ends": [t - start for t in ends],
        "fit_end": finished[0] - start,
        "saves": saves,
        "peaks": peaks,
        "end_peak": peak_bytes(),
    }
    Path(result_file).write_text(json.dumps(result))
    return 0


# -- parent ---------------------------------------------------------------------------------


def step_times(result: dict[str, Any]) -> list[float]:
    """Seconds of each step (from the previous step's end; the first from the fit's start)."""
    ends = result["step_ends"]
    return [b - a for a, b in zip([0.0, *ends[:-1]], ends)]


def figures(result: dict[str, Any], baseline: dict[str, Any] | None, save_every: int) -> dict:
    """The memory and time figures of one process."""
    times = step_times(result)
    first = save_every - 1  # 0-based index of the step whose callbacks run the first save
    before = times[1:first]  # the steps before the first save (not the 1st: tracing)
    base = statistics.median(before)
    ends = result["step_ends"]
    # From the end of the step before the first save to the end of fit (last write included).
    stretch = result["fit_end"] - ends[first - 1]
    steps = len(times) - first
    peaks = result["peaks"]
    out = {
        "state_mib": result["state_bytes"] / MIB,
        "peak_mib": result["end_peak"] / MIB,
        "within_run_extra_mib": (max(peaks[first:]) - peaks[first - 1]) / MIB,
        "save_cost_s": (stretch - base * steps) / result["saves"],
        "steps_per_s_before": 1 / base,
        "steps_per_s_window": steps / stretch,
    }
    if baseline is not None:
        out["extra_mib"] = (result["end_peak"] - baseline["end_peak"]) / MIB
    return out


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark (or, with `--child`, one configuration) and prints its figures.

    Args:
        argv: Command-line arguments (default: `sys.argv[1:]`).

    Returns:
        The exit status: 0, or 1 if a process failed.

    Example:

    ```python
    main(["--rounds", "1"])
    ```
    """
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--rounds", type=int, default=1, help="rounds of the 4 processes")
    parser.add_argument("--saves", type=int, default=3, help="saves in the fit")
    parser.add_argument("--save-every", type=int, default=16, help="steps between saves")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds allowed per run")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--directory", help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child, args.saves, args.save_every, args.directory, args.result_file)
    if args.rounds <= 0 or args.saves <= 0 or args.save_every < 4:
        parser.error("--rounds and --saves must be positive and --save-every >= 4")

    from importlib.metadata import version

    say(f"command: python benchmarks/checkpoint_memory.py {' '.join(sys.argv[1:])}".rstrip())
    say(
        f"TensorFlow {version('tensorflow')}, Keras {version('keras')}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.2f}; {REPLICAS} simulated replicas, global batch "
        f"{GLOBAL_BATCH}, {LAYERS} x Dense({WIDTH}) with Adam, {args.saves} saves, one every "
        f"{args.save_every} steps (the last at the epoch's end); {args.rounds} round(s) "
        "of fresh processes"
    )
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    failed = 0
    with tempfile.TemporaryDirectory(dir=os.environ.get("KMK_BENCH_DIR")) as tmp:
        for r in range(args.rounds):
            order = MODES[r % len(MODES) :] + MODES[: r % len(MODES)]
            for mode in order:
                result_file = Path(tmp) / f"{mode}-{r}.json"
                directory = Path(tmp) / f"ckpt-{mode}-{r}"
                command = [
                    sys.executable, str(Path(__file__).resolve()), "--child", mode,
                    "--saves", str(args.saves), "--save-every", str(args.save_every),
                    "--directory", str(directory), "--result-file", str(result_file),
                ]  # fmt: skip
                result, error, seconds = run_fresh(command, result_file, timeout=args.timeout)
                if error is not None:
                    failed += 1
                    say(f"  round {r + 1} {mode} failed: {error}")
                    continue
                results[mode].append(result)
                say(f"  round {r + 1} {mode}: peak {result['end_peak'] / MIB:.0f} MiB, "
                    f"{seconds:.0f} s")  # fmt: skip

    say()
    rows: dict[str, dict[str, float]] = {}
    for mode in MODES:
        per_round = []
        for r, result in enumerate(results[mode]):
            baseline = results["none"][r] if r < len(results["none"]) else None
            per_round.append(figures(result, baseline, args.save_every))
        if per_round:
            rows[mode] = {k: statistics.median(f[k] for f in per_round) for k in per_round[0]}
    if not rows:
        return 1
    state = next(iter(rows.values()))["state_mib"]
    lowest = {m: min(r["end_peak"] for r in results[m]) / MIB for m in MODES if results[m]}
    for mode, row in rows.items():
        if "none" in lowest:
            row["lowest_extra_mib"] = lowest[mode] - lowest["none"]
    say(f"training state: {state:.0f} MiB (median over rounds below)")
    say(
        f"  {'configuration':<14} {'peak RSS':>9} {'extra vs none':>15} {'lowest peaks':>15} "
        f"{'within run':>15} "
        f"{'cost/save':>10} {'steps/s before':>15} {'steps/s from save':>18}"
    )
    for mode, row in rows.items():
        extra = row.get("extra_mib")
        extra_text = f"{extra:.0f} ({extra / state:.2f}x)" if extra is not None else "-"
        low = row.get("lowest_extra_mib")
        low_text = f"{low:.0f} ({low / state:.2f}x)" if low is not None else "-"
        within = row["within_run_extra_mib"]
        cost = f"{row['save_cost_s']:.2f} s" + (" (noise)" if mode == "none" else "")
        say(
            f"  {mode:<14} {row['peak_mib']:>5.0f} MiB {extra_text:>15} {low_text:>15} "
            f"{f'{within:.0f} ({within / state:.2f}x)':>15} {cost:>10} "
            f"{row['steps_per_s_before']:>15.2f} {row['steps_per_s_window']:>18.2f}"
        )
    if "kit-sync" in rows and "kit-async" in rows:
        sync, asynchronous = rows["kit-sync"], rows["kit-async"]
        say()
        for name, row, target in (("sync", sync, 0.25), ("async", asynchronous, 1.1)):
            for key, how in (("extra_mib", "median"), ("lowest_extra_mib", "lowest peaks")):
                if key in row:
                    ratio = row[key] / state
                    verdict = "PASS" if ratio <= target else "FAIL"
                    say(
                        f"target: {name} extra peak <= {target}x the state ({how}): "
                        f"{ratio:.2f}x -> {verdict}"
                    )
        if sync["save_cost_s"] > 0:
            share = asynchronous["save_cost_s"] / sync["save_cost_s"]
            verdict = "PASS" if share <= 0.10 else "FAIL"
            costs = f"{asynchronous['save_cost_s']:.2f} / {sync['save_cost_s']:.2f} s"
            say(
                f"target: async save cost <= 10% of the sync's: {costs} = {share:.0%} -> {verdict}"
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
