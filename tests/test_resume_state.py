"""Resume exactly what was running, or refuse (issue 18; issue 11 item 1).

The same 2-replica job as tests/test_synced_checkpoint.py: 96 samples, global batch 16,
6 batches an epoch. Each test walks one ordinary situation that resumed wrongly, lost
checkpoints or trained from scratch before, and checks the weights, the batches trained
or the refusal. Runs several tests start from are made once per module, read-only (tests
resume copies of their directories): `crashed_mid_epoch`, `plain_run` (an uninterrupted
run: weights and checkpoints), `two_stage_runs`. Models are shared too (one trace each,
both fixtures of tests/conftest.py): `fresh()` is the one `build("sgd")` of the runs from
scratch, set back before each run to the state it was built in (what a new `build` trains
to, bit for bit); `resumer` is the one SGD model that resumes (`crashed_mid_epoch`'s
copies, the reruns): a restore replaces its state.
"""

from __future__ import annotations

import json
import logging
import os
from typing import NamedTuple

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_mirror_kit.callbacks.synced_checkpoint import SyncedCheckpoint
from keras_mirror_kit.checkpoint.store import CheckpointError, CorruptCheckpointWarning
from tests.ckpt_helpers import (
    CountBatches,
    StopAt,
    build,
    copy_of,
    data,
    dataset,
    max_diff,
    set_back,
)
from tests.subproc import last_json, run_python


def plain_dataset():
    """A dataset the kit did not build: fixed order every epoch."""
    return tf.data.Dataset.from_tensor_slices(data()).batch(16)


def npz_files(directory):
    return sorted(n for n in os.listdir(directory) if n.endswith(".npz"))


@pytest.fixture(scope="module")
def crashed_mid_epoch(tmp_path_factory, fresh):
    """A run (SGD, dataset=, save_freq=2) killed in epoch 1: newest checkpoint (1, 4)."""
    directory = tmp_path_factory.mktemp("crashed") / "ckpt"
    model, ds = fresh(), dataset()
    with pytest.raises(KeyboardInterrupt):
        model.fit(
            ds,
            epochs=4,
            verbose=0,
            callbacks=[SyncedCheckpoint(directory, save_freq=2, dataset=ds), StopAt(1, 3)],
        )
    return directory


class PlainRun(NamedTuple):
    weights: list[np.ndarray]
    directory: object


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory, fresh):
    """An uninterrupted 4-epoch SGD run on the plain dataset, save_freq=2, keep=3: its
    weights, and its checkpoint directory (read-only: tests copy it)."""
    directory = tmp_path_factory.mktemp("plain") / "ckpt"
    model = fresh()
    model.fit(
        plain_dataset(),
        epochs=4,
        verbose=0,
        callbacks=[SyncedCheckpoint(directory, save_freq=2, keep=3)],
    )
    return PlainRun(model.get_weights(), directory)


# -- issue 11 item 1: a stop request at the end of a resumed epoch ------------------------


class StopIn(keras.callbacks.Callback):
    """Asks to stop in `hook` of `epoch` (at its last batch for on_train_batch_end)."""

    def __init__(self, epoch: int, hook: str) -> None:
        super().__init__()
        self.epoch, self.hook, self.current = epoch, hook, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch

    def on_train_batch_end(self, batch, logs=None):
        # The resumed epoch 1 starts at batch 4: its last batch is Keras' batch index 1.
        if self.hook == "batch" and self.current == self.epoch and batch == 1:
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        if self.hook == "epoch" and epoch == self.epoch:
            self.model.stop_training = True


