"""N replicas train like one on every split of the data (issue: "N replicas train like one").

Every case builds the same model (same weights) on 1 and on 2 replicas of this process and
compares weights, per-epoch losses and val_loss, `evaluate` and `predict`, on data whose last
batch tf.distribute splits unevenly (269 rows at a global batch of 64: 13 rows, split 7/6),
for arrays, plain `tf.data` and kit datasets, with `sample_weight`, `class_weight` and a
masked sequence loss. The unweighted cases feed 1 replica the same rows in the same batches
(validation: the same 29 rows in one batch), so they share one 1-replica run (on arrays);
each 2-replica run is its own. The runs on a number of replicas share one model, restarted
for each run with the same first weights and an optimizer that took no step
(`tests.ckpt_helpers.set_back`):
it is traced once per input signature. Evaluation and prediction of 1, 2, 3 and 77 rows run a
Conv2D + BatchNormalization model on 3-channel images through a layer that fails if a
replica ever computes on an empty part, so the test does not depend on the host's oneDNN
having the empty-batch bug (`keras_replica_shares.probe_empty_conv`); one 1-replica and one
2-replica model (same weights) answer every size: Keras rebuilds nothing per call, and the
first batch of each call is split anew; 1 replica evaluates and predicts each size once, on
arrays (the datasets are the same batches of the same rows). The same two models, restarted,
are trained on 77 images (7/6), validating on one row (1/0) after each epoch (one pair of
runs for both properties), and then given their weights back.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mirror_kit as kmk
from keras_mirror_kit.fit_inputs import replica_parts
from keras_mirror_kit.upstream import versions
from keras_mirror_kit.workarounds import keras_activity_regularizer_sum, keras_replica_shares
from tests.ckpt_helpers import set_back
from tests.subproc import REPO, run_python

ONE, TWO = ["/cpu:0"], ["/cpu:0", "/cpu:1"]
SUMS = keras_activity_regularizer_sum.sums_over_the_batch()  # Keras before 3.14
GLOBAL = 64
TOLERANCE = 1e-6


def _close(a, b, what):
    a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
    gap = float(np.max(np.abs(a - b))) if a.size else 0.0
    assert a.shape == b.shape and gap <= TOLERANCE, (what, gap, a, b)


def _gap(a, b) -> float:
    """The largest absolute difference of two equally shaped arrays (inf if shapes differ)."""
    a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
    if a.shape != b.shape:
        return float("inf")
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def _state(model: keras.Model) -> list[np.ndarray]:
    """A copy of the model's weights, then its optimizer's step count (as a last item)."""
    return [*model.get_weights(), model.optimizer.iterations.numpy()]


def _as_state(model_or_state: keras.Model | list) -> list:
    """`_state(model)` of a model; a `_state` as it is."""
    return _state(model_or_state) if isinstance(model_or_state, keras.Model) else model_or_state


def _state_gap(one: keras.Model | list, two: keras.Model | list) -> float:
    """The largest difference of the two models' (or `_state`s') weights and optimizer steps."""
    one, two = _as_state(one), _as_state(two)
    return max(_gap(a, b) for a, b in zip(one, two, strict=True))


def _history_gap(one: dict, two: dict) -> float:
    """The largest difference between two `History.history` dicts (inf: other keys)."""
    if set(one) != set(two):
        return float("inf")
    return max(_gap(one[key], two[key]) for key in one)


def _weights_close(one: keras.Model | list, two: keras.Model | list) -> None:
    """The two models' (or `_state`s') weights and optimizer steps agree."""
    one, two = _as_state(one), _as_state(two)
    assert len(one) == len(two), (len(one), len(two))
    for a, b in zip(one[:-1], two[:-1], strict=True):
        _close(a, b, "weights")
    _close(one[-1], two[-1], "iterations")


def _tabular(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int32") + (x[:, 2] > 1)
    return x, y


def _dnn(devices, **distributed):
    """A DNN with a weight regularizer and an `add_loss` term (the tf-keras correctness
    scenario "DNN with regularizers")."""

    @kmk.distributed(global_batch_size=GLOBAL, devices=devices, **distributed)
    def build() -> keras.Model:
        keras.utils.set_random_seed(1)
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(
            16,
            activation="relu",
            kernel_regularizer=keras.regularizers.L2(1e-2),
            # Before Keras 3.14 an activity regularizer sums over the batch: refused on
            # several replicas (`test_activity_regularizers_are_refused_where_keras_sums_them`).
            activity_regularizer=None if SUMS else keras.regularizers.L1(1e-4),
        )(inputs)
        outputs = keras.layers.Dense(3, activation="softmax")(hidden)
        model = keras.Model(inputs, outputs)
        model.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
            weighted_metrics=["accuracy"],
        )
        return model

    return build()


def _run(model, fit_kwargs, data, eval_rows=29):
    """`model` (restarted: its first weights, no step taken) trained 2 epochs, then
    evaluated and asked to predict: (`_state`, history, evaluate, predict)."""
    assert int(model.optimizer.iterations.numpy()) == 0, "restarts from before any step"
    history = model.fit(*data(), epochs=2, verbose=0, **fit_kwargs).history
    x, y = _tabular(eval_rows, seed=9)
    state = _state(model)
    return state, history, model.evaluate(x, y, verbose=0), model.predict(x, verbose=0)


def _compare(one, two):
    """`one`, `two`: the runs (`_run`) of the same arguments on 1 and on 2 replicas."""
    _weights_close(one[0], two[0])
    assert set(one[1]) == set(two[1])
    for key in one[1]:
        _close(one[1][key], two[1][key], key)
    _close(one[2], two[2], "evaluate")
    _close(one[3], two[3], "predict")
    return one[1]


X, Y = _tabular(269)
XV, YV = _tabular(29, seed=3)
SW = np.random.default_rng(5).uniform(0.2, 2.0, 269).astype("float32")


def _arrays():
    return (X, Y)


def _plain_dataset():
    return (tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL),)


def _kit_dataset():
    return (kmk.make_dataset(X, Y, GLOBAL, shuffle=False, drop_remainder=False),)


def _validation_dataset():
    return tf.data.Dataset.from_tensor_slices((XV, YV)).batch(GLOBAL)


CASES = {
    "arrays": (_arrays, {"shuffle": False, "validation_data": (XV, YV)}),
    "arrays, validation as a dataset": (
        _arrays,
        {"shuffle": False, "validation_data": _validation_dataset},
    ),
    "arrays, sample_weight": (_arrays, {"shuffle": False, "sample_weight": SW}),
    "arrays, class_weight": (
        _arrays,
        {"shuffle": False, "class_weight": {0: 0.5, 1: 2.0, 2: 1.0}},
    ),
    "plain tf.data": (_plain_dataset, {"validation_data": (XV, YV)}),
    "kit dataset, last batch kept": (_kit_dataset, {"validation_data": _validation_dataset}),
}
# The case whose 1-replica run each case is compared with: on 1 replica the unweighted cases
# are the same batches of the same rows (so the same run, bit for bit), the weighted ones not.
REFERENCE = {case: case if "weight" in case else "arrays" for case in CASES}


def _fit_kwargs(case):
    _, fit_kwargs = CASES[case]
    return {
        k: (v() if callable(v) and k == "validation_data" else v) for k, v in fit_kwargs.items()
    }


@pytest.fixture(scope="module")
def dnn_runs():
    """`run(devices, case)`: the run (`_run`) of `case` on `devices`; one model per device
    list, restarted for each run with the same first weights and an optimizer that took no
    step; a 1-replica run is made once for the module (`REFERENCE[case]`)."""
    restarts = {len(devices): set_back(_dnn(devices), seed=None) for devices in (ONE, TWO)}
    references = {}

    def run(devices, case):
        if devices == ONE:
            case = REFERENCE[case]
            if case in references:
                return references[case]
        result = _run(restarts[len(devices)](), _fit_kwargs(case), CASES[case][0])
        if devices == ONE:
            references[case] = result
        return result

    return run


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_two_replicas_train_like_one_on_an_uneven_last_batch(dnn_runs, case):
    history = _compare(dnn_runs(ONE, case), dnn_runs(TWO, case))
    assert len(history["loss"]) == 2


def _sequence_model(devices):
    """Embedding with mask_zero and a per-timestep loss: the loss's denominator is the
    replica's valid (unmasked) entries, not its rows."""

    @kmk.distributed(global_batch_size=GLOBAL, devices=devices)
    def build() -> keras.Model:
        keras.utils.set_random_seed(2)
        model = keras.Sequential(
            [
                keras.Input((6,), dtype="int32"),
                keras.layers.Embedding(20, 4, mask_zero=True),
                keras.layers.Dense(3, activation="softmax"),
            ]
        )
        model.compile(keras.optimizers.SGD(0.5), "sparse_categorical_crossentropy")
        return model

    return build()


