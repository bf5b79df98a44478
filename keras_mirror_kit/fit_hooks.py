"""What a `fit()` calls on a callback besides Keras' own hooks: the `FitHooks` protocol.

Keras gives a callback no handle on the `fit()` that drives it: not the `CallbackList`
that calls it (so it cannot see or reorder the other callbacks), not the data, not the end
of a `fit()` that raised (Keras calls no `on_train_end` then). The kit's callbacks need
all three, so `fit()` itself hands them over: `dispatch` runs one `fit()` call with the
hooks of `FitHooks`, before, around and after Keras' own loop.

Two wrappers call `dispatch`: the per-instance `fit` of a model the kit built
(`keras_mirror_kit.fit_wrapper`, after its data checks and before the backend may swap
the data for its replica twin), and, for every other model, a class-level wrapper of
`keras.Model.fit` (`install`) that the kit's callbacks install when the first of them is
created (never on import). A call the per-instance wrapper already dispatched goes
through the class-level one untouched, and a `fit()` whose callbacks define no hook is
Keras' own `fit()` plus one look at each callback.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

import keras

from keras_mirror_kit.fit_arguments import KerasCall

__all__ = [
    "FitHooks",
    "dispatch",
    "install",
    "listed",
    "order_callbacks",
]

logger = logging.getLogger("keras_mirror_kit")

R = TypeVar("R")

_HOOKS = ("produces_logs", "check_fit_data", "arrange_callbacks", "on_fit_exception", "on_fit_end")

# The model whose next `fit()` call a wrapper already dispatched (the class-level wrapper
# then passes it through); one value per thread and task.
_dispatched: contextvars.ContextVar[Any] = contextvars.ContextVar("kmk_fit_dispatched")
_install_lock = threading.Lock()
_installed = False


@runtime_checkable
class FitHooks(Protocol):
    """What `fit()` calls on a callback besides Keras' hooks; each one defined is used.

    * `produces_logs = True` (a class attribute): the callback adds figures to `logs`
      (`ThroughputMonitor`), so `fit` runs it before the others: Keras calls callbacks in
      list order, and a logger (CSVLogger, TensorBoard, W&B) listed first would write its
      row before the figures exist.
    * `resumes_mid_epoch = True` (a class attribute): the callback resumes a kit dataset
      mid-epoch (`SyncedCheckpoint`), so the `fit` of a model the kit built trains on
      in-memory arrays through a kit dataset of the same batches
      (`fit_inputs.arrays_as_dataset`).
    * `check_fit_data(x)`: called with `fit`'s `x` before any step; raise to refuse it
      (`SyncedCheckpoint(dataset=)` refuses another dataset than its own).
    * `arrange_callbacks(callbacks)`: called with this `fit()`'s callbacks in the order
      Keras will call them (it appends its `History` and progress bar after them); returns
      the list to use instead (`SyncedCheckpoint` runs after the stateful callbacks and
      puts its hooks first and last). The user's own list is never changed.
    * `on_fit_exception(exception)`: called when `fit` raises (Ctrl-C too), before the
      exception propagates. Keras calls no `on_train_end` then, so this is where a callback
      closes what it opened (`WandbLogger` finishes its run as failed). An error raised
      here is logged and never replaces `exception`.
    * `on_fit_end()`: called once `fit()` has returned or raised (after
      `on_fit_exception`); errors are logged.
    """

    produces_logs: ClassVar[bool]

    def check_fit_data(self, x: Any) -> None: ...

    def arrange_callbacks(self, callbacks: list[Any]) -> list[Any]: ...

    def on_fit_exception(self, exception: BaseException) -> None: ...

    def on_fit_end(self) -> None: ...


def listed(callbacks: Any) -> list[Any]:
    """The callbacks of `fit`'s `callbacks` argument as a new list (a list, a `CallbackList`)."""
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    if isinstance(callbacks, keras.callbacks.Callback):
        return [callbacks]
    if not isinstance(callbacks, Sequence) or isinstance(callbacks, (str, bytes)):
        return []
    return list(callbacks)


def _hook(callback: Any, name: str) -> Any:
    hook = getattr(callback, name, None)
    return hook if callable(hook) else None


def _takes_part(callback: Any) -> bool:
    """Whether `callback` defines any of the `FitHooks`."""
    return getattr(callback, "produces_logs", False) is True or any(
        _hook(callback, name) is not None for name in _HOOKS[1:]
    )


