"""The replica check before a save (`check_replicas`) and its `ReplicaDivergenceError`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

__all__ = ["ReplicaDivergenceError", "check_replicas", "log_batch_norm_gap"]

logger = logging.getLogger("keras_mirror_kit")


class ReplicaDivergenceError(ValueError):
    """Per-replica copies of a mirrored variable differ: the replicas are out of sync.

    Raised by `SyncedCheckpoint(verify_replicas=True)` before a save; no checkpoint is
    written. The message names the variables that differ and by how much.

    Example:

    ```python
    try:
        model.fit(train_ds, epochs=10, callbacks=[kmk.SyncedCheckpoint("ckpts")])
    except kmk.ReplicaDivergenceError:
        # A variable was assigned per replica outside the optimizer: fix that, or pass
        # verify_replicas=False to save replica 0's values anyway.
        raise
    ```
    """


def _is_unsynced_batch_norm(layer: Any) -> bool:
    return isinstance(layer, keras.layers.BatchNormalization) and not getattr(
        layer, "synchronized", False
    )


# The largest slice of a variable compared at a time: its temporaries (replica 0's slice on
# another device, the elementwise results) stay a few MiB whatever the variable's size.
_CHUNK_BYTES = 4 << 20


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


def _all_equal(copies: list[Any]) -> tf.Tensor:
    """Whether every copy equals replica 0's, each compared on its own device (a bool)."""
    length = max(1, _CHUNK_BYTES // copies[0].dtype.size)
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


def _compare_on_devices(copies: list[Any]) -> tf.Tensor:
    """Per replica, on its own device: [equal to replica 0, all finite, max |difference|].

    Replica 0's copy is brought to each other replica's device a slice at a time; only
    the three scalars per replica are stacked for the host.
    """
    dtype = copies[0].dtype
    width = 8 if dtype.is_integer else dtype.size  # integers are compared as float64
    stats = _compare_slices(copies[0], copies, max(1, _CHUNK_BYTES // width), _slice_stats)
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


def check_replicas(model: Any, variables: list[tuple[str, Any]], atol: float) -> float:
    """Checks that the per-replica copies of every mirrored variable of `model` are equal.

    The copies are compared where they live, and only scalars come to the host: each
    replica's copy against replica 0's, on that replica's device (replica 0's values are
    brought there; one boolean per variable comes back); then, for the variables whose
    copies differ, whether each copy is finite and the largest difference, likewise. A
    variable over 4 MiB is compared a flat slice of at most 4 MiB at a time, so the
    check's temporaries stay a few MiB whatever the size of the largest variable.

    Variables synchronized on read are skipped (their copies legitimately differ). So are
    the moving statistics of a `BatchNormalization` without synchronized statistics: their
    largest difference is returned instead, for the caller to report.

    Returns the largest difference beyond `atol` between replicas of unsynchronised
    BatchNormalization moving statistics, or 0.0 (also with fewer than 2 replicas).

    Raises:
        ReplicaDivergenceError: When any other variable's copies differ by more than
            `atol`; copies holding NaN or Inf on some replicas only are named as such.
    """
    strategy = model.distribute_strategy
    if strategy.num_replicas_in_sync < 2:
        return 0.0
    batch_norm_ids = {
        id(v)
        for layer in model._flatten_layers(include_self=True)  # noqa: SLF001
        if _is_unsynced_batch_norm(layer)
        for v in (layer.moving_mean, layer.moving_variance)
    }
    diverged: list[str] = []
    non_finite: list[str] = []
    batch_norm_gap = 0.0
    mirrored: list[tuple[Any, list[Any]]] = []
    for _, variable in variables:
        value = getattr(variable, "value", variable)
        if getattr(value, "synchronization", None) == tf.VariableSynchronization.ON_READ:
            continue
        copies = list(strategy.experimental_local_results(value))
        if len(copies) >= 2:
            mirrored.append((variable, copies))
    if not mirrored:
        return 0.0
    # Each copy against replica 0's where it lives: one transfer of one bool per variable.
    equal = np.asarray(tf.stack([_all_equal(copies) for _, copies in mirrored]))
    differing = [pair for pair, same in zip(mirrored, equal) if not same]
    compared = [(variable, _compare_on_devices(copies)) for variable, copies in differing]
    # The copies that differ bit for bit, compared exactly: three scalars per replica.
    results = np.asarray(tf.stack([rows for _, rows in compared])) if compared else []
    for (variable, _), rows in zip(compared, results):
        if rows[:, 0].all():  # every copy equal to replica 0's (NaN where it has NaN)
            continue
        broken = [i for i, row in enumerate(rows) if not row[1]]
        if broken:  # NaN/Inf on some replicas: say so, not "max |diff| nan"
            non_finite.append(f"{variable.path} (NaN or Inf on replica {broken})")
            continue
        gap = max(0.0, float(rows[:, 2].max()))
        if gap <= atol:
            continue
        if id(variable) in batch_norm_ids:
            batch_norm_gap = max(batch_norm_gap, gap)
        else:
            diverged.append(f"{variable.path} (max |diff| {gap:.3g})")
    if non_finite:
        raise ReplicaDivergenceError(
            f"{len(non_finite)} mirrored variable(s) hold NaN or Inf on some replicas only, "
            "so the replicas are out of sync and no checkpoint was written: "
            f"{', '.join(non_finite[:10])}{' ...' if len(non_finite) > 10 else ''}. "
            "Training diverged on those replicas (for example a float16 overflow that was "
            "not skipped everywhere); resume from the earlier checkpoints, with a lower "
            "learning rate or bfloat16."
        )
    if diverged:
        raise ReplicaDivergenceError(
            f"{len(diverged)} mirrored variable(s) differ between replicas, so the "
            "replicas are out of sync and no checkpoint was written: "
            f"{', '.join(diverged[:10])}{' ...' if len(diverged) > 10 else ''}. This "
            "happens when a variable is assigned per replica outside the optimizer. "
            "Set verify_replicas=False to save anyway (replica 0's values)."
        )
    return batch_norm_gap


def log_batch_norm_gap(gap: float) -> None:
    """Logs that unsynchronised BatchNormalization statistics differ between replicas."""
    logger.info(
        "keras-mirror-kit: BatchNormalization moving statistics differ between "
        "replicas (max |diff| %.3g), as expected without synchronized statistics; "
        "replica 0's are saved. Use BatchNormalization(synchronized=True) to keep "
        "them equal.",
        gap,
    )
