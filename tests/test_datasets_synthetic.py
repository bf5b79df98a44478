"""Tests for `keras_mirror_kit.datasets.make_synthetic_cifar10`."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from keras_mirror_kit.datasets import make_synthetic_cifar10


def test_shapes_and_dtypes() -> None:
    (x_train, y_train), (x_test, y_test) = make_synthetic_cifar10(1500, 250, seed=1)
    assert x_train.shape == (1500, 32, 32, 3) and x_test.shape == (250, 32, 32, 3)
    assert y_train.shape == (1500, 1) and y_test.shape == (250, 1)
    for arr in (x_train, y_train, x_test, y_test):
        assert arr.dtype == np.uint8 and arr.flags.c_contiguous
    assert set(np.unique(y_train)) == set(range(10))
    assert y_test.max() <= 9
    # Uses the whole pixel range, not a constant or a narrow band.
    assert x_train.min() == 0 and x_train.max() == 255
    assert 90 < x_train.mean() < 165


def test_empty_splits() -> None:
    (x_train, y_train), (x_test, y_test) = make_synthetic_cifar10(0, 0)
    assert x_train.shape == (0, 32, 32, 3) and y_test.shape == (0, 1)
    assert x_test.dtype == np.uint8 and y_train.dtype == np.uint8


@pytest.mark.slow
def test_default_sizes_are_cifar_sizes() -> None:
    # How fast: benchmarks/synthetic_generation.py (a figure of the machine, not a test).
    (x_train, y_train), (x_test, y_test) = make_synthetic_cifar10()
    assert x_train.shape == (50000, 32, 32, 3) and y_train.shape == (50000, 1)
    assert x_test.shape == (10000, 32, 32, 3) and y_test.shape == (10000, 1)


def test_deterministic_from_seed() -> None:
    first = make_synthetic_cifar10(1200, 300, seed=7)
    again = make_synthetic_cifar10(1200, 300, seed=7)
    other = make_synthetic_cifar10(1200, 300, seed=8)
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])
    assert not np.array_equal(first[0][0], other[0][0])
    assert not np.array_equal(first[0][1], other[0][1])
    # Train and test are different images, not copies of each other.
    assert not np.array_equal(first[0][0][:300], first[1][0])


def test_prefix_stable_and_splits_independent() -> None:
    (x_small, y_small), (t_small, _) = make_synthetic_cifar10(1234, 10, seed=3)
    (x_big, y_big), (t_big, _) = make_synthetic_cifar10(2500, 40, seed=3)
    np.testing.assert_array_equal(x_small, x_big[:1234])
    np.testing.assert_array_equal(y_small, y_big[:1234])
    np.testing.assert_array_equal(t_small, t_big[:10])


def test_class_balance() -> None:
    (_, y_train), (_, y_test) = make_synthetic_cifar10(3000, 1000, seed=0)
    assert np.bincount(y_train[:, 0], minlength=10).tolist() == [300] * 10
    assert np.bincount(y_test[:, 0], minlength=10).tolist() == [100] * 10
    (_, y_odd), _ = make_synthetic_cifar10(2345, 0, seed=0)
    counts = np.bincount(y_odd[:, 0], minlength=10)
    assert counts.min() >= 200 and counts.max() <= 270  # balanced per 1000, then truncated
    # Shuffled, neither cyclic nor sorted.
    assert (y_train[:, 0] != np.arange(3000) % 10).mean() > 0.5
    assert (np.diff(y_train[:, 0].astype(int)) != 0).mean() > 0.5


def test_class_structure_and_noise() -> None:
    (x, y), _ = make_synthetic_cifar10(2000, 0, seed=2)
    x = x.astype(np.float32) / 255.0
    labels = y[:, 0]
    mean_color = np.stack([x[labels == c].mean(axis=(0, 1, 2)) for c in range(10)])
    # Classes 2k and 2k+1 share a tint; the 5 tints are clearly apart.
    pairs = mean_color.reshape(5, 2, 3).mean(axis=1)
    gaps = np.linalg.norm(pairs[:, None] - pairs[None], axis=-1)[np.triu_indices(5, 1)]
    assert gaps.min() > 0.1
    # Even classes have vertical stripes, odd ones horizontal: averaging each image over
    # its rows keeps vertical stripes and averages horizontal ones (and the noise) away.
    gray = x.mean(axis=-1)
    column_profile = np.abs(np.diff(gray.mean(axis=1), axis=1)).mean(axis=1)
    row_profile = np.abs(np.diff(gray.mean(axis=2), axis=1)).mean(axis=1)
    vertical = column_profile > row_profile
    assert vertical[labels % 2 == 0].mean() > 0.7
    assert vertical[labels % 2 == 1].mean() < 0.3
    # Noisy: neighbouring pixels differ well beyond the stripes' smooth variation.
    assert np.abs(np.diff(x, axis=2)).mean() > 0.1


def test_memory_frugal() -> None:
    tracemalloc.start()
    try:
        (x, _), _ = make_synthetic_cifar10(10000, 0, seed=0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The uint8 output is 30.7 MB; one float64 copy of it would be 246 MB.
    assert x.nbytes == 10000 * 3072
    assert peak < x.nbytes + 80 * 2**20, f"peak {peak / 2**20:.0f} MiB"


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"num_train": -1}, ValueError),
        ({"num_test": 2.5}, TypeError),
        ({"seed": -3}, ValueError),
        ({"seed": True}, TypeError),
        ({"num_train": "10"}, TypeError),
    ],
)
def test_invalid_arguments(kwargs: dict[str, object], error: type[Exception]) -> None:
    """A wrong value is a ValueError, a wrong type a TypeError; both name what was given."""
    name, value = next(iter(kwargs.items()))
    with pytest.raises(error, match=f"Received: {name}={value!r}"):
        make_synthetic_cifar10(**kwargs)  # type: ignore[arg-type]


@pytest.mark.slow
def test_tutorial_cnn_learns_it() -> None:
    keras = pytest.importorskip("keras")
    (x_train, y_train), (x_test, y_test) = make_synthetic_cifar10(4000, 1000, seed=0)
    from keras_mirror_kit.models import tutorial_cnn

    keras.utils.set_random_seed(0)
    model = tutorial_cnn()
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    model.fit(x_train / 255.0, y_train, batch_size=64, epochs=3, verbose=0)
    _, accuracy = model.evaluate(x_test / 255.0, y_test, batch_size=256, verbose=0)
    assert accuracy >= 0.3, f"test accuracy {accuracy:.3f} is too close to chance (0.1)"
    assert accuracy < 0.95, f"test accuracy {accuracy:.3f}: the task is trivially easy"