@pytest.mark.slow
def test_a_masked_loss_weighs_each_replica_by_its_valid_entries():
    rng = np.random.default_rng(7)
    tokens = rng.integers(1, 20, size=(269, 6)).astype("int32")
    lengths = rng.integers(1, 7, size=269)
    tokens[np.arange(6)[None, :] >= lengths[:, None]] = 0  # padding, masked
    labels = tokens % 3
    results = []
    for devices in (ONE, TWO):
        model = _sequence_model(devices)
        history = model.fit(
            tokens[:200],
            labels[:200],
            epochs=2,
            shuffle=False,
            verbose=0,
            # traced after the train step: nothing of its weighting may leak into it
            validation_data=(tokens[200:], labels[200:]),
            validation_freq=2,  # once, after the last epoch: only its presence is checked
        ).history
        history["train_again"] = model.fit(
            tokens, labels, epochs=1, shuffle=False, verbose=0
        ).history["loss"]
        results.append((model, history))
    _weights_close(results[0][0], results[1][0])
    _close(results[0][1]["loss"], results[1][1]["loss"], "loss")
    _close(results[0][1]["train_again"], results[1][1]["train_again"], "loss")
    assert len(results[1][1]["val_loss"]) == 1  # validated (after epoch 2), before train_again


class OwnComputeLoss(keras.Model):
    """A class that overrides `compute_loss`: Keras' loss plus a mean over the rows, scaled
    for the replicas as Keras scales its own terms (so that an even split trains as one
    device in Keras itself)."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        from keras.src.losses.loss import scale_loss_for_distribution

        loss = super().compute_loss(x, y, y_pred, sample_weight, training=training)
        extra = 0.1 * keras.ops.mean(keras.ops.square(y_pred))
        return loss + scale_loss_for_distribution(extra)


class OwnMetrics(keras.Model):
    """A class whose `compute_metrics` returns another dict than Keras' metrics."""

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        logs = super().compute_metrics(x, y, y_pred, sample_weight)
        return {**logs, "rows": keras.ops.cast(keras.ops.shape(y_pred)[0], "float32")}


