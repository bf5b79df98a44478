"""Training job run as a subprocess by the crash, disk-full and permission tests.

Usage: python -m tests.ckpt_child DIR OUT_NPZ [--epochs N] [--save-freq F]
           [--pause-at K --pause-mode partial|after-tmp|after-replace --marker PATH]
           [--step-marker K --marker PATH [--block-at-marker]]
           [--fsize-limit-after-epoch E --fsize-limit BYTES] [--read-only-after-epoch E]
           [--fill-disk-after-epoch E --fill-path PATH] [--async-save]

--pause-at K stops inside the K-th atomic file write of the checkpoint store (odd K: a
checkpoint file, even K: the manifest that follows it) and waits to be killed (with
--async-save, in the background thread that writes it, while training goes on).
--step-marker K writes the marker once training step K (counted from 1 in this process)
has ended, after the checkpoint callback's turn for that step. With --block-at-marker it
then waits there to be killed; without, it trains on and waits at the end of training,
so a kill sent after the marker lands between step K and the end, never after a normal
exit. The final RESULT line lists every atomic write ("writes": file names, in order) and
the global step of every checkpoint written ("saves", from each save's metadata).
--async-save runs SyncedCheckpoint(async_save=True); the disk-full, read-only and full-disk
switches then first wait for the epoch's checkpoint to be written, as a synchronous save
would have.
--fill-disk-after-epoch E fills the filesystem holding --fill-path after epoch E's
checkpoint, until a 1-byte write fails with ENOSPC: the next save meets a full disk.
--preempt-after-step G writes the marker once the optimizer's step G has ended and trains
on; before the run's last step it waits until SyncedCheckpoint has seen a stop signal, so
a SIGTERM sent after the marker always lands in training. On `Preempted` the RESULT line
says where it stopped ("preempted": saved epoch, batch, step; "iterations"; "observed":
the step count when a batch began with the signal seen; the longest step after the first
and the last save, in seconds) and the exit status is 75.
--accumulate N builds the model with distributed(gradient_accumulation_steps=N)
(`tests.accum_helpers`): one optimizer update every N training steps.
"""

from __future__ import annotations

import argparse
import errno
import io
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
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--preempt-after-step", type=int)
    parser.add_argument("--accumulate", type=int, default=1)
    args = parser.parse_args()

    import keras
    import numpy as np

    from keras_mirror_kit.callbacks.synced_checkpoint import SyncedCheckpoint
    from keras_mirror_kit.checkpoint import store as checkpoint_store
    from keras_mirror_kit.checkpoint.preemption import Preempted
    from tests.ckpt_helpers import build, dataset

    real_write = checkpoint_store.atomic_write
    real_store_write = checkpoint_store.CheckpointStore.write
    writes: list[str] = []
    saves: list[int] = []
    free_after_fill: list[int] = []  # free blocks once the disk was filled

    def recording_write(path, write, **options):
        writes.append(path.name)
        if len(writes) == args.pause_at:
            pause(path, write)
        return real_write(path, write, **options)

    def recording_store_write(self, arrays, meta, *more, **options):
        saves.append(int(meta["global_step"]))  # the step the state was read at
        return real_store_write(self, arrays, meta, *more, **options)

    checkpoint_store.atomic_write = recording_write
    checkpoint_store.CheckpointStore.write = recording_store_write

    def mark(text: str) -> None:
        tmp = f"{args.marker}.tmp"
        with open(tmp, "w") as handle:
            handle.write(text)
        os.replace(tmp, args.marker)

    def wait_to_be_killed() -> None:
        while True:
            time.sleep(1)

    def pause(path, write):
        buffer = io.BytesIO()
        write(buffer)  # the bytes the real write would have streamed
        data = buffer.getvalue()
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
            real_write(path, lambda handle: handle.write(data))
        mark(str(path))
        wait_to_be_killed()  # killed here

    timing = {"step_s": 0.0, "save_s": 0.0, "observed": None}

    class Limits(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.steps = 0

        def on_train_batch_begin(self, batch, logs=None):
            self.began = time.monotonic()
            if args.preempt_after_step is None:
                return
            done = int(self.model.optimizer.iterations.numpy())
            guard = checkpoint._preemption
            if done == args.epochs * 6 - 1:  # the last step: only once a signal was seen
                deadline = time.monotonic() + 240
                while guard.requested is None and time.monotonic() < deadline:
                    time.sleep(0.01)
            if guard.requested is not None and timing["observed"] is None:
                timing["observed"] = done

        def on_train_batch_end(self, batch, logs=None):
            if self.steps:  # the longest step after the first (which traces the function)
                timing["step_s"] = max(timing["step_s"], time.monotonic() - self.began)
            self.steps += 1
            if args.preempt_after_step is not None:
                if int(self.model.optimizer.iterations.numpy()) == args.preempt_after_step:
                    mark(str(args.preempt_after_step))
            if self.steps == args.step_marker:
                mark(str(self.steps))
                if args.block_at_marker:
                    wait_to_be_killed()

        def on_train_end(self, logs=None):
            if args.step_marker:
                wait_to_be_killed()

        def on_epoch_end(self, epoch, logs=None):
            if epoch in (
                args.fill_disk_after_epoch,
                args.fsize_limit_after_epoch,
                args.read_only_after_epoch,
            ):
                checkpoint.wait_for_pending_save()  # epoch's checkpoint written (async)
            if epoch == args.fill_disk_after_epoch:
                fill(args.fill_path)
                free_after_fill.append(os.statvfs(args.fill_path).f_bavail)
            if epoch == args.fsize_limit_after_epoch:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (args.fsize_limit, args.fsize_limit))
            if epoch == args.read_only_after_epoch:
                os.chmod(args.directory, 0o555)
                if os.geteuid() == 0:  # root ignores permissions: become nobody
                    os.setgid(65534)
                    os.setuid(65534)

    save_freq = args.save_freq if args.save_freq == "epoch" else int(args.save_freq)
    if args.accumulate > 1:
        from tests.accum_helpers import build_accumulating

        model, ds = build_accumulating("adam", args.accumulate), dataset()
    else:
        model, ds = build("adam"), dataset()
    checkpoint = SyncedCheckpoint(
        args.directory, save_freq=save_freq, dataset=ds, async_save=args.async_save
    )
    real_save = checkpoint._save

    def timed_save(*a, **k):
        began = time.monotonic()
        real_save(*a, **k)
        timing["save_s"] = time.monotonic() - began

    checkpoint._save = timed_save
    try:
        model.fit(ds, epochs=args.epochs, verbose=0, callbacks=[checkpoint, Limits()])
    except Preempted as stop:
        stopped = {
            "preempted": [stop.epoch, stop.step, stop.global_step],
            "signal": stop.signal_name,
            "iterations": int(model.optimizer.iterations.numpy()),
            "restored_step": None
            if checkpoint.last_restored is None
            else checkpoint.last_restored.meta["global_step"],
            **timing,
        }
        print("RESULT " + json.dumps(stopped), flush=True)
        raise
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
                    "iterations": int(model.optimizer.iterations.numpy()),
                    "free_after_fill": free_after_fill,
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
