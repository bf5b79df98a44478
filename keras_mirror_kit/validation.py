"""Argument validators shared by the whole kit: one wording for every "must be" error.

Each returns the value in its canonical type or raises a `TypeError` (wrong type; bools are
never numbers here) or `ValueError` (right type, bad value) of the form
`` `name` must be ... Received: name=value ``, as Keras' own errors read. Domain checks
(a learning-rate rule, a precision policy, a `TF_CONFIG`) stay with their modules.
"""

from __future__ import annotations

import math
import numbers

__all__ = [
    "check_bool",
    "non_negative_int",
    "non_negative_number",
    "optional_positive_number",
    "positive_int",
    "positive_number",
]


def _int(name: str, value: object, minimum: int, kind: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"`{name}` must be a {kind} integer. Received: {name}={value!r} "
            f"(of type {type(value).__name__})"
        )
    if value < minimum:
        raise ValueError(f"`{name}` must be a {kind} integer. Received: {name}={value}")
    return int(value)


def positive_int(name: str, value: object) -> int:
    """`value` as an int if it is an integer >= 1 (bools are refused)."""
    return _int(name, value, 1, "positive")


def non_negative_int(name: str, value: object) -> int:
    """`value` as an int if it is an integer >= 0 (bools are refused)."""
    return _int(name, value, 0, "non-negative")


def _number(name: str, value: object, allow_zero: bool, meaning: str) -> float:
    kind = "non-negative" if allow_zero else "positive"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        what = f" ({meaning})" if meaning else ""
        raise TypeError(
            f"`{name}` must be a {kind} number{what}. Received: {name}={value!r} "
            f"(of type {type(value).__name__})"
        )
    number = float(value)
    if not math.isfinite(number) or number < 0 or (number == 0 and not allow_zero):
        raise ValueError(f"`{name}` must be a {kind}, finite number. Received: {name}={value}")
    return number


def positive_number(name: str, value: object, meaning: str = "") -> float:
    """`value` as a float if it is a finite real > 0; `meaning` is added to a type error."""
    return _number(name, value, False, meaning)


def non_negative_number(name: str, value: object, meaning: str = "") -> float:
    """`value` as a float if it is a finite real >= 0; `meaning` is added to a type error."""
    return _number(name, value, True, meaning)


def optional_positive_number(name: str, value: object, meaning: str = "") -> float | None:
    """Like `positive_number`, but None passes through (an optional figure not given)."""
    return None if value is None else positive_number(name, value, meaning)


def check_bool(name: str, value: object) -> bool:
    """`value` if it is True or False (not merely truthy), else a `TypeError`."""
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be True or False. Received: {name}={value!r}")
    return value
