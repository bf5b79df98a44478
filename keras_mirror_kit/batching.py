"""Batch-size arithmetic for data parallelism: per-replica x replicas = global."""

from __future__ import annotations

from keras_mirror_kit.validation import positive_int

__all__ = [
    "global_batch_size",
    "per_replica_batch_size",
]


def global_batch_size(per_replica_batch_size: int, num_replicas: int) -> int:
    """Returns the global batch size: samples per step over all replicas.

    Args:
        per_replica_batch_size: Samples each replica processes per step.
        num_replicas: Replicas in sync.

    Returns:
        `per_replica_batch_size * num_replicas`.

    Raises:
        TypeError: If an argument is not an integer.
        ValueError: If an argument is not positive.

    Example:

    ```python
    kmk.global_batch_size(64, 2)  # -> 128
    ```
    """
    per_replica = positive_int("per_replica_batch_size", per_replica_batch_size)
    replicas = positive_int("num_replicas", num_replicas)
    return per_replica * replicas


def per_replica_batch_size(global_batch_size: int, num_replicas: int) -> int:
    """Splits a global batch size evenly over the replicas.

    Args:
        global_batch_size: Samples per step over all replicas.
        num_replicas: Replicas in sync.

    Returns:
        `global_batch_size // num_replicas`.

    Raises:
        TypeError: If an argument is not an integer.
        ValueError: If an argument is not positive, or the global batch does not divide
            evenly by the replicas (Keras 3 crashes on an uneven first batch, and an empty
            per-replica batch aborts the process in oneDNN).

    Example:

    ```python
    kmk.per_replica_batch_size(128, 2)  # -> 64
    ```
    """
    total = positive_int("global_batch_size", global_batch_size)
    replicas = positive_int("num_replicas", num_replicas)
    if total % replicas:
        lower = max(replicas, total - total % replicas)
        raise ValueError(
            f"`global_batch_size` must divide evenly by the number of replicas ({replicas}). "
            f"Received: global_batch_size={total}. Use a multiple of {replicas} (for example "
            f"{lower} or {lower + replicas}) or pass `per_replica_batch_size` instead."
        )
    return total // replicas
