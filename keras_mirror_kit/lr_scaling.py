"""Learning-rate scaling rules for a larger global batch.

`linear` is the rule of Goyal et al. 2017 ("Accurate, Large Minibatch SGD"): when the batch
grows k times, multiply the learning rate by k. `sqrt` multiplies by sqrt(k), the rule
commonly used for Adam-type optimizers. `none` leaves the learning rate as it is.
"""

from __future__ import annotations

import math

from keras_mirror_kit.validation import positive_int, positive_number

__all__ = ["RULES", "DEFAULT_RULE", "scale_learning_rate", "scale_factor", "validate_rule"]

RULES = ("linear", "sqrt", "none")
DEFAULT_RULE = "linear"


def validate_rule(rule: object) -> str:
    """Checks a scaling rule name.

    Args:
        rule: The rule to check.

    Returns:
        The rule.

    Raises:
        ValueError: If `rule` is not one of `RULES`.

    Example:

    ```python
    validate_rule("sqrt")  # -> "sqrt"
    ```
    """
    if rule not in RULES:
        raise ValueError(
            f"Unknown learning-rate scaling rule. Expected one of {', '.join(map(repr, RULES))}. "
            f"Received: rule={rule!r}"
        )
    return str(rule)


def scale_factor(base_batch_size: int, global_batch_size: int, rule: str = DEFAULT_RULE) -> float:
    """Returns the multiplier a rule applies when the batch goes from base to global.

    Args:
        base_batch_size: Batch size the base learning rate was tuned for.
        global_batch_size: The batch size in use.
        rule: `"linear"`, `"sqrt"` or `"none"`.

    Returns:
        k, sqrt(k) or 1.0, where k = global / base.

    Raises:
        TypeError: If a batch size is not an integer.
        ValueError: If a batch size is not positive or the rule is unknown.

    Example:

    ```python
    scale_factor(64, 256, "sqrt")  # -> 2.0
    ```
    """
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
