"""Batch-size arithmetic for data parallelism: per-replica x replicas = global."""

from __future__ import annotations

import numbers

__all__ = [
    "global_batch_size",
    "per_replica_batch_size",
    "validate_non_negative_int",
    "validate_positive_int",
]


def _validate_int(name: str, value: object, minimum: int, kind: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"`{name}` must be a {kind} integer. Received: {name}={value!r} "
            f"(of type {type(value).__name__})"
        )
    if value < minimum:
        raise ValueError(f"`{name}` must be a {kind} integer. Received: {name}={value}")
    return int(value)


def validate_positive_int(name: str, value: object) -> int:
    """Checks that `value` is a positive integer (bools are rejected).

    Args:
        name: The argument's name, used in the error message.
        value: The value to check.

    Returns:
        `value` as an `int`.

    Raises:
        TypeError: If `value` is not an integer.
        ValueError: If `value` is zero or negative.

    Example:

    ```python
    validate_positive_int("batch_size", 64)  # -> 64
    ```
    """
    return _validate_int(name, value, 1, "positive")


def validate_non_negative_int(name: str, value: object) -> int:
    """Checks that `value` is an integer >= 0 (bools are rejected).

    Args:
        name: The argument's name, used in the error message.
        value: The value to check.

    Returns:
        `value` as an `int`.

    Raises:
        TypeError: If `value` is not an integer.
        ValueError: If `value` is negative.

    Example:

    ```python
    validate_non_negative_int("seed", 0)  # -> 0
    ```
    """
    return _validate_int(name, value, 0, "non-negative")


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
    per_replica = validate_positive_int("per_replica_batch_size", per_replica_batch_size)
    replicas = validate_positive_int("num_replicas", num_replicas)
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
    total = validate_positive_int("global_batch_size", global_batch_size)
    replicas = validate_positive_int("num_replicas", num_replicas)
    if total % replicas:
        lower = max(replicas, total - total % replicas)
        raise ValueError(
            f"`global_batch_size` must divide evenly by the number of replicas ({replicas}). "
            f"Received: global_batch_size={total}. Use a multiple of {replicas} (for example "
            f"{lower} or {lower + replicas}) or pass `per_replica_batch_size` instead."
        )
    return total // replicas
