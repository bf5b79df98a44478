"""Workaround for a Keras 3 bug: `use_ema=True` with `ema_overwrite_frequency` under a strategy.

Keras' optimizers keep moving averages of the weights with `use_ema=True`, and with
`ema_overwrite_frequency=K` copy the averages into the weights every K steps.
`BaseOptimizer._backend_apply_gradients` chooses, with `ops.cond` in the replica function,
whether this step overwrites; the TensorFlow backend's
`_overwrite_model_variables_with_average_value` writes each variable with
`distribution.extended.update`, a merge call, and TensorFlow refuses a merge call inside a
conditional in replica context: `RuntimeError: merge_call called while defining a new
graph or a tf.function` (in `Cond.call()`) when `fit` traces its first step, on any replica
count, `MirroredStrategy` with one device included (Keras 3.15.1, TensorFlow 2.21). Without
`ema_overwrite_frequency` the averages train, and `finalize_variable_values` (called by
`fit` at its end, in cross-replica context) copies them into the weights. No upstream report
was found (keras-team/keras issues searched on 2026-12-01).
`tests/test_optimizer_options.py::test_plain_keras_ema_overwrite_still_fails_under_a_strategy`
reproduces it with plain Keras, so an upgrade that fixes it fails that test.

The fix, applied per optimizer *instance* (the class is untouched; models the kit did not
build are untouched), to the optimizer with `use_ema=True` (the inner optimizer of a
`LossScaleOptimizer`): its `_overwrite_model_variables_with_average_value`, called in
replica context (inside Keras' conditional), writes the calling replica's own copy of each
weight from its own copy of the average: no merge call, no communication. Every replica
takes the same branch (the decision reads the mirrored step counter) and holds the same
averages (they are updated from mirrored weights), so the copies stay equal, and the result
is what one device computes. Called in cross-replica context (`finalize_variable_values` at
the end of `fit`), or without a strategy, it is Keras' own. Keras' conditional, its EMA
update, its overwrite schedule and the optimizer's `get_config()` (which keeps
`ema_overwrite_frequency`, so a saved model keeps it) are unchanged.

Version guard: installed on the Keras versions it was tested on (`TESTED_KERAS`). On another
version, if the overwrite no longer runs a merge call inside the replica function's
conditional, the bug is taken as fixed upstream and nothing is done; otherwise the kit
refuses an optimizer with `use_ema=True` and `ema_overwrite_frequency` with a `ValueError`,
before any step.
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref
from typing import Any

import keras
import tensorflow as tf

from keras_mirror_kit.workarounds import inner_optimizer, keras_version_in, tf_optimizer_class

__all__ = ["TESTED_KERAS", "UPSTREAM", "apply", "is_fixed", "status"]

logger = logging.getLogger("keras_mirror_kit")

UPSTREAM = "no upstream report (keras-team/keras issues searched on 2026-12-01)"
#: Keras versions the workaround was tested on: `low <= version < high`.
TESTED_KERAS = ((3, 10, 0), (3, 16, 0))  # Keras 3.16 fixed the bug (status: fixed-upstream)
_FIXED: weakref.WeakSet[Any] = weakref.WeakSet()  # optimizers `apply` fixed


def _bug_in_source(optimizer_class: Any = None) -> bool:
    """True unless Keras' source shows the overwrite no longer merge-calls inside a cond."""
    optimizer_class = optimizer_class or tf_optimizer_class()
    try:
        apply_source = inspect.getsource(optimizer_class._backend_apply_gradients)  # noqa: SLF001
        overwrite_source = inspect.getsource(
            optimizer_class._overwrite_model_variables_with_average_value  # noqa: SLF001
        )
    except (AttributeError, OSError, TypeError):
        return True  # unreadable: cannot tell, so assume the bug is there
    overwrites_in_cond = "cond(" in apply_source and (
        "_overwrite_model_variables_with_average_value" in apply_source
    )
    return overwrites_in_cond and "extended.update" in overwrite_source