@pytest.mark.parametrize(
    ("hook", "before"),
    [("epoch", True), ("epoch", False), ("batch", False)],
    ids=["on_epoch_end-listed-before", "on_epoch_end-listed-after", "on_batch_end-after"],
)
@pytest.mark.slow
def test_a_stop_request_at_the_end_of_a_resumed_epoch_is_honoured(
    crashed_mid_epoch, resumer, tmp_path, hook, before
):
    directory = copy_of(crashed_mid_epoch, tmp_path)
    ds, counter = dataset(), CountBatches()
    checkpoint, stop = SyncedCheckpoint(directory, save_freq=2, dataset=ds), StopIn(1, hook)
    callbacks = [stop, checkpoint, counter] if before else [checkpoint, stop, counter]
    history = resumer.fit(ds, epochs=4, verbose=0, callbacks=callbacks)
    assert checkpoint.last_restored.meta["step"] == 4
    assert counter.batches == 2  # the rest of epoch 1, then the stop: epochs 2, 3 not run
    assert len(history.history["loss"]) == 1
    newest = json.loads((directory / "manifest.json").read_text())["checkpoints"][-1]
    assert (newest["epoch"], newest["epoch_end"], newest["stopped"]) == (2, True, True)


# -- item 1: another optimizer; non-finite state -------------------------------------------


@pytest.mark.slow
def test_a_checkpoint_of_another_optimizer_is_refused_before_any_step(tmp_path):
    model, ds = build("momentum"), dataset()
    model.fit(ds, epochs=1, verbose=0, callbacks=[SyncedCheckpoint(tmp_path, dataset=ds)])
    files = npz_files(tmp_path)
    other, counter = build("rmsprop"), CountBatches()  # 6 optimizer variables as well
    with pytest.raises(CheckpointError, match="does not match this model") as info:
        other.fit(
            ds, epochs=4, verbose=0, callbacks=[SyncedCheckpoint(tmp_path, dataset=ds), counter]
        )
    message = str(info.value)
    assert "momentum" in message and "velocity" in message  # names the first differences
    assert counter.batches == 0 and int(other.optimizer.iterations.numpy()) == 0
    assert npz_files(tmp_path) == files


@pytest.mark.slow
def test_a_non_finite_state_is_refused_and_the_finite_checkpoints_stay(tmp_path, fresh):
    model, ds = fresh(), dataset()
    model.fit(ds, epochs=1, verbose=0, callbacks=[SyncedCheckpoint(tmp_path, dataset=ds)])
    manifest = (tmp_path / "manifest.json").read_text()
    model.layers[0].bias.assign(np.full((8,), np.nan, "float32"))  # training diverged
    with pytest.raises(CheckpointError, match="NaN or Inf") as info:
        model.fit(
            ds,
            epochs=1,
            verbose=0,
            callbacks=[SyncedCheckpoint(tmp_path, save_freq=1, dataset=ds)],
        )
    assert "dense" in str(info.value) and "allow_non_finite=True" in str(info.value)
    assert (tmp_path / "manifest.json").read_text() == manifest  # nothing written
    # Opted in, with keep=1: NaN states are saved, and the last finite one is still kept.
    model.fit(
        ds,
        epochs=1,
        verbose=0,
        callbacks=[
            SyncedCheckpoint(tmp_path, save_freq=1, keep=1, dataset=ds, allow_non_finite=True)
        ],
    )
    entries = json.loads((tmp_path / "manifest.json").read_text())["checkpoints"]
    assert entries[-1]["finite"] is False
    finite = [e for e in entries if e.get("finite", True)]
    assert finite and (tmp_path / finite[-1]["file"]).exists()


# -- item 2: random state ------------------------------------------------------------------


@pytest.mark.slow
def test_random_layers_resume_mid_epoch_to_the_uninterrupted_weights(tmp_path):
    """The uninterrupted and the crashed run: one model (one trace), every variable of it
    (the random layers' seed-generator state too) and of its optimizer set back between."""
    model, ds = build("sgd", random_layers=True), dataset()
    assert any("seed_generator_state" in v.path for v in model.variables)
    reset = set_back(model)  # seed 3: as build("sgd", random_layers=True)
    model.fit(
        ds,
        epochs=3,
        verbose=0,
        callbacks=[SyncedCheckpoint(tmp_path / "ref", save_freq=2, dataset=ds)],
    )
    reference = model.get_weights()
    reset()
    ds = dataset()
    with pytest.raises(KeyboardInterrupt):
        model.fit(
            ds,
            epochs=3,
            verbose=0,
            callbacks=[SyncedCheckpoint(tmp_path / "run", save_freq=2, dataset=ds), StopAt(1, 3)],
        )
    fresh, ds = build("sgd", random_layers=True, seed=99), dataset()
    checkpoint = SyncedCheckpoint(tmp_path / "run", save_freq=2, dataset=ds)
    fresh.fit(ds, epochs=3, verbose=0, callbacks=[checkpoint])
    assert checkpoint.last_restored.meta["step"] == 4
    assert max_diff(reference, fresh.get_weights()) <= 1e-6  # 0.01 to 0.1 without the seeds
    assert any("seed_generator_state" in p for p in checkpoint.last_restored.meta["variables"])


