"""Training job run as a subprocess by the crash, disk-full and permission tests.

Usage: python -m tests.ckpt_child DIR OUT_NPZ [--epochs N] [--save-freq F]
           [--pause-at K --pause-mode partial|after-tmp|after-replace --marker PATH]
           [--step-marker K --marker PATH [--block-at-marker]]
           [--fsize-limit-after-epoch E --fsize-limit BYTES] [--read-only-after-epoch E]
           [--fill-disk-after-epoch E --fill-path PATH]

--pause-at K stops inside the K-th atomic file write of the checkpoint store (odd K: a
checkpoint file, even K: the manifest that follows it) and waits to be killed.
--step-marker K writes the marker once training step K (counted from 1 in this process)
has ended, after the checkpoint callback's turn for that step. With --block-at-marker it
then waits there to be killed; without, it trains on and waits at the end of training,
so a kill sent after the marker lands between step K and the end, never after a normal
exit. The final RESULT line lists every atomic write ("writes": file names, in order) and
the global step of every checkpoint written ("saves").
--fill-disk-after-epoch E fills the filesystem holding --fill-path after epoch E's
checkpoint, until a 1-byte write fails with ENOSPC: the next save meets a full disk.
"""

from __future__ import annotations

import argparse
import errno
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
    parser.add_argument("--step-marker", type=int)
    parser.add_argument("--block-at-marker", action="store_true")
    parser.add_argument("--fill-disk-after-epoch", type=int)
    parser.add_argument("--fill-path")
    args = parser.parse_args()

    import keras
    import numpy as np

    from keras_mirror_kit import checkpoint_store
    from keras_mirror_kit.callbacks.synced_checkpoint import SyncedCheckpoint
    from tests.ckpt_helpers import build, dataset

    real_write = checkpoint_store.atomic_write_bytes
    writes: list[str] = []
    saves: list[int] = []
    model = None

    def recording_write(path, data):
        writes.append(path.name)
        if path.name.startswith("ckpt-") and model is not None:
            saves.append(int(model.optimizer.iterations.numpy()))
        if len(writes) == args.pause_at:
            pause(path, data)
        return real_write(path, data)

    checkpoint_store.atomic_write_bytes = recording_write

    def mark(text: str) -> None:
        tmp = f"{args.marker}.tmp"
        with open(tmp, "w") as handle:
            handle.write(text)
        os.replace(tmp, args.marker)

    def wait_to_be_killed() -> None:
        while True:
            time.sleep(1)

    def pause(path, data):
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
        mark(str(path))
        wait_to_be_killed()  # killed here

    class Limits(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.steps = 0

        def on_train_batch_end(self, batch, logs=None):
            self.steps += 1
            if self.steps == args.step_marker:
                mark(str(self.steps))
                if args.block_at_marker:
                    wait_to_be_killed()

        def on_train_end(self, logs=None):
            if args.step_marker:
                wait_to_be_killed()

        def on_epoch_end(self, epoch, logs=None):
            if epoch == args.fill_disk_after_epoch:
                fill(args.fill_path)
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
    try:
        model.fit(ds, epochs=args.epochs, verbose=0, callbacks=[checkpoint, Limits()])
    except OSError as err:
        print(
            "RESULT "
            + json.dumps(
                {
                    "error": type(err).__name__,
                    "message": str(err),
                    "errno": err.errno,
                    "writes": writes,
                    "saves": saves,
                }
            )
        )
        return 3
    np.savez(args.out, *model.get_weights())
    restored = checkpoint.last_restored
    print(
        "RESULT "
        + json.dumps(
            {
                "restored": None
                if restored is None
                else [restored.meta["epoch"], restored.meta["step"]],
                "iterations": int(model.optimizer.iterations.numpy()),
                "writes": writes,
                "saves": saves,
            }
        )
    )
    return 0


def fill(path: str) -> None:
    """Writes to `path` until its filesystem has no byte left (ENOSPC on a 1-byte write)."""
    chunk = 1 << 16
    with open(path, "ab", buffering=0) as handle:
        while chunk:
            try:
                handle.write(b"\0" * chunk)
            except OSError as err:
                if err.errno != errno.ENOSPC:
                    raise
                chunk //= 2
        os.fsync(handle.fileno())


if __name__ == "__main__":
    sys.exit(main())
