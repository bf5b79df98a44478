"""A `fit` retried in the same process after an exception never trains a batch twice.

Keras' `BackupAndRestore` scenario `test_best_case_step`, played with `SyncedCheckpoint`: an
integer `save_freq`, an exception at step 2 of the first epoch (before any checkpoint),
then `fit` again with the same model and callback. The retry must end where one
uninterrupted run ends: optimizer step 32 and every variable equal. The state the retry
goes back to is the file `fit-start.kmk` the `fit` wrote at its start (no host copy kept).
"""

from __future__ import annotations

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mirror_kit as kmk
from keras_mirror_kit.checkpoint.store import START_FILE, CheckpointStore

pytestmark = pytest.mark.slow  # every test here starts children or trains for long

TWO = ["/cpu:0", "/cpu:1"]
GLOBAL = 64
X = np.random.default_rng(0).normal(size=(1024, 8)).astype("float32")
Y = (X[:, 0] > 0).astype("int32")


def _model() -> keras.Model:
    @kmk.distributed(global_batch_size=GLOBAL, devices=TWO)
    def build() -> keras.Model:
        keras.utils.set_random_seed(11)
        model = keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dropout(0.3),  # random state: the retry must draw the same masks
                keras.layers.Dense(2, activation="softmax"),
            ]
        )
        model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy")
        return model

    return build()


class FailOnce(keras.callbacks.Callback):
    """Raises at the end of the given step of the first epoch, once."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step, self.raised = step, False

    def on_train_batch_end(self, batch, logs=None):
        if not self.raised and batch + 1 == self.step:
            self.raised = True
            raise RuntimeError("injected failure")


def _state(model: keras.Model) -> list[np.ndarray]:
    return [np.asarray(v) for v in model.variables + model.optimizer.variables]


def _plain() -> tf.data.Dataset:
    """Data the kit did not build: its checkpoints resume at epoch boundaries only."""
    return tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL)


def _data(kind: str) -> tuple[tuple, dict, dict]:
    """fit()'s data, SyncedCheckpoint's and fit()'s options for one kind of run."""
    if kind == "dataset=":
        dataset = kmk.make_dataset(X, Y, GLOBAL, seed=3)
        return (dataset,), {"dataset": dataset}, {"shuffle": False}
    if kind == "plain":
        return (_plain(),), {}, {}
    options = {"async_save": True} if kind == "async" else {}
    return (X, Y), options, {"shuffle": kind == "shuffled"}


@pytest.mark.parametrize(
    ("kind", "fail_at"),
    [("arrays", 2), ("dataset=", 2), ("async", 2), ("shuffled", 2), ("plain", 7)],
)
def test_a_retried_fit_trains_no_batch_twice(tmp_path, caplog, kind, fail_at):
    """`shuffled`: fit(x, y, shuffle=True) draws a new seed each time, the retry takes the
    first attempt's back. `plain`: the failure comes after a mid-epoch checkpoint that
    data the kit did not build cannot resume from, so the retry still goes to the start."""
    reference = _model()
    args, options, fit_options = _data(kind)
    reference.fit(
        *args,
        epochs=2,
        verbose=0,
        callbacks=[kmk.SyncedCheckpoint(tmp_path / "reference", save_freq=5, **options)],
        **fit_options,
    )

    model = _model()
    args, options, fit_options = _data(kind)
    checkpoint = kmk.SyncedCheckpoint(tmp_path / "retried", save_freq=5, **options)
    failing = FailOnce(step=fail_at)
    with pytest.raises(RuntimeError, match="injected failure"):
        model.fit(*args, epochs=2, verbose=0, callbacks=[checkpoint, failing], **fit_options)
    assert int(model.optimizer.iterations.numpy()) == fail_at  # trained, no usable checkpoint
    assert (tmp_path / "retried" / START_FILE).is_file()  # kept for the retry
    with caplog.at_level(logging.INFO, logger="keras_mirror_kit"):
        model.fit(*args, epochs=2, verbose=0, callbacks=[checkpoint, failing], **fit_options)
    assert "no batch is trained twice" in caplog.text
    assert int(model.optimizer.iterations.numpy()) == 32
    for got, expected in zip(_state(model), _state(reference), strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-6, rtol=0)
    assert not (tmp_path / "retried" / START_FILE).exists()  # the fit ended


