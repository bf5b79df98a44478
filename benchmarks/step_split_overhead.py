"""What the step split costs: the CIFAR recipe with `ThroughputMonitor(step_split=True)` and
`(step_split=False)`, side by side, and whether the weights are the same.

One process with 2 simulated replicas (the CPU split into 2 logical devices): the
tutorial's CIFAR-10 CNN, Adam, per-replica batch 64 (global 128), the kit's defaults
(`kmk.distributed(per_replica_batch_size=64)`, `kmk.make_dataset(...,
preprocess=kmk.rescale())`), on CIFAR-sized synthetic data.

1. Cost. Three models built alike: one with the split on, two with it off (the second is
   the control: what two identical conditions differ by, the method's resolution). Each
   runs Keras' training loop (`on_train_batch_begin`, `model.train_function(iterator)`,
   `on_train_batch_end`, with a `ThroughputMonitor` set up as `fit()` sets it up) over an
   iterator of its own, in adjacent blocks of `--block-steps` steps whose order rotates and
   reverses from block to block, so that the machine's slow spells (seconds long) hit all
   three alike. The figure is the median over `--blocks` block triples of (step time with
   the split) / (step time without), with its quartiles; the target is <= 1.02.
2. The same training. Two fresh models from the same seed fit the same epoch, one with the
   split and one without; their weights are compared bit for bit.
3. The split itself, as the monitor reported it for a whole `fit()` of `--steps` steps
   (docs/throughput.md).

Usage:

    python benchmarks/step_split_overhead.py                  # 120 block triples of 8 steps
    python benchmarks/step_split_overhead.py --blocks 300

This is a script, not a test: it prints its figures and asserts nothing.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _report import say  # benchmarks/_report.py (scripts run from benchmarks/)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

REPLICAS = 2
PER_REPLICA_BATCH = 64


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark and prints its figures.

    Args:
        argv: Command-line arguments (default: `sys.argv[1:]`).

    Returns:
        The exit status, 0.

    Example:

    ```python
    main(["--blocks", "20", "--steps", "30"])
    ```
    """
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--blocks", type=int, default=120, help="timed block triples")
    parser.add_argument("--block-steps", type=int, default=8, help="steps per block")
    parser.add_argument("--steps", type=int, default=40, help="training steps per fit")
    parser.add_argument("--warmup", type=int, default=8, help="batches left out of the timing")
    args = parser.parse_args(argv)
    if min(args.blocks, args.block_steps) <= 0 or args.warmup < 1 or args.steps <= args.warmup:
        parser.error("--blocks and --block-steps must be positive, --steps > --warmup >= 1")

    import keras_mirror_kit as kmk

    kmk.simulate_replicas(REPLICAS, device_type="CPU")

    import keras
    import numpy as np
    import tensorflow as tf

    from keras_mirror_kit.datasets import make_synthetic_cifar10
    from keras_mirror_kit.throughput.step_split import SPLIT_KEYS, describe

    global_batch = PER_REPLICA_BATCH * REPLICAS
    say(f"command: python benchmarks/step_split_overhead.py {' '.join(sys.argv[1:])}".rstrip())
    say(
        f"TensorFlow {tf.__version__}, Keras {keras.__version__}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.2f}; {REPLICAS} simulated replicas, global batch "
        f"{global_batch}; {args.blocks} blocks of {args.block_steps} steps per model"
    )
    (x, y), _ = make_synthetic_cifar10(num_train=args.steps * global_batch, num_test=10, seed=0)

    def build() -> keras.Model:
        keras.utils.set_random_seed(0)

        @kmk.distributed(per_replica_batch_size=PER_REPLICA_BATCH)
        def factory() -> keras.Model:
            model = kmk.models.tutorial_cnn()
            model.compile(
                optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"]
            )
            return model

        return factory()

    data = kmk.make_dataset(x, y, global_batch, seed=0, preprocess=kmk.rescale())
    looped = data.repeat()  # the interleaved blocks' input: the same batches, endless

    class Timer(keras.callbacks.Callback):
        """Seconds per step from the end of warm-up to the end of the epoch."""

        def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
            self.began = None

        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            if self.began is None and batch + 1 >= args.warmup:
                self.began, self.first = time.perf_counter(), batch + 1

        def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
            self.per_step = (time.perf_counter() - self.began) / (args.steps - self.first)

    def fit(model: keras.Model, split: bool) -> tuple[float, dict]:
        timer = Timer()
        monitor = kmk.ThroughputMonitor(warmup_steps=args.warmup, step_split=split)
        history = model.fit(data, epochs=1, verbose=0, callbacks=[monitor, timer])
        return timer.per_step, {k: v[-1] for k, v in history.history.items()}

    models = {"split": build(), "off": build(), "off again": build()}
    last: dict = {}
    for name, model in models.items():
        _, logs = fit(model, name == "split")  # trace and compile each before timing
        if name == "split":
            last = logs
    # The interleaved monitors' epochs span the other models' blocks: their split (host
    # work) is not this figure's, so their WARNING is not shown.
    kit_logger = logging.getLogger("keras_mirror_kit")
    level = kit_logger.level
    kit_logger.setLevel(logging.ERROR)
    try:
        per_step = interleaved(models, looped, args.blocks, args.block_steps)
    finally:
        kit_logger.setLevel(level)
    ratios = [a / b for a, b in zip(per_step["split"], per_step["off"])]
    control = [a / b for a, b in zip(per_step["off again"], per_step["off"])]
    median = statistics.median(ratios)
    say(
        "median ms/step: "
        + ", ".join(f"{n} {1000 * statistics.median(v):.2f}" for n, v in per_step.items())
    )
    say(
        f"step time with / without the split: median {median:.4f} over {args.blocks} block "
        f"triples (quartiles {_quartiles(ratios)}); target <= 1.02: "
        f"{'PASS' if median <= 1.02 else 'FAIL'}"
    )
    say(
        f"control, another model without the split / without: median "
        f"{statistics.median(control):.4f} (quartiles {_quartiles(control)}): the method's "
        "resolution"
    )

    weights = []
    for split in (True, False):
        model = build()
        fit(model, split)
        weights.append([np.asarray(w) for w in model.get_weights()])
    equal = all(np.array_equal(a, b) for a, b in zip(*weights))
    verdict = "bit-equal" if equal else "DIFFER"
    say(f"weights after one epoch with and without the split: {verdict}")
    split_figures = {k: last[k] for k in SPLIT_KEYS if k in last}
    say(f"the last round's split: {describe(split_figures)} ({split_figures})")
    return 0


