"""SyncedCheckpoint in a 2-replica process: resume, retention, corruption, divergence.

Resumes (at an epoch boundary, mid-epoch, without a kit dataset, into 1 replica, by the
same instance after a raise, of a finished run) are compared with an uninterrupted run of
`EPOCHS` epochs: the `reference` fixture trains one per (optimizer, dataset kind) for the
module, and its checkpoint directory (read-only; tests copy it) also serves the tests of
a finished run, the optimizer state, an unreadable manifest, another model, corrupt and
pickled checkpoints. `crashed_at_boundary` is one crashed run per optimizer whose copies
several tests resume. Models are shared too (one trace each): `fresh(optimizer)`
(tests/conftest.py) is one `build(optimizer)` per optimizer, set back before each run to
the state it was built in (what a new `build` trains to, bit for bit), for the reference,
crashed and other runs from scratch; `resumers(optimizer)` is one seed-99 model per
optimizer (for "sgd" `resumer`, tests/conftest.py) for the resumes and the tests whose
checks do not depend on the weights a model starts from: a restore replaces its state.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from typing import NamedTuple

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mirror_kit as kmk
from keras_mirror_kit.callbacks.synced_checkpoint import ReplicaDivergenceError, SyncedCheckpoint
from keras_mirror_kit.checkpoint.store import CheckpointError, CorruptCheckpointWarning
from tests.ckpt_helpers import (
    CountBatches,
    StopAt,
    build,
    copy_of,
    data,
    dataset,
    max_diff,
)

EPOCHS = 3  # 6 batches each, 18 optimizer steps


def plain_dataset():
    """A dataset the kit did not build: fixed order every epoch."""
    return tf.data.Dataset.from_tensor_slices(data()).batch(16)


class Reference(NamedTuple):
    """What an uninterrupted run left: weights, optimizer variables, checkpoint directory."""

    weights: list[np.ndarray]
    optimizer_variables: list[np.ndarray]
    directory: object


@pytest.fixture(scope="module")
def resumers(resumer):
    """`resumers(optimizer)`: the module's one `build(optimizer, seed=99)` model of that
    optimizer that resumes (for "sgd" `resumer`): as a new process's fresh model, its
    weights are not the crashed run's; a restore replaces them and the optimizer state."""
    made = {"sgd": resumer}

    def get(optimizer):
        if optimizer not in made:
            made[optimizer] = build(optimizer, seed=99)
        return made[optimizer]

    return get


def uninterrupted(model, directory, use_dataset=True):
    ds = dataset() if use_dataset else plain_dataset()
    model.fit(
        ds,
        epochs=EPOCHS,
        verbose=0,
        callbacks=[SyncedCheckpoint(directory, dataset=ds if use_dataset else None)],
    )
    assert int(model.optimizer.iterations.numpy()) == EPOCHS * 6
    optimizer_variables = [v.numpy().copy() for v in model.optimizer.variables]
    return Reference(model.get_weights(), optimizer_variables, directory)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, fresh):
    """`reference(optimizer, use_dataset=True)`: the module's uninterrupted run of that
    setting (EPOCHS epochs from `fresh(optimizer)`, a SyncedCheckpoint listed, given the
    kit dataset if there is one), trained at first use."""
    runs = {}

    def get(optimizer, use_dataset=True):
        if (optimizer, use_dataset) not in runs:
            directory = tmp_path_factory.mktemp(f"reference-{optimizer}") / "ckpt"
            runs[optimizer, use_dataset] = uninterrupted(fresh(optimizer), directory, use_dataset)
        return runs[optimizer, use_dataset]

    return get


def crash(model, directory, crash_at, use_dataset=True, **kwargs):
    """`model` (from `fresh`) trains until the crash at `crash_at` (epoch, batch)."""
    ds = dataset() if use_dataset else plain_dataset()
    with pytest.raises(KeyboardInterrupt):
        model.fit(
            ds,
            epochs=EPOCHS,
            verbose=0,
            callbacks=[
                SyncedCheckpoint(directory, dataset=ds if use_dataset else None, **kwargs),
                StopAt(*crash_at),
            ],
        )


