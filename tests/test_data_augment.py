"""Deterministic augmentation: random draws keyed on (seed, epoch, batch or sample)."""

from __future__ import annotations

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mirror_kit as kmk

pytestmark = pytest.mark.slow  # every test here starts children or trains for long

N, BATCH = 48, 8


def images():
    rng = np.random.default_rng(0)
    return rng.integers(0, 255, (N, 12, 12, 3)).astype("uint8"), np.arange(N)


def keras_layers():
    return keras.Sequential(
        [
            keras.layers.RandomFlip(),
            keras.layers.RandomRotation(0.2),
            keras.layers.RandomZoom(0.2, seed=4),
            keras.layers.RandomContrast(0.3),
        ]
    )


def keras_random(batch):
    generator = keras_random.generator
    noise = keras.random.normal(tf.shape(batch), stddev=5.0, seed=generator)
    return tf.cast(batch, "float32") + noise + keras.random.uniform([], seed=None)


keras_random.generator = None  # a variable: made by the fixture below, not at import


@pytest.fixture(scope="module", autouse=True)
def _keras_random_generator():
    """One generator for the module, made once TensorFlow's devices are configured."""
    keras_random.generator = keras.random.SeedGenerator(3)


def stateless(batch, seed):
    flipped = tf.image.stateless_random_flip_left_right(batch, seed)
    return tf.image.stateless_random_brightness(tf.cast(flipped, "float32"), 20.0, seed + 1)


def epoch(dataset, threads=None):
    if threads:
        options = tf.data.Options()
        options.threading.private_threadpool_size = threads
        dataset = dataset.with_options(options)
    return np.concatenate([x.numpy() for x, _ in dataset])


@pytest.mark.parametrize(
    "make",
    [keras_layers, lambda: keras_random, lambda: stateless],
    ids=["layers", "keras.random", "seed-arg"],
)
def test_the_same_seed_augments_identically_whatever_the_parallelism(make):
    x, y = images()
    ds = kmk.make_dataset(x, y, BATCH, seed=7, preprocess=make())
    first, second = epoch(ds), epoch(ds)  # epochs 0 and 1
    again = kmk.make_dataset(x, y, BATCH, seed=7, preprocess=make())
    assert np.array_equal(epoch(again, threads=1), first)  # one thread or many: the same
    assert np.array_equal(epoch(again), second)
    assert not np.array_equal(first, second)  # each epoch augments anew
    per_batch = first.reshape(N // BATCH, BATCH, -1)
    assert not np.array_equal(per_batch[0], per_batch[1])
    other = kmk.make_dataset(x, y, BATCH, seed=8, preprocess=make())
    kmk.cursor_of(other).set_seed(7)
    assert np.array_equal(epoch(other), first)  # the seed, not the object, keys the draws
    resumed = kmk.make_dataset(x, y, BATCH, seed=7, preprocess=make())
    kmk.cursor_of(resumed).set(epoch=1, skip_batches=4)
    assert np.array_equal(epoch(resumed)[: 2 * BATCH], second[4 * BATCH :])


def test_a_load_draws_per_sample_and_may_take_a_seed():
    x, _ = images()
    pool = tf.constant(x)

    def load(index, seed):
        image = tf.gather(pool, index)
        return tf.image.stateless_random_crop(image, (8, 8, 3), seed)

    def run(threads=None):
        ds = kmk.make_dataset(np.arange(N), np.arange(N), BATCH, seed=1, load=load)
        return epoch(ds, threads), ds

    first, _ = run()
    again, _ = run(threads=1)
    assert np.array_equal(first, again) and first.shape == (N, 8, 8, 3)


def test_stateful_randomness_is_named_or_refused(caplog):
    x, y = images()

    @tf.function
    def nested(batch):
        return tf.image.random_flip_left_right(batch)

    def stateful(batch):
        return nested(tf.random.shuffle(batch))

    with caplog.at_level(logging.WARNING, logger="keras_mirror_kit"):
        kmk.make_dataset(x, y, BATCH, seed=0, preprocess=stateful)
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "RandomShuffle" in warned and "RandomUniform" in warned and "stateless" in warned
    with pytest.raises(ValueError, match="Received: strict=True"):
        kmk.make_dataset(x, y, BATCH, seed=0, preprocess=stateful, strict=True)
    with pytest.raises(ValueError, match="RandomUniform"):
        kmk.make_dataset(
            np.arange(N), y, BATCH, seed=0, load=lambda i: tf.random.uniform([3]), strict=True
        )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="keras_mirror_kit"):
        kmk.make_dataset(x, y, BATCH, seed=0, preprocess=keras_layers(), strict=True)
        kmk.make_dataset(x, y, BATCH, seed=0, preprocess=kmk.rescale())
    assert not caplog.records
    with pytest.raises(TypeError, match="strict"):
        kmk.make_dataset(x, y, BATCH, strict="yes")
    with pytest.raises(ValueError, match="seed"):
        kmk.make_dataset(x, y, BATCH, preprocess=stateless, preprocess_on="replica")