def _subclassed(model_class, devices):
    @kmk.distributed(global_batch_size=GLOBAL, devices=devices)
    def build() -> keras.Model:
        keras.utils.set_random_seed(1)
        inputs = keras.Input((8,))
        outputs = keras.layers.Dense(3, activation="softmax")(inputs)
        model = model_class(inputs, outputs)
        model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy")
        return model

    return build()


@pytest.mark.slow
def test_an_own_compute_loss_is_weighted_once():
    """Its compiled losses (through `super()`) are not weighted a second time."""
    models = [_subclassed(OwnComputeLoss, devices) for devices in (ONE, TWO)]
    histories = [m.fit(X, Y, epochs=2, shuffle=False, verbose=0).history for m in models]
    assert replica_parts(len(X) % GLOBAL, 2) == [7, 6]  # the split this test is about
    assert _state_gap(*models) <= TOLERANCE
    assert _history_gap(*histories) <= TOLERANCE, histories


def test_an_own_compute_metrics_keeps_keras_test_step():
    model = _subclassed(OwnMetrics, TWO)
    x, y = _tabular(29, seed=4)
    logs = model.evaluate(x, y, verbose=0, return_dict=True)
    assert "loss" in logs


@pytest.mark.slow
def test_plain_keras_still_weighs_parts_unequally():
    """The upstream behaviour the kit corrects (module `keras_replica_shares`): when this
    fails, Keras weighs each replica by its share itself and the workaround can go."""
    weights = []
    for devices in (ONE, TWO):
        # Reduced on one device: TensorFlow's collectives of another strategy in this
        # process would clash with those of the kit's strategies.
        strategy = tf.distribute.MirroredStrategy(
            devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
        )
        with strategy.scope():
            keras.utils.set_random_seed(1)
            model = keras.Sequential(
                [keras.Input((8,)), keras.layers.Dense(3, activation="softmax")]
            )
            model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy")
        model.fit(X, Y, batch_size=GLOBAL, epochs=2, shuffle=False, verbose=0)
        weights.append(model.get_weights()[0])
    assert np.max(np.abs(weights[0] - weights[1])) > 1e-5


