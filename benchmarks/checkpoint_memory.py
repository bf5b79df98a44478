"""Host memory and training time of the checkpoints of a big model: the kit's synchronous
and asynchronous saves against Keras' own `BackupAndRestore`, on the same run.

Each configuration is a fresh Python process (peak RSS is per process), one after the
other, running the same job: 2 simulated replicas on the CPU, an MLP of 3 x Dense(4096)
layers (50.3M float32 parameters) with Adam, so the training state (weights and Adam's two
moments) is 576 MiB; a `fit` of a global batch of 16 that saves `--saves` times, every
`--save-every` steps, on one of two schedules (`--schedules`):

* `step`: one epoch of `--saves` x `--save-every` steps, `save_freq=--save-every` (the
  last save at the end of the epoch, whose background write `fit` waits for);
* `epoch`: `--saves` epochs of `--save-every` steps, `save_freq="epoch"`.

Configurations, each on each schedule:

* `none`: no checkpoint (the run the others of its schedule are measured against).
* `kit-sync`: `kmk.SyncedCheckpoint(save_freq=...)` (a fit from scratch: it also writes
  the state it starts from, `fit-start.kmk`, for a retry of the `fit`).
* `kit-async`: `kmk.SyncedCheckpoint(save_freq=..., async_save=True)` (the default
  `async_host_memory=0.2`: the last variables that fit in a fifth of the state are staged
  and written in the background, the others before training goes on).
* `kit-async-all`: the same with `async_host_memory=1.0` (the whole state staged: one host
  copy of it, every value written in the background).
* `keras`: `keras.callbacks.BackupAndRestore(save_freq=...)` (weights and optimizer in one
  `.weights.h5`, written in place).

Figures:

* extra peak host memory of the saves = peak RSS of the process (`ru_maxrss`) minus the
  peak RSS of the `none` process of the same round, as a multiple of the state size
  (median over rounds); also from the lowest peak of each configuration over the rounds
  (TensorFlow's own peak during training varies by a 64 MiB block or two from run to run
  with the timing of its threads, in the `none` run too: that noise only adds, so the
  lowest peaks show what the saves need); and within the run: the peak after the first
  save minus the peak before it.
* the time at the start of `fit`: the callbacks' `on_train_begin` (for the kit: the lock,
  the checks, the write of `fit-start.kmk`, and with `async_save` the staging arrays); and
  the wall time of the write of `fit-start.kmk` itself (with `async_save` in the
  background, after `on_train_begin` returned).
* the training time a save costs = the time from the first save's step to the end of `fit`
  (its last write included), minus as many steps at the median step time of the same run
  before the first save, divided by the number of saves, in seconds; and steps/s before
  the first save and over that stretch. For `kit-async` this includes the snapshot, the
  background writer's competition for the CPUs and any wait at the next save or at the end
  of `fit`. The `none` run's figure, computed alike, is the noise floor.

Targets ("What the kit costs", issue 47, for both schedules): extra peak <= 0.25x the
state for synchronous saves and for asynchronous ones at the default share; with the whole
state staged (issue 12) <= 1.1x (one host copy of the state by design; the start state
must add nothing to it), and such a save costs the loop <= 10% of what the synchronous one
blocks it. The default asynchronous save's cost is printed beside the synchronous one's.

Usage:

    python benchmarks/checkpoint_memory.py                 # 1 round of the 8 processes
    python benchmarks/checkpoint_memory.py --rounds 3 --saves 3 --save-every 16
    python benchmarks/checkpoint_memory.py --schedules epoch   # 4 processes a round

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

MODES = ("none", "kit-sync", "kit-async", "kit-async-all", "keras")
SCHEDULES = ("step", "epoch")
REPLICAS, GLOBAL_BATCH, WIDTH, LAYERS = 2, 16, 4096, 3
MIB = 1024**2


def peak_bytes() -> int:
    """This process's peak resident set size so far, in bytes (Linux reports KiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) * (1 if sys.platform == "darwin" else 1024)


# -- child: one process, one configuration --------------------------------------------------


def machine() -> str:
    """The CPU this runs on (`lscpu`'s model name), its cores and memory."""
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        pages = 0
    return f"{model}, {os.cpu_count()} CPUs, {pages / 1024**3:.0f} GiB of memory"


