"""The measurement behind the step split, on the real run: host time and the backend's own.

`StepClock` measures one `fit()` for `ThroughputMonitor` (the arithmetic is
`keras_mirror_kit.throughput.step_split`). For the whole `fit()` the model's compiled
`train_function` (which Keras' loop looks up at every call) is wrapped with a host timer:
the time inside the calls, against the time between them (Keras' loop and the callbacks).
Inside the calls, what each backend lets the kit tell apart:

* TensorFlow: the batch reads and the replicas' own time (their all-reduce included),
  timed inside the compiled function (`keras_mirror_kit.backends.tensorflow_step_time`);
  the rest of the call is launching it and returning.
* JAX: Keras' JAX loop reads each batch in Python (`next(iterator)` inside the call), so the
  wait for the batch is timed on the host, and the call waits for its step's results
  (`jax.block_until_ready`) so that the device's time is inside it and not in the next
  wait. Blocking keeps JAX from dispatching the next step while the host runs the
  callbacks; that cost has not been measured yet (`benchmarks/step_split_overhead.py`
  runs on TensorFlow), and `ThroughputMonitor(step_split=False)` turns it off.

Neither backend reports the all-reduce apart: XLA fuses it into JAX's step, and timing it
in TensorFlow's step cost more than the 2% budget (`tensorflow_step_time`).

Only calls made while `measuring` is set count (the monitor sets it when warm-up ends), and
the backend's totals are read by `totals()` only, at the monitor's epoch ends: never inside
an epoch.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from keras_mirror_kit import backends

__all__ = ["StepClock", "Totals", "remove_step_timing"]

_WRAPPER_MARK = "kmk_step_clock_wrapper"


class Totals(NamedTuple):
    """What a `StepClock` measured so far (seconds; None: not measured by this backend)."""

    calls: int  # timed calls of the train function
    in_call: float  # host seconds inside them
    input_wait: float | None  # seconds waiting for batches
    busy: float | None  # the replicas' own seconds (TensorFlow)
    timed_steps: float  # steps timed inside the calls (as many as the calls' steps, or 0)

    def minus(self, earlier: Totals) -> Totals:
        """What was measured since `earlier`."""

        def less(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else a - b

        return Totals(
            self.calls - earlier.calls,
            self.in_call - earlier.in_call,
            less(self.input_wait, earlier.input_wait),
            less(self.busy, earlier.busy),
            self.timed_steps - earlier.timed_steps,
        )


class _TimedIterator:
    """An iterator that adds the time spent in `next()` to its clock (JAX's loop reads it)."""

    def __init__(self, iterator: Iterator[Any], clock: StepClock) -> None:
        self._iterator, self._clock = iterator, clock

    def __iter__(self) -> _TimedIterator:
        return self

    def __next__(self) -> Any:
        began = self._clock.now()
        try:
            return next(self._iterator)
        finally:
            self._clock.input_wait += self._clock.now() - began


class StepClock:
    """Times one `fit()`'s training calls (module docstring); `start()`, `totals()`, `stop()`.

    Args:
        model: The Keras model being fitted.
        clock: Seconds, monotonic, for the host timers; `time.perf_counter` by default.
    """

    def __init__(self, model: Any, clock: Callable[[], float] = time.perf_counter) -> None:
        self.model = model
        self.now = clock
        self.measuring = False
        self.calls = 0
        self.in_call = 0.0
        self.input_wait = 0.0
        self.why_not: str | None = None  # why nothing inside the calls is measured
        self._backend = backends.name()
        self._graph: Any = None

    def start(self) -> bool:
        """Instruments the model for this `fit()` (after Keras made its train function).

        Returns:
            False, with `why_not` set, when the backend measures nothing inside the calls
            (then only the host split could be told, and the monitor reports no split).
        """
        model = self.model
        if self._backend == "tensorflow":
            from keras_mirror_kit.backends import tensorflow_step_time

            self._graph = tensorflow_step_time.attach(model)
            if self._graph is None:
                self.why_not = (
                    "the step's timestamps need a TensorFlow graph that XLA does not compile "
                    "and that op determinism allows: the model is compiled with "
                    "jit_compile=True or run_eagerly=True, or "
                    "tf.config.experimental.enable_op_determinism() is in force"
                )
                return False
        elif self._backend != "jax":
            self.why_not = f"the {self._backend} backend is not measured"
            return False
        function = _unwrapped(getattr(model, "train_function", None))
        if function is None:
            self.why_not = "the model has no train_function (a loop that is not Keras' fit)"
            return False
        object.__setattr__(model, "train_function", self._wrap(function))
        return True

    def _wrap(self, function: Callable[..., Any]) -> Callable[..., Any]:
        if self._backend == "jax":
            import jax

            @functools.wraps(function)
            def timed_jax(state: Any, iterator: Any) -> Any:
                if not self.measuring:
                    return function(state, iterator)
                began = self.now()
                outputs = function(state, _TimedIterator(iterator, self))
                jax.block_until_ready(outputs)
                self.in_call += self.now() - began
                self.calls += 1
                return outputs

            timed: Callable[..., Any] = timed_jax
        else:
            graph = self._graph

            @functools.wraps(function)
            def timed_tf(iterator: Any) -> Any:
                with graph.reading(iterator):  # a trace times the batch reads it makes
                    if not self.measuring:
                        return function(iterator)
                    began = self.now()
                    try:
                        return function(iterator)
                    finally:
                        self.in_call += self.now() - began
                        self.calls += 1

            timed = timed_tf
        setattr(timed, _WRAPPER_MARK, True)
        return timed

    def totals(self) -> Totals:
        """The measured calls and their seconds so far (see `Totals`)."""
        if self._graph is not None:
            waited, busy, steps = self._graph.read()
            return Totals(self.calls, self.in_call, waited, busy, steps)
        return Totals(self.calls, self.in_call, self.input_wait, None, float(self.calls))

    def stop(self) -> None:
        """Gives the model back its own train function (idempotent)."""
        self.measuring = False
        model = self.model
        function = vars(model).get("train_function") if hasattr(model, "__dict__") else None
        if function is not None and getattr(function, _WRAPPER_MARK, False):
            object.__setattr__(model, "train_function", _unwrapped(function))


def _unwrapped(function: Any) -> Any:
    while function is not None and getattr(function, _WRAPPER_MARK, False):
        function = function.__wrapped__
    return function


def remove_step_timing(model: Any) -> None:
    """Makes the model's compiled training step untimed again (TensorFlow; else a no-op)."""
    if backends.name() == "tensorflow":
        from keras_mirror_kit.backends import tensorflow_step_time

        tensorflow_step_time.detach(model)
