"""Epoch `e` of a kit-built model sees the order of epoch `e` of its kit dataset.

The order is a permutation keyed on (seed, epoch). It must not depend on what else iterated
the dataset object (Keras' own first-batch build, a peek, an `evaluate` between two fits)
or on which callbacks are listed (`SyncedCheckpoint(dataset=)` used to key the order on the
epoch while a fit without it keyed it on the number of iterations). Each case is compared
with one reference fit for the module, which also shows that a fit of a kit dataset
warns of no shuffle.
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest

import keras_mirror_kit as kmk
from tests.ckpt_helpers import max_diff

TWO = ["/cpu:0", "/cpu:1"]


def _model() -> keras.Model:
    @kmk.distributed(global_batch_size=16, devices=TWO)
    def build() -> keras.Model:
        keras.utils.set_random_seed(11)
        model = keras.Sequential(
            [keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)]
        )
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    return build()


def _dataset():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1)) + np.sin(3 * x[:, :1])).astype("float32")
    return kmk.make_dataset(x, y, 16, seed=3)


@pytest.fixture(scope="module")
def reference_run() -> tuple[list[np.ndarray], list[warnings.WarningMessage]]:
    """A fresh model's fit of a fresh kit dataset: its weights, and the warnings it gave."""
    model, ds = _model(), _dataset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(ds, epochs=2, verbose=0)
    return model.get_weights(), caught


@pytest.fixture(scope="module")
def reference(reference_run) -> list[np.ndarray]:
    return reference_run[0]


def test_orders_differ_between_epochs_so_the_cases_below_can_fail():
    ds = _dataset()

    def order() -> list[float]:
        return [v for batch in ds for v in batch[1].numpy().ravel().tolist()]

    first, second = order(), order()  # each iteration moves the cursor to the next epoch
    assert first != second
    kmk.cursor_of(ds).set(0)
    assert order() == first


@pytest.mark.slow
def test_a_synced_checkpoint_does_not_change_what_trains(reference, tmp_path):
    model, ds = _model(), _dataset()
    model.fit(ds, epochs=2, verbose=0, callbacks=[kmk.SyncedCheckpoint(tmp_path, dataset=ds)])
    assert max_diff(model.get_weights(), reference) <= 1e-6


@pytest.mark.slow
def test_a_peek_at_the_dataset_before_fit_does_not_change_what_trains(reference):
    model, ds = _model(), _dataset()
    next(iter(ds))
    model.fit(ds, epochs=2, verbose=0)
    assert max_diff(model.get_weights(), reference) <= 1e-6


@pytest.mark.slow
def test_an_evaluate_between_two_fits_does_not_change_what_trains(reference):
    model, ds = _model(), _dataset()
    model.fit(ds, epochs=1, verbose=0)
    model.evaluate(ds, verbose=0)
    model.fit(ds, epochs=2, initial_epoch=1, verbose=0)
    assert max_diff(model.get_weights(), reference) <= 1e-6


@pytest.mark.slow
def test_fit_of_a_kit_dataset_prints_no_shuffle_warning(reference_run):
    _, caught = reference_run  # the reference's fit
    assert not [w for w in caught if "shuffle" in str(w.message)]