# -- item 3: the data changed --------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"n": 112}, "112 samples now but held 96"),
        # 100 samples still make 6 batches of 16 (drop_remainder): another permutation of
        # the same number of batches; resumed mid-epoch with no warning before the fix.
        ({"n": 100}, "100 samples now but held 96"),
        ({"seed": 12}, "seed 12 differs"),
    ],
    ids=["16-more-samples", "4-more-samples", "another-seed"],
)
@pytest.mark.slow
def test_changed_data_resumes_from_the_epoch_boundary_with_a_warning(
    crashed_mid_epoch, resumer, tmp_path, caplog, change, why
):
    directory = copy_of(crashed_mid_epoch, tmp_path)
    caplog.set_level(logging.WARNING, logger="keras_mirror_kit")
    ds, counter = dataset(**change), CountBatches()
    per_epoch = kmk_batches(ds)
    checkpoint = SyncedCheckpoint(directory, save_freq=2, dataset=ds)
    resumer.fit(ds, epochs=2, verbose=0, callbacks=[checkpoint, counter])
    restored = checkpoint.last_restored.meta
    assert (restored["epoch"], restored["step"], restored["epoch_end"]) == (1, 0, True)
    assert counter.batches == per_epoch  # epoch 1 whole: nothing twice
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(why in m and "newest epoch boundary" in m for m in warned), warned
    # strict=True refuses instead, before any step.
    directory, counter = copy_of(crashed_mid_epoch, tmp_path / "strict"), CountBatches()
    strict = SyncedCheckpoint(directory, save_freq=2, dataset=ds, strict=True)
    with pytest.raises(CheckpointError, match=why):
        resumer.fit(ds, epochs=2, verbose=0, callbacks=[strict, counter])
    assert counter.batches == 0


def kmk_batches(ds):
    from keras_mirror_kit import cursor_of

    return cursor_of(ds).num_batches


# -- item 4: fit iterates another make_dataset object --------------------------------------


def test_fit_on_another_dataset_than_the_one_given_is_refused_before_any_step(tmp_path):
    given, trained = dataset(), dataset()  # two calls of the same builder
    model, counter = build("sgd"), CountBatches()
    with pytest.raises(ValueError, match="given another kmk.make_dataset object"):
        model.fit(
            trained.prefetch(1),
            epochs=2,
            verbose=0,
            callbacks=[SyncedCheckpoint(tmp_path, save_freq=1, dataset=given), counter],
        )
    assert counter.batches == 0 and int(model.optimizer.iterations.numpy()) == 0
    assert npz_files(tmp_path) == []


def test_a_pipeline_built_on_the_given_dataset_is_refused_naming_its_steps(tmp_path):
    given = dataset()
    model, counter = build("sgd"), CountBatches()
    # .map() and .prefetch() keep the kit dataset's batches (its cursor is found through
    # them); a rebatching does not, and its position would not be the one saved.
    with pytest.raises(
        ValueError, match=r"unbatch -> batch after it.*Map and prefetch after the kit dataset"
    ) as refused:
        model.fit(
            given.unbatch().batch(16),
            epochs=2,
            verbose=0,
            callbacks=[SyncedCheckpoint(tmp_path, save_freq=1, dataset=given), counter],
        )
    assert "No step was trained" in str(refused.value)
    assert counter.batches == 0 and int(model.optimizer.iterations.numpy()) == 0
    assert npz_files(tmp_path) == []


