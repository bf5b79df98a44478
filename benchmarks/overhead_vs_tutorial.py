"""Overhead of the kit versus the tutorial's hand-written MirroredStrategy code, side by side.

The same job both ways, in one process with 2 simulated replicas (the CPU split into 2
logical devices, configured once at the start): the tutorial's CIFAR-10 CNN, Adam,
per-replica batch 64 (global 128), on CIFAR-sized synthetic data (50,000 x 32x32x3 uint8,
`keras_mirror_kit.datasets.make_synthetic_cifar10`), one epoch of `--steps` steps per fit.

* `tutorial`: the tutorial's code: `x / 255.0`, `from_tensor_slices((x, y)).shuffle(10000)
  .batch(128)`, `strategy.experimental_distribute_dataset`, model built and compiled in
  `strategy.scope()` (the strategy is given the 2 logical CPUs, as it would find 2 GPUs).
* `kit`: `kmk.distributed(per_replica_batch_size=64)`, `kmk.make_dataset(...,
  preprocess=kmk.rescale())` and `kmk.ThroughputMonitor()` (and
  the end-of-fit stall workaround, which `distributed()` applies).
* `kit + checkpoint`: the same, plus `kmk.SyncedCheckpoint(dataset=...)` writing (and
  verifying the replicas) at the end of every epoch, i.e. once per fit.

Every condition is timed the same way, by a tiny timestamping callback placed last: from
the end of the `--warmup`-th training batch to `on_epoch_end` (after the other callbacks'
`on_epoch_end`, so a checkpoint's write is inside the window); no validation. Samples/sec =
(steps - warmup) x 128 / that time. Each round runs every condition once, in an order that
rotates from round to round, so drift in the machine's speed hits all alike.

Targets (ratio kit / tutorial of samples/sec, the median of the per-round ratios):
>= 0.99 without checkpointing, >= 0.97 with a checkpoint every epoch.

Usage:

    python benchmarks/overhead_vs_tutorial.py                     # 5 rounds of 390 steps
    python benchmarks/overhead_vs_tutorial.py --rounds 7 --steps 200

This is a script, not a test: it prints its figures and asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _report import say  # benchmarks/_report.py (scripts run from benchmarks/)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["CUDA_VISIBLE_DEVICES"] = "-1"  # the simulated replicas are CPU replicas
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

PER_REPLICA_BATCH = 64
REPLICAS = 2
NUM_TRAIN = 50_000
TARGETS = {"kit": 0.99, "kit + checkpoint": 0.97}


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark and prints its figures.

    Args:
        argv: Command-line arguments (default: `sys.argv[1:]`).

    Returns:
        The exit status, 0.

    Example:

    ```python
    main(["--rounds", "3", "--steps", "100"])
    ```
    """
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    parser.add_argument(
        "--steps",
        type=int,
        default=NUM_TRAIN // (PER_REPLICA_BATCH * REPLICAS),
        help="steps per epoch (the first steps x 128 samples; 390 = all 50,000)",
    )
    parser.add_argument(
        "--warmup", type=int, default=10, help="training batches per fit left out of the timing"
    )
    args = parser.parse_args(argv)
    global_batch = PER_REPLICA_BATCH * REPLICAS
    if args.rounds <= 0 or args.warmup < 1 or args.steps <= args.warmup:
        parser.error("--rounds must be positive and --steps larger than --warmup (>= 1)")
    if args.steps * global_batch > NUM_TRAIN:
        parser.error(f"--steps x {global_batch} must not exceed the {NUM_TRAIN} samples")

    import keras_mirror_kit as kmk

    kmk.simulate_replicas(REPLICAS, device_type="CPU")

    import keras
    import tensorflow as tf

    from keras_mirror_kit.datasets import make_synthetic_cifar10

    say(f"command: python benchmarks/overhead_vs_tutorial.py {' '.join(sys.argv[1:])}".rstrip())
    say(
        f"TensorFlow {tf.__version__}, Keras {keras.__version__}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.2f}; {REPLICAS} simulated replicas, global batch "
        f"{global_batch}, {args.steps} steps per fit ({args.warmup} warm-up), "
        f"{args.rounds} rounds"
    )
    (x_all, y_all), _ = make_synthetic_cifar10(num_train=NUM_TRAIN, num_test=10, seed=0)
    n = args.steps * global_batch
    x_train, y_train = x_all[:n], y_all[:n]

    # The tutorial, as written (with the 2 logical CPUs standing in for 2 GPUs).
    plain_model, train_dist_dataset = tutorial_job(x_train, y_train)

    # The kit.
    @kmk.distributed(per_replica_batch_size=PER_REPLICA_BATCH)
    def build_model() -> keras.Model:
        model = kmk.models.tutorial_cnn()
        model.compile(
            optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"]
        )
        return model

    kit_model = build_model()  # distributed() applies the end-of-fit stall workaround
    dist = build_model.distribution
    train_ds = kmk.make_dataset(
        x_train, y_train, dist.global_batch_size, seed=0, preprocess=kmk.rescale()
    )

    class Timer(keras.callbacks.Callback):
        """Training samples/sec from the end of warm-up to the end of the epoch."""

        def __init__(self) -> None:
            super().__init__()
            self.batches = 0
            self.start = self.end = 0.0

        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            self.batches += 1
            if self.batches == args.warmup:
                self.start = time.perf_counter()

        def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
            self.end = time.perf_counter()

        def rate(self) -> float:
            return (self.batches - args.warmup) * global_batch / (self.end - self.start)

    monitor_rates: list[float] = []

    def run_tutorial(checkpoint_dir: str) -> list[keras.callbacks.Callback]:
        return []

    def run_kit(checkpoint_dir: str) -> list[keras.callbacks.Callback]:
        return [kmk.ThroughputMonitor(warmup_steps=args.warmup)]

    def run_kit_checkpoint(checkpoint_dir: str) -> list[keras.callbacks.Callback]:
        return run_kit(checkpoint_dir) + [kmk.SyncedCheckpoint(checkpoint_dir, dataset=train_ds)]

    conditions: dict[str, tuple[Any, Any, Callable[[str], list[keras.callbacks.Callback]]]] = {
        "tutorial": (plain_model, train_dist_dataset, run_tutorial),
        "kit": (kit_model, train_ds, run_kit),
        "kit + checkpoint": (kit_model, train_ds, run_kit_checkpoint),
    }
    names = list(conditions)

    def run(name: str, workdir: str) -> float:
        model, data, make_callbacks = conditions[name]
        callbacks = make_callbacks(workdir)
        timer = Timer()
        model.fit(data, epochs=1, verbose=0, callbacks=[*callbacks, timer])
        if callbacks and isinstance(callbacks[0], kmk.ThroughputMonitor):
            monitor_rates.append(callbacks[0].summary().get("samples_per_sec", float("nan")))
        return timer.rate()

    # Trace both models once, untimed (a short fit without checkpointing).
    for model, data in ((plain_model, train_dist_dataset), (kit_model, train_ds)):
        model.fit(data, epochs=1, steps_per_epoch=args.warmup + 2, verbose=0)

    rates: dict[str, list[float]] = {name: [] for name in names}
    started = time.perf_counter()
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            with tempfile.TemporaryDirectory() as workdir:
                rates[name].append(run(name, workdir))
        say(f"round {r + 1}: " + ", ".join(f"{k}: {rates[k][-1]:.0f}" for k in names))
    say(
        f"{time.perf_counter() - started:.0f} s for the rounds; load average at the end "
        f"{os.getloadavg()[0]:.2f}"
    )

    say()
    say("training samples per second (timing callback; warm-up and fit() set-up excluded)")
    base = rates["tutorial"]
    say(
        f"  {'condition':<18} {'median':>8} {'min-max':>12} {'ratio':>7} {'paired':>7} "
        f"{'p. min-max':>12} {'best':>7}  target"
    )
    verdicts = []
    for name in names:
        values = rates[name]
        median = statistics.median(values)
        per_round = [v / b for v, b in zip(values, base, strict=True)]
        paired = statistics.median(per_round)
        target = TARGETS.get(name)
        verdict = ""
        if target is not None:
            ok = paired >= target
            verdicts.append(ok)
            verdict = f">= {target:.2f}: {'PASS' if ok else 'FAIL'}"
        say(
            f"  {name:<18} {median:>8.0f} {f'{min(values):.0f}-{max(values):.0f}':>12} "
            f"{median / statistics.median(base):>7.3f} {paired:>7.3f} "
            f"{f'{min(per_round):.3f}-{max(per_round):.3f}':>12} "
            f"{max(values) / max(base):>7.3f}  {verdict}"
        )
    say(
        "ratio: median / tutorial's median; paired: median over rounds of the round's ratio "
        "(judged against the target); p. min-max: its spread; best: fastest round / "
        "tutorial's fastest."
    )
    if monitor_rates:
        say(
            f"cross-check, ThroughputMonitor's own samples/sec over the kit's fits: median "
            f"{statistics.median(monitor_rates):.0f} ({min(monitor_rates):.0f}-"
            f"{max(monitor_rates):.0f}; steps only, so a checkpoint's write is not in it)"
        )
    say(f"overall: {'PASS' if all(verdicts) else 'FAIL'}")
    return 0


def tutorial_job(x_train: Any, y_train: Any) -> tuple[Any, Any]:
    """The tutorial's code as written: its model and distributed dataset, on the logical CPUs.

    `MirroredStrategy` over every logical CPU (standing in for the GPUs it would find),
    `x_train / 255.0`, `from_tensor_slices(...).shuffle(10000).batch(64 x replicas)`,
    `experimental_distribute_dataset`, the tutorial CNN compiled with Adam in the scope.
    Also used by `benchmarks/fastest_recipe.py`.
    """
    import tensorflow as tf

    import keras_mirror_kit as kmk

    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    strategy = tf.distribute.MirroredStrategy(devices=devices)
    x_float = x_train / 255.0
    train_dataset = tf.data.Dataset.from_tensor_slices((x_float, y_train))
    batch = PER_REPLICA_BATCH * strategy.num_replicas_in_sync
    train_dataset = train_dataset.shuffle(10000).batch(batch)
    train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
    with strategy.scope():
        model = kmk.models.tutorial_cnn()
        model.compile(
            optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"]
        )
    return model, train_dist_dataset


if __name__ == "__main__":
    sys.exit(main())
