"""The saved state of the other stateful callbacks of a `fit()`: collecting and applying it.

Known Keras callbacks (`EarlyStopping`, `ReduceLROnPlateau`, `ModelCheckpoint`'s best value)
are read and written attribute by attribute; any other callback takes part by defining
`get_checkpoint_state()` (a dict of JSON values and NumPy arrays) and
`set_checkpoint_state(state)`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

import keras
import numpy as np

from keras_mirror_kit.checkpoint.meta import CALLBACK_ARRAY, CALLBACK_ARRAYS, callback_array_key

__all__ = ["apply_callback_states", "best_weights_restored", "callback_states", "is_stateful"]

logger = logging.getLogger("keras_mirror_kit")

_KNOWN_STATE: tuple[tuple[type, tuple[str, ...]], ...] = (
    (
        keras.callbacks.EarlyStopping,
        ("wait", "stopped_epoch", "best", "best_epoch", "best_weights"),
    ),
    (keras.callbacks.ReduceLROnPlateau, ("wait", "best", "cooldown_counter")),
    (keras.callbacks.ModelCheckpoint, ("best",)),
)


def _has_protocol(callback: Any) -> bool:
    return callable(getattr(callback, "get_checkpoint_state", None)) and callable(
        getattr(callback, "set_checkpoint_state", None)
    )


def _state_fields(callback: Any) -> tuple[str, ...] | None:
    for cls, fields in _KNOWN_STATE:
        if isinstance(callback, cls):
            return fields
    return None


def is_stateful(callback: Any) -> bool:
    """Whether a checkpoint saves the state of `callback` (a known stateful Keras callback,
    or one with `get_checkpoint_state` and `set_checkpoint_state`)."""
    return _has_protocol(callback) or _state_fields(callback) is not None


def callback_states(
    tracked: list[tuple[str, Any]], arrays: dict[str, np.ndarray]
) -> dict[str, Any]:
    """The JSON-able state of each tracked callback by key (`"EarlyStopping#0"`).

    Each NumPy array of a state goes into `arrays` under `"callback/<key>/<name>"` (lists
    of arrays: `"callback/<key>/<name>/<i>"`), replaced by a marker in the state.

    Raises:
        TypeError: When a state value is neither JSON nor NumPy arrays.
    """
    states: dict[str, Any] = {}
    for key, callback in tracked:
        if _has_protocol(callback):
            raw = dict(callback.get_checkpoint_state())
        else:
            raw = {f: getattr(callback, f, None) for f in _state_fields(callback) or ()}
        encoded: dict[str, Any] = {}
        for name, value in raw.items():
            if isinstance(value, np.ndarray):
                arrays[callback_array_key(key, name)] = value
                encoded[name] = {CALLBACK_ARRAY: True}
            elif (
                isinstance(value, (list, tuple))
                and value
                and all(isinstance(v, np.ndarray) for v in value)
            ):
                for i, v in enumerate(value):
                    arrays[callback_array_key(key, name, i)] = v
                encoded[name] = {CALLBACK_ARRAYS: len(value)}
            else:
                value = value.item() if isinstance(value, np.generic) else value
                try:
                    json.dumps(value)
                except (TypeError, ValueError) as err:
                    raise TypeError(
                        f"The checkpoint state of {key} must hold JSON values or NumPy "
                        f"arrays; {name!r} is {type(value).__name__}. Received: "
                        f"{name}={value!r}"
                    ) from err
                encoded[name] = value
        states[key] = encoded
    return states


def apply_callback_states(
    tracked: list[tuple[str, Any]], states: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
) -> None:
    """Gives the tracked callbacks the state a checkpoint saved for them.

    A callback without saved state starts afresh, and saved state of a callback no longer
    listed is ignored; both are logged.
    """
    for key, callback in tracked:
        if key not in states:
            logger.info(
                "keras-mirror-kit: the checkpoint holds no state for %s; it starts afresh",
                key,
            )
            continue
        decoded: dict[str, Any] = {}
        for name, value in states[key].items():
            if isinstance(value, dict) and value.get(CALLBACK_ARRAY):
                decoded[name] = arrays[callback_array_key(key, name)]
            elif isinstance(value, dict) and CALLBACK_ARRAYS in value:
                decoded[name] = [
                    arrays[callback_array_key(key, name, i)]
                    for i in range(int(value[CALLBACK_ARRAYS]))
                ]
            else:
                decoded[name] = value
        if _has_protocol(callback):
            callback.set_checkpoint_state(decoded)
        else:
            for name, value in decoded.items():
                setattr(callback, name, value)
    unused = sorted(set(states) - {key for key, _ in tracked})
    if unused:
        logger.info(
            "keras-mirror-kit: the checkpoint holds state for %s, which is not in the "
            "callbacks list now; ignored",
            ", ".join(unused),
        )


def best_weights_restored(tracked: list[tuple[str, Any]]) -> bool:
    """Whether an `EarlyStopping` among the tracked callbacks puts its best weights back."""
    return any(
        isinstance(c, keras.callbacks.EarlyStopping)
        and c.restore_best_weights
        and c.best_weights is not None
        for _, c in tracked
    )