def test_fit_of_a_model_the_kit_did_not_build_on_another_dataset_is_refused(tmp_path):
    given, trained = dataset(), dataset()
    keras.utils.set_random_seed(3)
    plain = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    plain.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    counter = CountBatches()
    with pytest.raises(ValueError, match="given another kmk.make_dataset object"):
        plain.fit(
            trained,
            epochs=2,
            verbose=0,
            callbacks=[SyncedCheckpoint(tmp_path, save_freq=1, dataset=given), counter],
        )
    assert counter.batches == 0  # keras.Model.fit checked it (fit_hooks), before any step
    assert npz_files(tmp_path) == []


def test_a_generator_over_another_dataset_is_refused_at_the_first_batch_end(tmp_path, fresh):
    given, trained = dataset(), dataset()
    model = fresh()

    def batches():
        for _ in range(2):
            yield from trained

    with pytest.raises(ValueError, match="the dataset given was never read"):
        model.fit(
            batches(),
            steps_per_epoch=6,
            epochs=2,
            verbose=0,
            callbacks=[SyncedCheckpoint(tmp_path, save_freq=1, dataset=given)],
        )
    assert npz_files(tmp_path) == []  # refused at the first batch end, before any save


# -- item 5: a two-stage script rerun ------------------------------------------------------


def two_stages(model, ds, callbacks):
    model.fit(ds, epochs=1, verbose=0, callbacks=callbacks)
    model.fit(ds, epochs=3, initial_epoch=1, verbose=0, callbacks=callbacks)


class TwoStageRuns(NamedTuple):
    reference: list[np.ndarray]  # the weights of the script run uninterrupted
    crashed: object  # the directory of the script run crashed in stage 2, epoch 2


@pytest.fixture(scope="module")
def two_stage_runs(tmp_path_factory, fresh):
    """The two-stage script run uninterrupted and run crashed in stage 2 (read-only)."""
    root = tmp_path_factory.mktemp("two-stages")
    model, ds = fresh(), dataset()
    two_stages(model, ds, [SyncedCheckpoint(root / "ref", dataset=ds)])
    reference = model.get_weights()
    model, ds = fresh(), dataset()
    with pytest.raises(KeyboardInterrupt):  # crash in stage 2, epoch 2 (after its boundary)
        two_stages(model, ds, [SyncedCheckpoint(root / "run", dataset=ds), StopAt(2, 2)])
    return TwoStageRuns(reference, root / "run")


@pytest.mark.slow
def test_a_rerun_two_stage_script_continues_each_fit_from_the_newest_checkpoint(
    tmp_path, two_stage_runs, resumer
):
    directory = copy_of(two_stage_runs.crashed, tmp_path)
    ds, counter = dataset(), CountBatches()
    two_stages(resumer, ds, [SyncedCheckpoint(directory, dataset=ds), counter])
    assert counter.batches == 6  # epoch 2 only: stage 1 trains nothing, stage 2 resumes
    assert int(resumer.optimizer.iterations.numpy()) == 18
    assert max_diff(two_stage_runs.reference, resumer.get_weights()) <= 1e-6


