"""`SyncedCheckpoint(async_save=True)` (issue 12 item 3): a snapshot at the step boundary,
copied into host staging arrays allocated once per fit, written in a background thread
while training goes on; one write at a time; a failed write
raised as `CheckpointWriteError` at the next step or at the end of `fit`. Kills during a
background write: tests/test_checkpoint_crash.py (both modes)."""

from __future__ import annotations

import os
import sys
import threading

import keras
import pytest

from keras_mirror_kit.callbacks.synced_checkpoint import SyncedCheckpoint
from keras_mirror_kit.checkpoint import store as checkpoint_store
from keras_mirror_kit.checkpoint.store import CheckpointStore, CheckpointWriteError
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
    """The metadata and arrays of a file, the variables in their saved order, then the rest."""
    loaded = store.read(entry)

    def order(key: str) -> tuple[int, int, str]:
        number = key.partition("/")[2]
        return (0, int(number), "") if number.isdigit() else (1, 0, key)

    return loaded.meta, [loaded.arrays[k] for k in sorted(loaded.arrays, key=order)]


@pytest.mark.slow
def test_background_writes_hold_the_state_of_their_step_while_training_goes_on(
    tmp_path, monkeypatch
):
    """...and the snapshots are copied into staging arrays allocated once per fit: one host
    copy of the state, allocated at the start of fit, reused by every save (no fresh memory
    at a save), freed when fit returns; each file holds its own step's state."""
    from keras_mirror_kit.checkpoint.state import state_variables

    model, ds = build("adam"), dataset()
    sync = SyncedCheckpoint(tmp_path / "sync", save_freq=2, keep=100, dataset=ds)
    model.fit(ds, epochs=2, verbose=0, callbacks=[sync])

    # Each background write starts only once training has run one step past the save's
    # (progress, not time), so the variables it snapshots have changed by then; writes are
    # recorded. The k-th write is the save of step 2k (save_freq=2, 6 steps an epoch): its
    # target is step 2k + 1, whenever the writer thread gets to run (a target taken from the
    # step reached when the thread starts could wait for a step that waits for this write).
    steps, real_write = Steps(), checkpoint_store.atomic_write
    started: list[tuple[str, int]] = []
    active: list[int] = []

    def write_after_one_more_step(path, write, **options):
        if path.name.startswith("ckpt-"):
            with steps.changed:
                target = 2 * (len(started) + 1) + 1
                assert steps.changed.wait_for(lambda: steps.done >= target or steps.ended, 120)
                started.append((path.name, steps.done))
            active.append(1)
            assert len(active) == 1, "two checkpoint writes at once"
        try:
            return real_write(path, write, **options)
        finally:
            if path.name.startswith("ckpt-"):
                active.pop()

    monkeypatch.setattr(checkpoint_store, "atomic_write", write_after_one_more_step)
    model, ds = build("adam"), dataset()
    checkpoint = SyncedCheckpoint(
        tmp_path / "async", save_freq=2, keep=100, dataset=ds, async_save=True,
        async_host_memory=1.0,  # all of the state staged: every value written in the background
    )  # fmt: skip
    seen: list[tuple[int, list]] = []

    class Watch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            staging = checkpoint._staging  # noqa: SLF001
            seen.append((staging.nbytes, list(staging._arrays)))  # noqa: SLF001

    model.fit(ds, epochs=2, verbose=0, callbacks=[steps, checkpoint, Watch()])
    monkeypatch.undo()
    assert not checkpoint._writer.pending  # noqa: SLF001  (fit waited for the last one)
    state = sum(v.numpy().nbytes for _, v in state_variables(model))
    assert {nbytes for nbytes, _ in seen} == {state}  # from the first step on, never more
    first = seen[0][1]  # the same array objects at every step, every save included
    assert all(len(a) == len(first) and all(x is y for x, y in zip(a, first)) for _, a in seen)
    assert checkpoint._staging.nbytes == 0  # noqa: SLF001  (freed after fit)

    ours, theirs = CheckpointStore(tmp_path / "async"), CheckpointStore(tmp_path / "sync")
    assert [e.file for e in ours.entries()] == [e.file for e in theirs.entries()]
    assert len(started) == 6  # steps 2, 4, 6 (epoch end), 8, 10, 12 (epoch end)
    for (name, step_at_write), a, b in zip(started, ours.entries(), theirs.entries()):
        meta, values = _arrays(ours, a)
        sync_meta, sync_values = _arrays(theirs, b)
        assert name == a.file and meta.global_step == sync_meta.global_step
        if not steps.ended or meta.global_step < 12:
            assert step_at_write > meta.global_step  # training had gone on
        assert max_diff(values, sync_values) <= 1e-6, name  # the state of its own step
    global_steps = [ours.read(e).meta.global_step for e in ours.entries()]
    assert len(global_steps) >= 4 and global_steps == sorted(set(global_steps))  # distinct
    _, last = _arrays(ours, ours.entries()[-1])
    assert max_diff(last, [v.numpy() for _, v in state_variables(model)]) == 0.0


