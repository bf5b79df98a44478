"""A shuffled kit dataset trains on every sample of every epoch, as Keras' `fit(x, y)` does
(issue "What the Keras ecosystem hands the kit", part 6).

269 rows at a global batch of 64: `kmk.make_dataset(x, y, 64, seed=5)` with its defaults
gives 5 batches an epoch, the last of 13 rows (7/6 on 2 replicas). A kit-built model on 1
and on 2 replicas trains 2 epochs on it; a plain Keras model (no kit, the same first
weights) trains on the same arrays with Keras' own `fit(x, y, batch_size=64,
shuffle=False)`, one epoch at a time, the rows put in the kit's order of that epoch. All
three agree to 1e-6 in weights, per-epoch losses, `evaluate` and `predict`. Then the
2-replica run is crashed mid-epoch and resumed (`SyncedCheckpoint`): it ends on the
uninterrupted run's weights.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_mirror_kit as kmk
from keras_mirror_kit.callbacks.synced_checkpoint import SyncedCheckpoint
from tests.ckpt_helpers import CountBatches, StopAt, set_back

pytestmark = pytest.mark.slow  # three models trained, one run crashed and resumed

ROWS, GLOBAL, SEED, EPOCHS = 269, 64, 5, 2
TOLERANCE = 1e-6
RNG = np.random.default_rng(0)
X = RNG.normal(size=(ROWS, 8)).astype("float32")
Y = ((X[:, 0] + X[:, 1] > 0).astype("int32") + (X[:, 2] > 1)).astype("int32")
XE = np.random.default_rng(9).normal(size=(29, 8)).astype("float32")
YE = (XE[:, 0] > 0).astype("int32")


def _layers() -> keras.Model:
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _kit(devices) -> keras.Model:
    return kmk.distributed(global_batch_size=GLOBAL, devices=devices)(_layers)()


def _order(epoch: int) -> np.ndarray:
    """The rows of `epoch` in the kit's order (the order depends on seed, epoch and count)."""
    rows = kmk.make_dataset(np.arange(ROWS), None, GLOBAL, seed=SEED)
    kmk.cursor_of(rows).set(epoch=epoch)
    return np.concatenate([batch.numpy() for batch in rows])


def _outcome(model, losses):
    return {
        "weights": model.get_weights(),
        "losses": np.asarray(losses, "float64"),
        "evaluate": np.asarray(model.evaluate(XE, YE, verbose=0), "float64"),
        "predict": model.predict(XE, verbose=0),
    }


def _gap(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b))


def test_a_shuffled_kit_dataset_trains_every_sample_like_keras_fit_on_the_arrays(tmp_path):
    orders = [_order(epoch) for epoch in range(EPOCHS)]
    for order in orders:  # every row once per epoch, in another order each epoch
        assert sorted(order.tolist()) == list(range(ROWS))
    assert orders[0].tolist() != orders[1].tolist()

    plain, losses = _layers(), []
    for order in orders:
        history = plain.fit(X[order], Y[order], batch_size=GLOBAL, shuffle=False, verbose=0)
        losses += history.history["loss"]
    assert int(plain.optimizer.iterations.numpy()) == EPOCHS * 5
    outcomes = {"keras": _outcome(plain, losses)}

    resets = {}
    for n, devices in {1: ["/cpu:0"], 2: ["/cpu:0", "/cpu:1"]}.items():
        resets[n] = set_back(_kit(devices), seed=None)
        model, counter = resets[n](), CountBatches()
        ds = kmk.make_dataset(X, Y, GLOBAL, seed=SEED)  # the defaults: every sample
        history = model.fit(ds, epochs=EPOCHS, verbose=0, callbacks=[counter])
        assert counter.batches == EPOCHS * 5 and len(history.history["loss"]) == EPOCHS
        outcomes[n] = _outcome(model, history.history["loss"])
    for n in (1, 2):
        for key in ("weights", "losses", "evaluate", "predict"):
            a, b = outcomes["keras"][key], outcomes[n][key]
            a, b = (a, b) if key == "weights" else ([a], [b])
            assert _gap(a, b) <= TOLERANCE, (n, key, _gap(a, b))

    # Crashed after batch 2 of epoch 1 and resumed: the uninterrupted 2-replica weights.
    def run(crash_at=None):
        ds = kmk.make_dataset(X, Y, GLOBAL, seed=SEED)
        checkpoint, counter = SyncedCheckpoint(tmp_path, save_freq=1, dataset=ds), CountBatches()
        extra = [StopAt(*crash_at)] if crash_at else []
        model = resets[2]()
        model.fit(ds, epochs=EPOCHS, verbose=0, callbacks=[checkpoint, counter, *extra])
        return model, checkpoint, counter.batches

    with pytest.raises(KeyboardInterrupt):
        run(crash_at=(1, 1))
    model, checkpoint, trained = run()
    meta = checkpoint.last_restored.meta
    assert (meta["epoch"], meta["step"], trained) == (1, 2, 3)  # its 3 batches left, the 13 last
    assert _gap(outcomes[2]["weights"], model.get_weights()) <= TOLERANCE
