"""Overhead of `ThroughputMonitor`: training steps/s with and without it, side by side.

The monitor runs with `step_split=False`: this measures the callback in Keras' loop. What
the step split adds (timestamps in the compiled step, a timer around each call) is
measured on the CIFAR recipe by `benchmarks/step_split_overhead.py`.

A tiny model (one Dense layer on 8 features, batch 32) makes each step as short as it gets
(about 0.6 ms on 2 CPUs), so any per-step cost of the callback shows most. One process
trains the same compiled model three ways:

1. The decisive figure. Keras' own training loop, as `fit()` runs it for every step
   (`on_train_batch_begin`, `model.train_function(iterator)`, `on_train_batch_end` through
   Keras `CallbackList`s built as `fit()` builds them), in blocks of 50 steps that
   alternate without / with the monitor (ABBA). The machine has slow spells lasting
   seconds that halve its speed; adjacent 30 ms blocks share them, so the median over
   600 pairs of (steps/s with) / (steps/s without) resolves a few tenths of a percent.
   It comes with a 95% bootstrap interval (seeded) and two controls measured the same way:
   no callback on either side (the method's own resolution) and Keras' base `Callback`,
   which does nothing (what adding any callback costs). Against the target (>= 0.99) it
   prints PASS when the whole interval is at or above 0.99, FAIL when it is below, and NOT
   SHOWN when it straddles 0.99.
2. Context: whole `fit()` calls of 1000 steps, one per condition per round, in an order
   that rotates and reverses from round to round; median steps/s, spread, the ratio of
   medians, the paired ratio with its interval, and the ratio of the fastest rounds. Slow
   spells make these much noisier than 1.
3. The callback's own cost per step without training: Keras's `CallbackList` dispatching
   `on_train_batch_begin`/`on_train_batch_end` with and without the monitor, fastest of 9
   alternating repeats.

Usage:

    python benchmarks/throughput_overhead.py                    # about 3 minutes on 2 CPUs
    python benchmarks/throughput_overhead.py --log-every 100,1  # also with batch logs
    python benchmarks/throughput_overhead.py --blocks 2000 --rounds 60
    python benchmarks/throughput_overhead.py --replicas 2       # 2-replica MirroredStrategy

This is a script, not a test: it prints its figures and asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _report import say  # benchmarks/_report.py (scripts run from benchmarks/)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark and prints its figures.

    Args:
        argv: Command-line arguments (default: `sys.argv[1:]`).

    Returns:
        The exit status, 0.

    Example:

    ```python
    main(["--rounds", "3", "--steps", "500"])
    ```
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--blocks", type=int, default=600, help="block pairs in the training loop (600)"
    )
    parser.add_argument("--block-steps", type=int, default=50, help="steps per block (50)")
    parser.add_argument("--rounds", type=int, default=30, help="alternating fit() rounds (30)")
    parser.add_argument("--steps", type=int, default=1000, help="training steps per fit (1000)")
    parser.add_argument("--batch", type=int, default=32, help="global batch size (32)")
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="1: a plain model on one device; n > 1: kmk.distributed on n logical CPUs",
    )
    parser.add_argument(
        "--calls", type=int, default=20000, help="dispatches timed per repeat (20000)"
    )
    parser.add_argument(
        "--log-every",
        type=lambda text: [int(n) for n in text.split(",") if n],
        default=[],
        metavar="N[,N...]",
        help="also run ThroughputMonitor(log_every_n_steps=N) for each N (batch logs)",
    )
    args = parser.parse_args(argv)

    import keras_mirror_kit as kmk

    if args.replicas > 1:
        kmk.simulate_replicas(args.replicas, device_type="CPU")

    import keras
    import numpy as np
    import tensorflow as tf

    from keras_mirror_kit.callbacks import ThroughputMonitor

    def tiny() -> keras.Model:
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        return model

    if args.replicas > 1:
        model = kmk.distributed(global_batch_size=args.batch)(tiny)()
    else:
        model = tiny()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch * 64, 8)).astype("float32")
    y = rng.normal(size=(args.batch * 64, 1)).astype("float32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch, drop_remainder=True)
    data = data.repeat().prefetch(tf.data.AUTOTUNE)

    def monitor(**kwargs: int) -> Callable[[], list[keras.callbacks.Callback]]:
        # The callback's own cost; what the step split adds to the compiled step is
        # benchmarks/step_split_overhead.py's.
        return lambda: [
            ThroughputMonitor(global_batch_size=args.batch, step_split=False, **kwargs)
        ]

    conditions: dict[str, Callable[[], list[keras.callbacks.Callback]]] = {
        "without monitor": list,
        "ThroughputMonitor()": monitor(),
    }
    for every in args.log_every:
        conditions[f"ThroughputMonitor(log_every_n_steps={every})"] = monitor(
            log_every_n_steps=every
        )
    names = list(conditions)

    def run(name: str, steps: int) -> float:
        """One fit() of `steps` steps; returns steps per second."""
        callbacks = conditions[name]()
        start = time.perf_counter()
        model.fit(
            data, epochs=1, steps_per_epoch=steps, shuffle=False, verbose=0, callbacks=callbacks
        )
        return steps / (time.perf_counter() - start)

    say(f"command: python benchmarks/throughput_overhead.py {' '.join(sys.argv[1:])}".rstrip())
    say(
        f"TensorFlow {tf.__version__}, Keras {keras.__version__}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.2f}, {args.replicas} replica(s), global batch "
        f"{args.batch}"
    )
    for name in names:  # trace and warm every path once, untimed
        run(name, 200)

    # 1. The decisive figure: Keras' own training loop, blocks with and without alternating.
    say()
    say(
        f"1. Keras' training loop (fit()'s inner loop: CallbackList hooks around "
        f"model.train_function), {args.blocks} pairs of adjacent {args.block_steps}-step "
        "blocks, without / with the monitor in alternating order"
    )
    say(
        f"  {'condition':<40} {'steps/s without':>15} {'with':>7} "
        f"{'paired [95% interval]':>23}  target >= 0.99"
    )
    # Controls: the same two sides with no callback added (what the method resolves) and
    # with Keras' base Callback, which does nothing (what any callback costs).
    controls: dict[str, Callable[[], list[keras.callbacks.Callback]]] = {
        "control: no callback on either side": list,
        "control: keras.callbacks.Callback()": lambda: [keras.callbacks.Callback()],
    }
    verdicts = {}
    for name, make in [*controls.items(), *((n, conditions[n]) for n in names[1:])]:
        without, with_ = interleaved(model, data, make, args.blocks, args.block_steps)
        paired = statistics.median(w / b for w, b in zip(with_, without, strict=True))
        low, high = paired_interval(with_, without)
        verdicts[name] = "(no target)" if name in controls else verdict(low, high)
        say(
            f"  {name:<40} {statistics.median(without):>15.0f} "
            f"{statistics.median(with_):>7.0f} {paired:>7.4f} [{low:.4f}-{high:.4f}]  "
            f"{verdicts[name]}"
        )

    # 2. Context: whole fit() calls, rounds of one fit per condition.
    say()
    say(f"2. Whole fit() calls: {args.rounds} rounds of one {args.steps}-step fit per condition")

    wall: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        if (r // len(names)) % 2:
            order.reverse()
        for name in order:
            wall[name].append(run(name, args.steps))
        if (r + 1) % 25 == 0 or r + 1 == args.rounds:
            say(
                f"rounds 1-{r + 1} done; round {r + 1}: "
                + ", ".join(f"{n}: {wall[n][-1]:.0f}" for n in names)
            )

    say()
    say("steps per second (wall clock)")
    table(names, wall)
    say(
        "  ratio: median with / median without; paired: median over rounds of with/without "
        "from the same round, [95% bootstrap interval]; best: fastest round with / fastest "
        "without."
    )

    # The callback's own cost per step, without the noise of training: the same Keras
    # CallbackList dispatch of on_train_batch_begin/end, with and without the monitor.
    step_ms = 1000.0 / statistics.median(wall[names[0]])
    say()
    say(
        f"3. Per-step cost of the callback itself (CallbackList dispatch of {args.calls} "
        "steps, fastest of 9 alternating repeats):"
    )
    for name in names[1:]:
        extra_us = hook_cost(model, conditions[name], args.calls)
        expected = step_ms / (step_ms + extra_us / 1000)
        say(
            f"  {name:<40} {extra_us:6.2f} us/step = {extra_us / (10 * step_ms):.3f} % of "
            f"a {step_ms:.3f} ms step -> expected ratio {expected:.4f}"
        )
    say()
    for name in names[1:]:
        say(f"target (1.): {name} paired ratio >= 0.99: {verdicts[name]}")
    return 0


def verdict(low: float, high: float) -> str:
    """PASS, FAIL or NOT SHOWN for a 95% interval of a ratio against the 0.99 target."""
    if low >= 0.99:
        return "PASS"
    if high < 0.99:
        return "FAIL"
    return "NOT SHOWN (the interval straddles 0.99: run more blocks)"


def interleaved(
    model: Any, data: Any, make_callbacks: Callable[[], list], blocks: int, block_steps: int
) -> tuple[list[float], list[float]]:
    """Steps/s of adjacent blocks without and with the callbacks, in Keras' training loop.

    Runs what `fit()` runs for each step (keras/src/backend/tensorflow/trainer.py):
    `callbacks.on_train_batch_begin`, `model.train_function(iterator)`,
    `callbacks.on_train_batch_end` with the step's logs, through two Keras `CallbackList`s
    built as `fit()` builds them (one with the callbacks, one without: History only) over
    one input iterator, alternating block by block (ABBA) so that a slow spell of the
    machine, which lasts seconds, hits both sides of a pair. The first pair (the
    callbacks' warm-up) is not timed.

    Returns:
        The per-block steps/s without and with the callbacks, paired by index.
    """
    import keras

    model.make_train_function()
    iterator = iter(model.distribute_strategy.experimental_distribute_dataset(data))
    steps = (blocks + 1) * block_steps
    lists = {
        label: keras.callbacks.CallbackList(
            callbacks, add_history=True, model=model, verbose=0, epochs=1, steps=steps
        )
        for label, callbacks in (("without", []), ("with", make_callbacks()))
    }
    for cbl in lists.values():
        cbl.on_train_begin()
        cbl.on_epoch_begin(0)
    done = dict.fromkeys(lists, 0)
    rates: dict[str, list[float]] = {label: [] for label in lists}
    for block in range(blocks + 1):
        for label in ("without", "with") if block % 2 else ("with", "without"):
            cbl, first = lists[label], done[label]
            start = time.perf_counter()
            for step in range(first, first + block_steps):
                cbl.on_train_batch_begin(step)
                logs = model.train_function(iterator)
                cbl.on_train_batch_end(step, logs)
            elapsed = time.perf_counter() - start
            done[label] = first + block_steps
            if block:
                rates[label].append(block_steps / elapsed)
    for cbl in lists.values():
        cbl.on_epoch_end(0, {})
        cbl.on_train_end()
    return rates["without"], rates["with"]


def paired_interval(values: list[float], base: list[float]) -> tuple[float, float]:
    """95% bootstrap interval of the median of per-round ratios (10,000 resamples, seeded)."""
    ratios = [v / b for v, b in zip(values, base, strict=True)]
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(10_000))
    return medians[250], medians[9749]  # the 2.5th and 97.5th percentiles


def table(names: list[str], rates: dict[str, list[float]]) -> dict[str, tuple[float, float]]:
    """Prints median, spread and ratios to the first condition; returns the intervals."""
    intervals = {}
    base = rates[names[0]]
    base_median = statistics.median(base)
    base_best = max(base)
    say(
        f"  {'condition':<40} {'median':>7} {'min-max':>10} {'ratio':>6} "
        f"{'paired [95% interval]':>23} {'best':>6}"
    )
    for name in names:
        values = rates[name]
        median = statistics.median(values)
        paired = statistics.median(v / b for v, b in zip(values, base, strict=True))
        low, high = intervals[name] = paired_interval(values, base)
        spread = f"{min(values):.0f}-{max(values):.0f}"
        say(
            f"  {name:<40} {median:>7.0f} {spread:>10} {median / base_median:>6.3f} "
            f"{paired:>7.4f} [{low:.4f}-{high:.4f}] {max(values) / base_best:>6.3f}"
        )
    return intervals


def hook_cost(model: object, make_callbacks: Callable[[], list], calls: int) -> float:
    """Extra microseconds per training step that the callbacks add to Keras's dispatch.

    Times `calls` batch begin/end dispatches through a `CallbackList` with the callbacks and
    through one without, alternating over 9 repeats (each an epoch), and compares the
    fastest repeat of each.
    """
    import keras

    lists = {
        label: keras.callbacks.CallbackList(
            callbacks, add_history=True, model=model, epochs=9, steps=calls, verbose=0
        )
        for label, callbacks in (("with", make_callbacks()), ("without", []))
    }
    best = dict.fromkeys(lists, float("inf"))
    for cbl in lists.values():
        cbl.on_train_begin()
    for repeat in range(9):
        order = ["with", "without"] if repeat % 2 else ["without", "with"]
        for label in order:
            cbl = lists[label]
            cbl.on_epoch_begin(repeat)
            start = time.perf_counter()
            for batch in range(calls):
                cbl.on_train_batch_begin(batch)
                cbl.on_train_batch_end(batch, {"loss": 0.5})
            best[label] = min(best[label], time.perf_counter() - start)
            cbl.on_epoch_end(repeat, {"loss": 0.5})
    for cbl in lists.values():
        cbl.on_train_end()
    return 1e6 * (best["with"] - best["without"]) / calls


if __name__ == "__main__":
    sys.exit(main())
