"""The kit's own tf.data functions are single-device ones; user code stays multi-device.

How much a new iterator then costs is measured, not unit-tested (a timing): see
benchmarks/epoch_start_probe.py, benchmarks/image_folder.py and docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import tensorflow as tf

import keras_mirror_kit as kmk
from keras_mirror_kit.workarounds.tf_data_function_instantiation import ATTRIBUTE, host_functions
from tests import data_files


def functions(dataset: tf.data.Dataset) -> dict[str, bool]:
    """`{name: carries the single-device attribute}` of the dataset's tf.data functions."""
    policy = tf.data.experimental.ExternalStatePolicy.IGNORE
    serialized = dataset._as_serialized_graph(external_state_policy=policy)  # noqa: SLF001
    graph = tf.compat.v1.GraphDef.FromString(serialized.numpy())
    return {
        f.signature.name: f.attr[ATTRIBUTE].b if ATTRIBUTE in f.attr else False
        for f in graph.library.function
        if "_tf_data_function" in f.attr
    }


def read_on_cpu1(dataset_of) -> float:
    """Iterates `dataset_of(variable)` whose function reads a variable placed on /cpu:1."""
    with tf.device("/cpu:1"):
        variable = tf.Variable(2.0)
    return float(next(iter(dataset_of(variable))).numpy())


def plus_variable(variable: tf.Variable) -> tf.data.Dataset:
    return tf.data.Dataset.range(2).map(lambda i: tf.cast(i, tf.float32) + variable)


def test_plain_tf_data_functions_are_still_multi_device():
    """Upstream: TensorFlow instantiates a plain tf.data function as a multi-device one
    (Grappler at every new iterator), so it can read a resource on another device. Remove
    the workaround when this fails."""
    assert read_on_cpu1(plus_variable) == 2.0


def test_a_function_built_in_the_block_is_single_device():
    def in_block(variable: tf.Variable) -> tf.data.Dataset:
        with host_functions():
            return plus_variable(variable)

    with pytest.raises(tf.errors.FailedPreconditionError, match="located in device .*CPU:1"):
        read_on_cpu1(in_block)  # a single-device function on CPU:0 cannot read it
    with host_functions():
        dataset = tf.data.Dataset.range(2).map(lambda i: i + 1)
    assert list(functions(dataset).values()) == [True]
    assert list(functions(tf.data.Dataset.range(2).map(lambda i: i + 1)).values()) == [False]


def test_a_folder_datasets_own_functions_are_single_device(tmp_path):
    folder = str(data_files.image_folder(tmp_path / "images"))
    dataset = kmk.image_dataset_from_directory(
        folder, image_size=(8, 8), batch_size=4, seed=1, verbose=False
    )
    found = functions(dataset)
    assert len(found) >= 2 and all(found.values()), found  # the cursor's scan, the decoding


def test_user_functions_stay_multi_device(tmp_path):
    def double(images):
        return images * 2.0

    folder = str(data_files.image_folder(tmp_path / "images"))
    dataset = kmk.image_dataset_from_directory(
        folder, image_size=(8, 8), batch_size=4, seed=1, verbose=False, preprocess=double
    )
    found = functions(dataset)
    users = {name: single for name, single in found.items() if "preprocess_batch" in name}
    assert list(users.values()) == [False], found
    assert all(single for name, single in found.items() if name not in users), found


def test_arrays_and_loaded_items_own_functions_are_single_device():
    x, y = np.arange(40, dtype="uint8").reshape(10, 4), np.arange(10)
    arrays = functions(kmk.make_dataset(x, y, 4, seed=0))
    assert len(arrays) >= 2 and all(arrays.values()), arrays

    def load(item):
        return tf.fill([3], tf.cast(item, tf.float32))

    loaded = functions(kmk.make_dataset(np.arange(10), y, 4, seed=0, load=load))
    users = {name: single for name, single in loaded.items() if "load_one" in name}
    assert list(users.values()) == [False], loaded
    assert all(single for name, single in loaded.items() if name not in users), loaded


def test_a_record_datasets_own_functions_are_single_device(tmp_path):
    shards = data_files.record_shards(tmp_path)
    found = functions(kmk.tfrecord_dataset(shards, data_files.parse, 4, seed=0))
    users = {name: single for name, single in found.items() if "load_one" in name}
    assert list(users.values()) == [False], found  # `parse`, the user's
    assert len(found) > 2 and all(s for n, s in found.items() if n not in users), found


def test_the_same_batches_with_and_without_the_workaround(tmp_path, monkeypatch):
    from keras_mirror_kit.data import folders

    folder = str(data_files.image_folder(tmp_path / "images"))
    common = dict(image_size=(8, 8), batch_size=4, seed=1, verbose=False)
    single = kmk.image_dataset_from_directory(folder, **common)
    monkeypatch.setattr(folders, "host_functions", contextlib.nullcontext)
    multi = kmk.image_dataset_from_directory(folder, **common)
    assert not any(functions(multi).values())
    for epoch, skip in ((0, 0), (2, 3)):
        for dataset in (single, multi):
            kmk.cursor_of(dataset).set(epoch=epoch, skip_batches=skip)
        for (a, la), (b, lb) in zip(single, multi, strict=True):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
            np.testing.assert_array_equal(la.numpy(), lb.numpy())
