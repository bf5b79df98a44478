"""The knobs: synchronized BatchNorm, mixed precision and steps_per_execution (2 replicas).

The steps_per_execution=4 model of the factory serves the three tests of its checks (counts
are taken relative to its steps before) and resumes the checkpoint of steps_per_execution=4;
the checkpoint-resume cases share one uninterrupted run (steps_per_execution changes no
arithmetic: 3 and 4 end on the same weights, bit for bit), whose model, set back to its
initial state, also makes the crashed run of steps_per_execution=4.
"""

from __future__ import annotations

from typing import NamedTuple

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mirror_kit as kmk
from keras_mirror_kit.callbacks.synced_checkpoint import SyncedCheckpoint
from keras_mirror_kit.upstream import keras_private
from tests.ckpt_helpers import CountBatches, max_diff, set_back

RNG = np.random.default_rng(0)
X = RNG.normal(size=(256, 6)).astype("float32") * np.arange(1, 7, dtype="float32")
Y = ((X[:, 0] > 0).astype("int32") + (X[:, 1] > 0)).astype("int32")


def bn_factory(devices=None, sync=False):
    @kmk.distributed(global_batch_size=32, devices=devices, sync_batch_norm=sync)
    def build():
        keras.utils.set_random_seed(1)
        inner = keras.Sequential(
            [keras.layers.Dense(8), keras.layers.BatchNormalization()], name="nested"
        )
        inputs = keras.Input((6,))
        hidden = keras.layers.BatchNormalization(name="bn_in")(inputs)
        hidden = inner(hidden)
        outputs = keras.layers.Dense(3)(keras.layers.ReLU()(hidden))
        model = keras.Model(inputs, outputs)
        model.compile(
            optimizer=keras.optimizers.SGD(0.05),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return model

    return build


def batch_norms(model):
    layers = model._flatten_layers()  # noqa: SLF001
    return [la for la in layers if isinstance(la, keras.layers.BatchNormalization)]


def train_bn(devices, sync, initial=None):
    model = bn_factory(devices, sync)()
    if initial is not None:
        model.set_weights(initial)
    start = [w.copy() for w in model.get_weights()]
    model.fit(kmk.make_dataset(X, Y, 32, seed=4), epochs=1, verbose=0)  # 8 steps
    return model, start


def replica_gap(model, variable):
    copies = model.distribute_strategy.experimental_local_results(variable.value)
    return float(np.max(np.abs(np.asarray(copies[0]) - np.asarray(copies[1]))))


@pytest.mark.slow
def test_sync_batch_norm_reaches_nested_and_functional_layers_and_matches_one_replica():
    unsynced, start = train_bn(None, sync=False)
    assert not any(bn.synchronized for bn in batch_norms(unsynced))
    gaps = [replica_gap(unsynced, bn.moving_mean) for bn in batch_norms(unsynced)]
    assert max(gaps) > 1e-3  # the default: statistics drift apart per replica

    synced, _ = train_bn(None, sync=True, initial=start)
    layers = batch_norms(synced)
    assert len(layers) == 2 and all(bn.synchronized for bn in layers)
    for bn in layers:
        for stat in (bn.moving_mean, bn.moving_variance):
            assert replica_gap(synced, stat) == 0.0  # identical across replicas

    single, _ = train_bn(["/cpu:0"], sync=False, initial=start)
    for a, b in zip(batch_norms(single), layers):
        np.testing.assert_allclose(a.moving_mean.numpy(), b.moving_mean.numpy(), atol=1e-5)
        np.testing.assert_allclose(
            a.moving_variance.numpy(), b.moving_variance.numpy(), rtol=1e-5, atol=1e-5
        )
    assert max_diff(single.get_weights(), synced.get_weights()) < 1e-5


def test_sync_batch_norm_survives_saving(tmp_path):
    model = bn_factory(sync=True)()
    model.save(tmp_path / "m.keras")
    reloaded = keras.saving.load_model(tmp_path / "m.keras")
    assert all(bn.synchronized for bn in batch_norms(reloaded))


def test_a_layer_named_like_batch_norm_is_left_alone_with_a_warning(caplog):
    """Only real BatchNormalization layers are converted; a look-alike is no error."""

    class MyBatchNorm(keras.layers.Layer):
        def call(self, x):
            return x

    @kmk.distributed(per_replica_batch_size=4, sync_batch_norm=True)
    def build():
        return keras.Sequential(
            [keras.Input((3,)), MyBatchNorm(name="custom_bn"), keras.layers.BatchNormalization()]
        )

    with caplog.at_level("WARNING", logger="keras_mirror_kit"):
        model = build()
    assert [la.synchronized for la in batch_norms(model)] == [True]
    warned = [r.getMessage() for r in caplog.records if "'custom_bn'" in r.getMessage()]
    assert len(warned) == 1 and "statistics stay per replica" in warned[0]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_for_the_factory_only(policy):
    @kmk.distributed(per_replica_batch_size=32, mixed_precision=policy)
    def build():
        model = kmk.models.tutorial_cnn()
        model.compile(
            optimizer=keras.optimizers.Adam(2e-3),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
        return model

    before = keras.config.dtype_policy().name
    keras.utils.set_random_seed(0)  # unseeded, the accuracy after 3 epochs ranged 0.34-0.44
    model = build()
    assert keras.config.dtype_policy().name == before == "float32"  # restored
    compute = policy.split("_")[1]
    conv, output = model.layers[0], model.layers[-1]
    assert conv.compute_dtype == compute and conv.dtype_policy.name == policy
    assert output.compute_dtype == "float32"  # the softmax keeps its range
    assert all(v.dtype == "float32" for v in model.weights)  # variables stay float32
    is_scaled = isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert is_scaled == (policy == "mixed_float16")
    other = keras.layers.Dense(2)
    assert other.compute_dtype == "float32"  # layers built elsewhere are untouched

    # bfloat16 arithmetic is slow on a CPU: a few steps show it learns (chance is 0.1).
    (x, y), (xt, yt) = kmk.datasets.make_synthetic_cifar10(1024, 256, seed=1)
    train = kmk.make_dataset(x, y, 64, seed=0, preprocess=kmk.rescale())
    model.fit(train, epochs=3, verbose=0)
    assert model(kmk.rescale()(xt[:4])).dtype == "float32"
    _, accuracy = model.evaluate(
        kmk.make_dataset(xt, yt, 64, shuffle=False, preprocess=kmk.rescale()), verbose=0
    )
    assert accuracy > 0.3, accuracy  # converges (chance is 0.1)


def test_bad_mixed_precision_and_steps_arguments():
    with pytest.raises(ValueError, match="mixed_precision='float16'"):
        kmk.distributed(8, mixed_precision="float16")
    with pytest.raises(ValueError, match="steps_per_execution='many'"):
        kmk.distributed(8, steps_per_execution="many")
    with pytest.raises(ValueError, match="steps_per_execution=0"):
        kmk.distributed(8, steps_per_execution=0)


def test_the_with_form_applies_sync_batch_norm_and_steps_per_execution():
    with kmk.distributed(8, sync_batch_norm=True, steps_per_execution=4):
        model = keras.Sequential(
            [keras.Input((3,)), keras.layers.BatchNormalization(), keras.layers.Dense(1)]
        )
        model.compile("sgd", "mse")
    assert [la.synchronized for la in batch_norms(model)] == [True]
    assert model.steps_per_execution == 4


def spe_factory(steps, compile_steps=1, optimizer="adam"):
    @kmk.distributed(global_batch_size=16, steps_per_execution=steps)
    def build():
        keras.utils.set_random_seed(3)
        model = keras.Sequential(
            [keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(0.01)
            if optimizer == "adam"
            else keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=compile_steps,
        )
        return model

    return build


@pytest.fixture(scope="module")
def spe4_model():
    """`spe_factory(4)()`, shared by the tests of steps_per_execution's checks."""
    return spe_factory(4)()


def _steps(model) -> int:
    return int(model.optimizer.iterations.numpy())


@pytest.mark.slow
def test_steps_per_execution_is_picked_up_by_the_factorys_compile(tmp_path, spe4_model):
    model = spe4_model
    assert model.steps_per_execution == 4
    assert spe_factory("auto")().steps_per_execution == 8
    assert spe_factory(None, compile_steps=3)().steps_per_execution == 3
    with pytest.raises(ValueError, match="Pass it in one place only"):
        spe_factory(4, compile_steps=3)()
    before = _steps(model)
    model.fit(kmk.make_dataset(X, Y, 16, seed=0), epochs=1, verbose=0)
    assert _steps(model) == before + 16  # 256 / 16, partial execution ok
    model.save(tmp_path / "m.keras")
    assert keras.saving.load_model(tmp_path / "m.keras").steps_per_execution == 4


def test_keras_still_rounds_epochs_up():
    """The Keras 3.15 bug the guard exists for (plain Keras, no kit). If this fails, Keras
    fixed it: limit keras_mirror_kit.workarounds.keras_epoch_rounding to the affected versions."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse", steps_per_execution=4)
    data = tf.data.Dataset.from_tensor_slices((np.ones((40, 3)), np.ones((40, 1)))).batch(2)
    model.fit(data.repeat(), steps_per_epoch=10, epochs=2, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 24  # not 20


@pytest.mark.slow
def test_steps_per_epoch_that_keras_would_round_up_is_rejected_before_training(spe4_model):
    model, counter = spe4_model, CountBatches()
    data = kmk.make_dataset(X, Y, 16, seed=0).repeat()
    before = _steps(model)
    with pytest.raises(ValueError, match="steps_per_epoch=10 is not a multiple") as info:
        model.fit(data, steps_per_epoch=10, epochs=1, verbose=0, callbacks=[counter])
    assert "steps_per_epoch=8 or 12" in str(info.value) and counter.batches == 0
    assert _steps(model) == before
    model.fit(data, steps_per_epoch=12, epochs=2, verbose=0)
    assert _steps(model) == before + 24


class EvaluatedSteps(keras.callbacks.Callback):
    """Evaluation steps run, from the index Keras reports at each execution's end."""

    def __init__(self) -> None:
        super().__init__()
        self.test_batches = 0

    def on_test_begin(self, logs=None):
        self.test_batches = 0

    def on_test_batch_end(self, batch, logs=None):
        # Keras 3.10 reports an execution's first step, 3.11+ its last.
        spe = self.model.steps_per_execution
        self.test_batches = keras_private.last_step_of_execution(batch, spe) + 1


def test_keras_still_rounds_evaluation_steps_up():
    """The same Keras 3.15 bug in evaluate(steps=) and fit(validation_steps=) (plain Keras)."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse", steps_per_execution=4)
    data = tf.data.Dataset.from_tensor_slices((np.ones((40, 3)), np.ones((40, 1)))).batch(2)
    counter = EvaluatedSteps()
    model.evaluate(data.repeat(), steps=10, verbose=0, callbacks=[counter])
    assert counter.test_batches == 12  # not 10
    counter = EvaluatedSteps()
    model.fit(
        data.repeat(),
        steps_per_epoch=4,
        epochs=1,
        validation_data=data.repeat(),
        validation_steps=10,
        verbose=0,
        callbacks=[counter],
    )
    assert counter.test_batches == 12  # not 10


@pytest.mark.slow
def test_evaluation_steps_that_keras_would_round_up_are_rejected_before_any_step(spe4_model):
    model = spe4_model
    data = kmk.make_dataset(X, Y, 16, seed=0).repeat()
    counter, steps, before = CountBatches(), EvaluatedSteps(), _steps(spe4_model)
    with pytest.raises(ValueError, match="steps=10 is not a multiple") as info:
        model.evaluate(data, steps=10, verbose=0, callbacks=[counter, steps])
    assert "steps=8 or 12" in str(info.value)
    with pytest.raises(ValueError, match="validation_steps=6 is not a multiple"):
        model.fit(
            data,
            steps_per_epoch=8,
            epochs=1,
            validation_data=data,
            validation_steps=6,
            verbose=0,
            callbacks=[counter, steps],
        )
    assert counter.batches == steps.test_batches == 0
    assert _steps(model) == before
    model.evaluate(data, steps=8, verbose=0, callbacks=[steps])
    assert steps.test_batches == 8


def _resume_data():
    return kmk.make_dataset(X, Y, 16, seed=9)


@pytest.fixture(scope="module")
def spe4_fresh():
    """`spe4_fresh()`: the module's `spe_factory(4)()` for runs from scratch, set back at
    each call to the weights and optimizer state it was built with (its optimizer built at
    once, so that there is a state to set back): it trains as a new one would, bit for bit."""
    return set_back(spe_factory(4)())  # seed 3: as spe_factory's build()


class Uninterrupted(NamedTuple):
    weights: list[np.ndarray]
    steps: int  # the optimizer's iterations at the end


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, spe4_fresh):
    """3 epochs with steps_per_execution=4 and a checkpoint every execution, uninterrupted:
    the weights both resumed runs below must end on."""
    reference, ds = spe4_fresh(), _resume_data()
    directory = tmp_path_factory.mktemp("uninterrupted")
    reference.fit(
        ds, epochs=3, verbose=0, callbacks=[SyncedCheckpoint(directory, dataset=ds, save_freq=4)]
    )
    return Uninterrupted(reference.get_weights(), _steps(reference))


@pytest.mark.slow
@pytest.mark.parametrize(("steps", "resume_at"), [(4, (2, 12)), (3, (2, 0))])
def test_checkpoint_resume_is_exact_with_steps_per_execution(
    tmp_path, uninterrupted, spe4_fresh, spe4_model, steps, resume_at
):
    """16 batches per epoch: with 4 steps per execution the resume is mid-epoch; with 3 (16
    is no multiple of 3) it starts at the newest epoch boundary. Both end equal to the
    uninterrupted run (4 steps per execution: 3 would end on the same weights). With 4,
    the crashed run is `spe4_fresh`'s and `spe4_model` resumes; with 3, new models."""
    data, reference = _resume_data, uninterrupted
    assert reference.steps == 48

    class Crash(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations.numpy()) >= 32 + 9:
                raise KeyboardInterrupt

    crashed, ds = (spe4_fresh() if steps == 4 else spe_factory(steps)()), data()
    with pytest.raises(KeyboardInterrupt):
        crashed.fit(
            ds,
            epochs=3,
            verbose=0,
            callbacks=[SyncedCheckpoint(tmp_path / "run", dataset=ds, save_freq=steps), Crash()],
        )
    resumed, ds = (spe4_model if steps == 4 else spe_factory(steps)()), data()
    resumed.set_weights([w * 0 for w in resumed.get_weights()])
    checkpoint = SyncedCheckpoint(tmp_path / "run", dataset=ds, save_freq=steps)
    resumed.fit(ds, epochs=3, verbose=0, callbacks=[checkpoint])
    meta = checkpoint.last_restored.meta
    assert (meta["epoch"], meta["step"]) == resume_at
    assert int(resumed.optimizer.iterations.numpy()) == 48
    assert max_diff(reference.weights, resumed.get_weights()) <= 1e-6
