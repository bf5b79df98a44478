"""Keras' `BackupAndRestore` beside `SyncedCheckpoint`: exact in either order (issue "What
the Keras ecosystem hands the kit", part 4).

A run with both callbacks (`SyncedCheckpoint(save_freq=1)`, `BackupAndRestore` at epoch
ends) crashes at batch 5 of epoch 2 of 3: the kit's newest checkpoint is mid-epoch (epoch
2, batch 5), the backup is the end of epoch 1. Rerun with the callbacks in either order
(`BackupAndRestore` listed after the kit's callback is moved before it), the kit's state
wins: one step trained, and the weights of the uninterrupted run. A run that had only the
backup (a user adding the kit to a Keras script) resumes from it, in either order, at its
epoch boundary. Every case runs on 1 and on 2 replicas, which agree to 1e-6 in weights,
the resumed fit's history, `evaluate` and `predict`. One model per number of replicas
serves every run, set back to its first state before each (`tests.ckpt_helpers.set_back`):
a rerun in a new process starts from the weights a new `build` makes, which the restore
then replaces. Any other callback listed after the kit's that sets the start epoch over a
restored state is refused before any step.
"""

from __future__ import annotations

import logging
import shutil

import keras
import numpy as np
import pytest

import keras_mirror_kit as kmk
from keras_mirror_kit.callbacks.synced_checkpoint import SyncedCheckpoint
from tests.ckpt_helpers import CountBatches, StopAt, build, data, dataset, max_diff, set_back

EPOCHS = 3  # 6 batches an epoch
REPLICAS = {1: ["/cpu:0"], 2: ["/cpu:0", "/cpu:1"]}
TOLERANCE = 1e-6
PROBE = data(29)[0] * 0.5  # evaluated and predicted after each resume


@pytest.fixture(scope="module")
def resets():
    """One Adam model per number of replicas, set back to its first state at each call."""
    return {n: set_back(build("adam", devices=devices)) for n, devices in REPLICAS.items()}


def _fit(model, callbacks):
    counter = CountBatches()
    history = model.fit(dataset(), epochs=EPOCHS, verbose=0, callbacks=[*callbacks, counter])
    return history.history, counter.batches


def _outcome(model, history):
    x, y = PROBE, data(29)[1]
    return {
        "weights": model.get_weights(),
        "iterations": int(model.optimizer.iterations.numpy()),
        "history": history,
        "evaluate": model.evaluate(x, y, verbose=0),
        "predict": model.predict(x, verbose=0),
    }


@pytest.fixture(scope="module")
def runs(resets, tmp_path_factory):
    """Per number of replicas: the uninterrupted run's weights, and the directories a run
    with both callbacks and a run with the backup alone left when they crashed."""
    made = {}
    for n, reset in resets.items():
        root = tmp_path_factory.mktemp(f"replicas{n}")
        model = reset()
        _fit(model, [])
        reference = model.get_weights()
        both = root / "both"
        with pytest.raises(KeyboardInterrupt):
            _fit(
                reset(),
                [
                    SyncedCheckpoint(both / "ckpt", save_freq=1),
                    keras.callbacks.BackupAndRestore(str(both / "backup")),
                    StopAt(2, 4),  # after 5 of epoch 2's 6 batches
                ],
            )
        alone = root / "alone"
        with pytest.raises(KeyboardInterrupt):
            _fit(reset(), [keras.callbacks.BackupAndRestore(str(alone / "backup")), StopAt(2, 2)])
        made[n] = {"reference": reference, "both": both, "alone": alone}
    return made


def _resume(reset, crashed, tmp_path, order, monitor):
    """Reruns the crashed run's script from copies of its directories, the callbacks in
    `order`: "kit first" or "backup first"."""
    shutil.copytree(crashed, tmp_path)
    ds = dataset()
    checkpoint = SyncedCheckpoint(tmp_path / "ckpt", save_freq=1, dataset=ds)
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    callbacks = [checkpoint, backup] if order == "kit first" else [backup, checkpoint]
    if monitor:  # the list: [ThroughputMonitor(), SyncedCheckpoint(...), BackupAndRestore]
        callbacks.insert(0, kmk.ThroughputMonitor())
    model, counter = reset(), CountBatches()
    history = model.fit(ds, epochs=EPOCHS, verbose=0, callbacks=[*callbacks, counter])
    return model, checkpoint, counter.batches, {"loss": history.history["loss"]}


