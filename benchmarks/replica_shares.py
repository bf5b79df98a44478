"""Step time of the exact (share-weighted) train step against Keras' own, on the CIFAR recipe.

`keras_mirror_kit.workarounds.keras_replica_shares` gives each kit-built model a train step
that weighs every replica's loss by its share of the batch: one scalar all-reduce per step
(the batch's rows) and a multiply. This measures what that costs on the recommended
CIFAR-10 recipe (the tutorial's CNN, Adam, `make_dataset(..., preprocess=kmk.rescale())`,
64 samples per replica): two models, same weights and data, one with the kit's steps and
one with Keras' own (`keras_replica_shares.apply` switched off while it is built), trained
side by side in one process in alternating rounds; each round is one epoch timed by
`ThroughputMonitor` (warm-up steps excluded). Every batch is full, so both models train the
same weights (reported: the largest difference).

    python benchmarks/replica_shares.py                 # CPU: 2 simulated replicas
    python benchmarks/replica_shares.py --gpu           # every GPU of the host
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--steps", type=int, default=80, help="steps per round (one epoch)")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--per-replica-batch-size", type=int, default=64)
    parser.add_argument("--gpu", action="store_true", help="every GPU of the host")
    return parser.parse_args()


def main() -> int:
    args = parse()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _report import say

    import keras_mirror_kit as kmk

    if not args.gpu:
        kmk.simulate_replicas(args.replicas, device_type="CPU")
    import keras
    import numpy as np
    import tensorflow as tf

    from keras_mirror_kit.workarounds import keras_replica_shares

    def make(label: str, exact: bool) -> dict:
        @kmk.distributed(per_replica_batch_size=args.per_replica_batch_size)
        def build() -> keras.Model:
            keras.utils.set_random_seed(0)
            model = kmk.models.tutorial_cnn()
            model.compile(
                optimizer=keras.optimizers.Adam(1e-3),
                loss="sparse_categorical_crossentropy",
                metrics=["accuracy"],
            )
            return model

        original = keras_replica_shares.apply
        if not exact:
            keras_replica_shares.apply = lambda model: False  # Keras' own steps
        try:
            model = build()
        finally:
            keras_replica_shares.apply = original
        assert keras_replica_shares.is_applied(model) is exact
        return {"label": label, "model": model, "dist": build.distribution, "times": []}

    conditions = [make("Keras' own train step", False), make("kit: share-weighted", True)]
    dist = conditions[0]["dist"]
    global_batch = dist.global_batch_size
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(args.steps * global_batch, 32, 32, 3), dtype=np.uint8)
    y = rng.integers(0, 10, size=(args.steps * global_batch, 1), dtype=np.uint8)
    for condition in conditions:
        condition["dataset"] = kmk.make_dataset(
            x, y, global_batch, seed=0, preprocess=kmk.rescale()
        )
        condition["model"].fit(condition["dataset"], epochs=1, verbose=0)  # traces the step

    for round_index in range(args.rounds):
        order = conditions if round_index % 2 == 0 else conditions[::-1]
        for condition in order:
            monitor = kmk.ThroughputMonitor(warmup_steps=3)
            condition["model"].fit(condition["dataset"], epochs=1, verbose=0, callbacks=[monitor])
            condition["times"].append(monitor.last["step_time_ms"])
        say(f"round {round_index + 1}/{args.rounds} done")

    gap = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(*(condition["model"].get_weights() for condition in conditions))
    )
    say()
    say(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"load {os.getloadavg()[0]:.2f}; TensorFlow {tf.__version__}, Keras "
        f"{keras.__version__}; {dist.num_replicas} replicas on {', '.join(dist.devices)}; "
        f"tutorial CNN, Adam, global batch {global_batch}; {args.steps} steps x "
        f"{args.rounds} rounds, alternating"
    )
    base = statistics.median(conditions[0]["times"])
    for condition in conditions:
        times = condition["times"]
        median = statistics.median(times)
        say(
            f"{condition['label']:<24} step {median:7.2f} ms (min {min(times):.2f}, max "
            f"{max(times):.2f}); {100 * (median / base - 1):+.1f}% against Keras' own"
        )
    ratios = [b / a for a, b in zip(conditions[0]["times"], conditions[1]["times"], strict=True)]
    say(
        f"per round, kit / Keras' own step time: median {statistics.median(ratios):.3f} "
        f"(min {min(ratios):.3f}, max {max(ratios):.3f}); target <= 1.02: "
        f"{'PASS' if statistics.median(ratios) <= 1.02 else 'NOT MET'}"
    )
    say(f"largest weight difference between the two models: {gap:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
