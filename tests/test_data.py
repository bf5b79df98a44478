"""make_dataset: dtype, batching, order keyed on (seed, epoch), cursor and errors."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import keras_mirror_kit as kmk

N = 50


def arrays(n=N):
    x = np.arange(n * 2 * 2 * 3, dtype=np.uint8).reshape(n, 2, 2, 3)
    x[:, 0, 0, 0] = np.arange(n)  # sample id in the first pixel
    return x, np.arange(n, dtype=np.int64)


def ids(dataset):
    return [batch[1].numpy().tolist() for batch in dataset]


def test_keeps_stored_dtype_and_preprocesses_per_batch():
    x, y = arrays()
    raw = kmk.make_dataset(x, y, 10, shuffle=False)
    assert raw.element_spec[0].dtype == tf.uint8
    seen_shapes = []

    def preprocess(batch):
        seen_shapes.append(batch.shape)
        return kmk.rescale()(batch)

    ds = kmk.make_dataset(x, y, 10, shuffle=False, preprocess=preprocess)
    assert ds.element_spec[0].dtype == tf.float32
    assert seen_shapes and seen_shapes[0].rank == 4  # traced on whole batches
    first_x, first_y = next(iter(ds))
    np.testing.assert_allclose(first_x.numpy(), x[:10] / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(first_y.numpy(), y[:10])


def test_every_epoch_holds_every_sample_unless_the_remainder_is_dropped():
    """As Keras' fit(x, y) and loaders: shuffled or not, the last partial batch is kept."""
    x, y = arrays()
    train = kmk.make_dataset(x, y, 16, seed=0)
    assert int(train.cardinality()) == 4
    for _ in range(2):  # two epochs, two permutations, each of every sample
        epoch = ids(train)
        assert [len(b) for b in epoch] == [16, 16, 16, 2]
        assert sorted(sum(epoch, [])) == list(range(N))
    evaluation = kmk.make_dataset(x, y, 16, shuffle=False)
    assert int(evaluation.cardinality()) == 4
    assert sum(ids(evaluation), []) == list(range(N))
    dropped = kmk.make_dataset(x, y, 16, seed=0, drop_remainder=True)
    assert int(dropped.cardinality()) == 3
    assert [len(b) for b in ids(dropped)] == [16, 16, 16]


def test_each_epoch_is_a_permutation_keyed_on_seed_and_epoch():
    x, y = arrays()
    ds = kmk.make_dataset(x, y, 10, seed=3)
    epoch0, epoch1 = sum(ids(ds), []), sum(ids(ds), [])
    assert sorted(epoch0) == list(range(N)) and sorted(epoch1) == list(range(N))
    assert epoch0 != epoch1 and epoch0 != list(range(N))
    again = kmk.make_dataset(x, y, 10, seed=3)
    assert sum(ids(again), []) == epoch0  # same seed, same first epoch
    other = kmk.make_dataset(x, y, 10, seed=4)
    assert sum(ids(other), []) != epoch0
    # a fresh dataset positioned at epoch 1 reproduces epoch 1 exactly (resume)
    fresh = kmk.make_dataset(x, y, 10, seed=3)
    kmk.cursor_of(fresh).set(epoch=1)
    assert sum(ids(fresh), []) == epoch1


def test_cursor_skips_consumed_batches_once():
    x, y = arrays()
    ds = kmk.make_dataset(x, y, 10, seed=9)
    cursor = kmk.cursor_of(ds)
    full = ids(ds)
    cursor.set(epoch=0, skip_batches=3)
    resumed = ids(ds)
    assert resumed[:2] == full[3:]  # the remaining batches first, in order
    assert resumed[2:] == full[:3]  # read past them, it wraps (the length stays 5)
    assert int(ds.cardinality()) == 5
    assert cursor.get() == (1, 0)  # moved on to the next epoch, skip cleared
    assert kmk.cursor_of(tf.data.Dataset.range(3)) is None


def test_features_only_and_structured_features():
    x, _ = arrays()
    only = kmk.make_dataset(x, batch_size=5, shuffle=False)
    assert next(iter(only)).shape == (5, 2, 2, 3)
    feats = {"a": x, "b": np.arange(N, dtype=np.float32)}
    with pytest.raises(ValueError, match="same first dimension"):
        kmk.make_dataset((x, x[:3]), np.arange(N), batch_size=5)
    ds = kmk.make_dataset(feats, np.arange(N), batch_size=5, shuffle=False)
    batch_x, _ = next(iter(ds))
    assert set(batch_x) == {"a", "b"} and batch_x["b"].numpy().tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    ("kwargs", "exc", "fragment"),
    [
        ({"batch_size": None}, TypeError, "batch_size=None"),
        ({"batch_size": 0}, ValueError, "batch_size=0"),
        ({"batch_size": 3.0}, TypeError, "batch_size=3.0"),
        ({"batch_size": 64, "drop_remainder": True}, ValueError, "larger than the data"),
        ({"batch_size": 16, "drop_remainder": None}, TypeError, "drop_remainder=None"),
        ({"batch_size": 16, "preprocess": "float"}, TypeError, "preprocess='float'"),
        ({"batch_size": 16, "num_replicas": 0}, ValueError, "num_replicas=0"),
    ],
)
def test_bad_input_is_rejected_clearly(kwargs, exc, fragment):
    x, y = arrays()
    with pytest.raises(exc) as info:
        kmk.make_dataset(x, y, **kwargs)
    assert fragment in str(info.value)


def test_empty_arrays_are_rejected():
    with pytest.raises(ValueError, match="empty"):
        kmk.make_dataset(np.zeros((0, 3)), np.zeros((0,)), 4)