def _agree(one, two):
    for key in ("weights", "history", "evaluate", "predict"):
        a, b = one[key], two[key]
        if key == "history":
            assert set(a) == set(b), (a, b)
            a, b = [a[k] for k in sorted(a)], [b[k] for k in sorted(b)]
        gap = max_diff([np.asarray(v, "float64") for v in keras.tree.flatten(a)],
                       [np.asarray(v, "float64") for v in keras.tree.flatten(b)])  # fmt: skip
        assert gap <= TOLERANCE, (key, gap)
    assert one["iterations"] == two["iterations"]


@pytest.mark.slow
@pytest.mark.parametrize("order", ["kit first", "backup first"])
def test_the_kits_mid_epoch_checkpoint_wins_over_the_backup_in_either_order(
    order, resets, runs, tmp_path
):
    outcomes = {}
    for n, reset in resets.items():
        model, checkpoint, trained, history = _resume(
            reset, runs[n]["both"], tmp_path / f"r{n}", order, monitor=order == "kit first"
        )
        meta = checkpoint.last_restored.meta
        assert (meta["epoch"], meta["step"]) == (2, 5)
        assert trained == 1  # the last batch of epoch 2, nothing else
        assert int(model.optimizer.iterations.numpy()) == EPOCHS * 6
        assert max_diff(runs[n]["reference"], model.get_weights()) <= TOLERANCE, n
        outcomes[n] = _outcome(model, history)
    _agree(outcomes[1], outcomes[2])


@pytest.mark.slow
@pytest.mark.parametrize("order", ["kit first", "backup first"])
def test_a_backup_alone_resumes_at_its_epoch_in_either_order(
    order, resets, runs, tmp_path, caplog
):
    outcomes = {}
    for n, reset in resets.items():
        with caplog.at_level(logging.INFO, logger="keras_mirror_kit"):
            model, checkpoint, trained, history = _resume(
                reset, runs[n]["alone"], tmp_path / f"r{n}", order, monitor=False
            )
        assert checkpoint.last_restored is None
        assert trained == 6  # epoch 2 again from its start: the backup is its beginning
        assert len(history["loss"]) == 1
        assert int(model.optimizer.iterations.numpy()) == EPOCHS * 6
        assert max_diff(runs[n]["reference"], model.get_weights()) <= TOLERANCE, n
        outcomes[n] = _outcome(model, history)
    assert "starts at epoch 2, from the state another callback restored" in caplog.text
    assert "BackupAndRestore" in caplog.text
    _agree(outcomes[1], outcomes[2])


class OwnRestore(keras.callbacks.Callback):
    """A callback of one's own that restores a training position at on_train_begin."""

    def on_train_begin(self, logs=None):
        self.model._initial_epoch = 1  # noqa: SLF001


class NewRate(keras.callbacks.Callback):
    """Sets another learning rate at on_train_begin (docs/checkpointing.md: allowed)."""

    def on_train_begin(self, logs=None):
        self.model.optimizer.learning_rate.assign(0.005)


def test_backup_and_restore_listed_after_the_kit_is_moved_before_it():
    checkpoint, backup, other = (
        SyncedCheckpoint("unused"),
        keras.callbacks.BackupAndRestore("b"),
        NewRate(),
    )
    given = [checkpoint, other, backup]
    arranged = checkpoint.arrange_callbacks(list(given))
    assert arranged[1:-1] == [backup, checkpoint, other]  # head first, tail last
    assert given == [checkpoint, other, backup]
    assert checkpoint.arrange_callbacks([backup, checkpoint])[1:-1] == [backup, checkpoint]


@pytest.mark.slow
def test_another_callback_restoring_after_the_kit_is_refused_before_any_step(
    resets, runs, tmp_path
):
    shutil.copytree(runs[1]["both"], tmp_path / "run")
    model, counter = resets[1](), CountBatches()
    callbacks = [SyncedCheckpoint(tmp_path / "run" / "ckpt"), NewRate(), OwnRestore(), counter]
    with pytest.raises(
        ValueError,
        match=r"listed after SyncedCheckpoint set the epoch fit\(\) starts at .* at epoch 2: "
        r".*List it before SyncedCheckpoint.*Received: model._initial_epoch=1, .*"
        r"\['NewRate', 'OwnRestore'\]",
    ):
        model.fit(dataset(), epochs=EPOCHS, verbose=0, callbacks=callbacks)
    assert counter.batches == 0
    # Listed before it, the checkpoint's state wins; a new rate after it stands.
    callbacks = [OwnRestore(), SyncedCheckpoint(tmp_path / "run" / "ckpt"), NewRate(), counter]
    model.fit(dataset(), epochs=EPOCHS, verbose=0, callbacks=callbacks)
    assert counter.batches == 1
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(0.005)
