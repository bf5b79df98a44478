"""Step time of an own `train_step` under the kit's rule against Keras' own handling of it.

`keras_mirror_kit.own_steps` gives a model that writes its own `train_step` one device's
losses on each replica, share-weighted gradients for every optimizer, metrics that hold
one device's figures and one device's random draws: per step one all-reduce of an
N-vector (the replicas' rows), one per metric update (its change) and one for the figures
the step returns, and a multiply per gradient. This measures what that costs on the
CIFAR-10 recipe (the tutorial's CNN, Adam, `make_dataset(..., preprocess=kmk.rescale())`,
64 samples per replica) written with the Keras guide's own `train_step`
(`self.compute_loss`, `optimizer.apply_gradients`, the metrics loop): two models, same
weights and data, one with the kit's rule and one left to Keras (`own_steps.apply`
switched off while it is built), trained side by side in one process. Two measures:

* **paired steps** (the figure the target is judged on): after a warm-up `fit`, each
  model's train function (the step as Keras compiles it, from `make_train_function`) is
  called on its own distributed iterator over the dataset (whose batches come rescaled
  from the host here: inside `fit` the kit runs the rescale on the replicas, in both models
  alike), the two models taking turns step by step (A B, B A, ...), each call timed up
  to its returned loss; the ratio of the two median step times, per block of steps and
  over all. Pairing step by step makes the machine's load, which drifts by 15-35% from one
  epoch to the next on a shared host, the same for both.
* **alternating epochs**: whole `fit` epochs timed by `ThroughputMonitor` (warm-up steps
  excluded), the order alternating per round: what a user sees, noisier.

The guide's step uses `compute_loss`, which Keras itself scales right, so both models
train the same weights (reported: the largest difference).

    python benchmarks/own_train_step.py                 # CPU: 2 simulated replicas
    python benchmarks/own_train_step.py --gpu           # every GPU of the host
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
    parser.add_argument("--steps", type=int, default=80, help="steps per round (one epoch)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating epochs")
    parser.add_argument("--pairs", type=int, default=1000, help="paired steps")
    parser.add_argument("--blocks", type=int, default=10, help="blocks of paired steps")
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

    from keras_mirror_kit import own_steps

    class GuideStep(keras.Model):
        """The Keras guide's first `CustomModel` step."""

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred)
            gradients = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}

    def make(label: str, kit: bool) -> dict:
        @kmk.distributed(per_replica_batch_size=args.per_replica_batch_size)
        def build() -> keras.Model:
            keras.utils.set_random_seed(0)
            cnn = kmk.models.tutorial_cnn()
            model = GuideStep(cnn.inputs, cnn.outputs)
            model.compile(
                optimizer=keras.optimizers.Adam(1e-3),
                loss="sparse_categorical_crossentropy",
                metrics=["accuracy"],
            )
            return model

        original = own_steps.apply
        if not kit:
            own_steps.apply = lambda model, strategy: False  # Keras' own handling
        try:
            model = build()
        finally:
            own_steps.apply = original
        assert own_steps.is_applied(model) is kit
        return {"label": label, "model": model, "dist": build.distribution, "times": []}

    conditions = [make("Keras' own handling", False), make("kit: own-step rule", True)]
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

    paired = _paired_steps(conditions, args.pairs, tf)
    gap = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(*(condition["model"].get_weights() for condition in conditions))
    )
    say()
    say(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"load {os.getloadavg()[0]:.2f}; TensorFlow {tf.__version__}, Keras "
        f"{keras.__version__}; {dist.num_replicas} replicas on {', '.join(dist.devices)}; "
        f"tutorial CNN with the guide's own train_step, Adam, global batch {global_batch}"
    )
    say(f"paired steps ({args.pairs} pairs, each model's train_function in turn):")
    keras_own, kit = paired
    for label, times in zip((c["label"] for c in conditions), paired, strict=True):
        say(f"  {label:<24} median step {statistics.median(times):7.3f} ms")
    size = max(1, len(kit) // args.blocks)
    blocks = [
        statistics.median(kit[i : i + size]) / statistics.median(keras_own[i : i + size])
        for i in range(0, len(kit) - size + 1, size)
    ]
    overall = statistics.median(kit) / statistics.median(keras_own)
    say(
        f"  kit / Keras' own median step: {overall:.4f} over all pairs; per block of {size}: "
        f"median {statistics.median(blocks):.4f} (min {min(blocks):.4f}, max "
        f"{max(blocks):.4f}); target <= 1.02: {'PASS' if overall <= 1.02 else 'NOT MET'}"
    )
    base = statistics.median(conditions[0]["times"])
    say(f"alternating epochs ({args.steps} steps x {args.rounds} rounds):")
    for condition in conditions:
        times = condition["times"]
        median = statistics.median(times)
        say(
            f"  {condition['label']:<24} step {median:7.2f} ms (min {min(times):.2f}, max "
            f"{max(times):.2f}); {100 * (median / base - 1):+.1f}% against Keras' own"
        )
    ratios = [b / a for a, b in zip(conditions[0]["times"], conditions[1]["times"], strict=True)]
    say(
        f"  per round, kit / Keras' own step time: median {statistics.median(ratios):.3f} "
        f"(min {min(ratios):.3f}, max {max(ratios):.3f})"
    )
    say(f"largest weight difference between the two models: {gap:.2e}")
    return 0


def _paired_steps(conditions: list[dict], pairs: int, tf) -> tuple[list[float], list[float]]:
    """Each model's step times (ms) when the two take turns step by step (A B, B A, ...)."""
    iterators = [
        iter(c["model"].distribute_strategy.experimental_distribute_dataset(c["dataset"].repeat()))
        for c in conditions
    ]
    for condition in conditions:
        condition["model"].make_train_function()
    functions = [c["model"].train_function for c in conditions]  # the compiled steps
    times: tuple[list[float], list[float]] = ([], [])

    def step(index: int) -> float:
        start = time.perf_counter()
        out = functions[index](iterators[index])
        if isinstance(out, tf.experimental.Optional):
            out = out.get_value()
        float(out["loss"])  # the step has run
        return 1000 * (time.perf_counter() - start)

    for _ in range(10):  # warm-up of the iterators and the functions
        step(0), step(1)
    for i in range(pairs):
        order = (0, 1) if i % 2 == 0 else (1, 0)
        for index in order:
            times[index].append(step(index))
    return times


if __name__ == "__main__":
    sys.exit(main())
