"""make_dataset's `preprocess` on each replica (issue 17, item 8), on 2 logical CPU replicas.

Models the kit built receive the stored dtype (uint8) and cast on each replica; the results
must be those of host preprocessing, and every other consumer keeps host preprocessing. The
host-preprocessed run is made once (without steps_per_execution, which changes no
arithmetic) and compared with each replica-preprocessed run.
"""

from __future__ import annotations

import functools
import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mirror_kit as kmk
from keras_mirror_kit.callbacks.synced_checkpoint import SyncedCheckpoint
from keras_mirror_kit.data import preprocess_placement, replica_variant
from tests.ckpt_helpers import StopAt

N, PER_REPLICA = 64, 8  # 2 replicas: global batch 16, 4 steps per epoch
RNG = np.random.default_rng(0)
X = RNG.integers(0, 256, size=(N, 4, 4, 3), dtype=np.uint8)
Y = (X.reshape(N, -1).astype("float32").mean(axis=1) > 127.5).astype("int32")
X_VAL, Y_VAL = X[:40], Y[:40]  # 40 = 2 full batches and one of 8 (4 per replica)


def layers(built: bool = True) -> list:
    head = [keras.Input((4, 4, 3))] if built else []
    return [
        *head,
        keras.layers.Flatten(),
        keras.layers.Dense(6, activation="relu"),
        keras.layers.Dense(2),
    ]


