"""End-of-fit stall: seconds from `on_train_end` to `model.fit` returning, in fresh processes.

With 2 replicas, Keras' `fit` often returned seconds (up to about a minute) after its last
callback, the CPU idle and the main thread waiting in the destructor of the distributed
input iterator. The cause is a lost wake-up in TensorFlow's tf.data autotuning thread (see
`keras_mirror_kit.workarounds.tf_data_iterator_stall`); the kit's path avoids it. Each
run is a fresh Python process (the stall depends on thread timing, so it is a matter of
chance per process):
2 simulated replicas on the CPU, the tutorial's CNN, a `--steps`-step epoch of synthetic
CIFAR-shaped data, `--epochs` epochs. The paths alternate run by run:

* `tutorial`: the MirroredStrategy tutorial's code: `x / 255.0`, `from_tensor_slices`,
  `shuffle(10000)`, `batch`, `strategy.experimental_distribute_dataset`, model built and
  compiled in `strategy.scope()` (the strategy is given the 2 logical CPUs, as it would
  find 2 GPUs).
* `kit`: `kmk.distributed()`, `kmk.make_dataset`, `ThroughputMonitor` and
  `SyncedCheckpoint` every epoch (`distributed()` applies `tf_data_iterator_stall`).
* optional, for the diagnosis: `kit-no-workaround` (the kit's path with tf.data autotuning
  switched back on and `distributed()`'s `apply` undone) and `tutorial-workaround` (the
  tutorial's pipeline with
  `without_autotune` and `apply`).

A timestamping callback, last in the list, notes `on_train_end`; the stall is the time from
there to `fit` returning. With `--epochs` > 1 the gaps between an epoch's end and the next
epoch's first batch are reported too (the same stall, inside `fit`).

Target: the kit's stall is under 1 s in every one of 20 runs (the default).

Usage:

    python benchmarks/end_of_fit_stall.py                      # 20 runs per path, ~7 min
    python benchmarks/end_of_fit_stall.py --runs 10 --epochs 3
    python benchmarks/end_of_fit_stall.py --paths tutorial,kit,kit-no-workaround

This is a script, not a test: it prints its figures and asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
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

PATHS = ("tutorial", "kit", "kit-no-workaround", "tutorial-workaround")
PER_REPLICA_BATCH = 64
REPLICAS = 2


# -- child: one fit() in this fresh process ------------------------------------------------


def child(path: str, steps: int, epochs: int, result_file: str) -> int:
    """Trains one path for `epochs` epochs of `steps` steps and writes the timings as JSON."""
    import keras_mirror_kit as kmk

    kmk.simulate_replicas(REPLICAS, device_type="CPU")

    import keras
    import tensorflow as tf

    from keras_mirror_kit.datasets import make_synthetic_cifar10
    from keras_mirror_kit.workarounds import tf_data_iterator_stall

    global_batch = PER_REPLICA_BATCH * REPLICAS
    (x_train, y_train), _ = make_synthetic_cifar10(
        num_train=steps * global_batch, num_test=10, seed=0
    )
    marks: dict[str, Any] = {"gaps": []}

    class Stamp(keras.callbacks.Callback):
        def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
            marks["epoch_end"] = time.perf_counter()

        def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
            if batch == 0 and "epoch_end" in marks:
                marks["gaps"].append(time.perf_counter() - marks.pop("epoch_end"))

        def on_train_end(self, logs: dict | None = None) -> None:
            marks["train_end"] = time.perf_counter()

    callbacks: list[keras.callbacks.Callback] = []
    tmp = tempfile.TemporaryDirectory()
    if path.startswith("tutorial"):
        devices = [d.name for d in tf.config.list_logical_devices("CPU")]
        strategy = tf.distribute.MirroredStrategy(devices=devices)
        x_float = x_train / 255.0
        train_dataset = tf.data.Dataset.from_tensor_slices((x_float, y_train))
        train_dataset = train_dataset.shuffle(10000).batch(global_batch)
        if path == "tutorial-workaround":
            train_dataset = tf_data_iterator_stall.without_autotune(train_dataset)
        train_data = strategy.experimental_distribute_dataset(train_dataset)
        with strategy.scope():
            model = kmk.models.tutorial_cnn()
            model.compile(
                optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"]
            )
        if path == "tutorial-workaround":
            tf_data_iterator_stall.apply(model)
    else:

        @kmk.distributed(per_replica_batch_size=PER_REPLICA_BATCH)
        def build() -> keras.Model:
            model = kmk.models.tutorial_cnn()
            model.compile(
                optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"]
            )
            return model

        model = build()
        train_data = kmk.make_dataset(
            x_train,
            y_train,
            build.distribution.global_batch_size,
            seed=0,
            preprocess=kmk.rescale(),
        )
        callbacks += [
            kmk.ThroughputMonitor(),
            kmk.SyncedCheckpoint(tmp.name, dataset=train_data),
        ]
        if path == "kit-no-workaround":  # distributed() applied the workaround: undo it
            for method in tf_data_iterator_stall.PATCHED_METHODS:
                vars(model).pop(method, None)  # back to Keras' own fit/evaluate/predict
            vars(model).pop(tf_data_iterator_stall._APPLIED_FLAG, None)  # noqa: SLF001
            # and autotuning back on (same cursor)
            options = tf.data.Options()
            options.autotune.enabled = True
            train_data = train_data.with_options(options)
    callbacks.append(Stamp())  # last: its on_train_end runs after the others'

    begin = time.perf_counter()
    model.fit(train_data, epochs=epochs, verbose=0, callbacks=callbacks)
    returned = time.perf_counter()
    result = {
        "path": path,
        "stall_s": returned - marks["train_end"],
        "fit_s": returned - begin,
        "epoch_gaps_s": marks["gaps"],
        "pid": os.getpid(),
    }
    Path(result_file).write_text(json.dumps(result))
    tmp.cleanup()
    return 0


# -- parent: the alternating fresh-process runs --------------------------------------------


def run_child(path: str, args: argparse.Namespace, tmp: str, index: int) -> dict[str, Any]:
    """Runs one fresh process; returns its timings (or an error entry)."""
    result_file = Path(tmp) / f"{path}-{index}.json"
    command = [
        sys.executable, str(Path(__file__).resolve()), "--child", path,
        "--steps", str(args.steps), "--epochs", str(args.epochs),
        "--result-file", str(result_file),
    ]  # fmt: skip
    result, error, seconds = run_fresh(command, result_file, timeout=args.timeout)
    if error is not None:
        return {"path": path, "error": error}
    result["process_s"] = seconds
    return result


def summarize(values: list[float]) -> str:
    """`median (min-max)` of seconds."""
    if not values:
        return "-"
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark (or, with `--child`, one run) and prints its figures.

    Args:
        argv: Command-line arguments (default: `sys.argv[1:]`).

    Returns:
        The exit status: 0, or 1 if a run failed.

    Example:

    ```python
    main(["--runs", "4"])
    ```
    """
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--runs", type=int, default=20, help="fresh processes per path")
    parser.add_argument("--steps", type=int, default=100, help="training steps per epoch")
    parser.add_argument("--epochs", type=int, default=1, help="epochs per fit()")
    parser.add_argument(
        "--paths",
        default="tutorial,kit",
        help=f"comma-separated paths, alternated run by run; of {', '.join(PATHS)}",
    )
    parser.add_argument(
        "--threshold",
        type=float,
        default=1.0,
        help="a stall longer than this many seconds counts as one",
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds allowed per run")
    parser.add_argument("--child", choices=PATHS, help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child, args.steps, args.epochs, args.result_file)
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    unknown = [p for p in paths if p not in PATHS]
    if unknown or not paths or args.runs <= 0 or args.steps <= 0 or args.epochs <= 0:
        parser.error(f"--paths takes some of {', '.join(PATHS)}; --runs/--steps/--epochs > 0")

    from importlib.metadata import version

    say(f"command: python benchmarks/end_of_fit_stall.py {' '.join(sys.argv[1:])}".rstrip())
    say(
        f"TensorFlow {version('tensorflow')}, Keras {version('keras')}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.2f}; {REPLICAS} simulated replicas, global batch "
        f"{PER_REPLICA_BATCH * REPLICAS}, {args.steps} steps x {args.epochs} epoch(s), "
        f"{args.runs} fresh processes per path, alternating"
    )
    results: dict[str, list[dict[str, Any]]] = {p: [] for p in paths}
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            order = paths[i % len(paths) :] + paths[: i % len(paths)]
            line = []
            for path in order:
                result = run_child(path, args, tmp, i)
                results[path].append(result)
                if "error" in result:
                    failed += 1
                    line.append(f"{path}: FAILED")
                    say(f"  {path} run {i + 1} failed: {result['error']}")
                else:
                    gaps = result["epoch_gaps_s"]
                    extra = f", max gap {max(gaps):.2f}" if gaps else ""
                    line.append(f"{path}: {result['stall_s']:.3f} s{extra}")
            say(f"run {i + 1:>2}: " + "; ".join(line))
        say(f"load average at the end: {os.getloadavg()[0]:.2f}")

    say()
    say(f"seconds from on_train_end to fit() returning (stall: > {args.threshold:g} s)")
    header = (
        f"  {'path':<22} {'runs':>4} {'stalls':>7} {'median (min-max)':>24} "
        f"{'epoch gaps > thr.':>18} {'epoch gaps median (min-max)':>30}"
    )
    say(header)
    for path in paths:
        ok = [r for r in results[path] if "error" not in r]
        stalls = [r["stall_s"] for r in ok]
        gaps = [g for r in ok for g in r["epoch_gaps_s"]]
        n_stall = sum(s > args.threshold for s in stalls)
        n_gap = sum(g > args.threshold for g in gaps)
        gap_text = f"{n_gap}/{len(gaps)}" if gaps else "-"
        say(
            f"  {path:<22} {len(ok):>4} {f'{n_stall}/{len(ok)}':>7} {summarize(stalls):>24} "
            f"{gap_text:>18} {summarize(gaps):>30}"
        )
    if "kit" in results:
        ok = [r for r in results["kit"] if "error" not in r]
        worst = max((r["stall_s"] for r in ok), default=float("nan"))
        passed = len(ok) == args.runs and worst < args.threshold
        say()
        say(
            f"target: the kit's stall < {args.threshold:g} s in every run: worst "
            f"{worst:.3f} s over {len(ok)}/{args.runs} runs -> {'PASS' if passed else 'FAIL'}"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
