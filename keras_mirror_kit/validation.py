"""Argument validators shared by the whole kit: one wording for every "must be" error.

Each returns the value in its canonical type or raises a `TypeError` (wrong type; bools are
never numbers here) or `ValueError` (right type, bad value) of the form
`` `name` must be ... Received: name=value ``, as Keras' own errors read. Domain checks
(a learning-rate rule, a precision policy, a `TF_CONFIG`) stay with their modules.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable, Hashable, Mapping, Sequence

__all__ = [
    "pick_devices",
    "check_bool",
    "check_path",
    "non_empty_str",
    "non_negative_int",
    "non_negative_number",
    "one_of",
    "optional_positive_number",
    "positive_int",
    "positive_int_or",
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


def share_of_one(name: str, value: object) -> float:
    """`value` as a float if it is a finite real from 0 to 1 (a share of something)."""
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if real and not 0 <= value <= 1:  # NaN and infinities too
        raise ValueError(f"`{name}` must be a share, from 0 to 1. Received: {name}={value}")
    return non_negative_number(name, value, "a share, from 0 to 1")


def optional_positive_number(name: str, value: object, meaning: str = "") -> float | None:
    """Like `positive_number`, but None passes through (an optional figure not given)."""
    return None if value is None else positive_number(name, value, meaning)


def check_bool(name: str, value: object) -> bool:
    """`value` if it is True or False (not merely truthy), else a `TypeError`."""
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be True or False. Received: {name}={value!r}")
    return value


def positive_int_or(name: str, value: object, word: str, unit: str = "") -> int | str:
    """`word`, or `value` as an int if it is an integer >= 1 (`unit`: what it counts)."""
    if isinstance(value, str) and value == word:
        return word
    what = f"{word!r} or a positive integer" + (f" number of {unit}" if unit else "")
    if isinstance(value, bool) or not isinstance(value, (str, numbers.Integral)):
        raise TypeError(
            f"`{name}` must be {what}. Received: {name}={value!r} (of type {type(value).__name__})"
        )
    if isinstance(value, str) or value < 1:
        raise ValueError(f"`{name}` must be {what}. Received: {name}={value!r}")
    return int(value)


def non_empty_str(name: str, value: object, meaning: str = "a non-empty string") -> str:
    """`value` if it is a non-empty string (`meaning`: what it must be, for the message)."""
    if not isinstance(value, str):
        raise TypeError(f"`{name}` must be {meaning}. Received: {name}={value!r}")
    if not value:
        raise ValueError(f"`{name}` must be {meaning}. Received: {name}={value!r}")
    return value


def one_of(name: str, value: object, choices: Sequence[str], note: str = "") -> str:
    """`value` if it is one of the strings `choices` (`note` follows them in the message)."""
    quoted = [repr(c) for c in choices]
    listed = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
    message = f"`{name}` must be {listed}{' ' + note if note else ''}. Received: {name}={value!r}"
    if not isinstance(value, str):
        raise TypeError(message)
    if value not in choices:
        raise ValueError(message)
    return value


def check_path(name: str, value: object) -> str | os.PathLike[str]:
    """`value` if it is a non-empty path (a str or an `os.PathLike`)."""
    message = f"`{name}` must be a non-empty path (str or os.PathLike). Received: {name}={value!r}"
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(message)
    if not str(value):
        raise ValueError(message)
    return value


def pick_devices(
    devices: Sequence[object],
    canonical: Callable[[str], Hashable],
    available: Mapping[Hashable, object],
    shown: Sequence[str],
) -> list[object]:
    """Each named device's entry in `available` (keyed by `canonical(name)`), in order."""
    chosen: list[object] = []
    seen: set[Hashable] = set()
    for item in devices:
        if not isinstance(item, str):
            raise TypeError(
                f"`devices` must contain device-name strings. Received: devices={devices!r}"
            )
        key = canonical(item)
        if key in seen:
            raise ValueError(f"`devices` names {item!r} twice. Received: devices={devices!r}")
        seen.add(key)
        if key not in available:
            raise ValueError(
                f"Device {item!r} does not exist on this host. Available devices: "
                f"{list(shown)}. Received: devices={list(devices)!r}"
            )
        chosen.append(available[key])
    return chosen
