"""Samples/sec with each knob off and on: sync_batch_norm, mixed_precision, steps_per_execution.

All conditions run side by side in one process (2 simulated replicas by default), in
alternating rounds; each round is one `fit` over `--steps` batches of CIFAR-shaped synthetic
data, timed by `ThroughputMonitor` (warm-up excluded). Reported: median samples/sec, min-max
over rounds, and the ratio to the knob's "off" condition.

    python benchmarks/knobs.py                      # CPU: 2 simulated replicas
    python benchmarks/knobs.py --replicas 2 --gpu   # one GPU split into 2 logical GPUs

Models: the tutorial CNN (mixed precision, steps_per_execution), the tutorial CNN with a
BatchNormalization after the convolution (sync_batch_norm), and a tiny MLP where Keras'
per-step Python overhead dominates (steps_per_execution).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60, help="measured steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-replica-batch-size", type=int, default=64)
    parser.add_argument(
        "--gpu", action="store_true", help="split the first GPU into --replicas logical GPUs"
    )
    parser.add_argument("--only", choices=["bn", "precision", "spe"], default=None)
    return parser.parse_args()


def main() -> int:
    args = parse()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras_mirror_kit as kmk

    kmk.simulate_replicas(
        args.replicas,
        device_type="GPU" if args.gpu else "CPU",
        memory_limit_mb=8192 if args.gpu else None,
    )
    import keras
    import tensorflow as tf

    warmup = 3
    per_replica = args.per_replica_batch_size

    def cnn(batch_norm: bool) -> keras.Model:
        layers = [keras.Input((32, 32, 3)), keras.layers.Conv2D(32, (3, 3), activation="relu")]
        if batch_norm:
            layers.append(keras.layers.BatchNormalization())
        layers += [
            keras.layers.MaxPooling2D((2, 2)),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
        return keras.Sequential(layers)

    def mlp() -> keras.Model:
        return keras.Sequential(
            [
                keras.Input((32, 32, 3)),
                keras.layers.Flatten(),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(10, activation="softmax"),
            ]
        )

    def make(group: str, label: str, make_model, **knobs):
        @kmk.distributed(per_replica_batch_size=per_replica, **knobs)
        def build() -> keras.Model:
            model = make_model()
            model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
            return model

        return {
            "group": group,
            "label": label,
            "model": build(),
            "dist": build.distribution,
            "rates": [],
        }

    conditions = []
    if args.only in (None, "bn"):
        conditions += [
            make("sync_batch_norm (CNN+BN)", "off", lambda: cnn(True)),
            make("sync_batch_norm (CNN+BN)", "on", lambda: cnn(True), sync_batch_norm=True),
        ]
    if args.only in (None, "precision"):
        conditions += [
            make("mixed_precision (CNN)", "float32", lambda: cnn(False)),
            make(
                "mixed_precision (CNN)",
                "mixed_bfloat16",
                lambda: cnn(False),
                mixed_precision="mixed_bfloat16",
            ),
            make(
                "mixed_precision (CNN)",
                "mixed_float16",
                lambda: cnn(False),
                mixed_precision="mixed_float16",
            ),
        ]
    if args.only in (None, "spe"):
        for model_name, factory in (("CNN", lambda: cnn(False)), ("tiny MLP", mlp)):
            for steps in (1, 4, "auto"):
                conditions.append(
                    make(
                        f"steps_per_execution ({model_name})",
                        str(steps),
                        factory,
                        steps_per_execution=steps,
                    )
                )

    global_batch = conditions[0]["dist"].global_batch_size
    total_steps = args.steps + warmup + 8  # + up to one execution of slack
    (x, y), _ = kmk.datasets.make_synthetic_cifar10(total_steps * global_batch, 10, seed=0)
    dataset = kmk.make_dataset(x, y, global_batch, seed=0, preprocess=kmk.rescale())
    for condition in conditions:  # trace every train function once, outside the rounds
        condition["model"].fit(dataset.take(2 * 8), epochs=1, verbose=0)

    for round_index in range(args.rounds):
        order = conditions if round_index % 2 == 0 else conditions[::-1]
        for condition in order:
            monitor = kmk.ThroughputMonitor(warmup_steps=warmup)
            condition["model"].fit(dataset, epochs=1, verbose=0, callbacks=[monitor])
            condition["rates"].append(monitor.last["samples_per_sec"])
        sys.stdout.write(f"round {round_index + 1}/{args.rounds} done\n")
        sys.stdout.flush()

    devices = conditions[0]["dist"].devices
    print(
        f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"load {os.getloadavg()[0]:.2f}; TensorFlow {tf.__version__}, Keras "
        f"{keras.__version__}; {len(devices)} replicas on {', '.join(devices)}; global "
        f"batch {global_batch}; {args.steps} steps x {args.rounds} rounds"
    )
    print(f"{'knob':<32} {'setting':<15} {'median samples/s':>17} {'min-max':>17} {'ratio':>6}")
    baseline: dict[str, float] = {}
    for condition in conditions:
        rates = condition["rates"]
        median = statistics.median(rates)
        baseline.setdefault(condition["group"], median)
        ratio = median / baseline[condition["group"]]
        print(
            f"{condition['group']:<32} {condition['label']:<15} {median:>17.1f} "
            f"{min(rates):>8.1f}-{max(rates):<8.1f} {ratio:>6.2f}"
        )
    print(f"finished {time.strftime('%Y-%m-%d %H:%M:%S')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
