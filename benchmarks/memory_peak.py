"""Peak memory (RSS) of a whole training process: the tutorial's input pipeline versus the kit's.

Each measurement is a fresh Python process (peak RSS is per process), run one after the
other, with 2 simulated replicas on the CPU, the tutorial's CNN and CIFAR-sized synthetic
data (50,000 training and 10,000 test images, 32x32x3 uint8, as `cifar10.load_data()` gives
them), and a short `fit` (`--steps` training steps, `--val-steps` validation steps):

* `baseline`: imports TensorFlow and Keras, builds and compiles the model under the
  strategy; no data (for context: what any such process costs).
* `tutorial`: the tutorial's pipeline: `x_train, x_test = x_train / 255.0, x_test / 255.0`
  (float64), `from_tensor_slices(...).shuffle(10000).batch(128)`,
  `strategy.experimental_distribute_dataset`, then `fit` with `validation_data`.
* `kit`: `kmk.distributed()`, `kmk.make_dataset(..., preprocess=kmk.rescale())` for the
  training and test data (uint8 in memory, cast per batch), `ThroughputMonitor`, the same
  `fit`.

The peak is `resource.getrusage(RUSAGE_SELF).ru_maxrss` at the end of the process; the same
figure is also read after the data is loaded and after the pipelines are built, to show
where the memory goes. The three run in a rotating order, `--rounds` times.

Target: the kit's peak RSS at most 1/3 of the tutorial's (measured before: about 4.3 GB
versus 1.2 GB).

Usage:

    python benchmarks/memory_peak.py                 # 3 rounds
    python benchmarks/memory_peak.py --rounds 1 --steps 20

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
from pathlib import Path
from typing import Any

from _fresh import ROOT, run_fresh  # benchmarks/_fresh.py (scripts run from benchmarks/)
from _report import say  # benchmarks/_report.py

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(ROOT))  # run from a checkout

MODES = ("baseline", "tutorial", "kit")
PER_REPLICA_BATCH = 64
REPLICAS = 2
TARGET = 1 / 3
GIB = 1024**3


def peak_bytes() -> int:
    """This process's peak resident set size so far, in bytes (Linux reports KiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) * (1 if sys.platform == "darwin" else 1024)


# -- child: one process, one mode -----------------------------------------------------------


def child(mode: str, steps: int, val_steps: int, result_file: str) -> int:
    """Runs one mode in this fresh process and writes its peak RSS figures as JSON."""
    import keras_mirror_kit as kmk

    kmk.simulate_replicas(REPLICAS, device_type="CPU")

    import keras
    import tensorflow as tf

    stages: dict[str, int] = {}
    global_batch = PER_REPLICA_BATCH * REPLICAS

    def compile_model(model: keras.Model) -> keras.Model:
        model.compile(
            optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"]
        )
        return model

    if mode in ("baseline", "tutorial"):
        devices = [d.name for d in tf.config.list_logical_devices("CPU")]
        strategy = tf.distribute.MirroredStrategy(devices=devices)
        with strategy.scope():
            model = compile_model(kmk.models.tutorial_cnn())
        stages["model built"] = peak_bytes()
        if mode == "tutorial":
            from keras_mirror_kit.datasets import make_synthetic_cifar10

            (x_train, y_train), (x_test, y_test) = make_synthetic_cifar10(seed=0)
            stages["data loaded (uint8)"] = peak_bytes()
            # The tutorial's code from here on.
            x_train, x_test = x_train / 255.0, x_test / 255.0
            train_dataset = (
                tf.data.Dataset.from_tensor_slices((x_train, y_train))
                .shuffle(10000)
                .batch(global_batch)
            )
            test_dataset = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(global_batch)
            train_data = strategy.experimental_distribute_dataset(train_dataset)
            test_data = strategy.experimental_distribute_dataset(test_dataset)
            stages["pipelines built"] = peak_bytes()
            callbacks: list[keras.callbacks.Callback] = []
    else:
        from keras_mirror_kit.datasets import make_synthetic_cifar10

        @kmk.distributed(per_replica_batch_size=PER_REPLICA_BATCH)
        def build_model() -> keras.Model:
            return compile_model(kmk.models.tutorial_cnn())

        model = build_model()  # distributed() applies the end-of-fit stall workaround
        dist = build_model.distribution
        stages["model built"] = peak_bytes()
        (x_train, y_train), (x_test, y_test) = make_synthetic_cifar10(seed=0)
        stages["data loaded (uint8)"] = peak_bytes()
        train_data = kmk.make_dataset(
            x_train, y_train, dist.global_batch_size, seed=0, preprocess=kmk.rescale()
        )
        test_data = kmk.make_dataset(
            x_test, y_test, dist.global_batch_size, shuffle=False, preprocess=kmk.rescale()
        )
        stages["pipelines built"] = peak_bytes()
        callbacks = [kmk.ThroughputMonitor()]

    if mode != "baseline":
        model.fit(
            train_data,
            validation_data=test_data,
            epochs=1,
            steps_per_epoch=steps,
            validation_steps=val_steps,
            callbacks=callbacks,
            verbose=0,
        )
    stages["end (peak)"] = peak_bytes()
    Path(result_file).write_text(json.dumps({"mode": mode, "stages": stages}))
    return 0


