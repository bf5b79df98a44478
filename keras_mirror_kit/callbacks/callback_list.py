"""Finding the `keras.callbacks.CallbackList` that is calling a callback."""

from __future__ import annotations

import sys
from typing import Any

import keras

__all__ = ["find_callback_list"]


def find_callback_list(
    callback: keras.callbacks.Callback, max_frames: int = 8
) -> keras.callbacks.CallbackList | None:
    """The `CallbackList` whose loop is calling `callback` right now, found in the call stack.

    Keras gives a callback no handle on the `CallbackList` that drives it (`fit()` wraps the
    `callbacks` argument in a list of its own), yet some callbacks need it: to see the other
    callbacks of the same `fit()`, to change their order, or to tell later whether that
    `fit()` is still running. So the caller frames are walked, looking for a frame whose
    `self` is a `CallbackList` holding `callback`.

    The walk starts at the caller of the function that calls this one and looks at
    `max_frames` frames from there: called directly from a hook such as `on_train_begin`,
    the first frame is the `CallbackList` method that called the hook.

    Args:
        callback: The callback being called (the caller's `self`).
        max_frames: How many frames to look at, from the starting one outwards.

    Returns:
        The `CallbackList`, or None when none is found (callbacks driven by hand, or a
        list calling through more wrapper frames than `max_frames`).

    Example:

    ```python
    class Watcher(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.callback_list = find_callback_list(self)
    ```
    """
    frame = sys._getframe(2)  # noqa: SLF001
    for _ in range(max_frames):
        if frame is None:
            return None
        candidate: Any = frame.f_locals.get("self")
        if isinstance(candidate, keras.callbacks.CallbackList) and any(
            c is callback for c in candidate.callbacks
        ):
            return candidate
        frame = frame.f_back
    return None