def _call_each(callbacks: list[Any], name: str, *args: Any) -> None:
    """Calls hook `name` of every callback that has it; errors are logged, never raised."""
    for callback in callbacks:
        hook = _hook(callback, name)
        if hook is not None:
            try:
                hook(*args)
            except Exception:
                logger.exception("keras-mirror-kit: %s of %r failed", name, callback)


def order_callbacks(callbacks: Any) -> Any:
    """`callbacks` with those that produce logs first (a `CallbackList` is left as it is)."""
    if not isinstance(callbacks, Sequence) or isinstance(callbacks, (str, bytes)):
        return callbacks
    listed = list(callbacks)
    producers = [c for c in listed if getattr(c, "produces_logs", False) is True]
    if not producers:
        return callbacks
    return producers + [c for c in listed if getattr(c, "produces_logs", False) is not True]


def _arranged(callbacks: list[Any]) -> list[Any]:
    """`callbacks` as each one's `arrange_callbacks` leaves them, in list order."""
    for callback in list(callbacks):
        hook = _hook(callback, "arrange_callbacks")
        if hook is not None:
            callbacks = list(hook(list(callbacks)))
    return callbacks


def dispatch(model: Any, callbacks: Any, x: Any, run: Callable[[Any], R]) -> R:
    """Runs one `fit()` of `model`, `run(callbacks)`, with the callbacks' `FitHooks`.

    Orders the callbacks (producers of logs first), lets each check `x` and arrange the
    list, then calls `run` with the callbacks to give Keras (a `CallbackList` given by the
    user is arranged in place and put back afterwards); `on_fit_exception` if a check or
    `run` raises, `on_fit_end` in any case.
    """
    if not any(_takes_part(c) for c in listed(callbacks)):
        token = _dispatched.set(model)
        try:
            return run(callbacks)
        finally:
            _dispatched.reset(token)
    callbacks = order_callbacks(callbacks)
    given_list = callbacks if isinstance(callbacks, keras.callbacks.CallbackList) else None
    before = list(given_list.callbacks) if given_list is not None else []
    arranged = listed(callbacks)
    token = _dispatched.set(model)
    try:
        for callback in arranged:
            hook = _hook(callback, "check_fit_data")
            if hook is not None:
                hook(x)
        arranged = _arranged(arranged)
        if given_list is not None:  # Keras uses it as it is: no set_model for what was added
            for callback in arranged:
                if not any(callback is c for c in before):
                    callback.set_model(model)
            given_list.callbacks = arranged
        return run(given_list if given_list is not None else arranged)
    except BaseException as exception:  # Ctrl-C too: Keras' fit has no finally
        _call_each(arranged, "on_fit_exception", exception)
        raise
    finally:
        _dispatched.reset(token)
        if given_list is not None:
            given_list.callbacks = before
        _call_each(arranged, "on_fit_end")


def install() -> None:
    """Wraps `keras.Model.fit` once, so that every model's `fit()` calls `FitHooks`.

    Called by the kit's callbacks when one is created. A model the kit built dispatches in
    its own `fit` wrapper (`fit_wrapper`); its calls pass through this one untouched.
    """
    global _installed
    with _install_lock:
        if _installed:
            return
        original = keras.Model.fit
        parameters = list(inspect.signature(original).parameters.values())
        signature = inspect.Signature(parameters[1:])  # after `self`

        @functools.wraps(original)
        def fit(self: Any, *args: Any, **kwargs: Any) -> Any:
            if _dispatched.get(None) is self:  # the kit's wrapper of this model dispatched it
                _dispatched.set(None)  # a nested fit() of the same model is dispatched again
                return original(self, *args, **kwargs)
            call = KerasCall.read("fit", signature, args, kwargs)
            if call is None:  # does not bind: Keras' own error
                return original(self, *args, **kwargs)
            given = call.arguments

            def run(callbacks: Any) -> Any:
                _dispatched.set(None)  # Keras' own fit() next: a nested fit() is dispatched
                if callbacks is not None or "callbacks" in given:
                    given["callbacks"] = callbacks
                call_args, call_kwargs = call.call()
                return original(self, *call_args, **call_kwargs)

            return dispatch(self, given.get("callbacks"), given.get("x"), run)

        keras.Model.fit = fit  # type: ignore[method-assign]
        _installed = True
