"""Evaluation, validation and prediction of any size give exactly what one replica gives.

Each case builds the same model (same weights) on 1 and on 2 replicas of this process and
compares loss, every compiled metric (unweighted and weighted) and the predicted rows, on
sizes that leave a last batch of 13 samples (split 7/6), 1 sample (1/0: a replica without
any), and a set smaller than one global batch; 1 replica, which gives the same results for
the same batches of the same rows whatever feeds them (arrays, `tf.data`, `make_dataset`;
up to 16 rows, arrays in one batch of 64 too), evaluates and predicts each once. One model
on 1 replica and one on 2 (same weights) answer every size of `evaluate` and `predict`:
neither changes a weight, Keras builds a model once, and the first batch of each call is
split anew (they also serve the tests below that train them, which give them their weights
back). Training keeps its rule: a kit dataset whose last batch would split unevenly is
refused before any step.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mirror_kit as kmk
from keras_mirror_kit.workarounds import keras_uneven_first_batch

ONE, TWO = ["/cpu:0"], ["/cpu:0", "/cpu:1"]
GLOBAL = 16
TOLERANCE = 1e-6


def _images(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, size=(n, 6, 6, 3), dtype=np.uint8)
    y = (x[:, :3].mean(axis=(1, 2, 3)) > x[:, 3:].mean(axis=(1, 2, 3))).astype("int32")
    return x, y + (x[:, 0, 0, 0] > 127)


def _build(devices: list[str], weights: list[np.ndarray] | None = None) -> keras.Model:
    # Synchronized BatchNormalization: training computes the statistics of the whole batch.
    @kmk.distributed(global_batch_size=GLOBAL, devices=devices, sync_batch_norm=True)
    def build() -> keras.Model:
        keras.utils.set_random_seed(3)
        model = keras.Sequential(
            [
                keras.Input((6, 6, 3)),
                keras.layers.Rescaling(1 / 255),
                keras.layers.Conv2D(4, 3, activation="relu"),
                keras.layers.BatchNormalization(),
                keras.layers.Flatten(),
                keras.layers.Dense(3, activation="softmax"),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.SGD(0.05),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=2)],
            weighted_metrics=["accuracy"],
        )
        return model

    model = build()
    if weights is not None:
        model.set_weights(weights)
    return model


@pytest.fixture(scope="module")
def weights() -> list[np.ndarray]:
    """Trained a little (so metrics are not trivial), then shared by every model here."""
    model = _build(ONE)
    x, y = _images(64, seed=1)
    model.fit(x.astype("float32"), y, epochs=2, verbose=0)
    return model.get_weights()


@pytest.fixture(scope="module")
def models(weights) -> tuple[keras.Model, keras.Model]:
    """The model on 1 and on 2 replicas with `weights`, for evaluate and predict only."""
    return _build(ONE, weights), _build(TWO, weights)


EVALUATIONS = ["arrays", "arrays, one batch", "arrays, weighted", "tf.data", "make_dataset"]
# On 1 replica these are the batches of 16 of "arrays" (the rows, in order): the same
# evaluation bit for bit, so the 1-replica reference evaluates those batches once.
SAME_ON_ONE_REPLICA = {"tf.data": "arrays", "make_dataset": "arrays"}


def _same_on_one_replica(n: int) -> dict[str, str]:
    """`SAME_ON_ONE_REPLICA` for `n` rows: up to 16 rows, "arrays, one batch" is the one
    batch of "arrays" too."""
    return {**SAME_ON_ONE_REPLICA, **({"arrays, one batch": "arrays"} if n <= GLOBAL else {})}


def _evaluations(
    model: keras.Model, n: int, cases: list[str] = EVALUATIONS
) -> dict[str, list[float]]:
    x, y = _images(n, seed=n)
    w = np.linspace(0.5, 1.5, n).astype("float32")  # weighted metrics see real weights
    plain = tf.data.Dataset.from_tensor_slices((x.astype("float32"), y)).batch(GLOBAL)
    calls = {
        "arrays": lambda: model.evaluate(x.astype("float32"), y, verbose=0),
        "arrays, one batch": lambda: model.evaluate(
            x.astype("float32"), y, batch_size=64, verbose=0
        ),
        "arrays, weighted": lambda: model.evaluate(
            x.astype("float32"), y, sample_weight=w, verbose=0
        ),
        "tf.data": lambda: model.evaluate(plain, verbose=0),
        # uint8 stored, cast on each replica (the model itself rescales by 1/255)
        "make_dataset": lambda: model.evaluate(
            kmk.make_dataset(x, y, GLOBAL, shuffle=False, preprocess=kmk.rescale(1.0)), verbose=0
        ),
    }
    return {case: calls[case]() for case in cases}


@pytest.mark.slow
@pytest.mark.parametrize("n", [29, 61, 1, 3])
def test_evaluate_on_two_replicas_equals_one_replica(models, n):
    one, two = models
    got = _evaluations(two, n)
    same = _same_on_one_replica(n)
    reference = _evaluations(one, n, [c for c in EVALUATIONS if c not in same])
    for case in EVALUATIONS:
        expected = reference[same.get(case, case)]
        close = np.allclose(got[case], expected, atol=TOLERANCE, rtol=0)
        assert close, (case, got, reference)


@pytest.mark.slow
def test_validation_of_any_size_during_fit_equals_one_replica(models, weights):
    """The crash of the issue: a kit dataset to train on (stored dtype on the replicas) and
    29 validation samples, evaluated in one batch of 32 split 15/14 after the epoch."""
    x, y = _images(64, seed=2)
    xv, yv = _images(29, seed=3)
    histories = []
    for model in models:  # trained here, then given their weights back
        try:
            train = kmk.make_dataset(x, y, GLOBAL, seed=0, preprocess=kmk.rescale(1.0))
            history = model.fit(
                train, epochs=2, validation_data=(xv.astype("float32"), yv), verbose=0
            ).history
            histories.append(history)
        finally:
            model.set_weights(weights)
    one, two = histories
    assert set(two) == set(one) and "val_loss" in two
    for key in one:
        assert np.allclose(two[key], one[key], atol=1e-5, rtol=0), (key, one[key], two[key])


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 3, 29])
def test_predict_returns_every_row_in_order_on_two_replicas(models, n):
    x, _ = _images(n, seed=10 + n)
    one, two = models
    expected = one.predict(x.astype("float32"), verbose=0)  # 1 replica: the same rows each way
    for data in (
        x.astype("float32"),
        tf.data.Dataset.from_tensor_slices(x.astype("float32")).batch(GLOBAL),
        kmk.make_dataset(x.astype("float32"), batch_size=GLOBAL, shuffle=False),
    ):
        got = two.predict(data, verbose=0)
        assert got.shape == (n, 3)
        np.testing.assert_allclose(got, expected, atol=TOLERANCE, rtol=0)


@pytest.mark.slow
def test_training_on_a_last_batch_that_splits_unevenly_is_refused_before_any_step(models):
    model = models[1]
    x, y = _images(17, seed=4)  # last batch of 1: one replica would get nothing
    dataset = kmk.make_dataset(x.astype("float32"), y, GLOBAL, shuffle=False)
    steps, weights = int(model.optimizer.iterations.numpy()), model.get_weights()
    try:
        with pytest.raises(ValueError, match=r"last batch holds 1 samples.*2 replicas"):
            model.fit(dataset, epochs=1, verbose=0)
        assert int(model.optimizer.iterations.numpy()) == steps  # no step
        assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), weights))
    finally:
        model.set_weights(weights)  # the models fixture's weights, whatever happened
    model.evaluate(dataset, verbose=0)  # evaluation takes it


def test_make_dataset_num_replicas_is_deprecated():
    x, y = _images(17, seed=5)
    with pytest.warns(DeprecationWarning, match="num_replicas"):
        kmk.make_dataset(x, y, GLOBAL, shuffle=False, num_replicas=2)


@pytest.mark.slow
def test_plain_keras_still_fails_on_an_uneven_first_batch(weights):
    """The upstream bug (keras-team/keras#19246) the kit works around: when this test fails,
    Keras builds without averaging the replicas' parts and the workaround can go."""
    assert keras_uneven_first_batch.bug_in_source() is True
    strategy = tf.distribute.MirroredStrategy(TWO)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
        model.compile("sgd", "sparse_categorical_crossentropy", metrics=["accuracy"])
    x = np.zeros((29, 4), "float32")
    y = np.zeros(29, "int32")
    with pytest.raises(tf.errors.InvalidArgumentError, match="AddN"):
        model.evaluate(x, y, batch_size=32, verbose=0)  # one batch, split 15/14


@pytest.mark.slow  # seconds: a 2-replica model's evaluate and fit
def test_a_shuffled_kit_dataset_is_evaluated_and_validated_whole(models):
    x, y = _images(45, seed=11)  # 2 full global batches and 13 samples
    model = models[1]  # trained here, then given its weights back (finally, below)
    weights = model.get_weights()
    try:
        ds = kmk.make_dataset(x, y, GLOBAL, seed=0, drop_remainder=True)  # drops the 13
        assert sum(len(b) for _, b in ds) == 32
        reference = model.evaluate(x, y, batch_size=GLOBAL, verbose=0, return_dict=True)
        whole = model.evaluate(ds, verbose=0, return_dict=True)
        for name, value in reference.items():
            assert abs(whole[name] - value) <= TOLERANCE, (name, whole, reference)
        # As validation_data: the epoch's val_loss is the loss of all 45 samples too.
        train = kmk.make_dataset(x[:32], y[:32], GLOBAL, seed=1)
        history = model.fit(train, validation_data=ds, epochs=1, verbose=0)
        after = model.evaluate(x, y, batch_size=GLOBAL, verbose=0, return_dict=True)
        assert abs(history.history["val_loss"][0] - after["loss"]) <= TOLERANCE
    finally:
        model.set_weights(weights)
