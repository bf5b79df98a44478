"""Batch sizes and learning rates under data parallelism.

The global batch is the per-replica batch times the replicas (`global_batch_size`,
`per_replica_batch_size`). When the batch grows, the learning rate tuned for a smaller one is
scaled (`scale_learning_rate`): `linear` is the rule of Goyal et al. 2017 ("Accurate, Large
Minibatch SGD"): when the batch grows k times, multiply the learning rate by k. `sqrt`
multiplies by sqrt(k), the rule commonly used for Adam-type optimizers. `none` leaves the
learning rate as it is.
"""

from __future__ import annotations

import math

from keras_mirror_kit.validation import positive_int, positive_number

__all__ = [
    "DEFAULT_RULE",
    "RULES",
    "global_batch_size",
    "per_replica_batch_size",
    "scale_factor",
    "scale_learning_rate",
    "validate_rule",
]

RULES = ("linear", "sqrt", "none")
DEFAULT_RULE = "linear"


def validate_rule(rule: object) -> str:
    """`rule` if it is one of `RULES`, else a `ValueError` naming them."""
    if rule not in RULES:
        raise ValueError(
            f"Unknown learning-rate scaling rule. Expected one of {', '.join(map(repr, RULES))}. "
            f"Received: rule={rule!r}"
        )
    return str(rule)


def scale_factor(base_batch_size: int, global_batch_size: int, rule: str = DEFAULT_RULE) -> float:
    """The multiplier `rule` applies when the batch grows from base to global: k, sqrt(k), 1."""
    base = positive_int("base_batch_size", base_batch_size)
    total = positive_int("global_batch_size", global_batch_size)
    rule = validate_rule(rule)
    k = total / base
    if rule == "linear":
        return k
    if rule == "sqrt":
        return math.sqrt(k)
    return 1.0


def scale_learning_rate(
    base_learning_rate: float,
    base_batch_size: int,
    global_batch_size: int,
    rule: str = DEFAULT_RULE,
) -> float:
    """Scales a learning rate tuned at `base_batch_size` to `global_batch_size`.

    Args:
        base_learning_rate: A positive learning rate that works at `base_batch_size`.
        base_batch_size: Batch size the base learning rate was tuned for.
        global_batch_size: The global batch size in use (all replicas).
        rule: `"linear"` (Goyal et al. 2017), `"sqrt"` or `"none"`.

    Returns:
        The scaled learning rate.

    Raises:
        TypeError: If a batch size is not an integer or the learning rate not a number.
        ValueError: If a value is not positive, or the rule is unknown.

    Example:

    ```python
    kmk.scale_learning_rate(1e-3, 64, 256)                # -> 0.004
    kmk.scale_learning_rate(1e-3, 64, 256, rule="sqrt")   # -> 0.002
    ```
    """
    base_learning_rate = positive_number("base_learning_rate", base_learning_rate)
    return base_learning_rate * scale_factor(base_batch_size, global_batch_size, rule)


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
