"""`SyncedCheckpoint(async_save=True)` (issue 12 item 3): a snapshot at the step boundary,
written in a background thread while training goes on; one write at a time; a failed write
raised as `CheckpointWriteError` at the next step or at the end of `fit`. Kills during a
background write: tests/test_checkpoint_crash.py (both modes)."""

from __future__ import annotations

import os
import sys
import threading

import keras
import pytest

from keras_mirror_kit import checkpoint_store
from keras_mirror_kit.callbacks.synced_checkpoint import SyncedCheckpoint
from keras_mirror_kit.checkpoint_store import CheckpointStore, CheckpointWriteError
from tests.ckpt_helpers import build, dataset, max_diff


class Steps(keras.callbacks.Callback):
    """Counts finished training steps (listed before the checkpoint) and wakes waiters."""

    def __init__(self) -> None:
        super().__init__()
        self.done, self.ended = 0, False
        self.changed = threading.Condition()

    def on_train_batch_end(self, batch, logs=None):
        with self.changed:
            self.done += 1
            self.changed.notify_all()

    def on_train_end(self, logs=None):
        with self.changed:
            self.ended = True
            self.changed.notify_all()


def _arrays(store: CheckpointStore, entry):
    loaded = store.read(entry)
    return loaded.meta, [loaded.arrays[k] for k in sorted(loaded.arrays)]


def test_background_writes_hold_the_state_of_their_step_while_training_goes_on(
    tmp_path, monkeypatch
):
    model, ds = build("adam"), dataset()
    sync = SyncedCheckpoint(tmp_path / "sync", save_freq=2, keep=100, dataset=ds)
    model.fit(ds, epochs=2, verbose=0, callbacks=[sync])

    # Each background write starts only once training has run one more step (progress, not
    # time), so the variables it snapshots have changed by then; writes are recorded.
    steps, real_write = Steps(), checkpoint_store.atomic_write
    started: list[tuple[str, int]] = []
    active: list[int] = []

    def write_after_one_more_step(path, write):
        if path.name.startswith("ckpt-"):
            with steps.changed:
                target = steps.done + 1
                assert steps.changed.wait_for(lambda: steps.done >= target or steps.ended, 120)
                started.append((path.name, steps.done))
            active.append(1)
            assert len(active) == 1, "two checkpoint writes at once"
        try:
            return real_write(path, write)
        finally:
            if path.name.startswith("ckpt-"):
                active.pop()

    monkeypatch.setattr(checkpoint_store, "atomic_write", write_after_one_more_step)
    model, ds = build("adam"), dataset()
    checkpoint = SyncedCheckpoint(
        tmp_path / "async", save_freq=2, keep=100, dataset=ds, async_save=True
    )
    model.fit(ds, epochs=2, verbose=0, callbacks=[steps, checkpoint])
    monkeypatch.undo()
    assert not checkpoint._writer.pending  # noqa: SLF001  (fit waited for the last one)

    ours, theirs = CheckpointStore(tmp_path / "async"), CheckpointStore(tmp_path / "sync")
    assert [e["file"] for e in ours.entries()] == [e["file"] for e in theirs.entries()]
    assert len(started) == 6  # steps 2, 4, 6 (epoch end), 8, 10, 12 (epoch end)
    for (name, step_at_write), a, b in zip(started, ours.entries(), theirs.entries()):
        meta, values = _arrays(ours, a)
        sync_meta, sync_values = _arrays(theirs, b)
        assert name == a["file"] and meta["global_step"] == sync_meta["global_step"]
        if not steps.ended or meta["global_step"] < 12:
            assert step_at_write > meta["global_step"]  # training had gone on
        assert max_diff(values, sync_values) <= 1e-6, name  # the state of its own step


class BreakManifest(keras.callbacks.Callback):
    """After the checkpoint of `at` (a step, or "epoch"), makes the next manifest write fail
    for real: a directory stands where `manifest.json` is replaced."""

    def __init__(self, checkpoint: SyncedCheckpoint, at) -> None:
        super().__init__()
        self.checkpoint, self.at, self.steps = checkpoint, at, 0

    def _break(self) -> None:
        self.checkpoint.wait_for_pending_save()
        manifest = self.checkpoint.directory / "manifest.json"
        os.remove(manifest)
        os.mkdir(manifest)

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.steps == self.at:
            self._break()

    def on_epoch_end(self, epoch, logs=None):
        if self.at == "epoch" and epoch == 0:
            self._break()


def test_a_failed_background_write_is_raised_at_a_following_step(tmp_path):
    model, ds = build("sgd"), dataset()
    checkpoint = SyncedCheckpoint(tmp_path, save_freq=2, dataset=ds, async_save=True)
    steps = Steps()
    with pytest.raises(CheckpointWriteError, match="Earlier checkpoints are intact"):
        model.fit(
            ds,
            epochs=2,
            verbose=0,
            callbacks=[steps, checkpoint, BreakManifest(checkpoint, at=2)],
        )
    # The save of step 4 failed in the background: raised at step 5's end, or at the
    # latest when the save of step 6 waits for it; never lost.
    assert 5 <= steps.done <= 6 and not steps.ended
    assert (tmp_path / "ckpt-00000001.npz").exists()


def test_a_failed_last_background_write_is_raised_at_the_end_of_fit(tmp_path):
    model, ds = build("sgd"), dataset()
    checkpoint = SyncedCheckpoint(tmp_path, dataset=ds, async_save=True)
    steps = Steps()
    with pytest.raises(CheckpointWriteError, match="manifest.json|Is a directory"):
        model.fit(
            ds,
            epochs=2,
            verbose=0,
            callbacks=[steps, checkpoint, BreakManifest(checkpoint, at="epoch")],
        )
    assert steps.done == 12 and steps.ended  # every step ran; the end of fit raised
    checkpoint.wait_for_pending_save()  # raised once, not again


def test_async_save_must_be_a_bool(tmp_path):
    with pytest.raises(TypeError, match="`async_save` must be True or False"):
        SyncedCheckpoint(tmp_path, async_save="yes")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_the_writer_thread_yields_the_cpu_to_training():
    from keras_mirror_kit.callbacks.synced_checkpoint.background import (
        WRITER_NICE,
        BackgroundWriter,
    )

    seen = {}

    def write():
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    writer = BackgroundWriter()
    writer.submit(write)
    writer.wait()
    assert seen["nice"] == WRITER_NICE == 19
    # Only the writer thread: the training thread keeps its priority.
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
