"""`with kmk.distributed(...)`: the same guarantees as the decorator, per thread."""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mirror_kit as kmk
from keras_mirror_kit import with_block
from keras_mirror_kit.model_setup import is_prepared
from keras_mirror_kit.workarounds import tf_data_iterator_stall
from tests import models
from tests.ckpt_helpers import CountBatches

X = np.random.default_rng(0).normal(size=(64, 6)).astype("float32")
Y = (X[:, 0] > 0).astype("int32")


def test_a_model_compiled_in_the_block_gets_the_decorators_guarantees():
    config = kmk.distributed(per_replica_batch_size=8, mixed_precision="mixed_bfloat16")
    with config as dist:
        model = models.sequential()
        model.compile(
            optimizer="sgd",
            steps_per_execution=4,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    assert is_prepared(model) and kmk.distribution_of(model) is dist
    assert tf_data_iterator_stall.is_applied(model)
    assert model.layers[-1].compute_dtype == "float32"  # outputs kept in float32
    assert model.layers[0].compute_dtype == "bfloat16"
    data = kmk.make_dataset(X, Y, dist.global_batch_size, seed=0).repeat()
    counter = CountBatches()
    with pytest.raises(ValueError, match="steps_per_epoch=6 is not a multiple"):
        model.fit(data, steps_per_epoch=6, epochs=1, verbose=0, callbacks=[counter])
    assert counter.batches == 0 and int(model.optimizer.iterations.numpy()) == 0


def test_a_model_built_before_the_block_and_compiled_in_it_is_rejected_at_compile():
    model = models.sequential()  # no strategy: it would train on one device
    with kmk.distributed(per_replica_batch_size=8):
        with pytest.raises(ValueError, match="created outside the strategy's scope"):
            model.compile(optimizer="sgd", loss="mse")
    assert not is_prepared(model)


def test_fit_in_the_block_of_a_model_built_elsewhere_is_refused_by_the_kits_callbacks():
    model = models.compile_sgd(models.sequential())  # built and compiled outside
    data = tf.data.Dataset.from_tensor_slices((X, Y)).batch(16)
    counter = CountBatches()
    with kmk.distributed(per_replica_batch_size=8):
        with pytest.raises(ValueError, match="not built under its strategy"):
            model.fit(
                data,
                epochs=1,
                verbose=0,
                callbacks=[kmk.ThroughputMonitor(global_batch_size=16), counter],
            )
    assert counter.batches == 0


@pytest.mark.slow
def test_a_model_compiled_after_the_block_gets_a_warning_from_the_callbacks(caplog):
    with kmk.distributed(per_replica_batch_size=8) as dist:
        model = models.sequential()
    model.compile(
        optimizer="sgd",  # outside the block: Keras' plain compile
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    assert not is_prepared(model)
    data = kmk.make_dataset(X, Y, dist.global_batch_size, seed=0)
    with caplog.at_level(logging.WARNING, logger="keras_mirror_kit"):
        model.fit(data, epochs=1, verbose=0, callbacks=[kmk.ThroughputMonitor()])
    assert any("compiled outside its `with` block" in r.getMessage() for r in caplog.records)


def test_compile_in_another_thread_is_not_touched_by_this_threads_block():
    built = {}
    entered, done = threading.Event(), threading.Event()

    def other_thread():
        entered.wait(30)
        built["model"] = models.compile_sgd(models.sequential())
        done.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    with kmk.distributed(per_replica_batch_size=8):
        entered.set()
        assert done.wait(60)
    thread.join(30)
    assert not is_prepared(built["model"]) and kmk.distribution_of(built["model"]) is None


def test_entering_leaves_no_scope_behind_when_a_later_context_fails(monkeypatch):
    @contextmanager
    def failing(*_args, **_kwargs):
        raise RuntimeError("a later context failed")
        yield  # pragma: no cover

    monkeypatch.setattr(with_block, "_compiled_models_prepared", failing)
    config = kmk.distributed(per_replica_batch_size=8)
    with pytest.raises(RuntimeError, match="a later context failed"):
        config.__enter__()
    assert not tf.distribute.has_strategy()  # the strategy scope was closed again
    with pytest.raises(RuntimeError, match="outside a distributed"):
        kmk.current()
    assert keras.config.dtype_policy().name == "float32"


def test_two_threads_in_one_distributed_object_each_close_their_own_block():
    config = kmk.distributed(per_replica_batch_size=8)
    order = [threading.Event() for _ in range(3)]
    results: dict[str, object] = {}

    def second():
        try:
            with config:
                order[0].set()  # 2nd thread is inside
                order[1].wait(30)  # ... until the main thread has left its block
                results["inside"] = tf.distribute.has_strategy()
            results["after"] = tf.distribute.has_strategy()
        except BaseException as err:  # noqa: BLE001  (reported below)
            results["error"] = err
        finally:
            order[2].set()

    with config:
        thread = threading.Thread(target=second)
        thread.start()
        assert order[0].wait(30)
    # The main thread's exit must close the main thread's scope, not the other thread's.
    assert not tf.distribute.has_strategy()
    order[1].set()
    assert order[2].wait(30)
    thread.join(30)
    assert results == {"inside": True, "after": False}