# -- parent ---------------------------------------------------------------------------------


def run_child(mode: str, args: argparse.Namespace, tmp: str, index: int) -> dict[str, Any]:
    """Runs one fresh process; returns its figures (or an error entry)."""
    result_file = Path(tmp) / f"{mode}-{index}.json"
    command = [
        sys.executable, str(Path(__file__).resolve()), "--child", mode,
        "--steps", str(args.steps), "--val-steps", str(args.val_steps),
        "--result-file", str(result_file),
    ]  # fmt: skip
    result, error, seconds = run_fresh(command, result_file, timeout=args.timeout)
    if error is not None:
        return {"mode": mode, "error": error}
    result["seconds"] = seconds
    return result


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark (or, with `--child`, one process) and prints its figures.

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
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the 3 processes")
    parser.add_argument("--steps", type=int, default=50, help="training steps of the fit")
    parser.add_argument("--val-steps", type=int, default=10, help="validation steps")
    parser.add_argument("--timeout", type=float, default=600, help="seconds allowed per run")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child, args.steps, args.val_steps, args.result_file)
    if args.rounds <= 0 or args.steps <= 0 or args.val_steps <= 0:
        parser.error("--rounds, --steps and --val-steps must be positive")

    from importlib.metadata import version

    say(f"command: python benchmarks/memory_peak.py {' '.join(sys.argv[1:])}".rstrip())
    say(
        f"TensorFlow {version('tensorflow')}, Keras {version('keras')}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.2f}; {REPLICAS} simulated replicas, global batch "
        f"{PER_REPLICA_BATCH * REPLICAS}, fit of {args.steps} + {args.val_steps} validation "
        f"steps, {args.rounds} round(s) of fresh processes"
    )
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = MODES[r % len(MODES) :] + MODES[: r % len(MODES)]
            line = []
            for mode in order:
                result = run_child(mode, args, tmp, r)
                results[mode].append(result)
                if "error" in result:
                    failed += 1
                    line.append(f"{mode}: FAILED")
                    say(f"  {mode} failed: {result['error']}")
                else:
                    line.append(f"{mode}: {result['stages']['end (peak)'] / GIB:.2f} GiB")
            say(f"round {r + 1}: " + ", ".join(line))

    say()
    say("peak RSS of the whole process, GiB (median over rounds; min-max)")
    stage_names = ["model built", "data loaded (uint8)", "pipelines built", "end (peak)"]
    say(f"  {'process':<10} " + " ".join(f"{s:>22}" for s in stage_names))
    medians: dict[str, float] = {}
    for mode in MODES:
        ok = [r for r in results[mode] if "error" not in r]
        cells = []
        for stage in stage_names:
            values = [r["stages"][stage] / GIB for r in ok if stage in r["stages"]]
            if not values:
                cells.append(f"{'-':>22}")
                continue
            median = statistics.median(values)
            if stage == "end (peak)":
                medians[mode] = median
            cells.append(f"{f'{median:.2f} ({min(values):.2f}-{max(values):.2f})':>22}")
        say(f"  {mode:<10} " + " ".join(cells))
    say("(ru_maxrss so far at each point: a later column is never below an earlier one)")
    if "kit" in medians and "tutorial" in medians:
        ratio = medians["kit"] / medians["tutorial"]
        verdict = "PASS" if ratio <= TARGET else "FAIL"
        say()
        say(
            f"target: kit peak <= 1/3 of the tutorial's: {medians['kit']:.2f} / "
            f"{medians['tutorial']:.2f} GiB = {ratio:.3f} -> {verdict}"
        )
        if "baseline" in medians:
            base = medians["baseline"]
            say(
                f"above the baseline process ({base:.2f} GiB): tutorial "
                f"+{medians['tutorial'] - base:.2f} GiB, kit +{medians['kit'] - base:.2f} GiB"
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
