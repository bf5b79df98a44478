"""Checking, before a save, that every replica holds the same values: `ReplicaDivergenceError`."""

from __future__ import annotations

import logging
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


def _all_equal(copies: list[Any]) -> tf.Tensor:
    """Whether every copy equals replica 0's, each compared on its own device (a bool)."""
    first = tf.convert_to_tensor(copies[0])
    equal = []
    for copy in copies[1:]:
        with tf.device(copy.device):
            equal.append(tf.reduce_all(tf.equal(tf.convert_to_tensor(copy), first)))
    return tf.reduce_all(tf.stack(equal))


def _compare_on_devices(copies: list[Any]) -> tf.Tensor:
    """Per replica, on its own device: [equal to replica 0, all finite, max |difference|].

    Replica 0's copy is brought to each other replica's device (one variable at a time);
    only the three scalars per replica are stacked for the host.
    """
    rows = []
    first = tf.convert_to_tensor(copies[0])
    for copy in copies:
        with tf.device(copy.device):
            here = tf.convert_to_tensor(copy)
            there = tf.identity(first)  # replica 0's values, copied to this device
            if here.dtype.is_complex:
                here = tf.stack([tf.math.real(here), tf.math.imag(here)])
                there = tf.stack([tf.math.real(there), tf.math.imag(there)])
            same = tf.equal(here, there)
            if here.dtype.is_floating:
                same = tf.logical_or(
                    same, tf.logical_and(tf.math.is_nan(here), tf.math.is_nan(there))
                )
                finite = tf.reduce_all(tf.math.is_finite(here))
            else:
                finite = tf.constant(True)
            if here.dtype == tf.bool:
                gap = tf.cast(tf.logical_not(tf.reduce_all(same)), tf.float64)
            elif here.dtype.is_floating:  # in its own precision: no wider temporaries
                gap = tf.cast(tf.reduce_max(tf.abs(here - there)), tf.float64)
            else:
                gap = tf.reduce_max(tf.abs(tf.cast(here, tf.float64) - tf.cast(there, tf.float64)))
            rows.append(
                tf.stack(
                    [tf.cast(tf.reduce_all(same), tf.float64), tf.cast(finite, tf.float64), gap]
                )
            )
    return tf.stack(rows)


def check_replicas(model: Any, variables: list[tuple[str, Any]], atol: float) -> float:
    """Checks that the per-replica copies of every mirrored variable of `model` are equal.

    The copies are compared where they live, and only scalars come to the host: each
    replica's copy against replica 0's, on that replica's device (replica 0's values are
    brought there; one boolean per variable comes back); then, for the variables whose
    copies differ, whether each copy is finite and the largest difference, likewise.

    Variables synchronized on read are skipped (their copies legitimately differ). So are
    the moving statistics of a `BatchNormalization` without synchronized statistics: their
    largest difference is returned instead, for the caller to report.

    Args:
        model: The model being fit (its `distribute_strategy` holds the replicas).
        variables: The `(group, variable)` pairs to check, as saved.
        atol: Largest absolute difference accepted between two copies.

    Returns:
        The largest difference between replicas of unsynchronised BatchNormalization
        moving statistics beyond `atol`, or 0.0 (also with fewer than 2 replicas).

    Raises:
        ReplicaDivergenceError: When any other variable's copies differ by more than
            `atol`; copies holding NaN or Inf on some replicas only are named as such.

    Example:

    ```python
    gap = check_replicas(model, [("model", v) for v in model.variables], atol=0.0)
    ```
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
    """Logs that unsynchronised BatchNormalization statistics differ between replicas.

    Args:
        gap: The largest difference, as returned by `check_replicas`.

    Returns:
        None.

    Example:

    ```python
    if gap := check_replicas(model, variables, atol=0.0):
        log_batch_norm_gap(gap)
    ```
    """
    logger.info(
        "keras-mirror-kit: BatchNormalization moving statistics differ between "
        "replicas (max |diff| %.3g), as expected without synchronized statistics; "
        "replica 0's are saved. Use BatchNormalization(synchronized=True) to keep "
        "them equal.",
        gap,
    )
