"""The saved state of the other stateful callbacks of a `fit()`: collecting and applying it.

Known Keras callbacks (`EarlyStopping`, `ReduceLROnPlateau`, `ModelCheckpoint`'s best value)
are read and written attribute by attribute; any other callback takes part by defining
`get_checkpoint_state()` (a dict of JSON values and NumPy arrays) and
`set_checkpoint_state(state)`.

A `LearningRateScheduler` holds no state, but it reads the optimizer's rate as each epoch
begins (`schedule(epoch, lr)`), and a checkpoint written mid-epoch holds the rate it set
then: a resumed epoch would apply a function of the rate twice (keras-io's `lr *
exp(-0.1)`). So the rate each epoch began with, before any callback's `on_epoch_begin`, is
noted (`note_epoch_start`, from `SyncedCheckpoint`'s first hook) and saved as the
scheduler's state; an epoch resumed part-way puts it back before the scheduler reads it,
so the scheduler sets the rate the uninterrupted run had.
"""

from __future__ import annotations

import json
import logging
import weakref
from collections.abc import Mapping
from typing import Any

import keras
import numpy as np

from keras_mirror_kit.checkpoint.meta import CALLBACK_ARRAY, CALLBACK_ARRAYS, callback_array_key

__all__ = [
    "apply_callback_states",
    "best_weights_restored",
    "callback_states",
    "is_stateful",
    "note_epoch_start",
]

logger = logging.getLogger("keras_mirror_kit")

_KNOWN_STATE: tuple[tuple[type, tuple[str, ...]], ...] = (
    (
        keras.callbacks.EarlyStopping,
        ("wait", "stopped_epoch", "best", "best_epoch", "best_weights"),
    ),
    (keras.callbacks.ReduceLROnPlateau, ("wait", "best", "cooldown_counter")),
    (keras.callbacks.ModelCheckpoint, ("best",)),
    (keras.callbacks.LearningRateScheduler, ()),  # the rate its epoch began with (above)
)
_EPOCH_RATE = "epoch_start_learning_rate"
_epoch_rates: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()


def _schedulers(tracked: list[tuple[str, Any]]) -> list[Any]:
    return [
        c
        for _, c in tracked
        if isinstance(c, keras.callbacks.LearningRateScheduler) and not _has_protocol(c)
    ]


def note_epoch_start(tracked: list[tuple[str, Any]], model: Any) -> None:
    """Notes the optimizer's learning rate as an epoch begins, before any callback's
    `on_epoch_begin`, for each tracked `LearningRateScheduler` (saved as its state)."""
    schedulers = _schedulers(tracked)
    optimizer = getattr(model, "optimizer", None)
    if not schedulers or optimizer is None:
        return
    rate = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
    for scheduler in schedulers:
        _epoch_rates[scheduler] = rate


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
        elif isinstance(callback, keras.callbacks.LearningRateScheduler):
            raw = {_EPOCH_RATE: _epoch_rates.get(callback)}
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
    tracked: list[tuple[str, Any]],
    states: Mapping[str, Any],
    arrays: Mapping[str, np.ndarray],
    mid_epoch: bool = False,
) -> None:
    """Gives the tracked callbacks the state a checkpoint saved for them.

    A callback without saved state starts afresh, and saved state of a callback no longer
    listed is ignored; both are logged. `mid_epoch`: the first epoch resumes part-way, so
    the learning rate it began with is put back for a `LearningRateScheduler` to read.
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
        elif isinstance(callback, keras.callbacks.LearningRateScheduler):
            rate = decoded.get(_EPOCH_RATE)
            if mid_epoch and isinstance(rate, float):
                callback.model.optimizer.learning_rate = rate  # as the scheduler sets it
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