# -- parts with no rows ------------------------------------------------------------------


class NoEmptyPart(keras.layers.Layer):
    """Fails the step if it ever runs on a replica's part with no rows."""

    def call(self, inputs):
        check = tf.debugging.assert_positive(
            tf.shape(inputs)[0], message="a replica computed on an empty part"
        )
        with tf.control_dependencies([check]):
            return tf.identity(inputs)


def _conv_bn(devices, weights=None):
    @kmk.distributed(global_batch_size=16, devices=devices, sync_batch_norm=True)
    def build() -> keras.Model:
        keras.utils.set_random_seed(4)
        model = keras.Sequential(
            [
                keras.Input((12, 12, 3)),
                NoEmptyPart(),
                keras.layers.Conv2D(16, 3, strides=4, padding="same"),
                keras.layers.BatchNormalization(),
                keras.layers.Flatten(),
                keras.layers.Dense(3, activation="softmax"),
            ]
        )
        model.compile(
            keras.optimizers.SGD(0.05),
            "sparse_categorical_crossentropy",
            metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=2)],
        )
        return model

    model = build()
    if weights is not None:
        model.set_weights(weights)
    return model


def _images(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.uniform(size=(n, 12, 12, 3)).astype("float32")
    return x, (x[:, :6].mean(axis=(1, 2, 3)) > 0.5).astype("int32")


@pytest.fixture(scope="module")
def conv_setup():
    """The CNN on 1 and on 2 replicas with the same weights: those the 1-replica model has
    after an epoch on 64 images (then it is the 1-replica model here); and for each model
    its `set_back`, with which a test that trains it gives it those weights back:
    (weights, [(model, restart)] for 1 and for 2 replicas)."""
    one = _conv_bn(ONE)
    restart_one = set_back(one, seed=None)  # its optimizer before the epoch below
    one.fit(*_images(64, seed=1), epochs=1, verbose=0)
    weights = one.get_weights()
    restart_one(weights)  # and its optimizer steps back to 0
    two = _conv_bn(TWO, weights)
    return weights, [(one, restart_one), (two, set_back(two, seed=None))]


@pytest.fixture(scope="module")
def conv_models(conv_setup):
    """The CNN on 1 and on 2 replicas with the same weights, for evaluate and predict."""
    return tuple(model for model, _ in conv_setup[1])


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 2, 3, 77])
def test_evaluate_and_predict_never_compute_on_an_empty_part(conv_models, n):
    """1 row on 2 replicas leaves one empty; 77 rows at 16 end on 13 (7/6)."""
    one, two = conv_models
    x, y = _images(n, seed=n)
    datasets = [
        (x, y),
        (tf.data.Dataset.from_tensor_slices((x, y)).batch(16),),
        (kmk.make_dataset(x, y, 16, shuffle=False),),
    ]
    # 1 replica: each input is the same batches of 16 of the same rows, so one reference.
    expected = one.evaluate(x, y, verbose=0)
    for data in datasets:
        _close(expected, two.evaluate(*data, verbose=0), "evaluate")
    expected = one.predict(x, verbose=0)
    for data in (x, tf.data.Dataset.from_tensor_slices(x).batch(16)):
        got = two.predict(data, verbose=0)
        assert got.shape == (n, 3)
        _close(expected, got, "predict")


@pytest.fixture(scope="module")
def cnn_runs(conv_setup):
    """The CNN (`conv_models`, restarted: no step taken) trained 2 epochs on 77 images at 16
    (last batch 13: 7/6) on 1 and on 2 replicas, validating on 1 row (1/0) after each epoch,
    then given its weights back: [(`_state` after training, history)] x 2."""
    weights, models = conv_setup
    x, y = _images(77, seed=5)
    results = []
    for model, restart in models:
        restart(weights)
        assert int(model.optimizer.iterations.numpy()) == 0, "restarts from before any step"
        try:
            history = model.fit(
                x, y, epochs=2, shuffle=False, validation_data=_images(1, seed=3), verbose=0
            ).history
            results.append((_state(model), history))
        finally:
            restart(weights)  # the weights of `conv_models`, whatever happened
    return results


