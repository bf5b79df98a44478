"""TensorFlow: the batch reads and the replicas' own time inside each compiled training step.

For `ThroughputMonitor`'s step split (`keras_mirror_kit.throughput.step_split`). On a
model that `attach()` instruments, every training step Keras compiles from then on reads
`tf.timestamp()` on each replica:

* when the step's batch is ready on the replica (after the inputs, before the forward pass);
* when its last update is done (after its outputs and a read of every variable it trains,
  which is ordered after the variable's update);

and the compiled function reads it once more, before the call's first `get_next()` of the
input iterator (Keras reads the batches inside the function, outside the replicas' steps):
while `reading()` is active, the iterator's class (`type(iterator)`, TensorFlow's own,
patched once) has reads that note that time when a trace calls them. A step's wait for its
batch runs from that time (the call's first step) or from the replica's previous step's
end (a later step of the call: a read that overlapped the previous step is no wait) to the
step's start; its busy time from its start to its end: one interval of the call each.

The gradient all-reduce is inside the replicas' time. Timing it apart (timestamps after the
local and after the reduced gradients, around the optimizer's `_all_reduce_sum_gradients`)
was tried and cost 5-8% of the CIFAR recipe's step on 2 CPU replicas
(`benchmarks/step_split_overhead.py`), over the 2% budget, so it is not done.

On a GPU a timestamp waits for its tensors to be computed, not only launched: the step
copies one element of each to the host first. The figures are added, per replica, to a
host variable of its own that no model, optimizer or checkpoint tracks, read at epoch ends:
nothing is read from the devices during the epoch. The timestamps add operations beside
the step's and change none of its values (`tests/test_step_split.py` compares the weights
bit for bit).

How: the model instance's `_make_function` (through which Keras' TensorFlow trainer
compiles `train_step` in every release the kit supports) is wrapped, so a train function
made while the clock is on times its steps; `attach()` and `detach()` make the model's
train function again when the setting changes, so the next call traces it. XLA cannot
compile `tf.timestamp()`, and TensorFlow refuses it under
`tf.config.experimental.enable_op_determinism()`: such models are not instrumented.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import tensorflow as tf

from keras_mirror_kit.upstream import tensorflow_private

__all__ = ["GraphClock", "attach", "detach"]

_MAKER_MARK = "kmk_step_clock"
_ITERATOR_MARK = "kmk_step_clock_iterator"
# A replica's row: busy seconds, steps, seconds waited for batches, and the time its last
# step ended.
_STEPS, _LAST_END = 1, 3
_reading = threading.local()  # set while Keras' train function runs under a clock


class GraphClock:
    """Per replica, the totals of its timed steps (`_STEPS`, `_LAST_END`), and the time the
    current call began reading."""

    def __init__(self, rows: int) -> None:
        with tf.init_scope(), tf.device("/cpu:0"):
            # One variable per replica: no replica's update waits for another's.
            self.rows_of = [
                tf.Variable(tf.zeros([4], tf.float64), trainable=False) for _ in range(rows)
            ]
            self.call_start = tf.Variable(tf.zeros([], tf.float64), trainable=False)
        self.rows = rows
        self.enabled = True
        self.made: tuple[Any, ...] | None = None  # the train function made with this setting

    def row(self) -> Any:
        """The variable of the replica that is tracing its step."""
        context = tf.distribute.get_replica_context()
        replica = 0 if context is None else tf.get_static_value(context.replica_id_in_sync_group)
        return self.rows_of[int(replica or 0) % self.rows]

    def read(self) -> tuple[float, float, float]:
        """(input wait seconds, busy seconds, steps) so far: the mean over this process's
        replicas that ran a step (each has its own row)."""
        totals = np.stack([row.numpy() for row in self.rows_of])
        ran = totals[totals[:, _STEPS] > 0]
        busy, steps, waited = ran.mean(axis=0)[:3] if len(ran) else (0.0, 0.0, 0.0)
        return float(waited), float(busy), float(steps)

    @contextmanager
    def reading(self, iterator: Any) -> Iterator[None]:
        """While Keras' train function runs (and is traced) on `iterator`: its batch reads
        are timed (module docstring)."""
        _time_reads(type(iterator))
        _reading.clock, _reading.first = self, True
        try:
            yield
        finally:
            _reading.clock = None


def _time_reads(cls: type) -> None:
    """Gives an iterator class reads that time themselves while a clock reads (once)."""
    if cls.__dict__.get(_ITERATOR_MARK):
        return
    for name in ("get_next", "get_next_as_optional"):
        method = cls.__dict__.get(name) or getattr(cls, name, None)
        if callable(method):
            setattr(cls, name, _timed_read(method))
    setattr(cls, _ITERATOR_MARK, True)


def _timed_read(read: Any) -> Any:
    @functools.wraps(read)
    def timed_read(self: Any, *args: Any, **kwargs: Any) -> Any:
        clock = getattr(_reading, "clock", None)
        if clock is None or not clock.enabled or not _reading.first:
            return read(self, *args, **kwargs)  # a later read: the step times its wait
        _reading.first = False  # the call's first read (also of one read calling another)
        began = tf.timestamp()
        with tf.control_dependencies([clock.call_start.assign(began)]):
            return read(self, *args, **kwargs)

    return timed_read


def _settled(structure: Any) -> list[Any]:
    """Control inputs that are done once every tensor of `structure` is computed."""
    flat = [
        t
        for t in tf.nest.flatten(structure, expand_composites=True)
        if isinstance(t, tf.Tensor) and t.dtype != tf.resource
    ]
    on_device = [t for t in flat if "GPU" in (t.device or "").upper()]
    if not on_device:
        return flat  # host kernels are done when they return
    numeric = [t for t in on_device if t.dtype.is_floating or t.dtype.is_integer]
    with tf.device("/cpu:0"):  # the copy to the host waits for the device's stream
        probe = tf.reduce_sum(
            [tf.reduce_sum(tf.cast(tf.reshape(t, [-1])[:1], tf.float64)) for t in numeric]
            or [tf.zeros([], tf.float64)]
        )
    device_ids = {id(t) for t in on_device}  # by identity: `in` would compare tensors
    return [t for t in flat if id(t) not in device_ids] + [probe]


def _stamp_after(structure: Any) -> Any:
    with tf.control_dependencies(_settled(structure)):
        return tf.timestamp()


def _timed_step(model: Any, step: Any, clock: GraphClock) -> Any:
    @functools.wraps(step)
    def train_step(data: Any) -> Any:
        row = clock.row()
        begin = _stamp_after(data)
        before = row.read_value()
        # The step waited for its batch from the call's first read (its first step) or from
        # the previous step's end (a later step: a read that overlapped the previous step
        # is not a wait). Wait and busy time are then one interval of the call per step.
        waited = begin - tf.maximum(before[_LAST_END], clock.call_start.read_value())
        outputs = step(data)
        # A read of each updated variable (this replica's copy), ordered after its update.
        updated = [tf.identity(v.value) for v in model.trainable_variables]
        end = _stamp_after([outputs, updated])
        busy, steps, waits = before[0] + end - begin, before[_STEPS] + 1.0, before[2] + waited
        row.assign(tf.stack([busy, steps, waits, end]))
        return outputs

    return train_step


def _clock_of(model: Any) -> GraphClock | None:
    maker = vars(model).get("_make_function") if hasattr(model, "__dict__") else None
    return getattr(maker, _MAKER_MARK, None)


def attach(model: Any) -> GraphClock | None:
    """Times this model's compiled training steps from its next call on (module docstring).

    Makes the model's train function again when it was made without the clock, so its next
    call traces the timed step. Returns the clock, or None for a model that cannot be timed
    (compiled with `jit_compile=True`, run eagerly, not a Keras TensorFlow trainer, or with
    `tf.config.experimental.enable_op_determinism()` in force: it refuses timestamps).
    """
    if getattr(model, "jit_compile", False) is True or getattr(model, "run_eagerly", False):
        return None
    if tensorflow_private.op_determinism_enabled():
        return None  # TensorFlow then fails every tf.timestamp() (FAILED_PRECONDITION)
    if not callable(getattr(model, "_make_function", None)):
        return None
    clock = _clock_of(model)
    if clock is None:
        strategy = getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()
        clock = GraphClock(int(strategy.num_replicas_in_sync))
        original = model._make_function  # noqa: SLF001

        @functools.wraps(original)
        def make_function(step_function: Any) -> Any:
            if clock.enabled and step_function == model.train_step:
                step_function = _timed_step(model, step_function, clock)
            return original(step_function)

        setattr(make_function, _MAKER_MARK, clock)
        object.__setattr__(model, "_make_function", make_function)
    clock.enabled = True
    _remake(model, clock)
    return clock


def detach(model: Any) -> None:
    """Makes the model's next train function untimed again (a no-op if it never was timed)."""
    clock = _clock_of(model)
    if clock is not None and clock.enabled:
        clock.enabled = False
        _remake(model, clock)


def _remake(model: Any, clock: GraphClock) -> None:
    """Makes the train function again unless the current one was made with this setting
    (a `compile()` drops Keras' train function, so a new one is never mistaken for it)."""
    function = getattr(model, "train_function", None)
    if function is not None and clock.made == (function, clock.enabled):
        return
    model.make_train_function(force=True)
    clock.made = (model.train_function, clock.enabled)