@pytest.mark.slow
def test_stage_two_rerun_alone_resumes_its_own_checkpoint(
    tmp_path, caplog, two_stage_runs, resumer
):
    """Stage 1 commented out (or a notebook cell after a restart): stage 2 is fit #0 now."""
    directory = copy_of(two_stage_runs.crashed, tmp_path)
    other = copy_of(two_stage_runs.crashed, tmp_path, "other")
    caplog.set_level(logging.WARNING, logger="keras_mirror_kit")
    ds, counter = dataset(), CountBatches()
    checkpoint = SyncedCheckpoint(directory, dataset=ds)
    resumer.fit(ds, epochs=3, initial_epoch=1, verbose=0, callbacks=[checkpoint, counter])
    assert counter.batches == 6  # epoch 2; 0 (taken as finished) before the fix
    assert int(resumer.optimizer.iterations.numpy()) == 18
    assert max_diff(two_stage_runs.reference, resumer.get_weights()) <= 1e-6
    # Its saves go on under the stage's number: a rerun of the whole script finds them.
    assert checkpoint.last_restored.meta["fit_index"] == 1
    entries = json.loads((directory / "manifest.json").read_text())["checkpoints"]
    assert entries[-1]["fit_index"] == 1 and entries[-1]["epoch"] == 3
    # Another epochs: still counted as finished, but said at WARNING, with what happens.
    caplog.clear()
    counter = CountBatches()
    resumer.fit(
        ds,
        epochs=4,
        initial_epoch=1,
        verbose=0,
        callbacks=[SyncedCheckpoint(other, dataset=ds), counter],
    )
    assert counter.batches == 0
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("epochs=3, at epoch 2" in m and "trains nothing" in m for m in warned), warned


@pytest.mark.slow
def test_a_full_rerun_of_stages_with_equal_epochs_goes_stage_by_stage(tmp_path, fresh, resumer):
    """Both stages fit(epochs=2) (e.g. frozen, then fine-tuning): after a crash in stage 2
    the full rerun must not let stage 1 take stage 2's checkpoint as its own."""

    def stages(model, ds, callbacks):
        model.fit(ds, epochs=2, verbose=0, callbacks=callbacks)
        model.fit(ds, epochs=2, verbose=0, callbacks=callbacks)

    model, ds = fresh(), dataset()
    stages(model, ds, [SyncedCheckpoint(tmp_path / "ref", dataset=ds)])
    reference = model.get_weights()

    class CrashInStageTwo(StopAt):
        fits = 0

        def on_train_begin(self, logs=None):
            self.fits += 1

        def on_train_batch_end(self, batch, logs=None):
            if self.fits == 2:
                super().on_train_batch_end(batch, logs)

    model, ds = fresh(), dataset()
    with pytest.raises(KeyboardInterrupt):  # crash in stage 2, its epoch 1
        stages(model, ds, [SyncedCheckpoint(tmp_path / "run", dataset=ds), CrashInStageTwo(1, 2)])
    ds, counter = dataset(), CountBatches()
    stages(resumer, ds, [SyncedCheckpoint(tmp_path / "run", dataset=ds), counter])
    assert counter.batches == 6  # stage 2's epoch 1 again, from its boundary; nothing else
    assert max_diff(reference, resumer.get_weights()) <= 1e-6


# -- item 6: callbacks' state --------------------------------------------------------------


@pytest.mark.slow
def test_an_early_stopped_job_rerun_unchanged_trains_nothing(tmp_path, fresh, resumer):
    def job(model):
        ds, counter = dataset(), CountBatches()
        # Never improves by 10 after epoch 0: stops at the end of epoch 1 (12 steps) and
        # puts the weights of epoch 0 back.
        stop = keras.callbacks.EarlyStopping(
            monitor="loss", patience=0, min_delta=10, restore_best_weights=True
        )
        model.fit(
            ds,
            epochs=6,
            verbose=0,
            callbacks=[SyncedCheckpoint(tmp_path, dataset=ds), stop, counter],
        )
        return model, counter.batches

    first, batches = job(fresh())
    assert batches == 12
    rerun, batches = job(resumer)
    assert batches == 0
    assert max_diff(first.get_weights(), rerun.get_weights()) == 0.0


class Tally(keras.callbacks.Callback):
    """A stateful callback opting in through the documented protocol."""

    def __init__(self) -> None:
        super().__init__()
        self.epochs_seen, self.losses = 0, np.zeros(0)

    def on_epoch_end(self, epoch, logs=None):
        self.epochs_seen += 1
        self.losses = np.append(self.losses, logs["loss"])

    def get_checkpoint_state(self):
        return {"epochs_seen": self.epochs_seen, "losses": self.losses}

    def set_checkpoint_state(self, state):
        self.epochs_seen, self.losses = state["epochs_seen"], state["losses"]