def compile_model(model: keras.Model) -> keras.Model:
    model.compile(
        optimizer=keras.optimizers.SGD(0.5, momentum=0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def kit_model(steps_per_execution: int | None = None, seed: int = 1, model_layers=None):
    @kmk.distributed(per_replica_batch_size=PER_REPLICA, steps_per_execution=steps_per_execution)
    def build():
        keras.utils.set_random_seed(seed)
        return compile_model(keras.Sequential(model_layers() if model_layers else layers()))

    model = build()
    assert build.distribution.num_replicas == 2
    return model


def training(preprocess_on: str, preprocess=None):
    """The training set (shuffled, seed 3) with `preprocess` (default: rescale) there."""
    return kmk.make_dataset(
        X, Y, 2 * PER_REPLICA, seed=3, preprocess=preprocess or kmk.rescale(),
        preprocess_on=preprocess_on,
    )  # fmt: skip


def datasets(preprocess_on: str, preprocess=None):
    """`training(...)` and the validation set (40 samples, in order)."""
    preprocess = preprocess or kmk.rescale()
    train = training(preprocess_on, preprocess)
    val = kmk.make_dataset(
        X_VAL, Y_VAL, 2 * PER_REPLICA, shuffle=False, preprocess=preprocess,
        preprocess_on=preprocess_on,
    )  # fmt: skip
    return train, val


def run(model, preprocess_on: str):
    train, val = datasets(preprocess_on)
    history = model.fit(train, validation_data=val, epochs=2, verbose=0)
    evaluated = model.evaluate(val, verbose=0, return_dict=True)
    predicted = model.predict(val, verbose=0)
    return model.get_weights(), history.history, evaluated, predicted


def max_gap(first, second) -> float:
    return max(float(np.max(np.abs(a - b))) for a, b in zip(first, second))


class Probe:
    """A preprocess that records the dtype it is traced with inside a 2-replica step."""

    def __init__(self) -> None:
        self.traces = 0
        self.replica_dtypes: list[tf.DType] = []

    def __call__(self, x):
        self.traces += 1
        context = tf.distribute.get_replica_context()
        if context is not None and context.num_replicas_in_sync == 2:
            self.replica_dtypes.append(x.dtype)
        return tf.cast(x, "float32") * (1.0 / 255.0)


@pytest.fixture(scope="module")
def host_run():
    """`run` of a kit-built model on host-preprocessed data: what every replica run must give."""
    return run(kit_model(), "host")


@pytest.mark.slow
@pytest.mark.parametrize("steps_per_execution", [None, 2])
def test_fit_evaluate_predict_give_what_host_preprocessing_gives(host_run, steps_per_execution):
    host = host_run
    replica = run(kit_model(steps_per_execution), "auto")  # the default: rescale() moves
    assert max_gap(host[0], replica[0]) <= 1e-6
    assert max_gap(host[0], kit_model(steps_per_execution).get_weights()) > 1e-3  # it trained
    for key, values in host[1].items():  # loss, accuracy, val_loss, val_accuracy per epoch
        np.testing.assert_allclose(replica[1][key], values, rtol=1e-6, atol=1e-7, err_msg=key)
    assert host[2].keys() == replica[2].keys()
    for key, value in host[2].items():
        assert replica[2][key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
    assert replica[3].shape == (40, 2) and max_gap([host[3]], [replica[3]]) <= 1e-6


@pytest.mark.slow
def test_the_replica_step_receives_the_stored_dtype():
    train = training("auto")
    assert preprocess_placement(train) == "replica"
    assert train.element_spec[0].dtype == tf.float32  # what any other consumer iterates
    assert replica_variant(train).dataset().element_spec[0].dtype == tf.uint8
    assert preprocess_placement(training("host")) == "host"
    assert preprocess_placement(kmk.make_dataset(X, Y, 16, seed=0)) is None

    probe = Probe()
    train = training("replica", probe)
    kit_model().fit(train, epochs=1, verbose=0)
    assert probe.replica_dtypes and set(probe.replica_dtypes) == {tf.uint8}

    host_probe = Probe()
    kit_model().fit(training("host", host_probe), epochs=1, verbose=0)
    assert host_probe.replica_dtypes == []  # ran in the input pipeline only

    block_probe = Probe()  # the `with` form prepares the models compiled in the block
    with kmk.distributed(per_replica_batch_size=PER_REPLICA):
        model = compile_model(keras.Sequential(layers()))
    model.fit(training("replica", block_probe), epochs=1, verbose=0)
    assert block_probe.replica_dtypes and set(block_probe.replica_dtypes) == {tf.uint8}


@pytest.mark.slow
def test_a_plain_keras_model_keeps_host_preprocessing():
    def plain(seed=1):
        keras.utils.set_random_seed(seed)
        return compile_model(keras.Sequential(layers()))

    probe = Probe()
    train = training("replica", probe)
    traced_by_the_pipeline = probe.traces
    model = plain()
    model.fit(train, epochs=2, verbose=0)
    assert probe.traces == traced_by_the_pipeline  # the model's steps never applied it
    reference = plain()
    reference.fit(training("host"), epochs=2, verbose=0)
    assert max_gap(model.get_weights(), reference.get_weights()) <= 1e-6
    # Iterating it yourself gives the host-preprocessed batches.
    first_x, _ = next(iter(training("auto")))
    assert first_x.dtype == tf.float32 and float(tf.reduce_max(first_x)) <= 1.0


@pytest.mark.slow
def test_the_model_is_built_for_what_preprocess_returns():
    """Keras builds an unbuilt model from the first batch: it must see preprocess's output."""

    def flatten_and_scale(x):  # (batch, 4, 4, 3) uint8 -> (batch, 48) float32
        return tf.reshape(tf.cast(x, "float32") / 255.0, [-1, 48])

    model = kit_model(model_layers=lambda: [keras.layers.Dense(5), keras.layers.Dense(2)])
    assert not model.built
    train, val = datasets("replica", flatten_and_scale)
    model.fit(train, validation_data=val, epochs=1, verbose=0)
    assert tuple(model.layers[0].kernel.shape) == (48, 5)
    assert model.predict(val, verbose=0).shape == (40, 2)


@pytest.mark.slow
def test_compiled_functions_are_reused_and_never_leak_outside_the_kit_call():
    probe = Probe()
    model = kit_model()
    train = training("replica", probe)
    model.fit(train, epochs=1, verbose=0)
    traces = probe.traces
    model.fit(train, epochs=1, verbose=0)
    assert probe.traces == traces  # the step compiled for the probe was kept, not retraced
    # Outside fit the model runs Keras' own step: train_on_batch on host-preprocessed data
    # must not scale it twice. Same for a host-mode twin of the model.
    twin, host = kit_model(), training("host")
    for _ in range(2):  # the same epochs' orders (each fit also iterates once to build)
        twin.fit(host, epochs=1, verbose=0)
    batch = (X[:16].astype("float32") / 255.0, Y[:16])
    assert max_gap(model.get_weights(), twin.get_weights()) <= 1e-6
    first = model.train_on_batch(*batch, return_dict=True)
    second = twin.train_on_batch(*batch, return_dict=True)
    assert first["loss"] == pytest.approx(second["loss"], rel=1e-6)
    assert max_gap(model.get_weights(), twin.get_weights()) <= 1e-6
    assert probe.traces == traces
    with model.distribute_strategy.scope():  # a new compile() drops what was kept
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=model.loss)
    model.fit(train, epochs=1, verbose=0)
    assert probe.traces > traces


@pytest.mark.slow
def test_mid_epoch_resume_on_replicas_matches_an_uninterrupted_host_run(tmp_path):
    reference = kit_model()
    train = training("host")  # the order keyed on the fit epoch, as in the resumed run
    reference.fit(
        train, epochs=3, verbose=0, callbacks=[SyncedCheckpoint(tmp_path / "ref", dataset=train)]
    )

    crashed = kit_model()
    train = training("auto")
    with pytest.raises(KeyboardInterrupt):
        crashed.fit(
            train,
            epochs=3,
            verbose=0,
            callbacks=[
                SyncedCheckpoint(tmp_path / "run", save_freq=2, dataset=train),
                StopAt(1, 2),
            ],
        )
    resumed = kit_model(seed=99)
    train = training("auto")
    checkpoint = SyncedCheckpoint(tmp_path / "run", save_freq=2, dataset=train)
    resumed.fit(train, epochs=3, verbose=0, callbacks=[checkpoint])
    assert (checkpoint.last_restored.meta["epoch"], checkpoint.last_restored.meta["step"]) == (
        1,
        2,
    )
    assert int(resumed.optimizer.iterations.numpy()) == 12  # no batch trained twice
    assert max_gap(reference.get_weights(), resumed.get_weights()) <= 1e-6


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"preprocess_on": "gpu"}, "`preprocess_on` must be one of 'auto', 'host', 'replica'"),
        ({"preprocess_on": "replica"}, "no `preprocess` was given"),
    ],
)
def test_bad_preprocess_on_is_refused(kwargs, expected):
    with pytest.raises(ValueError, match="Received: ") as info:
        kmk.make_dataset(X, Y, 16, seed=0, **kwargs)
    assert expected in str(info.value)


@pytest.mark.slow
def test_a_step_replaced_after_the_kit_prepared_the_model(caplog):
    """Its own step would get uint8 unprocessed: host preprocessing ("auto"), or an error."""
    model = kit_model()
    model.train_step = functools.partial(type(model).train_step, model)  # Keras' own, unwrapped
    with caplog.at_level(logging.WARNING, logger="keras_mirror_kit"):
        model.fit(training("auto"), epochs=1, verbose=0)
    assert "`train_step` was replaced" in caplog.text and "runs on the host" in caplog.text
    reference = kit_model()
    reference.fit(training("host"), epochs=1, verbose=0)
    assert max_gap(model.get_weights(), reference.get_weights()) <= 1e-6

    steps = int(model.optimizer.iterations.numpy())
    with pytest.raises(ValueError, match="cannot run the `preprocess` of x=") as info:
        model.fit(training("replica", Probe()), epochs=1, verbose=0)
    assert "preprocess_on='host'" in str(info.value) and "stored uint8" in str(info.value)
    assert int(model.optimizer.iterations.numpy()) == steps  # refused before any step
