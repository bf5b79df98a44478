"""Training jobs on file sources, run as subprocesses by the data-source kill trials.

Usage:
    python -m tests.data_child kill JOB DATA CKPT --kill-after-step K [--async-save]
    python -m tests.data_child finish SPEC_JSON

JOB is `images` (an image folder, `kmk.image_dataset_from_directory`) or `records`
(TFRecord shards, `kmk.tfrecord_dataset`), both with random augmentation in `preprocess`
(Keras' random layers), 2 simulated replicas, `SyncedCheckpoint(save_freq=2, dataset=)`.

`kill` trains until step K has ended (the checkpoint callback's turn included) and then
SIGKILLs itself. `finish` reads SPEC_JSON, `{"out": DIR, "jobs": {JOB: {"data": DATA,
"twice": bool, "resume": [{"directory": CKPT, "async_save": bool}, ...]}}}`, and, in this
one process, trains each job's uninterrupted reference (twice with "twice": augmentation
must make the two identical), then resumes each CKPT with a fresh model (other initial
weights when a checkpoint was written) and the save mode its trial was killed in. Its
RESULT line gives, per job, the largest weight difference between the two uninterrupted
runs, and per CKPT the restored step, the steps trained after it, the optimizer's
iterations and the largest difference from the reference.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

os.environ.setdefault("KMK_SIMULATE_REPLICAS", "2")

EPOCHS, BATCH, SIZE, SAVE_FREQ = 2, 8, (12, 12), 2


def augment():
    import keras

    return keras.Sequential(
        [
            keras.layers.RandomFlip("horizontal"),
            keras.layers.RandomRotation(0.15, seed=2),
            keras.layers.RandomContrast(0.2),
        ]
    )


def dataset(job: str, data: str):
    import tensorflow as tf

    import keras_mirror_kit as kmk

    if job == "images":
        return kmk.image_dataset_from_directory(
            data, image_size=SIZE, batch_size=BATCH, seed=11, verbose=False, preprocess=augment()
        )
    from tests.data_files import parse

    def image_and_label(record):
        parsed = parse(record)
        image = tf.image.resize(tf.cast(parsed["image"], "float32"), SIZE)
        return image, parsed["label"]

    paths = sorted(os.path.join(data, name) for name in os.listdir(data))
    return kmk.tfrecord_dataset(
        paths, image_and_label, BATCH, seed=11, shuffle_window=8, preprocess=augment()
    )


def model(seed: int):
    import keras

    import keras_mirror_kit as kmk

    @kmk.distributed(global_batch_size=BATCH)
    def factory():
        keras.utils.set_random_seed(seed)
        net = keras.Sequential(
            [
                keras.Input((*SIZE, 3)),
                keras.layers.Rescaling(1 / 255),
                keras.layers.Conv2D(4, 3, activation="relu"),
                keras.layers.Flatten(),
                keras.layers.Dense(3),
            ]
        )
        net.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return net

    return factory()


def train(job, data, directory, seed, async_save, kill_after=None):
    """One fit of EPOCHS epochs; returns the model, the restored step and the steps trained."""
    import keras

    import keras_mirror_kit as kmk

    net, ds = model(seed), dataset(job, data)
    checkpoint = kmk.SyncedCheckpoint(
        directory, save_freq=SAVE_FREQ, dataset=ds, async_save=async_save
    )

    class Steps(keras.callbacks.Callback):
        trained = 0

        def on_train_batch_end(self, batch, logs=None):
            Steps.trained += 1
            if Steps.trained == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)

    net.fit(ds, epochs=EPOCHS, verbose=0, callbacks=[checkpoint, Steps()])
    restored = checkpoint.last_restored
    return net, None if restored is None else int(restored.meta["global_step"]), Steps.trained


def max_diff(a, b) -> float:
    import numpy as np

    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["kill", "finish"])
    parser.add_argument("job", help="images or records (kill); the spec file (finish)")
    parser.add_argument("data", nargs="?")
    parser.add_argument("paths", nargs="*")
    parser.add_argument("--kill-after-step", type=int)
    parser.add_argument("--async-save", action="store_true")
    args = parser.parse_args()
    if args.mode == "kill":
        train(args.job, args.data, args.paths[0], 3, args.async_save, args.kill_after_step)
        return 1  # the kill never came
    with open(args.job) as handle:
        spec = json.load(handle)
    result: dict = {}
    for job, plan in spec["jobs"].items():
        out = os.path.join(spec["out"], f"reference-{job}")
        reference = train(job, plan["data"], out + "-a", 3, False)[0].get_weights()
        found: dict = {"uninterrupted_diff": None, "resumed": []}
        if plan.get("twice"):
            second = train(job, plan["data"], out + "-b", 3, False)[0]
            found["uninterrupted_diff"] = max_diff(reference, second.get_weights())
        for trial in plan["resume"]:
            # A rerun builds its model afresh: other initial weights when a checkpoint
            # will replace them, the run's own when the kill came before any was written.
            written = any(name.endswith(".npz") for name in os.listdir(trial["directory"]))
            net, restored, trained = train(
                job, plan["data"], trial["directory"], 99 if written else 3, trial["async_save"]
            )
            found["resumed"].append(
                {
                    "restored_step": restored,
                    "trained": trained,
                    "iterations": int(net.optimizer.iterations.numpy()),
                    "diff": max_diff(reference, net.get_weights()),
                }
            )
        result[job] = found
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
