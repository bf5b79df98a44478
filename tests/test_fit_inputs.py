"""The data given to fit/evaluate/predict of a kit-built model: checked before any step."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mirror_kit as kmk
from keras_mirror_kit.fit_inputs import dataset_batch_size
from tests import models
from tests.ckpt_helpers import CountBatches

X = np.random.default_rng(0).normal(size=(128, 6)).astype("float32")
Y = (X[:, 0] > 0).astype("int32")


@pytest.fixture(scope="module")
def kit_model():
    @kmk.distributed(per_replica_batch_size=8)  # 2 replicas: global batch 16
    def build():
        return models.compile_sgd(models.sequential())

    return build(), build.distribution


def plain(batch):
    return tf.data.Dataset.from_tensor_slices((X, Y)).batch(batch)


@pytest.mark.parametrize(
    ("dataset", "expected"),
    [
        (lambda: plain(16), 16),
        (lambda: plain(8).map(lambda x, y: (x * 2, y)).prefetch(2).repeat(), 8),
        (lambda: plain(16).cache().shuffle(4).take(3).with_options(tf.data.Options()), 16),
        (lambda: tf.data.Dataset.from_tensor_slices((X, Y)).padded_batch(4), 4),
        (lambda: kmk.make_dataset(X, Y, 32, seed=0), 32),
        (lambda: kmk.make_dataset(X, Y, 32, seed=0).repeat().prefetch(1), 32),
        (lambda: plain(16).unbatch().batch(4), 4),
        (lambda: plain(16).unbatch(), None),  # not batched any more: unknown
        (lambda: plain(16).rebatch(8), None),  # rebatch: not read
        (lambda: tf.data.Dataset.from_tensor_slices((X, Y)), None),
    ],
)
def test_the_batch_size_is_read_where_it_is_known(dataset, expected):
    assert dataset_batch_size(dataset()) == expected


@pytest.mark.slow
def test_a_dataset_batched_per_replica_is_refused_before_any_step(kit_model):
    model, dist = kit_model
    counter = CountBatches()
    with pytest.raises(ValueError, match="batched to 8 samples per step") as info:
        model.fit(plain(dist.per_replica_batch_size), epochs=1, verbose=0, callbacks=[counter])
    assert "global batch of 16 (8 per replica x 2 replicas)" in str(info.value)
    assert counter.batches == 0 and int(model.optimizer.iterations.numpy()) == 0
    with pytest.raises(ValueError, match="batched to 32 samples"):
        model.fit(kmk.make_dataset(X, Y, 32, seed=0), epochs=1, verbose=0)
    # Evaluation may use another batch size; the global one trains.
    model.evaluate(plain(32), verbose=0)
    model.fit(plain(dist.global_batch_size), epochs=1, verbose=0, callbacks=[counter])
    assert counter.batches == 128 // 16


def test_a_dataset_distributed_by_hand_is_refused_in_fit_evaluate_and_predict(kit_model):
    model, dist = kit_model
    distributed = dist.strategy.experimental_distribute_dataset(plain(16))
    start = int(model.optimizer.iterations.numpy())
    for call in (
        lambda: model.fit(distributed, epochs=1, verbose=0),
        lambda: model.fit(plain(16), validation_data=distributed, verbose=0),
        lambda: model.evaluate(distributed, verbose=0),
        lambda: model.predict(distributed, verbose=0),
    ):
        with pytest.raises(ValueError, match="already distributed over the replicas"):
            call()
    assert int(model.optimizer.iterations.numpy()) == start


def test_models_the_kit_did_not_build_are_not_checked():
    model = models.compile_sgd(models.sequential())
    model.fit(plain(8), epochs=1, verbose=0)  # any batch size: plain Keras
    assert int(model.optimizer.iterations.numpy()) == 128 // 8


def test_a_functional_model_built_in_the_block_gets_the_same_check():
    with kmk.distributed(global_batch_size=16):
        inputs = keras.Input((6,))
        model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match="batched to 64 samples"):
        model.fit(plain(64), epochs=1, verbose=0)


def test_a_partial_last_batch_on_several_workers_is_refused_before_any_step():
    from types import SimpleNamespace

    from keras_mirror_kit.fit_inputs import check_training_split

    x = np.zeros((20, 3), "float32")
    workers = SimpleNamespace(num_replicas=4, num_workers=2, global_batch_size=8)
    with pytest.raises(ValueError, match=r"last batch holds 4 of 8 samples, on 2 workers"):
        check_training_split({"x": x, "batch_size": 8}, workers, exact=True)
    check_training_split({"x": x[:16], "batch_size": 8}, workers, exact=True)  # whole batches
    one = SimpleNamespace(num_replicas=4, num_workers=1, global_batch_size=8)
    check_training_split({"x": x, "batch_size": 8}, one, exact=True)  # one process: exact