@pytest.mark.slow
def test_only_a_share_of_the_state_is_staged_the_rest_is_read_while_training_waits(
    tmp_path, monkeypatch
):
    """`async_host_memory` (issue 47): the staging arrays hold the last variables that fit in
    that share of the state; the others are read from the variables while training waits
    (no step runs until they are read), the staged rest is written while training goes on;
    each file holds its own step's state, as a synchronous save's."""
    from keras_mirror_kit.checkpoint import snapshot as snapshot_module
    from keras_mirror_kit.checkpoint.state import state_variables

    model, ds = build("adam"), dataset()
    sync = SyncedCheckpoint(tmp_path / "sync", save_freq=2, keep=100, dataset=ds)
    model.fit(ds, epochs=2, verbose=0, callbacks=[sync])

    steps, real_items = Steps(), snapshot_module.StateSnapshot.items
    reads: list[tuple[int, int, int]] = []  # (values read live, steps meanwhile, after staged)

    def items(self):
        at_save, live, went_on = steps.done, self.live, 0
        for i, item in enumerate(real_items(self)):
            if i < live:
                assert steps.done == at_save, "a training step ran while the state was read"
            elif i == live and live < len(self.keys):  # staged: training may go on now
                with steps.changed:
                    assert steps.changed.wait_for(lambda: steps.done > at_save or steps.ended, 120)
                    went_on = steps.done - at_save
            yield item
        reads.append((live, went_on, len(self.keys) - live))

    monkeypatch.setattr(snapshot_module.StateSnapshot, "items", items)
    model, ds = build("adam"), dataset()
    checkpoint = SyncedCheckpoint(
        tmp_path / "async", save_freq=2, keep=100, dataset=ds, async_save=True,
        async_host_memory=0.5,
    )  # fmt: skip
    staged: list[int] = []

    class Watch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            staged.append(checkpoint._staging.nbytes)  # noqa: SLF001

    model.fit(ds, epochs=2, verbose=0, callbacks=[steps, checkpoint, Watch()])
    monkeypatch.undo()
    state = sum(v.numpy().nbytes for _, v in state_variables(model))
    assert len(set(staged)) == 1 and 0 < staged[0] <= 0.5 * state, (staged, state)
    assert len(reads) == 7  # fit-start.kmk and the 6 saves
    assert all(live > 0 and rest > 0 for live, _, rest in reads), reads
    assert any(went_on > 0 for _, went_on, _ in reads), reads  # training went on meanwhile
    ours, theirs = CheckpointStore(tmp_path / "async"), CheckpointStore(tmp_path / "sync")
    assert [e.file for e in ours.entries()] == [e.file for e in theirs.entries()]
    for a, b in zip(ours.entries(), theirs.entries()):
        assert max_diff(_arrays(ours, a)[1], _arrays(theirs, b)[1]) <= 1e-6, a.file


def test_async_host_memory_is_a_share_from_0_to_1(tmp_path):
    for bad in (1.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match="async_host_memory"):
            SyncedCheckpoint(tmp_path, async_save=True, async_host_memory=bad)
    with pytest.raises(TypeError, match="async_host_memory"):
        SyncedCheckpoint(tmp_path, async_save=True, async_host_memory="half")
    assert SyncedCheckpoint(tmp_path, async_host_memory=0).async_host_memory == 0.0