@pytest.mark.slow
def test_a_cnn_with_synchronized_batch_norm_trains_like_one_replica_on_a_7_6_split(cnn_runs):
    """77 images at a global batch of 16: the last batch of 13 is split 7/6; synchronized
    BatchNormalization computes the statistics of the whole batch."""
    assert replica_parts(77 % 16, 2) == [7, 6]  # the split this test is about
    (one, one_history), (two, two_history) = cnn_runs
    assert _state_gap(one, two) <= TOLERANCE
    training = [k for k in two_history if not k.startswith("val_")]  # validation: below
    assert "loss" in training and "accuracy" in training
    one_training = {k: one_history[k] for k in training}
    gap = _history_gap(one_training, {k: two_history[k] for k in training})
    assert gap <= TOLERANCE, two_history


def _gru(devices):
    @kmk.distributed(global_batch_size=GLOBAL, devices=devices)
    def build() -> keras.Model:
        keras.utils.set_random_seed(6)
        model = keras.Sequential(
            [
                keras.Input((5,), dtype="int32"),
                keras.layers.Embedding(30, 4),
                keras.layers.GRU(6),
                keras.layers.Dense(1),
            ]
        )
        model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"])
        return model

    return build()


@pytest.mark.slow
def test_an_embedding_and_gru_regression_trains_like_one_replica_on_a_7_6_split():
    rng = np.random.default_rng(8)
    tokens = rng.integers(0, 30, size=(269, 5)).astype("int32")
    target = (tokens.sum(axis=1, keepdims=True) / 75.0).astype("float32")
    results = []
    for devices in (ONE, TWO):
        model = _gru(devices)
        history = model.fit(tokens, target, epochs=2, shuffle=False, verbose=0).history
        results.append((model, history, model.predict(tokens[:3], verbose=0)))
    assert _state_gap(results[0][0], results[1][0]) <= TOLERANCE
    assert _history_gap(results[0][1], results[1][1]) <= TOLERANCE, results[1][1]
    assert _gap(results[0][2], results[1][2]) <= TOLERANCE


@pytest.mark.slow
def test_validation_of_one_row_during_fit_equals_one_replica(cnn_runs):
    """The runs of the 7/6 test above validate on 1 row (split 1/0) after each epoch."""
    histories = [history for _, history in cnn_runs]
    assert len(histories[1]["val_loss"]) == 2  # the 1-row validation ran after each epoch
    assert _history_gap(*histories) <= TOLERANCE, histories


