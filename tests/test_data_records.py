"""tfrecord_dataset: the record index, what a shuffle means there, exact O(shard) resume."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import keras_mirror_kit as kmk
from keras_mirror_kit.data.records import count_records
from tests import data_files

COUNTS = (10, 7, 13)  # 30 records, indices 0-29 across three shards


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return data_files.record_shards(tmp_path_factory.mktemp("records"), COUNTS)


def image_and_index(record):
    parsed = data_files.parse(record)
    return parsed["image"], parsed["index"]


def indices(dataset):
    return [y.numpy().tolist() for _, y in dataset]


def test_the_record_index_counts_from_the_length_headers(shards, tmp_path):
    assert [count_records(path) for path in shards] == list(COUNTS)
    broken = tmp_path / "broken.tfrecord"
    broken.write_bytes(open(shards[0], "rb").read()[:-7])  # the last record truncated
    with pytest.raises(ValueError, match="not a complete TFRecord file"):
        count_records(str(broken))
    with pytest.raises(ValueError, match="No TFRecord file matches"):
        kmk.tfrecord_dataset(str(tmp_path / "none-*.tfrecord"), image_and_index, 4)


@pytest.mark.slow
@pytest.mark.parametrize("window", [4, 64])
def test_a_shuffle_permutes_shards_and_windows_every_epoch(shards, window):
    ds = kmk.tfrecord_dataset(
        shards, image_and_index, 4, seed=2, shuffle_window=window, drop_remainder=False
    )
    assert int(ds.cardinality()) == 8
    epoch0, epoch1 = sum(indices(ds), []), sum(indices(ds), [])
    assert sorted(epoch0) == list(range(30)) == sorted(epoch1) and epoch0 != epoch1
    if window == 4:  # within each window of 4 of the shard-ordered stream
        starts = np.cumsum((0, *COUNTS))
        stream = []
        for shard in _shard_order(epoch0, starts):
            stream += list(range(starts[shard], starts[shard + 1]))
        for w in range(0, 30, 4):
            assert sorted(epoch0[w : w + 4]) == sorted(stream[w : w + 4])
    plain = kmk.tfrecord_dataset(shards, image_and_index, 4, shuffle=False)
    assert sum(indices(plain), []) == list(range(30))


def _shard_order(epoch, starts):
    """The shards in the order the epoch reads them (from where their records appear)."""
    first_seen = {}
    for place, index in enumerate(epoch):
        shard = int(np.searchsorted(starts, index, side="right") - 1)
        first_seen.setdefault(shard, place)
    return sorted(first_seen, key=first_seen.get)


def one_thread(dataset):
    """`dataset` run by one thread: its map calls happen in input order, one at a time."""
    options = tf.data.Options()
    options.threading.private_threadpool_size = 1
    return dataset.with_options(options)


@pytest.mark.slow
def test_a_resume_parses_nothing_before_its_first_record(shards):
    parsed: list[int] = []

    def note(index):
        parsed.append(int(index))
        return index

    def parse(record):
        image, index = image_and_index(record)
        return image, tf.reshape(tf.numpy_function(note, [index], tf.int64, stateful=True), [])

    ds = kmk.tfrecord_dataset(shards, parse, 2, seed=5, shuffle_window=4)
    epoch0 = indices(ds)
    cursor = kmk.cursor_of(ds)
    for skip in (1, 7, 13):
        cursor.set(epoch=0, skip_batches=skip)
        assert indices(ds) == epoch0[skip:] + epoch0[:skip]  # exact, then the wrap-around
        parsed.clear()
        cursor.set(epoch=0, skip_batches=skip)
        assert next(iter(one_thread(ds)))[1].numpy().tolist() == epoch0[skip]
        # Parsed in input order: the remaining records first; a skipped one only after
        # them all (the read-ahead reaching the wrap-around), never before.
        remaining = len(sum(epoch0[skip:], []))
        before = set(sum(epoch0[:skip], []))
        assert parsed[: min(remaining, len(parsed))] == sum(epoch0[skip:], [])[: len(parsed)]
        assert all(place >= remaining for place, i in enumerate(parsed) if i in before)


def test_parse_may_return_features_only_and_preprocess_runs_per_batch(shards):
    def image_only(record):
        return data_files.parse(record)["image"]

    ds = kmk.tfrecord_dataset(
        shards, image_only, 5, seed=1, preprocess=kmk.rescale(), preprocess_on="host"
    )
    batch = next(iter(ds))
    assert batch.dtype == tf.float32 and batch.shape == (5, 8, 8, 3)
    assert float(tf.reduce_max(batch)) <= 1.0
    assert kmk.cursor_of(ds).num_samples == 30 and int(ds.cardinality()) == 6
