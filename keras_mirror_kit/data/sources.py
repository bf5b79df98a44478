"""Indexable sources: a list of items (file paths, ids) read by `load`, and tables.

The epoch's order is `tf.random.experimental.index_shuffle(i, seed=[seed, epoch],
max_index=n - 1)` for the i-th position of the epoch: stateless and O(1) per position, so a
batch's samples are computed from its position alone. An iteration resumed at batch k
starts at position k x batch_size and never reads, let alone decodes, a sample before it:
its first batch costs what any batch costs. Items and labels stay in memory as tensors (a
path is a few dozen bytes); only `load` touches the files, one sample at a time.

Tables (a pandas `DataFrame`, or a dict of columns) become a dict of arrays, one per column
(strings as `tf.string`), and go in as any features do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from keras_mirror_kit.data.cursor import DatasetCursor
from keras_mirror_kit.data.samples import load_batches, slot_count
from keras_mirror_kit.data.sharding import WorkerSlice
from keras_mirror_kit.workarounds.tf_data_function_instantiation import host_functions

__all__ = ["as_columns", "index_batches", "indexed_dataset", "is_table", "to_tensors"]


def is_table(x: Any) -> bool:
    """Whether `x` looks like a pandas `DataFrame` (duck-typed: no pandas import)."""
    return hasattr(x, "columns") and hasattr(x, "dtypes") and hasattr(x, "iloc")


def _array(name: str, values: Any) -> Any:
    """One column or array: a pandas Series or a list as NumPy, strings as `str`."""
    if isinstance(values, (np.ndarray, tf.Tensor)):
        array = values
    elif hasattr(values, "to_numpy"):  # a pandas Series or Index
        array = values.to_numpy()
    else:
        array = np.asarray(values)
    if isinstance(array, np.ndarray) and array.dtype == object:
        if not all(isinstance(v, (str, bytes)) for v in array.ravel()):
            kinds = sorted({type(v).__name__ for v in array.ravel()})
            raise TypeError(
                f"The column or array {name!r} holds Python objects that are not all "
                f"strings ({', '.join(kinds)}): it must hold numbers or strings. Fill or drop "
                "missing values (`df[name].fillna(...)`) or convert it. "
                f"Received: {name}=<{len(array)} values of dtype object>"
            )
        array = array.astype(str)
    return array


def as_columns(x: Any) -> dict[str, Any]:
    """A `DataFrame` as a dict of NumPy columns keyed by column name (`str(name)`)."""
    return {str(name): _array(str(name), x[name]) for name in x.columns}


def _arrays(name: str, x: Any) -> Any:
    if is_table(x):
        return as_columns(x)
    if isinstance(x, dict):
        return {key: _arrays(str(key), value) for key, value in x.items()}
    if isinstance(x, tuple):
        return tuple(_arrays(f"{name}[{i}]", value) for i, value in enumerate(x))
    return _array(name, x)


def to_tensors(x: Any, name: str = "x") -> Any:
    """Features or labels as host tensors: tables by column, lists and Series as arrays."""
    arrays = _arrays(name, x)
    with tf.device("/cpu:0"):
        return tf.nest.map_structure(tf.convert_to_tensor, arrays)


def index_batches(
    cursor: DatasetCursor, n: int, batch_size: int, num_batches: int, shuffle: bool
) -> tf.data.Dataset:
    """One epoch of batches of sample indices, from the cursor's (epoch, skip, seed)."""

    def next_batch(state: Any, step: tf.Tensor) -> Any:
        taken = tf.cond(state[0] < 0, cursor._take, lambda: state)  # noqa: SLF001
        epoch, skip, seed = (tf.reshape(value, []) for value in taken)
        position = (step + skip) % num_batches
        start = position * batch_size
        where = tf.range(start, tf.minimum(start + batch_size, n), dtype=tf.int64)
        if shuffle:
            ids = tf.random.experimental.index_shuffle(
                where, seed=tf.stack([seed, epoch]), max_index=tf.constant(n - 1, tf.int64)
            )
        else:
            ids = where
        batch = {
            "ids": ids,
            "epoch_key": tf.stack([seed, epoch]),
            "position": position,
            "last": tf.equal(step, num_batches - 1),
        }
        return (epoch, skip, seed), batch

    initial = (tf.constant(-1, tf.int64), tf.constant(0, tf.int64), tf.constant(0, tf.int64))
    return tf.data.Dataset.range(num_batches).scan(initial, next_batch)


def indexed_dataset(
    cursor: DatasetCursor,
    items: Any,
    labels: Any,
    *,
    n: int,
    batch_size: int,
    num_batches: int,
    drop: bool,
    shuffle: bool,
    load: Callable[..., Any],
    preprocess: Callable[[Any], Any] | None,
    part: WorkerSlice | None,
    strict: bool | None,
    label_map: Callable[[Any], Any] | None = None,
) -> tf.data.Dataset:
    """The batches of a list of items read by `load` (before the kit's options and prefetch)."""
    has_y = labels is not None

    def gather(batch: dict[str, Any]) -> dict[str, Any]:
        batch = dict(batch)
        batch["items"] = tf.nest.map_structure(lambda t: tf.gather(t, batch["ids"]), items)
        if has_y:
            batch["labels"] = tf.nest.map_structure(lambda t: tf.gather(t, batch["ids"]), labels)
        return batch

    with host_functions():  # the kit's own functions: no user code
        batches = index_batches(cursor, n, batch_size, num_batches, shuffle).map(gather)
    last_size = 0 if drop else n % batch_size
    dataset = load_batches(
        batches,
        load=load,
        has_y=has_y,
        slots=slot_count(batch_size, last_size, part),
        part=part,
        label_map=label_map,
        preprocess=preprocess,
        strict=strict,
        short_batches=bool(last_size),
    )
    return dataset.apply(tf.data.experimental.assert_cardinality(num_batches))
