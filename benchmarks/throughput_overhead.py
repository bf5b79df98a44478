"""Overhead of `ThroughputMonitor`: training steps/s with and without it, side by side.

A tiny model (one Dense layer on 8 features, batch 32) makes each step as short as it gets
(about 0.6 ms on 2 CPUs), so any per-step cost of the callback shows most. One process
trains the same compiled model in many short rounds; each round runs one `fit()` per
condition, back to back, in an order that rotates and reverses from round to round (so a
slow spell of the machine hits all conditions alike), and times each `fit()` end to end.

Slow spells last seconds and halve a round's speed now and then, so the figure that
decides is paired: the median over rounds of (steps/s with) / (steps/s without) from the
same round, with a 95% bootstrap confidence interval (seeded). The target (>= 0.99) is
shown when the interval's lower bound reaches it. Also printed: the median steps/s per
condition, their spread, the ratio of medians and of the fastest rounds.

Last, the callback's own cost per step is timed without training: Keras's `CallbackList`
dispatching `on_train_batch_begin`/`on_train_batch_end` with and without the monitor,
fastest of 9 alternating repeats.

Usage:

    python benchmarks/throughput_overhead.py                # 150 rounds of 1000 steps
    python benchmarks/throughput_overhead.py --log-every 100,1  # also with batch logs
    python benchmarks/throughput_overhead.py --rounds 300 --steps 2000
    python benchmarks/throughput_overhead.py --replicas 2   # 2-replica MirroredStrategy

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
    parser.add_argument("--rounds", type=int, default=150, help="alternating rounds (150)")
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
        return lambda: [ThroughputMonitor(global_batch_size=args.batch, **kwargs)]

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
        f"{args.batch}, {args.steps} steps per fit, {args.rounds} rounds"
    )
    for name in names:  # trace and warm every path once, untimed
        run(name, 200)

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
    say()
    say(
        "ratio: median with / median without; paired: median over rounds of with/without "
        "from the same round, [95% bootstrap interval]; best: fastest round with / fastest "
        "without."
    )
    for name in names[1:]:
        low, _ = paired_interval(wall[name], wall[names[0]])
        verdict = "target >= 0.99 shown" if low >= 0.99 else "target >= 0.99 NOT shown"
        say(f"  {name}: paired lower bound {low:.4f}: {verdict}")

    # The callback's own cost per step, without the noise of training: the same Keras
    # CallbackList dispatch of on_train_batch_begin/end, with and without the monitor.
    step_ms = 1000.0 / statistics.median(wall[names[0]])
    say()
    say(
        f"per-step cost of the callback itself (CallbackList dispatch of {args.calls} steps, "
        "fastest of 9 alternating repeats):"
    )
    for name in names[1:]:
        extra_us = hook_cost(model, conditions[name], args.calls)
        expected = step_ms / (step_ms + extra_us / 1000)
        say(
            f"  {name:<40} {extra_us:6.2f} us/step = {extra_us / (10 * step_ms):.3f} % of "
            f"a {step_ms:.3f} ms step -> expected ratio {expected:.4f}"
        )
    return 0


def paired_interval(values: list[float], base: list[float]) -> tuple[float, float]:
    """95% bootstrap interval of the median of per-round ratios (10,000 resamples, seeded)."""
    ratios = [v / b for v, b in zip(values, base, strict=True)]
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(10_000))
    return medians[249], medians[9749]


def table(names: list[str], rates: dict[str, list[float]]) -> None:
    """Prints median, spread and ratios to the first condition."""
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
        low, high = paired_interval(values, base)
        spread = f"{min(values):.0f}-{max(values):.0f}"
        say(
            f"  {name:<40} {median:>7.0f} {spread:>10} {median / base_median:>6.3f} "
            f"{paired:>7.4f} [{low:.4f}-{high:.4f}] {max(values) / base_best:>6.3f}"
        )


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