class StartFileProbe(keras.callbacks.Callback):
    """At each batch end: whether the start file is there, and at the first what it holds."""

    def __init__(self, directory) -> None:
        super().__init__()
        self.directory, self.present, self.held = directory, [], None

    def on_train_batch_end(self, batch, logs=None):
        self.present.append((self.directory / START_FILE).is_file())
        if self.held is None:
            loaded = CheckpointStore(self.directory).read_start()
            with loaded.arrays:
                self.held = [loaded.arrays[key] for key in sorted(loaded.arrays)]


def test_the_start_state_is_a_file_until_the_first_checkpoint_not_a_host_copy(tmp_path):
    """The state a fit() starts from goes to fit-start.kmk (the model's variables and both
    optimizer moments: what a retry needs), which the first usable checkpoint removes; an
    earlier run's file is replaced; restore=False writes none and removes an old one."""
    model = _model()
    start = [np.asarray(v).copy() for v in model.variables + model.optimizer.variables]
    directory = tmp_path / "c"
    directory.mkdir()
    (directory / START_FILE).write_bytes(b"an earlier run's, not this fit()'s")
    probe = StartFileProbe(directory)
    checkpoint = kmk.SyncedCheckpoint(directory, save_freq="epoch")
    model.fit(X, Y, epochs=2, shuffle=False, verbose=0, callbacks=[checkpoint, probe])
    assert probe.present == [True] * 16 + [False] * 16  # until the end of epoch 1
    assert not (directory / START_FILE).exists()
    saved = sorted(np.asarray(a).tobytes() for a in probe.held)
    for value in start:  # every variable as it was before the first step
        assert value.tobytes() in saved
    assert not hasattr(checkpoint, "_start_state")  # no host copy of the state is kept

    other = tmp_path / "other"
    other.mkdir()
    (other / START_FILE).write_bytes(b"an earlier run's")
    present = []
    look = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: present.append((other / START_FILE).exists())
    )
    checkpoint = kmk.SyncedCheckpoint(other, restore=False)
    model.fit(X, Y, epochs=1, shuffle=False, verbose=0, callbacks=[checkpoint, look])
    assert present == [False] * 16


def test_a_retry_whose_start_file_is_gone_warns_and_trains_on(tmp_path, caplog):
    model = _model()
    checkpoint = kmk.SyncedCheckpoint(tmp_path / "c", save_freq=5)
    failing = FailOnce(step=2)
    with pytest.raises(RuntimeError, match="injected failure"):
        model.fit(X, Y, epochs=2, shuffle=False, verbose=0, callbacks=[checkpoint, failing])
    (tmp_path / "c" / START_FILE).unlink()
    with caplog.at_level(logging.INFO, logger="keras_mirror_kit"):
        model.fit(X, Y, epochs=2, shuffle=False, verbose=0, callbacks=[checkpoint, failing])
    assert "cannot be put back" in caplog.text and "trained again" in caplog.text
    assert int(model.optimizer.iterations.numpy()) == 2 + 32


def test_a_completed_fit_is_not_rewound_by_the_next_one(tmp_path):
    """The kept start state belongs to one fit(): a second fit() goes on from the first."""
    model = _model()
    checkpoint = kmk.SyncedCheckpoint(tmp_path / "c", save_freq=1000)
    model.fit(X, Y, epochs=1, shuffle=False, verbose=0, callbacks=[checkpoint])
    model.fit(X, Y, epochs=1, shuffle=False, verbose=0, callbacks=[checkpoint])
    assert int(model.optimizer.iterations.numpy()) == 32