@pytest.mark.slow
def test_callback_state_resumes_exactly(tmp_path, fresh, resumer):
    def run(directory, model, crash=None):
        ds, tally = dataset(), Tally()
        # Never improves by 10 after epoch 0: halves the rate at epochs 1, 2 (after a
        # cooldown of 1)... a fresh ReduceLROnPlateau on resume would start over.
        plateau = keras.callbacks.ReduceLROnPlateau(
            monitor="loss", factor=0.5, patience=0, min_delta=10, cooldown=1
        )
        callbacks = [plateau, SyncedCheckpoint(directory, dataset=ds), tally]
        model.fit(ds, epochs=4, verbose=0, callbacks=callbacks + ([crash] if crash else []))
        return model, tally

    reference, ref_tally = run(tmp_path / "ref", fresh())
    # Before `fresh` is set back for the crashed run:
    reference_lr, reference_weights = (
        float(reference.optimizer.learning_rate.numpy()),
        [w.copy() for w in reference.get_weights()],
    )
    # Resumed at epoch 2, a fresh plateau would not halve the rate there: 0.1 / 4 at the end
    # instead of 0.1 / 8.
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "run", fresh(), crash=StopAt(2, 2))
    resumed, tally = run(tmp_path / "run", resumer)
    lr = float(resumed.optimizer.learning_rate.numpy())
    assert lr == reference_lr < 0.1 / 4
    assert max_diff(reference_weights, resumed.get_weights()) <= 1e-6
    assert tally.epochs_seen == ref_tally.epochs_seen == 4
    np.testing.assert_allclose(tally.losses, ref_tally.losses, rtol=1e-6)


# -- items 7 and 8: retention --------------------------------------------------------------


@pytest.mark.slow
def test_retention_keeps_two_epoch_boundaries_when_mid_epoch_ones_cannot_resume(
    tmp_path, plain_run, resumer
):
    """Integer save_freq without dataset=: damage the newest, resume from the previous."""
    directory = copy_of(plain_run.directory, tmp_path)  # 4 epochs, save_freq=2, keep=3
    entries = json.loads((directory / "manifest.json").read_text())["checkpoints"]
    newest = directory / entries[-1]["file"]
    newest.write_bytes(newest.read_bytes()[:100])  # truncated
    counter = CountBatches()
    checkpoint = SyncedCheckpoint(directory, save_freq=2, keep=3)
    with pytest.warns(CorruptCheckpointWarning):
        resumer.fit(plain_dataset(), epochs=4, verbose=0, callbacks=[checkpoint, counter])
    assert counter.batches == 6  # epoch 3 again; 24 (from scratch) before the fix
    assert checkpoint.last_restored.meta["epoch"] == 3
    assert max_diff(plain_run.weights, resumer.get_weights()) <= 1e-6
    # keep=3 went to the newest three; two epoch boundaries older than the newest stayed.
    assert [e["epoch"] for e in entries if e["epoch_end"]][-3:] == [2, 3, 4]


@pytest.mark.slow
def test_a_lost_manifest_is_rebuilt_from_the_files_before_pruning(
    tmp_path, plain_run, fresh, resumer
):
    def run(model, epochs, crash=None):
        counter = CountBatches()
        checkpoint = SyncedCheckpoint(tmp_path, save_freq=2, keep=1)
        callbacks = [checkpoint, counter] + ([crash] if crash else [])
        model.fit(plain_dataset(), epochs=epochs, verbose=0, callbacks=callbacks)
        return model, checkpoint, counter.batches

    run(fresh(), epochs=2)
    (tmp_path / "manifest.json").unlink()
    with pytest.raises(KeyboardInterrupt):  # resumes at epoch 2; its saves prune
        run(resumer, epochs=4, crash=StopAt(2, 5))
    model, checkpoint, batches = run(resumer, epochs=4)  # the same instance, rerun
    assert batches == 12  # epochs 2 and 3; 24 (from scratch) before the fix
    assert checkpoint.last_restored.meta["epoch"] == 2
    assert max_diff(plain_run.weights, model.get_weights()) <= 1e-6