def child(
    mode: str, schedule: str, saves: int, save_every: int, directory: str, result_file: str
) -> int:
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
    begun: list[float] = []
    start_writes: list[float] = []  # seconds of each write of fit-start.kmk (kit)

    from keras_mirror_kit.checkpoint.store import CheckpointStore

    if hasattr(CheckpointStore, "write_start"):  # timed wherever it runs (async: writer)
        write_start = CheckpointStore.write_start

        def timed_write_start(self: Any, *args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return write_start(self, *args, **kwargs)
            finally:
                start_writes.append(time.perf_counter() - began)

        CheckpointStore.write_start = timed_write_start  # type: ignore[method-assign]

    class Begin(keras.callbacks.Callback):
        """Listed first: when the callbacks' `on_train_begin` start."""

        def on_train_begin(self, logs: Any = None) -> None:
            begun.append(time.perf_counter())

    class Clock(keras.callbacks.Callback):
        """Listed last: each step's end, after every callback (a save's blocking included)."""

        def on_train_begin(self, logs: Any = None) -> None:
            begun.append(time.perf_counter())

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            ends.append(time.perf_counter())
            peaks.append(peak_bytes())

        def on_train_end(self, logs: Any = None) -> None:  # after the last write landed
            finished.append(time.perf_counter())

    callbacks: list[keras.callbacks.Callback] = []
    freq: str | int = "epoch" if schedule == "epoch" else save_every
    if mode.startswith("kit-"):
        staged = {"async_host_memory": 1.0} if mode == "kit-async-all" else {}  # else default
        asynchronous = mode != "kit-sync"
        callbacks.append(
            kmk.SyncedCheckpoint(
                directory, save_freq=freq, async_save=asynchronous, keep=1, **staged
            )
        )
    elif mode == "keras":
        callbacks.append(keras.callbacks.BackupAndRestore(directory, save_freq=freq))
    epochs = saves if schedule == "epoch" else 1
    start = time.perf_counter()
    model.fit(
        dataset.repeat(),
        epochs=epochs,
        steps_per_epoch=save_every * saves // epochs,
        verbose=0,
        callbacks=[Begin(), *callbacks, Clock()],
    )
    variables = [*model.variables, *model.optimizer.variables]
    state = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables)
    result = {
        "mode": mode,
        "schedule": schedule,
        "start_s": begun[1] - begun[0],
        "start_write_s": sum(start_writes),
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
        "start_s": result["start_s"],
        "start_write_s": result.get("start_write_s", 0.0),
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
    parser.add_argument("--rounds", type=int, default=1, help="rounds of the processes")
    parser.add_argument(
        "--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES), help="save schedules"
    )
    parser.add_argument("--schedule", choices=SCHEDULES, help=argparse.SUPPRESS)  # a child's
    parser.add_argument("--saves", type=int, default=3, help="saves in the fit")
    parser.add_argument("--save-every", type=int, default=16, help="steps between saves")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds allowed per run")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--directory", help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(
            args.child,
            args.schedule,
            args.saves,
            args.save_every,
            args.directory,
            args.result_file,
        )
    if args.rounds <= 0 or args.saves <= 0 or args.save_every < 4:
        parser.error("--rounds and --saves must be positive and --save-every >= 4")

    from importlib.metadata import version

    say(f"command: python benchmarks/checkpoint_memory.py {' '.join(sys.argv[1:])}".rstrip())
    say(f"machine: {machine()}")
    say(
        f"TensorFlow {version('tensorflow')}, Keras {version('keras')}, "
        f"load average {os.getloadavg()[0]:.2f}; {REPLICAS} simulated replicas, global batch "
        f"{GLOBAL_BATCH}, {LAYERS} x Dense({WIDTH}) with Adam, {args.saves} saves, one every "
        f"{args.save_every} steps (schedules: {', '.join(args.schedules)}); {args.rounds} "
        "round(s) of fresh processes"
    )
    runs = [(schedule, mode) for schedule in args.schedules for mode in MODES]
    results: dict[tuple[str, str], list[dict[str, Any]]] = {run: [] for run in runs}
    failed = 0
    with tempfile.TemporaryDirectory(dir=os.environ.get("KMK_BENCH_DIR")) as tmp:
        for r in range(args.rounds):
            for schedule, mode in runs[r % len(runs) :] + runs[: r % len(runs)]:
                name = f"{schedule}-{mode}-{r}"
                result_file = Path(tmp) / f"{name}.json"
                directory = Path(tmp) / f"ckpt-{name}"
                command = [
                    sys.executable, str(Path(__file__).resolve()), "--child", mode,
                    "--schedule", schedule,
                    "--saves", str(args.saves), "--save-every", str(args.save_every),
                    "--directory", str(directory), "--result-file", str(result_file),
                ]  # fmt: skip
                result, error, seconds = run_fresh(command, result_file, timeout=args.timeout)
                if error is not None:
                    failed += 1
                    say(f"  round {r + 1} {schedule} {mode} failed: {error}")
                    continue
                results[schedule, mode].append(result)
                say(f"  round {r + 1} {schedule} {mode}: peak {result['end_peak'] / MIB:.0f} "
                    f"MiB, {seconds:.0f} s")  # fmt: skip
    reported = [report(schedule, results, args.save_every) for schedule in args.schedules]
    return 1 if failed or not all(reported) else 0


def report(
    schedule: str, results: dict[tuple[str, str], list[dict[str, Any]]], save_every: int
) -> bool:
    """Prints the figures and targets of one schedule; False when nothing ran."""
    say()
    rows: dict[str, dict[str, float]] = {}
    baselines = results.get((schedule, "none"), [])
    for mode in MODES:
        per_round = []
        for r, result in enumerate(results.get((schedule, mode), [])):
            baseline = baselines[r] if r < len(baselines) else None
            per_round.append(figures(result, baseline, save_every))
        if per_round:
            rows[mode] = {k: statistics.median(f[k] for f in per_round) for k in per_round[0]}
    if not rows:
        return False
    state = next(iter(rows.values()))["state_mib"]
    lowest = {
        m: min(r["end_peak"] for r in results[schedule, m]) / MIB for m in rows
    }  # fmt: skip
    for mode, row in rows.items():
        if "none" in lowest:
            row["lowest_extra_mib"] = lowest[mode] - lowest["none"]
    say(f"{schedule} saves; training state: {state:.0f} MiB (median over rounds below)")
    say(
        f"  {'configuration':<14} {'peak RSS':>9} {'extra vs none':>15} {'lowest peaks':>15} "
        f"{'within run':>15} {'fit start':>10} {'start file write':>18} "
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
            f"{f'{within:.0f} ({within / state:.2f}x)':>15} {row['start_s']:>8.2f} s "
            f"{row['start_write_s']:>16.2f} s "
            f"{cost:>10} {row['steps_per_s_before']:>15.2f} {row['steps_per_s_window']:>18.2f}"
        )
    if "kit-sync" in rows:
        sync = rows["kit-sync"]
        say()
        targets = (("kit-sync", 0.25), ("kit-async", 0.25), ("kit-async-all", 1.1))
        for name, target in targets:
            row = rows.get(name, {})
            for key, how in (("extra_mib", "median"), ("lowest_extra_mib", "lowest peaks")):
                if key in row:
                    ratio = row[key] / state
                    verdict = "PASS" if ratio <= target else "FAIL"
                    say(
                        f"target ({schedule} saves): {name} extra peak <= {target}x the state "
                        f"({how}): {ratio:.2f}x -> {verdict}"
                    )
        for name in ("kit-async", "kit-async-all"):
            if name not in rows or sync["save_cost_s"] <= 0:
                continue
            share = rows[name]["save_cost_s"] / sync["save_cost_s"]
            verdict = (  # the default's unstaged part blocks the loop as a sync save does
                ("PASS" if share <= 0.10 else "FAIL") if name == "kit-async-all" else "no target"
            )
            say(
                f"({schedule} saves) {name} save cost / the sync's (target <= 10% for "
                f"kit-async-all): {rows[name]['save_cost_s']:.2f} / {sync['save_cost_s']:.2f} s "
                f"= {share:.0%} -> {verdict}"
            )
    return True


if __name__ == "__main__":
    sys.exit(main())
