"""The training state on TensorFlow: reading variables for a save, comparing replica copies.

What `keras_mirror_kit.checkpoint` asks of the backend, through `backends.current()`:
a variable's value on its device (`read_value`), whether it is finite, checked there with
one boolean per variable coming to the host (`finite_check`, `finite_flags`), its host copy
(`host_value`), the per-replica copies of a mirrored variable (`replica_copies`) and their
comparison where they live (`differing_copies`), and the workers' exchange of their resume
points (`gather_rows`). A variable's copies are compared a flat slice of at most
`chunk_bytes` at a time, so the temporaries stay a few MiB whatever the variable's size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

__all__ = [
    "differing_copies",
    "finite_check",
    "finite_flags",
    "gather_rows",
    "host_layout",
    "host_value",
    "read_value",
    "reads_collectively",
    "replica_copies",
]


def _tf_value(variable: Any) -> Any:
    """The TensorFlow variable behind a Keras variable (a tensor or TF variable as it is)."""
    if isinstance(variable, (tf.Tensor, tf.Variable)):
        return variable
    return getattr(variable, "value", variable)


def read_value(variable: Any) -> tf.Tensor:
    """The variable's value as a tensor, on its (primary) device."""
    return tf.convert_to_tensor(_tf_value(variable))


def reads_collectively(variable: Any) -> bool:
    """Whether reading the variable is a collective (synchronized on read: every worker reads)."""
    value = _tf_value(variable)
    return getattr(value, "synchronization", None) == tf.VariableSynchronization.ON_READ


def host_layout(variable: Any) -> tuple[tuple[int, ...], Any]:
    """The shape and NumPy dtype of the variable's host copy (nothing is read)."""
    value = _tf_value(variable)
    return tuple(value.shape), tf.as_dtype(value.dtype).as_numpy_dtype


def host_value(source: Any) -> np.ndarray:
    """A variable's or a read tensor's value on the host (a view where it lives there)."""
    return np.asarray(tf.convert_to_tensor(_tf_value(source)))


def finite_check(tensor: tf.Tensor) -> tf.Tensor | None:
    """A scalar bool tensor, on the tensor's device: all values finite (None: not floating)."""
    if tensor.dtype.is_complex:
        parts = (tf.math.real(tensor), tf.math.imag(tensor))
        return tf.reduce_all([tf.reduce_all(tf.math.is_finite(p)) for p in parts])
    if tensor.dtype.is_floating:
        return tf.reduce_all(tf.math.is_finite(tensor))
    return None


def finite_flags(checks: Sequence[tf.Tensor]) -> np.ndarray:
    """The checks of `finite_check` on the host: one boolean each, in one transfer."""
    return np.asarray(tf.stack(list(checks))) if checks else np.ones(0, bool)


def replica_copies(model: Any, variable: Any) -> list[Any]:
    """The per-replica copies of a mirrored variable ([] when synchronized on read)."""
    value = getattr(variable, "value", variable)
    if getattr(value, "synchronization", None) == tf.VariableSynchronization.ON_READ:
        return []  # their copies legitimately differ
    return list(model.distribute_strategy.experimental_local_results(value))


def _compare_slices(
    first: Any, copies: list[Any], length: int, compare: Callable[[tf.Tensor, tf.Tensor], Any]
) -> list[list[Any]]:
    """Per copy: `compare(its slice, replica 0's slice)` on its device, `length` at a time."""
    whole = tf.convert_to_tensor(first)
    size = whole.shape.num_elements()
    results = []
    if size <= length:  # one slice: the whole variable, as it is
        for copy in copies:
            with tf.device(copy.device):
                results.append([compare(tf.convert_to_tensor(copy), whole)])
        return results
    with tf.device(first.device):
        first_flat = tf.reshape(whole, [-1])  # shares the buffer
    # One copy read at a time: a variable in copy-on-read mode (after a sparse update)
    # is copied whole by each read.
    for copy in copies:
        found = []
        with tf.device(copy.device):
            flat = first_flat if copy is first else tf.reshape(tf.convert_to_tensor(copy), [-1])
        for start in range(0, size, length):
            count = min(length, size - start)
            with tf.device(first.device):  # sliced where it lives; only the slice travels
                there = tf.slice(first_flat, [start], [count])
            with tf.device(copy.device):
                found.append(compare(tf.slice(flat, [start], [count]), there))
        results.append(found)
        del flat
    return results


