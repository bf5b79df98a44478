"""Bytes per step copied host -> devices, and step time: preprocess on the host vs on replicas.

`kmk.make_dataset(..., preprocess=kmk.rescale())` keeps uint8 images in memory. With
`preprocess_on="host"` the batches are cast to float32 in the input pipeline, so float32
crosses to every device; with the default (`"auto"`: on the replicas for `rescale()`) the
uint8 batch crosses and each replica casts its slice (`backends.tensorflow_preprocess`).
Both conditions run side by side in one process, same model, data and seed, in alternating
rounds; each round is one `fit` epoch timed by `ThroughputMonitor` (warm-up excluded).

Reported, per condition:

* bytes per global step delivered to the devices, measured from one element of the
  distributed dataset Keras iterates (every replica's features and labels), and the ratio;
* median step time and samples/s over rounds (min-max);
* the largest weight difference between the two models after the same rounds (0 expected:
  a per-sample cast gives the same values wherever it runs).

On a CPU the "devices" are the host's own memory, so no PCIe copy is saved and the step
times should agree; the figure that matters there is the bytes. On GPUs run it with `--gpu`
(or the `replica_preprocess` check of `benchmarks/gpu_selftest.py`).

    python benchmarks/replica_preprocess.py                      # CPU: 2 simulated replicas
    python benchmarks/replica_preprocess.py --gpu --image-size 224 --per-replica-batch-size 64
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
    parser.add_argument("--steps", type=int, default=30, help="steps per round (one epoch)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-replica-batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=32, help="square uint8 RGB images")
    parser.add_argument(
        "--gpu", action="store_true", help="every GPU (or the first one split in --replicas)"
    )
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

    from keras_mirror_kit.data import replica_variant

    gpus = tf.config.list_physical_devices("GPU")
    if args.gpu and len(gpus) < args.replicas:
        if not gpus:
            say("replica_preprocess: --gpu given but no GPU is visible")
            return 1
        kmk.simulate_replicas(args.replicas, device_type="GPU")
    warmup = 3
    side = args.image_size

    def make(label: str):
        @kmk.distributed(per_replica_batch_size=args.per_replica_batch_size)
        def build() -> keras.Model:
            keras.utils.set_random_seed(0)
            model = kmk.models.tutorial_cnn(input_shape=(side, side, 3))
            model.compile(
                optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy"
            )
            return model

        return {
            "label": label,
            "model": build(),
            "dist": build.distribution,
            "times": [],
            "rates": [],
        }

    conditions = [make("host (float32 crosses)"), make("replica (uint8 crosses)")]
    dist = conditions[0]["dist"]
    global_batch = dist.global_batch_size
    n = args.steps * global_batch
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(n, side, side, 3), dtype=np.uint8)
    y = rng.integers(0, 10, size=(n, 1), dtype=np.uint8)
    for condition, on in zip(conditions, ("host", "auto")):
        condition["dataset"] = kmk.make_dataset(
            x, y, global_batch, seed=0, preprocess=kmk.rescale(), preprocess_on=on
        )

    def bytes_per_step(dataset) -> tuple[int, str]:
        """Bytes of one global batch as the replicas receive it (what Keras distributes)."""
        variant = replica_variant(dataset)
        fed = variant.dataset() if variant is not None else dataset
        element = next(iter(dist.strategy.experimental_distribute_dataset(fed)))
        total, dtypes = 0, set()
        for leaf in tf.nest.flatten(element):
            for local in dist.strategy.experimental_local_results(leaf):
                total += int(np.prod(local.shape)) * local.dtype.size
                dtypes.add(local.dtype.name)
        return total, "+".join(sorted(dtypes))

    for condition in conditions:
        condition["bytes"], condition["dtypes"] = bytes_per_step(condition["dataset"])
        # The first epoch traces the step: not measured.
        condition["model"].fit(condition["dataset"], epochs=1, verbose=0)

    for round_index in range(args.rounds):
        order = conditions if round_index % 2 == 0 else conditions[::-1]
        for condition in order:
            monitor = kmk.ThroughputMonitor(warmup_steps=warmup)
            condition["model"].fit(condition["dataset"], epochs=1, verbose=0, callbacks=[monitor])
            condition["times"].append(monitor.last["step_time_ms"])
            condition["rates"].append(monitor.last["samples_per_sec"])
        say(f"round {round_index + 1}/{args.rounds} done")

    # Rounds alternate the order, so both models saw the same epochs: same weights expected.
    gap = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(*(condition["model"].get_weights() for condition in conditions))
    )
    say()
    say(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"load {os.getloadavg()[0]:.2f}; TensorFlow {tf.__version__}, Keras "
        f"{keras.__version__}; {dist.num_replicas} replicas on {', '.join(dist.devices)}; "
        f"global batch {global_batch} of {side}x{side}x3 uint8 images; {args.steps} steps "
        f"x {args.rounds} rounds"
    )
    say(
        f"{'preprocess on':<26} {'bytes/step to devices':>22} {'dtypes':>14} "
        f"{'median step ms':>15} {'min-max':>15} {'samples/s':>10}"
    )
    host_bytes = conditions[0]["bytes"]
    for condition in conditions:
        times, share = condition["times"], condition["bytes"] / host_bytes
        say(
            f"{condition['label']:<26} {condition['bytes']:>14,d} ({share:.2f}x)"
            f" {condition['dtypes']:>14} {statistics.median(times):>15.2f} "
            f"{min(times):>7.2f}-{max(times):<7.2f} "
            f"{statistics.median(condition['rates']):>10.1f}"
        )
    say(f"max |weight difference| replica vs host after the same epochs: {gap:.3g}")
    say(f"finished {time.strftime('%Y-%m-%d %H:%M:%S')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
