"""KerasTuner with a kit factory as the build function (the hypermodel), on 2 logical CPUs.

KerasTuner enters its `distribution_strategy`'s scope around the build function. Left
out, or given the kit's own strategy, every trial builds and trains on the kit's 2
replicas, with the kit's callbacks in `search(callbacks=)`; another strategy cannot hold
the kit's model, and `search` stops at the first trial with KerasTuner's fatal error,
which says what to pass (KerasTuner would otherwise mark each trial FAILED and return).
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest

import keras_mirror_kit as kmk

pytestmark = pytest.mark.slow  # two searches of two trials each

TWO = ["/cpu:0", "/cpu:1"]


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32")


@kmk.distributed(global_batch_size=16, devices=TWO)
def build_model(hp: Any) -> keras.Model:
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(hp.Int("units", 4, 8, step=4), activation="relu"),
            keras.layers.Dense(2),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(hp.Choice("learning_rate", [1e-2, 1e-3])),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


class Replicas(keras.callbacks.Callback):
    """Records each trial's replica count and the logs its epochs end with (KerasTuner
    deep-copies `search`'s callbacks for each trial: the copy is this one)."""

    def __init__(self) -> None:
        super().__init__()
        self.replicas: list[int] = []
        self.logs: list[set[str]] = []

    def __deepcopy__(self, memo: dict[int, Any]) -> Replicas:
        return self

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.replicas.append(self.model.distribute_strategy.num_replicas_in_sync)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.logs.append(set(logs or {}))


@pytest.mark.parametrize("strategy", ["left_out", "the_kits"])
def test_a_kit_factory_is_a_hypermodel_on_every_replica(tmp_path, strategy):
    import keras_tuner

    given = build_model.distribution.strategy if strategy == "the_kits" else None
    tuner = keras_tuner.RandomSearch(
        build_model,
        objective="loss",
        max_trials=2,
        seed=1,
        directory=str(tmp_path),
        distribution_strategy=given,
    )
    seen = Replicas()
    tuner.search(*data(), epochs=1, verbose=0, callbacks=[seen, kmk.ThroughputMonitor()])

    trials = tuner.oracle.get_best_trials(num_trials=2)
    assert [t.status for t in trials] == ["COMPLETED", "COMPLETED"]
    assert seen.replicas == [2, 2]
    # The monitor, listed last, ran before the callbacks listed before it.
    assert len(seen.logs) == 2 and all("samples_per_sec" in logs for logs in seen.logs)
    best = tuner.get_best_models(num_models=1)[0]
    assert best.distribute_strategy is build_model.distribution.strategy


def test_another_strategy_stops_the_search_saying_what_to_pass(tmp_path):
    import keras_tuner
    import tensorflow as tf

    tuner = keras_tuner.RandomSearch(
        build_model,
        objective="loss",
        max_trials=2,
        directory=str(tmp_path),
        distribution_strategy=tf.distribute.MirroredStrategy(["/cpu:0"]),
    )
    with pytest.raises(keras_tuner.errors.FatalError) as raised:
        tuner.search(*data(), epochs=1, verbose=0)
    assert isinstance(raised.value, RuntimeError)
    message = str(raised.value)
    assert "distribution_strategy=build_model.distribution.strategy" in message
    assert "leave `distribution_strategy` out" in message