def resume(model, directory, use_dataset=True, **kwargs):
    """`model` (from `resumers`: other weights than the crashed run's, on purpose) resumes."""
    ds = dataset() if use_dataset else plain_dataset()
    counter = CountBatches()
    checkpoint = SyncedCheckpoint(directory, dataset=ds if use_dataset else None, **kwargs)
    model.fit(ds, epochs=EPOCHS, verbose=0, callbacks=[checkpoint, counter])
    return model, checkpoint, counter


@pytest.fixture(scope="module")
def crashed_at_boundary(tmp_path_factory, fresh):
    """`crashed_at_boundary(optimizer)`: the directory of a run (save_freq="epoch") that
    crashed at batch 2 of epoch 1, made at first use: its newest checkpoint is epoch 1."""
    runs = {}

    def get(optimizer):
        if optimizer not in runs:
            runs[optimizer] = tmp_path_factory.mktemp(f"crashed-{optimizer}") / "ckpt"
            crash(fresh(optimizer), runs[optimizer], (1, 2))
        return runs[optimizer]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_resume_at_an_epoch_boundary_matches_an_uninterrupted_run(
    optimizer, tmp_path, reference, crashed_at_boundary, resumers
):
    """...and a clean resume warns of no corrupt checkpoint."""
    directory = copy_of(crashed_at_boundary(optimizer), tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, checkpoint, counter = resume(resumers(optimizer), directory)
    assert not [w for w in caught if issubclass(w.category, CorruptCheckpointWarning)]
    assert checkpoint.last_restored.meta["epoch"] == 1
    assert checkpoint.last_restored.meta["step"] == 0
    assert counter.batches == 12  # epochs 1 and 2 only
    assert int(model.optimizer.iterations.numpy()) == 18
    assert max_diff(reference(optimizer).weights, model.get_weights()) <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_integer_save_freq_resumes_mid_epoch_without_training_a_batch_twice(
    optimizer, tmp_path, reference, fresh, resumers
):
    # Saves at steps 4 (epoch 0), 8 (batch 2 of epoch 1), ...: a crash after batch 3 of
    # epoch 1 (step 10) leaves step 8 the newest, after the epoch-1 boundary.
    crash(fresh(optimizer), tmp_path / "run", (1, 3), save_freq=4)
    model, checkpoint, counter = resume(resumers(optimizer), tmp_path / "run", save_freq=4)
    assert (checkpoint.last_restored.meta["epoch"], checkpoint.last_restored.meta["step"]) == (
        1,
        2,
    )
    assert counter.batches == 4 + 6  # the rest of epoch 1, then epoch 2
    assert int(model.optimizer.iterations.numpy()) == 18  # not one step more
    assert max_diff(reference(optimizer).weights, model.get_weights()) <= 1e-6


@pytest.mark.slow
def test_without_a_kit_dataset_mid_epoch_checkpoints_fall_back_to_the_epoch_boundary(
    tmp_path, caplog, reference, fresh, resumer
):
    """Documented behaviour: resume from the newest epoch-end checkpoint, no batch twice,
    with a WARNING (default logging shows it) that says what to do for an exact resume."""
    crash(fresh("sgd"), tmp_path / "run", (1, 3), save_freq=4, use_dataset=False)
    with caplog.at_level(logging.INFO, logger="keras_mirror_kit"):
        model, checkpoint, counter = resume(
            resumer, tmp_path / "run", save_freq=4, use_dataset=False
        )
    said = [r for r in caplog.records if "written mid-epoch" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert "SyncedCheckpoint was given no dataset=" in said[0].getMessage()
    assert "dataset=train_ds" in said[0].getMessage()
    entries = json.loads((tmp_path / "run" / "manifest.json").read_text())["checkpoints"]
    assert any(not e["epoch_end"] for e in entries)  # a newer mid-epoch one exists
    assert checkpoint.last_restored.meta["epoch_end"] is True
    assert checkpoint.last_restored.meta["epoch"] == 1
    assert counter.batches == 12
    assert int(model.optimizer.iterations.numpy()) == 18
    assert max_diff(reference("sgd", use_dataset=False).weights, model.get_weights()) <= 1e-6


@pytest.mark.slow
def test_leftovers_are_cleaned_and_a_later_fit_on_the_same_model_behaves_normally(tmp_path, fresh):
    """The first fit removes the orphaned temporaries of its directory and keeps files it
    did not write; a later fit of the same model with the same callback trains normally."""
    directory = tmp_path / "c"
    directory.mkdir()
    (directory / ".ckpt-00000009.npz.deadbeef.tmp").write_bytes(b"half a checkpoint")
    (directory / ".manifest.json.0badf00d.tmp").write_bytes(b"{")
    (directory / "notes.txt").write_text("mine")
    (directory / "ckpt-final.npz").write_bytes(b"user file, not ours")
    model, ds = fresh("sgd"), dataset()
    checkpoint = SyncedCheckpoint(directory, dataset=ds)
    model.fit(ds, epochs=1, verbose=0, callbacks=[checkpoint])
    names = set(os.listdir(directory))
    assert not any(n.endswith(".tmp") for n in names)
    assert {"notes.txt", "ckpt-final.npz", "manifest.json"} <= names
    assert model._initial_epoch is None  # noqa: SLF001  (Keras' BackupAndRestore leaves it)
    counter = CountBatches()
    history = model.fit(ds, epochs=1, verbose=0, callbacks=[checkpoint, counter])
    assert counter.batches == 6 and len(history.history["loss"]) == 1
    assert int(model.optimizer.iterations.numpy()) == 12


@pytest.mark.slow
def test_a_finished_run_restarted_trains_nothing_more(tmp_path, reference):
    directory = copy_of(reference("sgd").directory, tmp_path)
    fresh, ds = build("sgd", seed=5), dataset()
    counter = CountBatches()
    fresh.fit(
        ds,
        epochs=EPOCHS,
        verbose=0,
        callbacks=[SyncedCheckpoint(directory, dataset=ds), counter],
    )
    assert counter.batches == 0
    assert max_diff(reference("sgd").weights, fresh.get_weights()) == 0.0


@pytest.mark.slow
def test_restores_optimizer_state_not_just_weights(tmp_path, reference):
    saved = reference("adam").optimizer_variables  # at the end of the run that wrote it
    directory = copy_of(reference("adam").directory, tmp_path)
    fresh = build("adam", seed=42)
    checkpoint = SyncedCheckpoint(directory, dataset=dataset())
    checkpoint.set_model(fresh)
    checkpoint.on_train_begin()
    restored = [v.numpy() for v in fresh.optimizer.variables]
    assert int(fresh.optimizer.iterations.numpy()) == EPOCHS * 6
    assert len(saved) == len(restored) > 4
    for a, b in zip(saved, restored):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_restores_into_a_different_replica_count(tmp_path, reference, crashed_at_boundary):
    """Saved with 2 replicas, resumed with 1 (same global batch): the weights end where an
    uninterrupted 2-replica run's do. Only the summation order differs (two per-replica
    halves all-reduced vs one mean over 16 samples): float32 rounding, 6e-8 measured after
    18 steps of this SGD model. 1e-5 leaves room for that and still fails for epochs
    trained in another order (8e-3 measured) or a batch trained twice or skipped."""
    directory = copy_of(crashed_at_boundary("sgd"), tmp_path)  # newest: epoch 1, 2 replicas
    single = build("sgd", devices=["/cpu:0"], seed=8)
    assert single.distribute_strategy.num_replicas_in_sync == 1
    ds = dataset()
    checkpoint = SyncedCheckpoint(directory, dataset=ds)
    counter = CountBatches()
    single.fit(ds, epochs=EPOCHS, verbose=0, callbacks=[checkpoint, counter])
    assert checkpoint.last_restored.meta["num_replicas"] == 2
    assert counter.batches == 12 and int(single.optimizer.iterations.numpy()) == 18
    assert max_diff(reference("sgd").weights, single.get_weights()) <= 1e-5


@pytest.mark.slow
def test_keeps_the_newest_and_two_usable_resume_points_beyond_it(tmp_path, resumer):
    model, ds = resumer, dataset()  # what is kept does not depend on the weights
    model.fit(
        ds,
        epochs=1,
        verbose=0,
        callbacks=[SyncedCheckpoint(tmp_path, save_freq=1, keep=2, dataset=ds)],
    )
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    names = [e["file"] for e in manifest["checkpoints"]]
    on_disk = sorted(n for n in os.listdir(tmp_path) if n.endswith(".npz"))
    # 6 saves; keep=2, and with dataset= every checkpoint is a resume point: the newest + 2.
    assert names == on_disk and len(names) == 3
    assert manifest["latest"] == names[-1]
    assert manifest["checkpoints"][-1]["epoch_end"] is True
    # Without dataset= only epoch boundaries are resume points: keep=1 with a crash
    # mid-epoch keeps the newest (mid-epoch) one and the only epoch boundary there is.
    other = tmp_path / "other"
    with pytest.raises(KeyboardInterrupt):
        model.fit(
            plain_dataset(),
            epochs=3,
            verbose=0,
            callbacks=[SyncedCheckpoint(other, save_freq=1, keep=1), StopAt(1, 3)],
        )
    manifest = json.loads((other / "manifest.json").read_text())
    assert [(e["epoch"], e["step"], e["epoch_end"]) for e in manifest["checkpoints"]] == [
        (1, 0, True),
        (1, 4, False),
    ]
    assert len([n for n in os.listdir(other) if n.endswith(".npz")]) == 2


@pytest.fixture(scope="module")
def written_async(tmp_path_factory, fresh):
    """The directory of an uninterrupted EPOCHS-epoch run with `async_save=True`."""
    directory = tmp_path_factory.mktemp("async") / "ckpt"
    model, ds = fresh("sgd"), dataset()
    model.fit(
        ds,
        epochs=EPOCHS,
        verbose=0,
        callbacks=[SyncedCheckpoint(directory, dataset=ds, async_save=True)],
    )
    return directory


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncate", "zero", "garbage", "delete", "truncate-async"])
def test_corrupt_newest_checkpoint_warns_and_uses_the_previous(
    tmp_path, damage, caplog, reference, written_async, resumer
):
    """3 epoch-end checkpoints written (synchronously: the reference's); the newest
    damaged; the resume takes the previous (epoch 2), not the oldest."""
    if damage.endswith("-async"):
        directory = copy_of(written_async, tmp_path)
    else:
        directory = copy_of(reference("sgd").directory, tmp_path)
    manifest = json.loads((directory / "manifest.json").read_text())
    assert [e["epoch"] for e in manifest["checkpoints"]] == [1, 2, 3]
    newest = directory / manifest["latest"]
    raw = newest.read_bytes()
    if damage.startswith("truncate"):
        newest.write_bytes(raw[: len(raw) // 2])
    elif damage == "zero":
        newest.write_bytes(b"\0" * len(raw))
    elif damage == "garbage":
        newest.write_bytes(b"not a checkpoint at all")
    else:
        newest.unlink()
    ds = dataset()
    checkpoint = SyncedCheckpoint(directory, dataset=ds)
    caplog.set_level(logging.WARNING, logger="keras_mirror_kit")
    with pytest.warns(CorruptCheckpointWarning, match="Skipping corrupt checkpoint"):
        resumer.fit(ds, epochs=EPOCHS, verbose=0, callbacks=[checkpoint])
    assert checkpoint.last_restored.meta["epoch"] == 2  # the previous one
    assert any("corrupt" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_unreadable_manifest_falls_back_to_the_files(tmp_path, reference):
    directory = copy_of(reference("sgd").directory, tmp_path)
    (directory / "manifest.json").write_text("{broken")
    checkpoint = SyncedCheckpoint(directory, dataset=dataset())
    checkpoint.set_model(build("sgd", seed=4))
    with pytest.warns(CorruptCheckpointWarning, match="manifest"):
        checkpoint.on_train_begin()
    assert checkpoint.last_restored.meta["epoch"] == EPOCHS  # the newest file


@pytest.mark.slow
def test_checkpoint_of_another_model_is_a_clear_error_before_training(tmp_path, reference):
    directory = copy_of(reference("sgd").directory, tmp_path)

    @kmk.distributed(global_batch_size=16)
    def other():
        m = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5), keras.layers.Dense(3)])
        m.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))
        return m

    counter = CountBatches()
    with pytest.raises(CheckpointError, match="does not match this model"):
        other().fit(
            dataset(), epochs=1, verbose=0, callbacks=[SyncedCheckpoint(directory), counter]
        )
    assert counter.batches == 0


