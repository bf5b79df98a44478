"""Keras 3.16: a step of `steps_per_execution=1` reads its batch outside the compiled step.

No upstream report found. Keras 3.16's TensorFlow trainer (`_make_function`) fetches the
batch of a one-step execution eagerly (`iterator.get_next_as_optional()`) and passes the
tensors to a `tf.function(reduce_retracing=True)`; up to Keras 3.15 every execution read
its batches inside the compiled function, traced with the dataset's element spec (batch
dimension None). The step is then traced from the shapes of the batches that came first:
static shapes at the first call, a relaxed batch dimension after a batch of another size.
Two runs of the same data can compile their steps differently, which (measured with Keras
3.16.0.dev2026102704, plain Keras and the kit alike):

* makes a run resumed mid-epoch round otherwise than the uninterrupted one (1.6e-5 in the
  weights of keras-io's timeseries classifier, whose conv biases sit before a
  BatchNormalization: Adam turns a last-bit difference into 1e-5);
* makes Keras weigh each per-output loss tracker of a model with several outputs by a batch
  size it knows in one trace and not in the other (`val_cls_loss` of 1 and 2 replicas).

On each model the kit builds (its class and other models are untouched), a one-step
execution reads its batch inside a compiled function again, as Keras 3.15 did; executions
of several steps are Keras' own. The canary reads `_make_function`'s source for the eager
fetch: where it is not there (Keras 3.15 and older) the workaround retires itself.
"""

from __future__ import annotations

import functools
import inspect
import re
import weakref
from typing import Any

import tensorflow as tf

from keras_mirror_kit.upstream import keras_private, versions
from keras_mirror_kit.workarounds import KerasPatch

__all__ = ["TESTED_KERAS", "apply", "is_applied"]

TESTED_KERAS = versions.TESTED_KERAS
# The eager fetch, as it reads in Keras 3.16's `_make_function`.
_EAGER_FETCH = re.compile(
    r"steps_per_execution == 1:\s*\n\s*next_optional_inputs = iterator\.get_next_as_optional\(\)"
)
_APPLIED: weakref.WeakSet[Any] = weakref.WeakSet()


def _source() -> str:
    return inspect.getsource(keras_private.tensorflow_trainer()._make_function)  # noqa: SLF001


def _target() -> str | None:
    """None when Keras' trainer has what the replacement calls, else what differs."""
    trainer = keras_private.tensorflow_trainer()
    parameters = list(inspect.signature(trainer._make_function).parameters)  # noqa: SLF001
    if parameters != ["self", "step_function"]:
        return f"_make_function takes {parameters}"
    if not callable(getattr(trainer, "_autoconvert_optionals", None)):
        return "the TensorFlow trainer has no _autoconvert_optionals"
    if not callable(
        getattr(keras_private.tensorflow_trainer_module(), "reduce_per_replica", None)
    ):
        return "the TensorFlow trainer's module has no reduce_per_replica"
    return None


def _bug() -> bool | None:
    """Whether Keras' `_make_function` fetches a one-step execution's batch eagerly."""
    try:
        return bool(_EAGER_FETCH.search(_source()))
    except (OSError, TypeError):
        return None


_PATCH = KerasPatch(
    TESTED_KERAS,
    name="keras_step_fetch",
    feature="steps_per_execution=1 compiled alike whatever batches came first",
    instead="compile with steps_per_execution > 1 (kmk.distributed(steps_per_execution=...))",
    target=_target,
    bug=_bug,
)


def is_applied(model: Any) -> bool:
    """Whether `apply(model)` gave this model the in-graph fetch."""
    try:
        return model in _APPLIED
    except TypeError:
        return False


def apply(model: Any) -> bool:
    """Makes this model's one-step executions read their batch inside a compiled function
    (module docstring; idempotent). False where the canary retired it (Keras 3.15 and older)
    or refused it (then the model keeps Keras' own, logged once)."""
    if is_applied(model):
        return True
    if not _PATCH.apply(lambda: None):  # the function is replaced per model, below
        return False
    original = model._make_function  # noqa: SLF001
    reduce_per_replica = keras_private.tensorflow_trainer_module().reduce_per_replica

    @functools.wraps(original)
    def make_function(step_function: Any) -> Any:
        keras_function = original(step_function)
        if model.run_eagerly:
            return keras_function

        @tf.autograph.experimental.do_not_convert
        def one_step_on_data(data: Any) -> Any:
            outputs = model.distribute_strategy.run(step_function, args=(data,))
            return reduce_per_replica(outputs, model.distribute_strategy, reduction="auto")

        one_step = tf.function(
            one_step_on_data, reduce_retracing=True, jit_compile=model.jit_compile
        )
        one_step = model._autoconvert_optionals(one_step)  # noqa: SLF001

        @tf.autograph.experimental.do_not_convert
        def one_step_on_iterator(iterator: Any) -> Any:
            return one_step(iterator.get_next())  # OutOfRangeError ends the epoch, as in Keras

        one_step_on_iterator = tf.function(one_step_on_iterator, reduce_retracing=True)

        def function(iterator: Any) -> Any:
            iterators = (tf.data.Iterator, tf.distribute.DistributedIterator)
            if model.steps_per_execution == 1 and isinstance(iterator, iterators):
                return one_step_on_iterator(iterator)
            return keras_function(iterator)

        return function

    object.__setattr__(model, "_make_function", make_function)
    _APPLIED.add(model)
    return True
