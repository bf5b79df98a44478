"""Training job run as a subprocess by the crash, disk-full and permission tests.

Usage: python -m tests.ckpt_child DIR OUT_NPZ [--epochs N] [--save-freq F]
           [--pause-at K --pause-mode partial|after-tmp|after-replace --marker PATH]
           [--fsize-limit-after-epoch E --fsize-limit BYTES] [--as-nobody]

--pause-at K stops inside the K-th atomic file write of the checkpoint store (odd K: a
checkpoint file, even K: the manifest that follows it) and waits to be killed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
import time

os.environ.setdefault("KMK_SIMULATE_REPLICAS", "2")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("out")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--save-freq", default="2")
    parser.add_argument("--pause-at", type=int)
    parser.add_argument("--pause-mode", default="after-tmp")
    parser.add_argument("--marker")
    parser.add_argument("--fsize-limit-after-epoch", type=int)
    parser.add_argument("--fsize-limit", type=int, default=2048)
    parser.add_argument("--read-only-after-epoch", type=int)
    parser.add_argument("--started-marker", help="touched when training starts")
    args = parser.parse_args()

    import keras
    import numpy as np

    from keras_mirror_kit import checkpoint_store
    from keras_mirror_kit.callbacks.synced_checkpoint import SyncedCheckpoint
    from tests.ckpt_helpers import build, dataset

    if args.pause_at:
        real_write = checkpoint_store.atomic_write_bytes
        calls = {"n": 0}

        def pausing_write(path, data):
            calls["n"] += 1
            if calls["n"] == args.pause_at:
                tmp = path.with_name(f".{path.name}.{os.urandom(4).hex()}.tmp")
                if args.pause_mode == "partial":
                    with open(tmp, "wb") as handle:
                        handle.write(data[: len(data) // 2])
                elif args.pause_mode == "after-tmp":
                    with open(tmp, "wb") as handle:
                        handle.write(data)
                        handle.flush()
                        os.fsync(handle.fileno())
                else:  # after-replace
                    real_write(path, data)
                with open(args.marker, "w") as handle:
                    handle.write(str(path))
                while True:
                    time.sleep(1)  # killed here
            return real_write(path, data)

        checkpoint_store.atomic_write_bytes = pausing_write

    class Limits(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            if args.started_marker:
                with open(args.started_marker, "w") as handle:
                    handle.write(str(time.time()))

        def on_epoch_end(self, epoch, logs=None):
            if epoch == args.fsize_limit_after_epoch:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (args.fsize_limit, args.fsize_limit))
            if epoch == args.read_only_after_epoch:
                os.chmod(args.directory, 0o555)
                if os.geteuid() == 0:  # root ignores permissions: become nobody
                    os.setgid(65534)
                    os.setuid(65534)

    save_freq = args.save_freq if args.save_freq == "epoch" else int(args.save_freq)
    model, ds = build("adam"), dataset()
    checkpoint = SyncedCheckpoint(args.directory, save_freq=save_freq, dataset=ds)
    started = time.time()
    try:
        model.fit(ds, epochs=args.epochs, verbose=0, callbacks=[checkpoint, Limits()])
    except OSError as err:
        print("RESULT " + json.dumps({"error": type(err).__name__, "message": str(err)}))
        return 3
    np.savez(args.out, *model.get_weights())
    restored = checkpoint.last_restored
    print("RESULT " + json.dumps({
        "restored": None if restored is None else [restored.meta["epoch"], restored.meta["step"]],
        "iterations": int(model.optimizer.iterations.numpy()),
        "fit_seconds": time.time() - started,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