@pytest.mark.slow
def test_verify_replicas_names_a_diverged_variable(tmp_path, fresh):
    model, ds = fresh("sgd"), dataset()
    kernel = model.layers[0].kernel
    copies = model.distribute_strategy.experimental_local_results(kernel.value)
    copies[1].assign(copies[1] + 1.0)  # one replica drifts
    with pytest.raises(ReplicaDivergenceError, match="dense") as info:
        model.fit(ds, epochs=1, verbose=0, callbacks=[SyncedCheckpoint(tmp_path, dataset=ds)])
    assert "kernel" in str(info.value) and "differ between replicas" in str(info.value)
    assert not any(n.endswith(".npz") for n in os.listdir(tmp_path))


@pytest.mark.slow
def test_non_finite_values_on_one_replica_are_named_as_such(tmp_path, fresh):
    model, ds = fresh("sgd"), dataset()
    bias = model.layers[0].bias

    class DivergeReplica1(keras.callbacks.Callback):
        """At the epoch's end, right before the save: no step spreads the NaN to replica 0."""

        def on_epoch_end(self, epoch, logs=None):
            copies = model.distribute_strategy.experimental_local_results(bias.value)
            copies[1].assign(np.full(copies[1].shape, np.nan, "float32"))

    checkpoint = SyncedCheckpoint(tmp_path, dataset=ds)
    with pytest.raises(ReplicaDivergenceError, match="NaN or Inf on some replicas") as info:
        model.fit(ds, epochs=1, verbose=0, callbacks=[DivergeReplica1(), checkpoint])
    assert "bias (NaN or Inf on replica [1])" in str(info.value)
    assert "nan" not in str(info.value)  # not "max |diff| nan"
    assert not any(n.endswith(".npz") for n in os.listdir(tmp_path))