def test_host_staging_keeps_the_last_variables_that_fit_in_its_share(caplog):
    import numpy as np

    from keras_mirror_kit.checkpoint.snapshot import HostStaging

    sizes = [400, 40, 200, 160]  # bytes of float32 variables
    variables = [("model", keras.Variable(np.zeros(n // 4, "float32"))) for n in sizes]
    staging = HostStaging()
    with caplog.at_level("INFO", logger="keras_mirror_kit"):
        assert staging.prepare(variables, 0.45) == (360, 800)  # 160 + 200: 40 more would not fit
    assert staging.first_staged == 2 and staging.nbytes == 360
    assert [staging.holds(i, 4) for i in range(4)] == [False, False, True, True]
    assert not staging.holds(3, 5)  # another state than the one prepared: nothing staged
    assert "0.0 of the state's 0.0 MiB" in caplog.text and "async_host_memory" in caplog.text
    assert staging.prepare(variables, 0.5) == (400, 800) and staging.first_staged == 1
    assert staging.prepare(variables, 1.0) == (800, 800) and staging.first_staged == 0
    assert staging.prepare(variables, 0.0) == (0, 800) and staging.nbytes == 0


def test_a_write_that_fails_before_reading_the_live_values_does_not_hold_training():
    """`submit` waits for the live values; a write that raises first lets it return, and
    its error comes at the next `wait`."""
    import numpy as np

    from keras_mirror_kit.checkpoint.snapshot import BackgroundWriter, StateSnapshot

    snapshot = StateSnapshot(
        ["model/00000", "model/00001"], ["model:a", "model:b"], [np.ones(2), np.ones(2)], [], {},
        live=2,
    )  # fmt: skip
    writer = BackgroundWriter()

    def write() -> None:
        raise OSError(28, "No space left on device")

    writer.submit(write, snapshot)  # returns: the write ended without reading anything
    with pytest.raises(OSError, match="No space"):
        writer.wait()


def test_a_save_whose_wait_was_interrupted_reads_no_live_value():
    """After the training thread stopped waiting (an interrupt), the write fails instead of
    reading variables training may already be changing."""
    import numpy as np

    from keras_mirror_kit.checkpoint.snapshot import StateSnapshot

    snapshot = StateSnapshot(["model/00000"], ["model:a"], [np.ones(2)], [], {}, live=1)
    snapshot._live_read.wait = lambda: (_ for _ in ()).throw(KeyboardInterrupt)  # noqa: SLF001
    with pytest.raises(KeyboardInterrupt):
        snapshot.wait_live_read()
    with pytest.raises(RuntimeError, match="stopped waiting"):
        next(snapshot.items())


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


@pytest.mark.slow
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


@pytest.mark.slow
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
    from keras_mirror_kit.checkpoint.snapshot import (
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


def test_host_staging_reuses_its_arrays_and_follows_shape_changes():
    import numpy as np
    import tensorflow as tf

    from keras_mirror_kit.checkpoint.snapshot import HostStaging

    staging = HostStaging()  # the whole state staged (async_host_memory=1.0)
    variables = [("model", keras.Variable(np.ones((3, 4), "float32"))),
                 ("model", keras.Variable(np.zeros(5, "int64")))]  # fmt: skip
    staging.prepare(variables)
    assert staging.nbytes == 3 * 4 * 4 + 5 * 8
    first = staging.copy(0, tf.fill((3, 4), 2.0))
    assert staging.copy(0, tf.fill((3, 4), 3.0)) is first and float(first[0, 0]) == 3.0
    wider = staging.copy(0, tf.fill((3, 6), 1.0))  # a variable whose shape changed
    assert wider is not first and wider.shape == (3, 6) and staging.nbytes == 72 + 40
    odd = [("model", keras.Variable(np.ones((2, 3)), dtype="bfloat16")),
           ("model", keras.Variable(np.float32(1.5))),
           ("model", keras.Variable(np.zeros((0, 4), "float32")))]  # fmt: skip
    staging.prepare(odd)
    prepared = [staging._array(i, tuple(v.shape), v.value.dtype.as_numpy_dtype)  # noqa: SLF001
                for i, (_, v) in enumerate(odd)]  # fmt: skip
    for i, (_, v) in enumerate(odd):  # copy() finds the arrays prepare() made: no new ones
        assert staging.copy(i, tf.convert_to_tensor(v.value)) is prepared[i]
    assert float(prepared[0][0, 0]) == 1.0 and float(prepared[1]) == 1.5
    staging.prepare(variables)
    staging.prepare(variables[:1])  # fewer variables: the others' arrays go
    assert staging.nbytes == 48
    staging.release()
    assert staging.nbytes == 0
