"""`tfrecord_dataset`: TFRecord shards that resume exactly mid-epoch, by a record index.

TensorFlow has no random-access reader of TFRecord files, so the kit keeps an index of how
many records each shard holds (a scan of the length headers: 8-byte length, 4-byte CRC,
data, 4-byte CRC, checked against the file's size; held in memory, keyed on each file's
size and modification time) and defines an epoch's order from it:

* the shards in an order permuted per epoch (`index_shuffle` keyed on `(seed, epoch)`),
  their records read in file order, one after the other: the epoch's *stream*;
* the stream cut into consecutive windows of `shuffle_window` records, each window
  permuted by a stateless permutation keyed on `(seed, epoch, window)`.

So a record moves at most `shuffle_window - 1` places from its place in the shard-ordered
stream; it is not a uniform permutation of all records (many shards, or the index form
`make_dataset(paths, load=...)` on one file per sample, shuffle better). A resume at record
p (batch k x batch size) skips every shard before p's window without opening it, reads
(never parses) the records of that shard before the window (`TFRecordDataset.skip`) and the
window's records before p, and parses from p on: its cost is bounded by one shard, not by
the epoch.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from keras_mirror_kit.data.augment import fold_key
from keras_mirror_kit.data.cursor import DatasetCursor
from keras_mirror_kit.data.pipeline import (
    check_batch_size,
    check_placement,
    epoch_info,
    finish_dataset,
    resolve_seed,
)
from keras_mirror_kit.data.samples import load_batches, slot_count
from keras_mirror_kit.data.sharding import WorkerSlice, record_part, worker_slice
from keras_mirror_kit.validation import check_bool, positive_int
from keras_mirror_kit.workarounds.tf_data_function_instantiation import host_functions

__all__ = ["count_records", "record_batches", "tfrecord_dataset"]

_COUNTS: dict[tuple[str, int, int, str], int] = {}
_COUNTS_LOCK = threading.Lock()
_WINDOW_DOMAIN = 2


def _scan(path: str, size: int) -> int:
    """Records in an uncompressed TFRecord file, from its length headers alone."""
    count, position = 0, 0
    opener = tf.io.gfile.GFile if "://" in path else open
    with opener(path, "rb") as handle:
        while position < size:
            header = handle.read(12)
            length = struct.unpack("<Q", header[:8])[0] if len(header) == 12 else size
            end = position + 12 + length + 4
            if end > size:
                raise ValueError(
                    f"{path!r} is not a complete TFRecord file: the record at byte {position} "
                    f"would end at byte {end}, past the file's {size} bytes (truncated, "
                    "compressed, or another format; pass compression_type= for a compressed "
                    f"file). Received: files=[..., {path!r}, ...]"
                )
            position = end
            handle.seek(position)
            count += 1
    return count


def count_records(path: str, compression_type: str = "") -> int:
    """Records in one TFRecord file (cached per path, size and modification time)."""
    stat = tf.io.gfile.stat(path)
    key = (path, int(stat.length), int(stat.mtime_nsec), compression_type)
    with _COUNTS_LOCK:
        if key in _COUNTS:
            return _COUNTS[key]
    if compression_type:
        dataset = tf.data.TFRecordDataset(path, compression_type=compression_type)
        count = int(dataset.reduce(np.int64(0), lambda total, _: total + 1).numpy())
    else:
        count = _scan(path, int(stat.length))
    with _COUNTS_LOCK:
        _COUNTS[key] = count
    return count


def _stream(
    paths: tf.Tensor,
    counts: tf.Tensor,
    start: tf.Tensor,
    count: tf.Tensor,
    window: int,
    epoch_key: tf.Tensor,
    shuffle: bool,
    compression_type: str,
) -> tf.data.Dataset:
    """Records `[start, start + count)` of the epoch's stream (shards in `paths` order)."""
    first = (start // window) * window if shuffle else start
    ends = tf.cumsum(counts)
    last_shard = tf.shape(counts, out_type=tf.int64)[0] - 1
    shard = tf.minimum(tf.reduce_sum(tf.cast(ends <= first, tf.int64)), last_shard)
    offset = first - (ends[shard] - counts[shard])
    skips = tf.concat([[offset], tf.zeros_like(counts[shard + 1 :])], axis=0)
    files = tf.data.Dataset.from_tensor_slices((paths[shard:], skips))
    records = files.flat_map(
        lambda path, skip: tf.data.TFRecordDataset(path, compression_type).skip(skip)
    )
    if shuffle:
        first_window = first // window

        def permute(index: tf.Tensor, records_of_window: tf.Tensor) -> tf.Tensor:
            size = tf.shape(records_of_window, out_type=tf.int64)[0]
            key = fold_key(epoch_key, _WINDOW_DOMAIN, first_window + index)
            order = tf.random.experimental.index_shuffle(
                tf.range(size), seed=key, max_index=size - 1
            )
            return tf.gather(records_of_window, order)

        records = records.batch(window).enumerate().map(permute).unbatch()
    return records.skip(start - first).take(count)


def record_batches(
    cursor: DatasetCursor,
    paths: Sequence[str],
    counts: Sequence[int],
    *,
    batch_size: int,
    num_batches: int,
    epoch_samples: int,
    shuffle: bool,
    window: int,
    compression_type: str,
) -> tf.data.Dataset:
    """One epoch of batches of serialized records, positioned by the cursor."""
    all_paths = tf.constant(list(paths), tf.string)
    all_counts = tf.constant(list(counts), tf.int64)
    num_shards = len(paths)

    def epoch_of(epoch: tf.Tensor, skip: tf.Tensor, seed: tf.Tensor) -> tf.data.Dataset:
        epoch_key = tf.stack([seed, epoch])
        order = tf.range(num_shards, dtype=tf.int64)
        if shuffle:
            order = tf.random.experimental.index_shuffle(
                order, seed=epoch_key, max_index=tf.constant(num_shards - 1, tf.int64)
            )
        ordered = (tf.gather(all_paths, order), tf.gather(all_counts, order))
        begin = skip * batch_size

        def part(start: tf.Tensor, count: tf.Tensor) -> tf.data.Dataset:
            stream = _stream(*ordered, start, count, window, epoch_key, shuffle, compression_type)
            return stream.batch(batch_size)

        # The remaining batches, then (to keep the epoch's length) the skipped ones.
        batches = part(begin, epoch_samples - begin).concatenate(part(0, begin))

        def describe(step: tf.Tensor, records: tf.Tensor) -> dict[str, Any]:
            position = (step + skip) % num_batches
            size = tf.shape(records, out_type=tf.int64)[0]
            return {
                "items": records,
                "ids": position * batch_size + tf.range(size),
                "epoch_key": epoch_key,
                "position": position,
                "last": tf.equal(step, num_batches - 1),
            }

        return batches.enumerate().map(describe)

    def take_cursor(_: tf.Tensor) -> Any:
        return tuple(tf.reshape(value, []) for value in cursor._take())  # noqa: SLF001

    with host_functions():  # the kit's own functions: no user code
        return tf.data.Dataset.range(1).map(take_cursor).flat_map(epoch_of)


def _records_dataset(
    cursor: DatasetCursor,
    paths: Sequence[str],
    counts: Sequence[int],
    *,
    parse: Callable[..., Any],
    has_y: bool,
    batch_size: int,
    num_batches: int,
    drop: bool,
    shuffle: bool,
    window: int,
    compression_type: str,
    preprocess: Callable[[Any], Any] | None,
    part: WorkerSlice | None,
    strict: bool | None,
) -> tf.data.Dataset:
    """The batches of TFRecord shards parsed by `parse` (before the kit's options)."""
    total = int(sum(counts))
    epoch_samples = num_batches * batch_size if drop else total
    batches = record_batches(
        cursor,
        paths,
        counts,
        batch_size=batch_size,
        num_batches=num_batches,
        epoch_samples=epoch_samples,
        shuffle=shuffle,
        window=window,
        compression_type=compression_type,
    )
    dataset = load_batches(
        batches,
        load=parse,
        has_y=has_y,
        slots=slot_count(batch_size, 0 if drop else total % batch_size, part),
        part=part,
        preprocess=preprocess,
        strict=strict,
        labels_from_load=has_y,
        short_batches=not drop and total % batch_size != 0,
    )
    return dataset.apply(tf.data.experimental.assert_cardinality(num_batches))


def _files(files: Any) -> list[str]:
    if isinstance(files, (str, bytes, os.PathLike)):
        pattern = os.fsdecode(files)
        paths = sorted(tf.io.gfile.glob(pattern))
        if not paths:
            raise ValueError(
                f"No TFRecord file matches {pattern!r}. Pass a list of files or a pattern "
                f"such as 'data/train-*.tfrecord'. Received: files={pattern!r}"
            )
        return paths
    if not isinstance(files, (list, tuple)) or not files:
        raise TypeError(
            "`files` must be a file pattern or a non-empty list of TFRecord files. "
            f"Received: files={files!r}"
        )
    return [os.fsdecode(path) for path in files]


def _parse_gives_labels(parse: Callable[..., Any]) -> bool:
    """Whether `parse` returns a `(features, labels)` pair (traced once, never run)."""
    spec = tf.data.Dataset.from_tensors(tf.constant(b"")).map(parse).element_spec
    return isinstance(spec, tuple) and len(spec) == 2


def tfrecord_dataset(
    files: Any,
    parse: Callable[..., Any],
    batch_size: int | None = None,
    *,
    shuffle: bool = True,
    seed: int | None = None,
    shuffle_window: int = 1024,
    preprocess: Callable[[Any], Any] | None = None,
    preprocess_on: str = "auto",
    drop_remainder: bool = False,
    compression_type: str | None = None,
    prefetch: bool = True,
    strict: bool = False,
) -> tf.data.Dataset:
    """A kit dataset of TFRecord shards: resumes exactly mid-epoch, shuffles by (seed, epoch).

    The kit counts the records of each shard from their length headers (in memory, checked
    against each file's size and modification time), then orders an epoch as follows: the
    shards in an order permuted per epoch, their records in file order, and that stream
    permuted within consecutive windows of `shuffle_window` records (a stateless
    permutation per window). A record thus moves at most `shuffle_window - 1` places from
    its place in the shard-ordered stream (use many shards for a thorough shuffle). A
    resume at batch k opens no shard before the one holding record `k x batch_size`, reads
    without parsing the records of that shard before its window, and parses from the
    first record not yet trained on. `parse` runs sample by sample in a parallel,
    deterministic map; in a multi-worker run each worker parses only its own part of
    every global batch.

    Args:
        files: A file pattern (`"data/train-*.tfrecord"`, expanded and sorted) or a list
            of TFRecord files.
        parse: A function of one serialized record (a `tf.string` scalar) returning its
            features, or a `(features, labels)` pair (e.g. `tf.io.parse_single_example`
            then a decode). Its random draws are keyed on (seed, epoch, record position),
            and it may take a `seed` parameter (see `make_dataset`).
        batch_size: The GLOBAL batch size (e.g. `dist.global_batch_size`).
        shuffle: Permute the shards and the windows every epoch (False: the files in the
            order given, records in file order).
        seed: Seed of every epoch's order and random draws; drawn at random when None
            (single host only); `SyncedCheckpoint` saves it.
        shuffle_window: Records permuted together (held in memory as serialized records).
        preprocess: Function applied to each batch of features (see `make_dataset`).
        preprocess_on: Where `preprocess` runs for kit-built models (see `make_dataset`).
        drop_remainder: Drop the last partial batch (default False: every record in
            every epoch).
        compression_type: `"GZIP"`, `"ZLIB"` or None (a compressed file is counted by
            reading it once).
        prefetch: Add a `prefetch(tf.data.AUTOTUNE)` at the end.
        strict: Refuse a `parse` or `preprocess` whose random draws the kit cannot key,
            instead of a WARNING.

    Returns:
        A kit `tf.data.Dataset` of `(features, labels)` (or features) batches, with a
        `DatasetCursor` (`kmk.cursor_of`) that `SyncedCheckpoint(dataset=)` resumes.

    Raises:
        TypeError: On a missing or non-integer batch size, `files` that are no pattern or
            list, or a non-callable `parse`.
        ValueError: On no file matching the pattern, a file that is not a complete
            TFRecord file, no records, a batch larger than the data when dropping the
            remainder, or the arguments `make_dataset` refuses.

    Example:

    ```python
    def parse(record):
        example = tf.io.parse_single_example(record, {
            "image": tf.io.FixedLenFeature([], tf.string),
            "label": tf.io.FixedLenFeature([], tf.int64)})
        return tf.io.decode_jpeg(example["image"], channels=3), example["label"]

    train_ds = kmk.tfrecord_dataset("data/train-*.tfrecord", parse,
                                    dist.global_batch_size, seed=0)
    ```
    """
    batch_size = check_batch_size(batch_size)
    placement = check_placement(preprocess, preprocess_on)
    if not callable(parse):
        raise TypeError(f"`parse` must be callable. Received: parse={parse!r}")
    strict = check_bool("strict", strict)
    window = positive_int("shuffle_window", shuffle_window)
    compression = compression_type or ""
    paths = _files(files)
    counts = [count_records(path, compression) for path in paths]
    total = sum(counts)
    if total == 0:
        raise ValueError(f"The TFRecord files hold no record. Received: files={paths!r}")
    seed, seed_given = resolve_seed(seed, shuffle, "tfrecord_dataset")
    drop = check_bool("drop_remainder", drop_remainder)
    info = epoch_info(total, batch_size, drop, seed, seed_given, placement)
    cursor, num_batches = info.cursor, info.cursor.num_batches
    has_y = _parse_gives_labels(parse)
    part = worker_slice()
    record_part(cursor, part)

    def batches(apply: Callable[[Any], Any] | None, check: bool) -> tf.data.Dataset:
        return _records_dataset(
            cursor,
            paths,
            counts,
            parse=parse,
            has_y=has_y,
            batch_size=batch_size,
            num_batches=num_batches,
            drop=drop,
            shuffle=shuffle,
            window=window,
            compression_type=compression,
            preprocess=apply,
            part=part,
            strict=strict if check else None,
        )

    return finish_dataset(batches, info, preprocess, preprocess_on, has_y, prefetch)
