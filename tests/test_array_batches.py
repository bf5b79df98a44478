"""The batch a kit-built model trains on is the one it was built for; the monitor counts it."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_mirror_kit as kmk
from tests import models

RNG = np.random.default_rng(0)
X = RNG.normal(size=(640, 6)).astype("float32")
Y = (X[:, 0] > 0).astype("int32")


class EvaluatedBatches(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.test_batches = 0

    def on_test_batch_end(self, batch, logs=None):
        self.test_batches = batch + 1


@pytest.fixture()
def model():
    @kmk.distributed(per_replica_batch_size=32)  # 2 replicas: global batch 64
    def build():
        return models.compile_sgd(models.sequential())

    return build()


def samples_per_step(monitor: kmk.ThroughputMonitor) -> float:
    figures = monitor.last
    return figures["samples_per_sec"] / figures["steps_per_sec"]


@pytest.mark.slow
def test_arrays_without_batch_size_train_at_the_global_batch_size(model):
    monitor = kmk.ThroughputMonitor(warmup_steps=0)
    model.fit(X, Y, epochs=1, verbose=0, callbacks=[monitor])
    assert int(model.optimizer.iterations.numpy()) == 640 // 64  # not 640 // 32
    assert samples_per_step(monitor) == pytest.approx(64)
    counter = EvaluatedBatches()
    model.evaluate(X, Y, verbose=0, callbacks=[counter])
    assert counter.test_batches == 640 // 64
    assert len(model.predict(X[:200], verbose=0)) == 200


@pytest.mark.slow
def test_a_batch_size_given_with_arrays_is_honoured_and_counted(model):
    monitor = kmk.ThroughputMonitor(warmup_steps=0)
    model.fit(X, Y, batch_size=32, epochs=1, verbose=0, callbacks=[monitor])
    assert int(model.optimizer.iterations.numpy()) == 640 // 32
    assert samples_per_step(monitor) == pytest.approx(32)
    assert monitor.summary()["global_batch_size"] == 32


@pytest.mark.slow
def test_a_smaller_last_array_batch_is_counted_exactly(model):
    monitor = kmk.ThroughputMonitor(warmup_steps=0)
    model.fit(X[:194], Y[:194], epochs=2, verbose=0, callbacks=[monitor])  # 64, 64, 64, 2
    assert int(model.optimizer.iterations.numpy()) == 8
    assert samples_per_step(monitor) == pytest.approx(194 / 4)
    summary = monitor.summary()
    assert summary["samples_per_sec"] / summary["steps_per_sec"] == pytest.approx(194 / 4)


@pytest.mark.slow
def test_validation_split_is_taken_out_before_counting(model):
    monitor = kmk.ThroughputMonitor(warmup_steps=0)
    # Keras trains on floor(330 * 0.8) = 264 samples: 4 batches of 64 and one of 8.
    model.fit(X[:330], Y[:330], validation_split=0.2, epochs=1, verbose=0, callbacks=[monitor])
    assert int(model.optimizer.iterations.numpy()) == 5
    assert samples_per_step(monitor) == pytest.approx(264 / 5)


class ArrayLike:
    """Not a NumPy array, but has `__array__` (like a pandas frame): Keras batches it."""

    def __init__(self, array: np.ndarray) -> None:
        self._array = array
        self.shape = array.shape

    def __array__(self, dtype=None, copy=None):
        return self._array if dtype is None else self._array.astype(dtype)

    def __len__(self) -> int:
        return len(self._array)


def test_array_likes_train_at_the_global_batch_size_too(model):
    monitor = kmk.ThroughputMonitor(warmup_steps=0)
    model.fit(ArrayLike(X[:640]), Y[:640], epochs=1, verbose=0, callbacks=[monitor])
    assert int(model.optimizer.iterations.numpy()) == 640 // 64  # not 640 // 32
    assert samples_per_step(monitor) == pytest.approx(64)


@pytest.mark.slow
def test_a_generator_batch_is_assumed_with_a_warning(model, caplog):
    def batches():
        for start in range(0, 640, 64):
            yield X[start : start + 64], Y[start : start + 64]

    monitor = kmk.ThroughputMonitor(warmup_steps=0)
    with caplog.at_level("WARNING", logger="keras_mirror_kit"):
        model.fit(batches(), epochs=1, steps_per_epoch=10, verbose=0, callbacks=[monitor])
    assert any("cannot be read" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_a_make_dataset_last_partial_batch_is_counted_exactly(model):
    data = kmk.make_dataset(X[:194], Y[:194], 64, seed=0)  # keeps the 2 left over
    monitor = kmk.ThroughputMonitor(warmup_steps=0)
    model.fit(data.prefetch(1), epochs=2, verbose=0, callbacks=[monitor])
    assert int(model.optimizer.iterations.numpy()) == 8
    assert samples_per_step(monitor) == pytest.approx(194 / 4)
    dropped = kmk.make_dataset(X[:194], Y[:194], 64, seed=0, drop_remainder=True)
    model.fit(dropped, epochs=1, verbose=0, callbacks=[monitor])
    assert samples_per_step(monitor) == pytest.approx(64)