@pytest.mark.slow
def test_unsynchronised_batch_norm_statistics_are_reported_not_raised(tmp_path, caplog):
    model = build("sgd", batch_norm=True)
    bn = model.layers[1]
    x, y = data()
    # 2 replicas see different halves of each batch, so moving statistics diverge.
    ds = kmk.make_dataset(x, y, 16, seed=2)
    caplog.set_level(logging.INFO, logger="keras_mirror_kit")
    checkpoint = SyncedCheckpoint(tmp_path, save_freq=3, dataset=ds)  # 2 saves, 2 checks
    model.fit(ds, epochs=1, verbose=0, callbacks=[checkpoint])
    copies = model.distribute_strategy.experimental_local_results(bn.moving_mean.value)
    assert not np.array_equal(np.asarray(copies[0]), np.asarray(copies[1]))
    warned = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "moving statistics differ" in r.getMessage()
    ]
    assert len(warned) == 1 and "sync_batch_norm=True" in warned[0]  # once per fit()
    # ...and saved anyway, at both saves (a check before each).
    assert len(json.loads((tmp_path / "manifest.json").read_text())["checkpoints"]) == 2


@pytest.mark.parametrize(
    ("kwargs", "exc", "fragment"),
    [
        ({"save_freq": 0}, ValueError, "save_freq=0"),
        ({"save_freq": "batch"}, ValueError, "save_freq='batch'"),
        ({"save_freq": 2.5}, TypeError, "save_freq=2.5"),
        ({"keep": 0}, ValueError, "keep=0"),
        ({"keep": True}, TypeError, "keep=True"),
        ({"verify_atol": -1e-3}, ValueError, "verify_atol=-0.001"),
        ({"verify_atol": "0"}, TypeError, "verify_atol='0'"),
        ({"dataset": [1, 2]}, ValueError, "dataset=list"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, exc, fragment):
    with pytest.raises(exc) as info:
        SyncedCheckpoint(tmp_path, **kwargs)
    assert fragment in str(info.value)
    with pytest.raises(TypeError, match="directory=None"):
        SyncedCheckpoint(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="directory=''"):
        SyncedCheckpoint("")


def test_a_file_where_the_directory_should_be_fails_before_training(tmp_path, fresh):
    target = tmp_path / "file"
    target.write_text("x")
    model, ds = fresh("sgd"), dataset()
    counter = CountBatches()
    with pytest.raises(CheckpointError, match="is not a directory"):
        model.fit(ds, epochs=1, verbose=0, callbacks=[SyncedCheckpoint(target), counter])
    assert counter.batches == 0 and target.read_text() == "x"


def test_dataset_with_steps_per_epoch_is_rejected_before_training(tmp_path, fresh):
    model, ds = fresh("sgd"), dataset()
    with pytest.raises(ValueError, match="steps_per_epoch=3"):
        model.fit(
            ds,
            epochs=1,
            steps_per_epoch=3,
            verbose=0,
            callbacks=[SyncedCheckpoint(tmp_path, dataset=ds)],
        )


@pytest.mark.slow
def test_a_random_shuffle_seed_is_saved_and_reused_on_resume(tmp_path, fresh, resumer):
    x, y = data()
    model, ds = fresh("sgd"), kmk.make_dataset(x, y, 16)  # seed drawn at random
    crashed_seed = kmk.cursor_of(ds).seed
    with pytest.raises(KeyboardInterrupt):
        model.fit(
            ds,
            epochs=2,
            verbose=0,
            callbacks=[SyncedCheckpoint(tmp_path, save_freq=1, dataset=ds), StopAt(0, 2)],
        )
    again = kmk.make_dataset(x, y, 16)
    assert kmk.cursor_of(again).seed != crashed_seed  # a new random draw...
    checkpoint, counter = SyncedCheckpoint(tmp_path, save_freq=1, dataset=again), CountBatches()
    resumer.fit(again, epochs=2, verbose=0, callbacks=[checkpoint, counter])
    assert kmk.cursor_of(again).seed == crashed_seed  # ...replaced by the checkpoint's
    assert checkpoint.last_restored.meta["data_seed"] == crashed_seed
    assert counter.batches == 3 + 6  # the rest of epoch 0, then epoch 1


@pytest.mark.slow
def test_an_interrupted_fit_does_not_leave_the_resume_epoch_behind(
    tmp_path, crashed_at_boundary, resumer
):
    directory = copy_of(crashed_at_boundary("sgd"), tmp_path)  # newest: epoch 1
    ds = dataset()
    model, checkpoint = resumer, SyncedCheckpoint(directory, dataset=ds)
    with pytest.raises(KeyboardInterrupt):  # resumes at epoch 1, then is interrupted
        model.fit(ds, epochs=EPOCHS, verbose=0, callbacks=[checkpoint, StopAt(1, 1)])
    assert checkpoint.last_restored.meta["epoch"] == 1
    # Keras skipped on_train_end; the resume epoch was cleared once the loop had read it.
    assert model._initial_epoch is None  # noqa: SLF001
    counter = CountBatches()
    model.fit(ds, epochs=1, verbose=0, callbacks=[counter])  # without the checkpoint
    assert counter.batches == 6  # a normal later fit: epoch 0 runs, nothing skipped


@pytest.mark.slow
def test_reusing_the_instance_after_fit_raised_resumes_like_a_new_one(tmp_path, reference, fresh):
    """Issue 18, rough edge: a retry with the same instance resumes exactly."""
    expected = reference("sgd").weights  # before `fresh`: the reference trains that model
    model, ds = fresh("sgd"), dataset()
    checkpoint = SyncedCheckpoint(tmp_path / "run", dataset=ds)
    with pytest.raises(KeyboardInterrupt):
        model.fit(ds, epochs=EPOCHS, verbose=0, callbacks=[checkpoint, StopAt(2, 3)])
    counter = CountBatches()  # the retry: same model (trained past the checkpoint)
    model.fit(ds, epochs=EPOCHS, verbose=0, callbacks=[checkpoint, counter])
    assert checkpoint.last_restored.meta["epoch"] == 2  # the newer of two epoch boundaries
    assert counter.batches == 6 and int(model.optimizer.iterations.numpy()) == 18
    assert max_diff(expected, model.get_weights()) <= 1e-6


TRAINED_IDS: list[int] = []


class RecordIds(keras.layers.Layer):
    """Passes x[:, :6] on; in training, records the sample ids that x[:, 6] carries."""

    def call(self, x, training=False):
        if training:

            def record(ids):
                TRAINED_IDS.extend(int(i) for i in ids.numpy())
                return np.int64(0)

            done = tf.py_function(record, [x[:, 6]], Tout=tf.int64)
            with tf.control_dependencies([done]):
                x = tf.identity(x)
        return x[:, :6]


class ClearIdsAtEpoch(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            TRAINED_IDS.clear()


@pytest.mark.slow
def test_mid_epoch_resume_into_another_replica_count_skips_the_consumed_samples(tmp_path, caplog):
    """The samples trained in the interrupted epoch, before (2 replicas, batches of 16)
    and after (1 replica, batches of 8) the resume: each of the 96 exactly once."""
    x, y = data()
    x = np.concatenate([x, np.arange(len(x), dtype="float32")[:, None]], axis=1)
    caplog.set_level(logging.INFO, logger="keras_mirror_kit")

    def model_on(devices):
        @kmk.distributed(per_replica_batch_size=8, devices=devices)
        def factory():
            keras.utils.set_random_seed(3)
            m = keras.Sequential([keras.Input((7,)), RecordIds(), keras.layers.Dense(3)])
            m.compile(
                optimizer="sgd",
                jit_compile=False,
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
            return m

        return factory(), factory.distribution.global_batch_size

    two, batch = model_on(None)  # 2 replicas: global batch 16, 6 batches per epoch
    ds = kmk.make_dataset(x, y, batch, seed=1)
    with pytest.raises(KeyboardInterrupt):
        two.fit(
            ds,
            epochs=2,
            verbose=0,
            callbacks=[
                SyncedCheckpoint(tmp_path, save_freq=2, dataset=ds),
                ClearIdsAtEpoch(1),
                StopAt(1, 3),
            ],
        )
    before = list(TRAINED_IDS)  # epoch 1 up to the crash: 4 batches, the last one saved
    one, batch = model_on(["/cpu:0"])  # 1 replica: global batch 8, 12 batches per epoch
    ds = kmk.make_dataset(x, y, batch, seed=1)
    checkpoint, counter = SyncedCheckpoint(tmp_path, save_freq=2, dataset=ds), CountBatches()
    TRAINED_IDS.clear()
    one.fit(ds, epochs=2, verbose=0, callbacks=[checkpoint, counter])
    after = list(TRAINED_IDS)
    assert (checkpoint.last_restored.meta["epoch"], checkpoint.last_restored.meta["step"]) == (
        1,
        4,
    )
    resumed = [r.getMessage() for r in caplog.records if "resumed from" in r.getMessage()]
    assert "(epoch 1, batch 8," in resumed[-1]  # 4 batches of 16 = 8 batches of 8
    assert counter.batches == 12 - 8  # only the 32 samples not yet trained in epoch 1
    assert len(before) == 64 and len(after) == 32
    assert sorted(before + after) == list(range(96))  # none twice, none skipped


class _Payload:
    """Unpickling it creates the file `path` (what a malicious pickle could do, harmlessly)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.slow
def test_a_pickled_array_in_a_checkpoint_is_never_unpickled(tmp_path, capsys, reference, resumer):
    """docs/security.md: checkpoints are read with NumPy's allow_pickle=False. A checkpoint
    whose first variable is replaced by a pickled object array of the right shape, with a
    manifest entry that matches it (someone who can write the directory), is skipped as
    unreadable at resume (the previous checkpoint is used) and fails `ckpt verify`; its
    payload, live under np.load(allow_pickle=True), never runs."""
    import io
    import zipfile

    from keras_mirror_kit import cli
    from keras_mirror_kit.checkpoint import store as checkpoint_store

    directory, marker = copy_of(reference("sgd").directory, tmp_path), tmp_path / "unpickled"
    manifest = json.loads((directory / "manifest.json").read_text())
    good = directory / manifest["latest"]
    evil = directory / f"ckpt-{int(good.stem.split('-')[1]) + 1:08d}.npz"  # the next one
    pickled = np.empty(reference("sgd").weights[0].shape, dtype=object)
    pickled[...] = _Payload(str(marker))
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(evil, "w") as dst:
        for name in src.namelist():
            data = src.read(name)
            if name == "model/00000.npy":  # the first kernel, as a pickle
                buffer = io.BytesIO()
                np.lib.format.write_array(buffer, pickled, allow_pickle=True)
                data = buffer.getvalue()
            elif name == "__meta__.npy":
                meta = json.loads(np.lib.format.read_array(src.open(name)).tobytes())
                buffer = io.BytesIO()
                blob = json.dumps({**meta, "file": evil.name}).encode()
                np.lib.format.write_array(buffer, np.frombuffer(blob, np.uint8))
                data = buffer.getvalue()
            dst.writestr(name, data)
    with zipfile.ZipFile(evil) as archive:
        crc32 = checkpoint_store._members_checksum(archive)
    entry = {**manifest["checkpoints"][-1], "file": evil.name, "crc32": crc32}
    manifest["checkpoints"].append({**entry, "size": evil.stat().st_size})
    manifest["latest"] = evil.name
    (directory / "manifest.json").write_text(json.dumps(manifest))

    ds = dataset()
    checkpoint = SyncedCheckpoint(directory, dataset=ds)
    with pytest.warns(CorruptCheckpointWarning, match="holds Python objects"):
        resumer.fit(ds, epochs=EPOCHS, verbose=0, callbacks=[checkpoint])
    assert checkpoint.last_restored.path.name == manifest["checkpoints"][-2]["file"]
    assert not marker.exists(), "the checkpoint's pickle was loaded"
    capsys.readouterr()
    assert cli.main(["ckpt", "verify", str(directory), evil.name]) == 1
    assert "holds Python objects" in capsys.readouterr().out
    assert not marker.exists()
    with np.load(evil, allow_pickle=True) as unsafe:  # the payload is live: the test can fail
        unsafe["model/00000"]  # noqa: B018
    assert marker.exists()


def _metered(devices, metrics=("accuracy",)):
    """A kit-built classifier with a loss tracker and compiled metrics, batches of 8."""

    @kmk.distributed(global_batch_size=8, devices=devices)
    def factory():
        keras.utils.set_random_seed(3)
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
        m.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=list(metrics))
        return m

    return factory()


def test_an_epoch_resumed_part_way_logs_the_uninterrupted_runs_loss_and_metrics(tmp_path, caplog):
    """The metrics' sums are saved with each checkpoint and put back as the resumed epoch
    begins (Keras resets them just before), so its logs are the uninterrupted run's: on 2
    replicas, on 1 after 2, on an uneven last batch (70 rows); a checkpoint holding other
    metrics resumes the weights and says that the epoch's logs cover its rest only."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(70, 4)).astype("float32"), rng.integers(0, 3, 70)
    metrics = ("accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2"))

    def fit(model, directory, *extra):
        callbacks = [SyncedCheckpoint(tmp_path / directory, save_freq=1), *extra]
        return model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                         callbacks=callbacks).history  # fmt: skip

    expected = fit(_metered(None, metrics), "reference")
    assert set(expected) == {"loss", "accuracy", "top2"}
    for devices, directory in ((None, "two"), (["/cpu:0"], "one")):
        with pytest.raises(KeyboardInterrupt):
            fit(_metered(None, metrics), directory, StopAt(1, 3))  # 4 of epoch 1's 9 batches
        logs = fit(_metered(devices, metrics), directory)
        for key in expected:
            assert logs[key] == pytest.approx(expected[key][-1:], rel=1e-6), (directory, key)
    caplog.set_level(logging.INFO, logger="keras_mirror_kit")
    with pytest.raises(KeyboardInterrupt):
        fit(_metered(None, metrics), "other", StopAt(1, 3))
    fit(_metered(None), "other")  # without top2: the weights resume, the logs say so
    said = [r.getMessage() for r in caplog.records if "logged loss and metrics" in r.getMessage()]
    assert said and "holds other metrics than this model" in said[0]
    assert "batch 4 on only" in said[0]
