"""Resumes several checkpoint directories in one process (one fresh model each).

Usage: python -m tests.resume_many OUT_JSON DIR [DIR ...]

A DIR given as `async:DIR` resumes with `SyncedCheckpoint(async_save=True)`.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("KMK_SIMULATE_REPLICAS", "2")


def main() -> int:
    import numpy as np

    from keras_mirror_kit.callbacks.synced_checkpoint import SyncedCheckpoint
    from tests.ckpt_helpers import CountBatches, build, dataset

    out, given = sys.argv[1], sys.argv[2:]
    results = {}
    for i, spec in enumerate(given):
        async_save = spec.startswith("async:")
        directory = spec.removeprefix("async:")
        # A restarted job: with nothing to resume from it starts as the original did (the
        # deterministic setup); with a checkpoint, a different init proves it is replaced.
        has_checkpoint = any(n.startswith("ckpt-") for n in os.listdir(directory))
        model, ds = build("adam", seed=1000 + i if has_checkpoint else 3), dataset()
        checkpoint = SyncedCheckpoint(directory, save_freq=4, dataset=ds, async_save=async_save)
        counter = CountBatches()
        model.fit(ds, epochs=3, verbose=0, callbacks=[checkpoint, counter])
        restored = checkpoint.last_restored
        leftovers = [n for n in os.listdir(directory) if n.endswith(".tmp")]
        np.savez(os.path.join(directory, "..", f"final-{i}.npz"), *model.get_weights())
        results[directory] = {
            "restored": None
            if restored is None
            else [restored.meta["epoch"], restored.meta["step"]],
            "iterations": int(model.optimizer.iterations.numpy()),
            "batches": counter.batches,
            "leftovers": leftovers,
            "weights": os.path.join(directory, "..", f"final-{i}.npz"),
        }
    with open(out, "w") as handle:
        json.dump(results, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
