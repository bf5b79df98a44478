"""The checkpoint tests' little training job with gradient accumulation, and a resumer.

Usage (resume several kill-trial directories in one process, like `tests.resume_many`):
    python -m tests.accum_helpers OUT_JSON ACCUMULATE DIR [DIR ...]
"""

from __future__ import annotations

import json
import os
import sys

SAVE_FREQ = 3  # not a multiple of the accumulation steps: saves land between updates


def build_accumulating(optimizer: str, accumulate: int, seed: int = 3):
    """`tests.ckpt_helpers.build`'s model, built with `gradient_accumulation_steps`."""
    import keras

    import keras_mirror_kit as kmk
    from tests.ckpt_helpers import BATCH, OPTIMIZERS

    @kmk.distributed(global_batch_size=BATCH, gradient_accumulation_steps=accumulate)
    def factory():
        keras.utils.set_random_seed(seed)
        model = keras.Sequential(
            [keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)]
        )
        model.compile(
            optimizer=OPTIMIZERS[optimizer](),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return model

    return factory()


def main() -> int:
    import numpy as np

    from keras_mirror_kit.callbacks.synced_checkpoint import SyncedCheckpoint
    from tests.ckpt_helpers import CountBatches, dataset

    out, accumulate, directories = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    results = {}
    for i, directory in enumerate(directories):
        has_checkpoint = any(n.startswith("ckpt-") for n in os.listdir(directory))
        model = build_accumulating("adam", accumulate, seed=1000 + i if has_checkpoint else 3)
        ds = dataset()
        checkpoint = SyncedCheckpoint(directory, save_freq=SAVE_FREQ, dataset=ds)
        counter = CountBatches()
        model.fit(ds, epochs=3, verbose=0, callbacks=[checkpoint, counter])
        restored = checkpoint.last_restored
        weights = os.path.join(directory, "..", f"final-{i}.npz")
        np.savez(weights, *model.get_weights())
        results[directory] = {
            "restored": None
            if restored is None
            else [restored.meta["epoch"], restored.meta["step"]],
            "micro_steps": int(model.optimizer._iterations.numpy()),
            "batches": counter.batches,
            "weights": weights,
        }
    with open(out, "w") as handle:
        json.dump(results, handle)
    return 0


if __name__ == "__main__":
    # 2 simulated replicas as a script only: importing this module (a test's fixture does)
    # must not change the environment the test process gives its other children.
    os.environ.setdefault("KMK_SIMULATE_REPLICAS", "2")
    sys.exit(main())
