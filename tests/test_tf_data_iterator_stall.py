"""The end-of-fit stall workaround: no tf.data autotuning in the kit's input iterators.

Whether the stall is gone is measured, not unit-tested (a timing): see
benchmarks/end_of_fit_stall.py and docs/benchmarks.md. Here: the mechanism is in place.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.data.ops import multi_device_iterator_ops as mdi

import keras_mirror_kit as kmk
from keras_mirror_kit.workarounds import tf_data_iterator_stall
from tests import models


def per_device_autotune(run) -> list[object]:
    """Runs `run()` and returns `options().autotune.enabled` of every per-replica pipeline
    that TensorFlow built meanwhile (as the kit's wrapper hands it back)."""
    with tf_data_iterator_stall.per_device_autotune_disabled():
        pass  # installs the kit's wrapper, so the spy below sits on top of it
    wrapper, seen = mdi._create_device_dataset, []  # noqa: SLF001

    def spy(*args, **kwargs):
        dataset = wrapper(*args, **kwargs)
        seen.append(dataset.options().autotune.enabled)
        return dataset

    mdi._create_device_dataset = spy  # noqa: SLF001
    try:
        run()
    finally:
        mdi._create_device_dataset = wrapper  # noqa: SLF001
    return seen


def first_distributed_batch():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    next(iter(strategy.experimental_distribute_dataset(tf.data.Dataset.range(8).batch(4))))


@pytest.mark.slow
def test_make_dataset_has_no_autotuning():
    x = np.zeros((8, 2), "float32")
    assert kmk.make_dataset(x, batch_size=4, seed=0).options().autotune.enabled is False


def test_per_device_pipelines_lose_autotuning_only_inside_the_block():
    def inside():
        with tf_data_iterator_stall.per_device_autotune_disabled():
            with tf_data_iterator_stall.per_device_autotune_disabled():  # re-entrant
                first_distributed_batch()

    seen = per_device_autotune(inside)
    assert len(seen) == 2 and all(enabled is False for enabled in seen)  # one per replica
    outside = per_device_autotune(first_distributed_batch)
    assert len(outside) == 2 and all(enabled is not False for enabled in outside)


@pytest.mark.slow
def test_models_built_by_the_kit_fit_without_per_device_autotuning():
    @kmk.distributed(per_replica_batch_size=4)
    def build():
        return models.compile_sgd(models.sequential())

    model = build()
    assert tf_data_iterator_stall.is_applied(model)
    assert tf_data_iterator_stall.apply(model) is model  # idempotent
    x = np.random.default_rng(0).normal(size=(32, 6)).astype("float32")
    data = kmk.make_dataset(x, np.zeros(32, "int32"), 8, seed=0)
    seen = per_device_autotune(lambda: model.fit(data, epochs=2, verbose=0))
    assert len(seen) >= 4 and all(enabled is False for enabled in seen)
    plain = models.compile_sgd(models.sequential())  # not built by the kit: untouched
    assert not tf_data_iterator_stall.is_applied(plain)


def test_the_block_is_per_thread_another_thread_keeps_autotuning():
    """A thread building a distributed iterator while another is inside a kit fit (inside
    the block) keeps TensorFlow's autotuning; the thread inside the block loses it."""
    import threading

    inside, other_done = threading.Event(), threading.Event()
    results: dict[str, object] = {}

    def kit_thread():
        with tf_data_iterator_stall.per_device_autotune_disabled():
            inside.set()
            other_done.wait(60)
            first_distributed_batch()

    def run():
        thread = threading.Thread(target=kit_thread)
        thread.start()
        assert inside.wait(60)
        try:
            first_distributed_batch()  # this thread is outside any block
        finally:
            other_done.set()
            thread.join(60)
        results["done"] = True

    seen = per_device_autotune(run)
    assert results == {"done": True}
    # 2 pipelines of this thread (autotuned), then 2 of the kit thread (not autotuned).
    assert len(seen) == 4
    assert all(enabled is not False for enabled in seen[:2]), seen
    assert all(enabled is False for enabled in seen[2:]), seen
