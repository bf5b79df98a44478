"""A `fit` retried in the same process after an exception never trains a batch twice.

Keras' `BackupAndRestore` scenario `test_best_case_step`, played with `SyncedCheckpoint`: an
integer `save_freq`, an exception at step 2 of the first epoch (before any checkpoint),
then `fit` again with the same model and callback. The retry must end where one
uninterrupted run ends: optimizer step 32 and every variable equal.
"""

from __future__ import annotations

import logging

import keras
import numpy as np
import pytest

import keras_mirror_kit as kmk

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


@pytest.mark.parametrize("with_dataset", [False, True], ids=["arrays", "dataset="])
def test_a_retried_fit_trains_no_batch_twice(tmp_path, caplog, with_dataset):
    def data():
        if with_dataset:
            dataset = kmk.make_dataset(X, Y, GLOBAL, seed=3)
            return (dataset,), {"dataset": dataset}
        return (X, Y), {}

    reference = _model()
    args, options = data()
    reference.fit(
        *args,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[kmk.SyncedCheckpoint(tmp_path / "reference", save_freq=5, **options)],
    )

    model = _model()
    args, options = data()
    checkpoint = kmk.SyncedCheckpoint(tmp_path / "retried", save_freq=5, **options)
    failing = FailOnce(step=2)
    with pytest.raises(RuntimeError, match="injected failure"):
        model.fit(*args, epochs=2, shuffle=False, verbose=0, callbacks=[checkpoint, failing])
    assert int(model.optimizer.iterations.numpy()) == 2  # trained, and no checkpoint yet
    with caplog.at_level(logging.INFO, logger="keras_mirror_kit"):
        model.fit(*args, epochs=2, shuffle=False, verbose=0, callbacks=[checkpoint, failing])
    assert "no batch is trained twice" in caplog.text
    assert int(model.optimizer.iterations.numpy()) == 32
    for got, expected in zip(_state(model), _state(reference), strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-6, rtol=0)


def test_a_completed_fit_is_not_rewound_by_the_next_one(tmp_path):
    """The kept start state belongs to one fit(): a second fit() goes on from the first."""
    model = _model()
    checkpoint = kmk.SyncedCheckpoint(tmp_path / "c", save_freq=1000)
    model.fit(X, Y, epochs=1, shuffle=False, verbose=0, callbacks=[checkpoint])
    model.fit(X, Y, epochs=1, shuffle=False, verbose=0, callbacks=[checkpoint])
    assert int(model.optimizer.iterations.numpy()) == 32
