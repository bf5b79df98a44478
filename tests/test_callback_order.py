"""The monitor's figures reach every logger, wherever the monitor is listed (kit-built models)."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

import keras_mirror_kit as kmk
from keras_mirror_kit.fit_hooks import order_callbacks
from tests import models

X = np.random.default_rng(0).normal(size=(256, 6)).astype("float32")
Y = (X[:, 0] > 0).astype("int32")
FIGURES = ("samples_per_sec", "samples_per_sec_per_replica", "steps_per_sec", "step_time_ms")


def tensorboard_tags(log_dir: Path) -> set[str]:
    tags = set()
    for events in log_dir.rglob("events.out.tfevents.*"):
        for event in tf.compat.v1.train.summary_iterator(str(events)):
            tags.update(value.tag for value in event.summary.value)
    return tags


def csv_columns(path: Path) -> list[str]:
    with open(path, newline="") as handle:
        return next(csv.reader(handle))


def kit_model():
    @kmk.distributed(per_replica_batch_size=8)
    def build():
        return models.compile_sgd(models.sequential())

    return build(), build.distribution


@pytest.mark.slow
@pytest.mark.parametrize("form", ["decorator", "with"])
def test_loggers_listed_before_the_monitor_record_its_figures(tmp_path, form):
    pytest.importorskip("tensorboard", reason="needs keras-mirror-kit[tensorboard]")
    if form == "decorator":
        model, dist = kit_model()
    else:
        with kmk.distributed(per_replica_batch_size=8) as dist:
            model = models.compile_sgd(models.sequential())
    data = kmk.make_dataset(X, Y, dist.global_batch_size, seed=0)
    # The TensorFlow "Distributed training with Keras" tutorial's callbacks, then ours.
    callbacks = [
        tf.keras.callbacks.TensorBoard(log_dir=str(tmp_path / "logs")),
        tf.keras.callbacks.ModelCheckpoint(
            str(tmp_path / "ckpt-{epoch}.weights.h5"), save_weights_only=True
        ),
        tf.keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr),
        tf.keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
        kmk.ThroughputMonitor(warmup_steps=1),
    ]
    monitor = callbacks[-1]
    history = model.fit(data, epochs=2, verbose=0, callbacks=callbacks)
    assert callbacks[-1] is monitor  # the user's list is left as it was
    assert set(FIGURES) <= set(history.history)
    assert set(FIGURES) <= set(csv_columns(tmp_path / "log.csv"))
    assert {f"epoch_{name}" for name in FIGURES} <= tensorboard_tags(tmp_path / "logs")


def test_the_users_list_is_not_reordered_in_place_and_others_keep_their_order():
    a, b, c = object(), kmk.ThroughputMonitor(global_batch_size=8), object()
    given = [a, b, c]
    assert order_callbacks(given) == [b, a, c]
    assert given == [a, b, c]
    assert order_callbacks([a, c]) == [a, c]
    assert order_callbacks(None) is None