def status(keras_version: str | None = None) -> str:
    """Says what the kit does for `use_ema=True` with `ema_overwrite_frequency`.

    Args:
        keras_version: Version to judge (default: the installed `keras.__version__`).

    Returns:
        `"tested"` (inside `TESTED_KERAS`: the workaround applies), `"fixed-upstream"`
        (outside it, and the overwrite no longer merge-calls inside a conditional), or
        `"refused"` (outside it and the bug is still there, or the source is unreadable).

    Example:

    ```python
    status("3.15.1")  # "tested"
    ```
    """
    if keras_version_in(TESTED_KERAS, keras_version):
        return "tested"
    return "refused" if _bug_in_source() else "fixed-upstream"


def is_fixed(optimizer: Any) -> bool:
    """Whether `apply` gave this optimizer the replica-local EMA overwrite.

    Args:
        optimizer: Any object (a `LossScaleOptimizer`'s inner optimizer is the one fixed).

    Returns:
        True for an optimizer the kit fixed.

    Example:

    ```python
    assert is_fixed(model.optimizer)
    ```
    """
    try:
        return inner_optimizer(optimizer) in _FIXED
    except TypeError:  # not weak-referenceable
        return False


def _refusal(frequency: int) -> ValueError:
    low, high = (".".join(map(str, v)) for v in TESTED_KERAS)
    return ValueError(
        f"use_ema=True with ema_overwrite_frequency={frequency} is refused on Keras "
        f"{keras.__version__}: under a tf.distribute strategy its overwrite runs a merge "
        "call inside a conditional and fails at the first step (see "
        "keras_mirror_kit.workarounds.keras_ema_overwrite). The kit corrects this on Keras "
        f"{low} <= version < {high} only. Use a Keras version in that range, or "
        "ema_overwrite_frequency=None (fit() still copies the averages into the weights at "
        f"its end). Received: keras.__version__={keras.__version__!r}, "
        f"ema_overwrite_frequency={frequency}"
    )


def _local(variable: Any) -> Any:
    """The calling replica's own copy of a (Keras or mirrored) variable."""
    value = getattr(variable, "value", variable)
    if isinstance(value, tf.distribute.DistributedValues):
        return value._get_on_device_or_primary()  # noqa: SLF001
    return value


def _install(optimizer: Any) -> None:
    """Gives this optimizer instance the replica-local overwrite (module docstring)."""
    keras_overwrite = optimizer._overwrite_model_variables_with_average_value  # noqa: SLF001

    @functools.wraps(keras_overwrite)
    def overwrite(trainable_variables: Any) -> Any:
        if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
            return keras_overwrite(trainable_variables)  # finalize_variable_values, or no strategy
        averages = optimizer._model_variables_moving_average  # noqa: SLF001
        if len(trainable_variables) != len(averages):
            return keras_overwrite(trainable_variables)  # Keras' own error
        for variable, average in zip(trainable_variables, averages):
            if average is not None:
                _local(variable).assign(_local(average).read_value())
        return None

    # On the instance, bypassing Keras' attribute tracking; the class is untouched.
    object.__setattr__(optimizer, "_overwrite_model_variables_with_average_value", overwrite)
    _FIXED.add(optimizer)
    logger.debug("keras-mirror-kit: the EMA overwrite runs on each replica's own copies")


def apply(optimizer: Any) -> bool:
    """Makes a kit-built model's `use_ema=True` optimizer overwrite its weights under a strategy.

    Nothing is done for an optimizer without `use_ema`, or one already fixed.

    Args:
        optimizer: The model's optimizer (a `LossScaleOptimizer`'s inner optimizer is the
            one fixed), or None.

    Returns:
        True if the optimizer now carries the fix.

    Raises:
        ValueError: On a Keras version outside `TESTED_KERAS` that still has the bug, for
            an optimizer with `use_ema=True` and `ema_overwrite_frequency` (raised before
            any step).

    Example:

    ```python
    apply(model.optimizer)
    ```
    """
    inner = inner_optimizer(optimizer)
    if inner is None or not getattr(inner, "use_ema", False):
        return False
    if is_fixed(inner):
        return True
    verdict = status()
    if verdict == "fixed-upstream":
        return False
    if verdict == "refused":
        if inner.ema_overwrite_frequency:
            raise _refusal(int(inner.ema_overwrite_frequency))
        return False
    _install(inner)
    return True