def _combine(device: str, scalars: list[tf.Tensor], reduce: Callable[..., tf.Tensor]) -> tf.Tensor:
    """The scalars of a copy's slices reduced to one, on its device (one slice: itself)."""
    if len(scalars) == 1:
        return scalars[0]
    with tf.device(device):
        return reduce(tf.stack(scalars))


def _all_equal(copies: list[Any], chunk_bytes: int) -> tf.Tensor:
    """Whether every copy equals replica 0's, each compared on its own device (a bool)."""
    length = max(1, chunk_bytes // copies[0].dtype.size)
    flags = _compare_slices(
        copies[0], copies[1:], length, lambda here, there: tf.reduce_all(tf.equal(here, there))
    )
    equal = [_combine(copy.device, found, tf.reduce_all) for copy, found in zip(copies[1:], flags)]
    return tf.reduce_all(tf.stack(equal))


def _slice_stats(here: tf.Tensor, there: tf.Tensor) -> tuple[Any, Any, tf.Tensor]:
    """For one slice: [equal (NaN equals NaN), all finite (None: not a float), max |diff|]."""
    there = tf.identity(there)  # replica 0's values, copied to this device once
    if here.dtype.is_complex:
        here = tf.stack([tf.math.real(here), tf.math.imag(here)])
        there = tf.stack([tf.math.real(there), tf.math.imag(there)])
    same = tf.equal(here, there)
    finite = None
    if here.dtype.is_floating:
        same = tf.logical_or(same, tf.logical_and(tf.math.is_nan(here), tf.math.is_nan(there)))
        finite = tf.reduce_all(tf.math.is_finite(here))
    same = tf.reduce_all(same)
    if here.dtype == tf.bool:
        gap = tf.cast(tf.logical_not(same), tf.float64)
    elif here.dtype.is_floating:  # in its own precision: no wider temporaries
        gap = tf.cast(tf.reduce_max(tf.abs(here - there)), tf.float64)
    else:
        gap = tf.reduce_max(tf.abs(tf.cast(here, tf.float64) - tf.cast(there, tf.float64)))
    return same, finite, gap


def _compare_on_devices(copies: list[Any], chunk_bytes: int) -> tf.Tensor:
    """Per replica, on its own device: [equal to replica 0, all finite, max |difference|].

    Replica 0's copy is brought to each other replica's device a slice at a time; only
    the three scalars per replica are stacked for the host.
    """
    dtype = copies[0].dtype
    width = 8 if dtype.is_integer else dtype.size  # integers are compared as float64
    stats = _compare_slices(copies[0], copies, max(1, chunk_bytes // width), _slice_stats)
    rows = []
    for copy, found in zip(copies, stats):
        same = _combine(copy.device, [s for s, _, _ in found], tf.reduce_all)
        gap = _combine(copy.device, [g for _, _, g in found], tf.reduce_max)
        with tf.device(copy.device):
            if found[0][1] is None:
                finite = tf.constant(True)
            else:
                finite = _combine(copy.device, [f for _, f, _ in found], tf.reduce_all)
            rows.append(tf.stack([tf.cast(same, tf.float64), tf.cast(finite, tf.float64), gap]))
    return tf.stack(rows)


def differing_copies(
    mirrored: Sequence[list[Any]], chunk_bytes: int
) -> list[tuple[int, np.ndarray]]:
    """`(index, rows)` of the variables whose copies differ bit for bit, compared where
    they live: first one boolean per variable (each copy against replica 0's), then, for
    those that differ, per replica [equal (NaN equals NaN), all finite, max |difference|].
    """
    # Each copy against replica 0's where it lives: one transfer of one bool per variable.
    equal = np.asarray(tf.stack([_all_equal(copies, chunk_bytes) for copies in mirrored]))
    differing = [i for i, same in enumerate(equal) if not same]
    compared = [_compare_on_devices(mirrored[i], chunk_bytes) for i in differing]
    # The copies that differ bit for bit, compared exactly: three scalars per replica.
    results = np.asarray(tf.stack(compared)) if compared else []
    return list(zip(differing, results))


def gather_rows(model: Any, row: list[int]) -> np.ndarray:
    """Every replica's `row` (of every worker), through the model's strategy."""
    strategy = model.distribute_strategy
    per_replica = strategy.run(lambda: tf.constant([row], tf.int64))
    return np.asarray(strategy.gather(per_replica, axis=0))
