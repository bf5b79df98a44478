"""The multi-worker fit workaround touches Keras' private modules only for multi-worker runs."""

from __future__ import annotations

import pytest
import tensorflow as tf

from keras_mirror_kit.workarounds import keras_multi_worker_fit


def private_keras_is_gone():
    raise ImportError("no module named keras.src.backend.tensorflow.trainer")


def test_single_worker_strategies_never_look_at_private_keras(monkeypatch):
    monkeypatch.setattr(keras_multi_worker_fit, "_trainer_module", private_keras_is_gone)
    for strategy in (
        tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]),
        tf.distribute.get_strategy(),
    ):
        assert keras_multi_worker_fit.apply(strategy) is False


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_a_keras_without_the_wrapped_functions_gets_a_warning_not_a_crash(monkeypatch, mode):
    monkeypatch.setenv(keras_multi_worker_fit.ENV_VAR, mode)
    monkeypatch.setattr(keras_multi_worker_fit, "_trainer_module", private_keras_is_gone)
    monkeypatch.setattr(keras_multi_worker_fit, "is_multi_worker", lambda strategy: True)
    with pytest.warns(keras_multi_worker_fit.KerasWorkaroundWarning, match="was not installed"):
        assert keras_multi_worker_fit.apply(object()) is False
    assert keras_multi_worker_fit.is_applied() is False
