"""The replica check before a save (`check_replicas`) and its `ReplicaDivergenceError`."""

from __future__ import annotations

import logging
from typing import Any

import keras

from keras_mirror_kit import backends
from keras_mirror_kit.model_record import engine_of

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


def check_replicas(model: Any, variables: list[tuple[str, Any]], atol: float) -> float:
    """Checks that the per-replica copies of every mirrored variable of `model` are equal.

    The copies are a `tf.distribute` mirrored variable's per-replica variables on
    TensorFlow, a replicated `jax.Array`'s copy on each device (`addressable_shards`) on
    JAX, where they differ only through a fault: under SPMD every copy is the output of
    the same program. They are compared where they live, and only scalars come to the host: each
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
    if engine_of(model).num_replicas < 2:
        return 0.0
    backend = backends.current()
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
        copies = backend.replica_copies(model, variable)  # none when synchronized on read
        if len(copies) >= 2:
            mirrored.append((variable, copies))
    if not mirrored:
        return 0.0
    compared = backend.differing_copies([copies for _, copies in mirrored], _CHUNK_BYTES)
    for index, rows in compared:
        variable = mirrored[index][0]
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
    """Warns that unsynchronised BatchNormalization statistics differ between replicas."""
    logger.warning(
        "keras-mirror-kit: BatchNormalization moving statistics differ between "
        "replicas (max |diff| %.3g), as expected without synchronized statistics: each "
        "replica evaluates and predicts its part of a batch with its own copy, and "
        "replica 0's are saved, so a resumed run starts every replica from them and its "
        "validation is no longer the uninterrupted run's. Build the model with "
        "kmk.distributed(..., sync_batch_norm=True) (or BatchNormalization("
        "synchronized=True)) for the statistics of the global batch, equal on every "
        "replica, and an exact resume.",
        gap,
    )
