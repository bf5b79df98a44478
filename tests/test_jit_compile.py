"""`jit_compile=True` on several replicas: a clear refusal at compile(), never a raw crash."""

from __future__ import annotations

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mirror_kit as kmk
from keras_mirror_kit.workarounds import keras_jit_replicas

ONE, TWO = ["/cpu:0"], ["/cpu:0", "/cpu:1"]


def _factory(devices, jit_compile):
    @kmk.distributed(per_replica_batch_size=8, devices=devices)
    def build():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
        model.compile("sgd", "sparse_categorical_crossentropy", jit_compile=jit_compile)
        return model

    return build


def _data():
    return np.zeros((32, 4), "float32"), np.zeros(32, "int32")


def test_jit_compile_on_two_replicas_is_refused_at_compile_naming_the_cause():
    with pytest.raises(ValueError) as info:
        _factory(TWO, True)()
    message = str(info.value)
    assert "jit_compile=True" in message and "replicas=2" in message
    assert keras_jit_replicas.UPSTREAM in message


def test_jit_compile_set_after_compile_is_refused_at_fit_before_any_step():
    model = _factory(TWO, False)()
    model.jit_compile = True
    with pytest.raises(ValueError, match="replicas=2"):
        model.fit(*_data(), epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0


def test_jit_compile_on_one_replica_trains():
    model = _factory(ONE, True)()
    assert model.jit_compile is True
    model.fit(*_data(), epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 4


def test_auto_without_xla_is_said_once_where_there_are_gpus(caplog, monkeypatch):
    class Compiled:
        name = "m"
        jit_compile = False

        class _compile_config:  # noqa: N801  (as Keras names it)
            config = {"jit_compile": "auto"}

    monkeypatch.setattr(keras_jit_replicas, "_noted", type(keras_jit_replicas._noted)())
    with caplog.at_level(logging.INFO, logger="keras_mirror_kit"):
        keras_jit_replicas.note_auto(Compiled(), has_gpus=False)  # CPU: off anyway
        assert not caplog.records
        keras_jit_replicas.note_auto(Compiled(), has_gpus=True)
        keras_jit_replicas.note_auto(Compiled(), has_gpus=True)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "jit_compile='auto'" in lines[0] and "no XLA" in lines[0]


def test_plain_keras_jit_still_fails_on_two_replicas():
    """The upstream bug (keras-team/keras#19005): when this test fails, Keras compiles the
    step over several replicas and the refusal can go."""
    with tf.distribute.MirroredStrategy(TWO).scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
        model.compile("sgd", "sparse_categorical_crossentropy", jit_compile=True)
    with pytest.raises(tf.errors.InvalidArgumentError):
        model.fit(*_data(), batch_size=16, epochs=1, verbose=0)