@pytest.mark.slow
def test_retention_keeps_an_epoch_boundary_among_mid_epoch_resume_points(tmp_path, fresh, resumer):
    """keep=1, save_freq=1, dataset=: mid-epoch saves fill the resume points."""
    model, ds = fresh(), dataset()
    with pytest.raises(KeyboardInterrupt):  # after the saves at batches 1, 2, 3 of epoch 2
        model.fit(
            ds,
            epochs=3,
            verbose=0,
            callbacks=[SyncedCheckpoint(tmp_path, save_freq=1, keep=1, dataset=ds), StopAt(2, 2)],
        )
    entries = json.loads((tmp_path / "manifest.json").read_text())["checkpoints"]
    assert [(e["epoch"], e["step"], e["epoch_end"]) for e in entries][-3:] == [
        (2, 1, False),
        (2, 2, False),
        (2, 3, False),
    ]
    assert [(e["epoch"], e["epoch_end"]) for e in entries if e["epoch_end"]] == [(2, True)]
    # The data changed (16 more samples): no mid-epoch resume, the epoch boundary is used.
    ds, counter = dataset(n=112), CountBatches()
    checkpoint = SyncedCheckpoint(tmp_path, save_freq=1, keep=1, dataset=ds)
    resumer.fit(ds, epochs=3, verbose=0, callbacks=[checkpoint, counter])
    restored = checkpoint.last_restored.meta
    assert (restored["epoch"], restored["step"], restored["epoch_end"]) == (2, 0, True)
    assert counter.batches == 7  # epoch 2 of 7 batches; 21 (from scratch) before the fix


# -- hand-driven loops and Keras' private layout ------------------------------------------


def test_a_hand_driven_loop_says_the_callback_runs_unhooked(tmp_path, caplog):
    model, ds = build("sgd"), dataset()
    checkpoint = SyncedCheckpoint(tmp_path, dataset=ds)
    checkpoint.set_model(model)
    caplog.set_level(logging.DEBUG, logger="keras_mirror_kit")
    checkpoint.on_train_begin()  # no CallbackList drives it
    assert any("(a hand-driven loop) and unhooked" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_keras_private_layout_change_does_not_break_the_import():
    proc = run_python(
        """
        import json, logging, sys
        import keras
        import keras.src.backend.common as common

        keras.random.normal((2,))  # creates Keras' global seed generator
        sys.modules["keras.src.backend.common.global_state"] = None  # the module moved
        del common.global_state
        import keras_mirror_kit
        from keras_mirror_kit.checkpoint.snapshot import take_snapshot

        records = []
        handler = logging.Handler(logging.DEBUG)
        handler.emit = records.append
        logger = logging.getLogger("keras_mirror_kit")
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
        arrays = take_snapshot([], allow_non_finite=False).extra
        take_snapshot([], allow_non_finite=False)
        lines = [r.getMessage() for r in records if "global random state" in r.getMessage()]
        print("RESULT " + json.dumps({"keys": sorted(arrays), "lines": len(lines)}))
        """,
        timeout=240,
    )
    assert last_json(proc) == {"keys": [], "lines": 1}


# -- rough edge: a changed learning rate at resume -----------------------------------------


@pytest.mark.slow
def test_a_changed_learning_rate_at_resume_is_logged(tmp_path, caplog, crashed_mid_epoch):
    directory = copy_of(crashed_mid_epoch, tmp_path)  # SGD(0.1)
    fresh = build("sgd", seed=4)
    fresh.optimizer.learning_rate = 0.05  # the checkpoint's is 0.1
    checkpoint = SyncedCheckpoint(directory, save_freq=2, dataset=dataset())
    checkpoint.set_model(fresh)
    caplog.set_level(logging.WARNING, logger="keras_mirror_kit")
    checkpoint.on_train_begin()
    assert float(fresh.optimizer.learning_rate.numpy()) == pytest.approx(0.1)
    assert any(
        "learning rate 0.05 is replaced by the checkpoint's 0.1" in r.getMessage()
        for r in caplog.records
    )