@pytest.mark.parametrize(
    ("data", "last"),
    [
        (lambda: (X[:193], Y[:193]), 1),  # arrays: 3 batches of 64, then 1 row
        (lambda: (tf.data.Dataset.from_tensor_slices((X[:65], Y[:65])).batch(GLOBAL),), 1),
        (lambda: (kmk.make_dataset(X[:65], Y[:65], GLOBAL, seed=0),), 1),  # its defaults
    ],
)
def test_training_on_a_part_with_no_rows_is_refused_before_any_step(data, last):
    model = _dnn(TWO)
    with pytest.raises(
        ValueError,
        match=rf"last batch holds {last} samples.*\[1, 0\].*make_dataset\(\.\.\., "
        r"drop_remainder=True\)",
    ):
        model.fit(*data(), epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0


@pytest.mark.slow
def test_a_pipeline_of_unknown_length_reaching_an_empty_part_stops_with_the_kits_message():
    """`filter` hides the length, so nothing is refused before the first step; the step
    that would leave a replica without rows fails with the kit's message instead."""
    model = _dnn(TWO)
    dataset = (
        tf.data.Dataset.from_tensor_slices((X[:65], Y[:65])).filter(lambda x, y: True).batch(64)
    )
    with pytest.raises(tf.errors.InvalidArgumentError, match="a replica received no samples"):
        model.fit(dataset, epochs=1, verbose=0)


def test_replica_parts_is_how_tf_distribute_splits_a_batch():
    strategy = tf.distribute.MirroredStrategy(TWO)
    for samples in (1, 2, 3, 13, 33):
        dataset = tf.data.Dataset.range(samples).batch(GLOBAL)
        element = next(iter(strategy.experimental_distribute_dataset(dataset)))
        parts = [int(t.shape[0]) for t in strategy.experimental_local_results(element)]
        assert parts == replica_parts(samples, 2), samples
    assert replica_parts(9, 4) == [3, 3, 3, 0]
    assert replica_parts(13, 4) == [4, 4, 4, 1]


def test_the_empty_conv_probe_answers_on_this_hosts_kernels():
    assert isinstance(keras_replica_shares.probe_empty_conv(), bool)


@pytest.mark.slow
def test_with_onednn_off_the_probe_and_the_empty_part_tests_see_the_reference_kernels():
    """One child with oneDNN off: the empty-part tests (the 1-row cases of evaluate and
    predict here and in `test_uneven_evaluation.py`) pass on TensorFlow's reference kernels
    too, and the probe says those kernels are right (it says whichever this host's kernels
    do with oneDNN on: True on the AMD EPYC hosts of the issue)."""
    tests = [  # 1 row: the second replica's part is empty (the sizes that leave one)
        "tests/test_uneven_training.py::test_evaluate_and_predict_never_compute_on_an_empty_part[1]",
        "tests/test_uneven_evaluation.py::test_predict_returns_every_row_in_order_on_two_replicas[1]",
        "tests/test_uneven_evaluation.py::test_evaluate_on_two_replicas_equals_one_replica[1]",
    ]
    proc = run_python(
        "import sys, pytest\n"
        f"rc = pytest.main(['-q', '-p', 'no:cacheprovider', '-p', 'no:xdist', *{tests!r}])\n"
        "from keras_mirror_kit.workarounds.keras_replica_shares import probe_empty_conv\n"
        "print('PROBE', probe_empty_conv())\n"  # after the test bed split the CPU
        "sys.exit(rc)\n",
        env={"TF_ENABLE_ONEDNN_OPTS": "0"},
        cwd=REPO,
        timeout=600,
    )
    assert f"{len(tests)} passed" in proc.stdout, proc.stdout[-2000:]
    assert "failed" not in proc.stdout, proc.stdout[-2000:]
    assert "PROBE False" in proc.stdout, proc.stdout[-2000:]


# -- stateful layers -----------------------------------------------------------------------


@pytest.mark.slow
def test_a_stateful_rnn_on_two_replicas_is_refused_when_built():
    def factory():
        model = keras.Sequential(
            [
                keras.Input(batch_shape=(GLOBAL, 5, 3)),
                keras.layers.LSTM(4, stateful=True),
                keras.layers.Dense(1),
            ]
        )
        model.compile("adam", "mse")
        return model

    with pytest.raises(ValueError, match=r"stateful layers \(lstm.*stateful=False"):
        kmk.distributed(global_batch_size=GLOBAL, devices=TWO)(factory)()
    model = kmk.distributed(global_batch_size=GLOBAL, devices=ONE)(factory)()
    model.fit(np.zeros((GLOBAL, 5, 3)), np.zeros((GLOBAL, 1)), epochs=1, verbose=0)


def test_activity_regularizers_are_refused_where_keras_sums_them(monkeypatch):
    def build(devices):
        @kmk.distributed(global_batch_size=GLOBAL, devices=devices)
        def factory() -> keras.Model:
            model = keras.Sequential(
                [
                    keras.Input((8,)),
                    keras.layers.Dense(4, activity_regularizer=keras.regularizers.L1(1e-4)),
                ]
            )
            model.compile(optimizer="sgd", loss="mse")
            return model

        return factory()

    # Keras 3.14 divides it by the batch size.
    assert SUMS == versions.keras_version_in(((3, 0, 0), (3, 14, 0)))
    monkeypatch.setattr(keras_activity_regularizer_sum, "sums_over_the_batch", lambda: True)
    with pytest.raises(ValueError, match=r"activity_regularizer \(dense.*replicas=2") as info:
        build(TWO)
    assert f"keras=={keras.__version__}" in str(info.value) and "Keras >= 3.14" in str(info.value)
    build(ONE)  # one replica: one device's sum
    monkeypatch.setattr(keras_activity_regularizer_sum, "sums_over_the_batch", lambda: False)
    build(TWO)  # a mean over each replica's part: the kit weighs it exactly