def interleaved(
    models: dict[str, Any], data: Any, blocks: int, block_steps: int
) -> dict[str, list[float]]:
    """Seconds per step of each model in adjacent blocks of Keras' training loop.

    Each model runs what `fit()` runs for a step, `model.train_function(iterator)` (with a
    `ThroughputMonitor` set up on it as `fit()` sets it up, so the split model's calls are
    timed as in a fit), over an iterator of its own on `data`, block by block, in an order
    that rotates and reverses from block to block, so that a slow spell of the machine
    (seconds) hits all three alike. The first round of blocks is not timed.
    """
    import keras

    iterators, lists = {}, {}
    for name, model in models.items():
        model.make_train_function()
        iterators[name] = iter(model.distribute_strategy.experimental_distribute_dataset(data))
        monitor = kmk_monitor(name == "split")
        lists[name] = keras.callbacks.CallbackList(
            [monitor], add_history=True, model=model, verbose=0, epochs=1, steps=10**9
        )
        lists[name].on_train_begin()
        lists[name].on_epoch_begin(0)
    names = list(models)
    per_step: dict[str, list[float]] = {name: [] for name in models}
    done = dict.fromkeys(models, 0)
    for block in range(blocks + 1):
        order = names[block % 3 :] + names[: block % 3]
        if block % 2:
            order.reverse()
        for name in order:
            cbl, model, iterator, first = lists[name], models[name], iterators[name], done[name]
            start = time.perf_counter()
            for step in range(first, first + block_steps):
                cbl.on_train_batch_begin(step)
                logs = model.train_function(iterator)
                cbl.on_train_batch_end(step, logs)
            elapsed = time.perf_counter() - start
            done[name] = first + block_steps
            if block:
                per_step[name].append(elapsed / block_steps)
    for cbl in lists.values():
        cbl.on_epoch_end(0, {})
        cbl.on_train_end()
    return per_step


def kmk_monitor(split: bool) -> Any:
    """The monitor of one condition: no warm-up (the models were traced before)."""
    import keras_mirror_kit as kmk

    return kmk.ThroughputMonitor(warmup_steps=0, step_split=split)


def _quartiles(values: list[float]) -> str:
    low, _, high = statistics.quantiles(values, n=4)
    return f"{low:.4f} to {high:.4f}"


if __name__ == "__main__":
    sys.exit(main())
