"""An image-folder job for the multi-worker sharding test, under `launch` or alone.

Usage: python -m tests.mw_data_child OUT_DIR DATA_DIR

Trains 2 epochs on `kmk.image_dataset_from_directory(DATA_DIR)` (with random augmentation
in `preprocess`, validation on a second folder dataset) with `kmk.distributed`, one
process per worker (TF_CONFIG from the launcher) or one process with 2 simulated replicas.
Every file Keras' decode function reads is recorded (a wrapper around
Keras' image loader, `keras_private.load_image()`). Writes OUT_DIR/result-<rank>.json
(every file decoded, in order; losses) and OUT_DIR/weights-<rank>.npz. A fresh worker
skips the optional imports no job here uses (`tests.mw_child.skip_optional_imports`).
"""

from __future__ import annotations

import json
import os
import sys

EPOCHS, BATCH, SIZE = 2, 8, (12, 12)


def _rank() -> int:
    raw = os.environ.get("TF_CONFIG")
    return int(json.loads(raw)["task"]["index"]) if raw else 0


def main() -> int:
    out, data = sys.argv[1], sys.argv[2]
    rank = _rank()
    os.makedirs(out, exist_ok=True)
    from tests.mw_child import skip_optional_imports

    skip_optional_imports()
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_mirror_kit as kmk
    from keras_mirror_kit.upstream import keras_private

    decoded: list[str] = []
    original = keras_private.load_image()
    image_dataset_utils = sys.modules[original.__module__]

    def note(path):
        decoded.append(path.decode())
        return path

    def recording_load(path, *args):
        path = tf.reshape(tf.numpy_function(note, [path], tf.string, stateful=True), [])
        return original(path, *args)

    setattr(image_dataset_utils, original.__name__, recording_load)  # its name on this Keras

    @kmk.distributed(global_batch_size=BATCH)
    def build():
        keras.utils.set_random_seed(3)
        model = keras.Sequential(
            [
                keras.Input((*SIZE, 3)),
                keras.layers.Rescaling(1 / 255),
                keras.layers.Conv2D(4, 3, activation="relu"),
                keras.layers.Flatten(),
                keras.layers.Dense(3),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return model

    model = build()
    augment = keras.Sequential(
        [keras.layers.RandomFlip("horizontal"), keras.layers.RandomRotation(0.15, seed=2)]
    )
    train_ds, val_ds = kmk.image_dataset_from_directory(
        data,
        image_size=SIZE,
        batch_size=BATCH,
        seed=11,
        validation_split=0.25,
        subset="both",
        verbose=False,
        preprocess=augment,
        drop_remainder=True,  # several workers: a partial last batch is refused
    )
    history = model.fit(train_ds, validation_data=val_ds, epochs=EPOCHS, verbose=0)
    result = {
        "rank": rank,
        "num_replicas": build.distribution.num_replicas,
        "num_workers": build.distribution.num_workers,
        "decoded": decoded,
        "train_files": train_ds.file_paths,
        "loss": [float(v) for v in history.history["loss"]],
        "val_loss": [float(v) for v in history.history["val_loss"]],
    }
    np.savez(os.path.join(out, f"weights-{rank}.npz"), *model.get_weights())
    with open(os.path.join(out, f"result-{rank}.json"), "w") as handle:
        json.dump(result, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
