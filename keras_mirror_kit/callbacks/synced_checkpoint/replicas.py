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


def _finite(value: np.ndarray) -> bool:
    return value.dtype.kind not in "fc" or bool(np.isfinite(value).all())


def check_replicas(model: Any, variables: list[tuple[str, Any]], atol: float) -> float:
    """Checks that the per-replica copies of every mirrored variable of `model` are equal.

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
    for _, variable in variables:
        value = getattr(variable, "value", variable)
        if getattr(value, "synchronization", None) == tf.VariableSynchronization.ON_READ:
            continue
        copies = strategy.experimental_local_results(value)
        if len(copies) < 2:
            continue
        first = np.asarray(copies[0])
        if all(np.array_equal(np.asarray(c), first, equal_nan=True) for c in copies):
            continue
        broken = [i for i, c in enumerate(copies) if not _finite(np.asarray(c))]
        if broken:  # NaN/Inf on some replicas: say so, not "max |diff| nan"
            non_finite.append(f"{variable.path} (NaN or Inf on replica {broken})")
            continue
        gap = max(
            float(np.max(np.abs(np.asarray(c, np.float64) - first), initial=0.0)) for c in copies
        )
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
