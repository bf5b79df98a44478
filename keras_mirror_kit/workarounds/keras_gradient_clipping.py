"""Workaround for a Keras 3 bug: gradient clipping on each replica, before the all-reduce.

Keras' optimizers clip gradients when given `clipnorm`, `global_clipnorm` or `clipvalue`.
`BaseOptimizer._backend_apply_gradients` clips (`_clip_gradients`) and then calls
`_backend_update_step`, where the TensorFlow backend sums the replicas' gradients
(`_all_reduce_sum_gradients`). Under a `tf.distribute` strategy each replica therefore clips
its own share of the gradient (its local gradient divided by the replica count, since Keras
scales each replica's loss by 1 / N), and the clipped shares are summed: the applied
gradient is up to N times the clip threshold, and clipping starts only where a replica's
share exceeds it (for equal shares, a global gradient N times the threshold). Measured with
Keras 3.15.1 on 2 replicas: one weight, `SGD(learning_rate=1, clipnorm=1)`, a global
gradient of 200 moves the weight by 2 instead of 1 (the same with `global_clipnorm` and
`clipvalue`); the small Dense model of `tests/test_optimizer_options.py` ends 2 epochs
3.9e-2 (Adam, `global_clipnorm`) to 1.5e-1 (SGD, `clipnorm`) away from one replica. Nothing
warns. tf.keras 2 refused the combination outright for the same reason ("Gradient clipping
in the optimizer ... is currently unsupported when using a distribution strategy",
tensorflow/tensorflow#33929); Keras 3 dropped the refusal, not the cause. No Keras 3 report
was found (keras-team/keras issues searched on 2026-12-01).
`tests/test_optimizer_options.py::test_plain_keras_still_clips_each_replica` reproduces it
with plain Keras, so an upgrade that fixes it fails that test.

The fix, applied per optimizer *instance* (the class is untouched; models the kit did not
build are untouched), to the optimizer that clips (the inner optimizer of a
`LossScaleOptimizer`): its `_clip_gradients` returns the gradients unchanged, and its
`_all_reduce_sum_gradients` clips what the all-reduce returns, with Keras' own
`_clip_gradients`. Every replica then clips the same global gradient, as one device clips
its gradient. This is the cheapest exact place: the sum is the one all-reduce Keras already
does (no extra communication), clipping it in replica context costs what clipping the local
gradients cost, and the update itself (`_distributed_tf_update_step`, weight decay,
`update_step`) stays Keras' own. The alternative, clipping per device in the cross-replica
update, would need a global norm computed per device from all variables' copies. Float16
loss scaling needs nothing more: `LossScaleOptimizer` unscales the gradients before the
inner optimizer's `apply`, so the reduced, unscaled gradient is clipped. Gradient
accumulation on several replicas (`keras_mirror_kit.workarounds.keras_grad_accumulation`)
all-reduces each micro-batch itself and clips the mean accumulated global gradient with the
class's `_clip_gradients`, so it clips after the reduction as well.

It is installed on every kit-built optimizer of a model on more than one replica (whether
or not it clips: the clipping options are plain attributes that Keras reads when the step
is traced, so a `clipnorm` set after `compile()` is covered; without one, Keras'
`_clip_gradients` returns the gradients unchanged). `MultiWorkerMirroredStrategy` takes the
same path (`_all_reduce_sum_gradients` sums over every replica of every worker).

Version guard: installed on the Keras versions it was tested on (`TESTED_KERAS`). On another
version, if the TensorFlow optimizer's all-reduce (`_backend_update_step` or
`_all_reduce_sum_gradients`) clips, the bug is taken as fixed upstream and nothing is done;
otherwise the kit refuses a clipping optimizer on several replicas with a `ValueError`,
before any step, as tf.keras 2 did.
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref
from typing import Any

import keras

from keras_mirror_kit.upstream import versions
from keras_mirror_kit.workarounds import inner_optimizer, keras_version_in, tf_optimizer_class

__all__ = ["TESTED_KERAS", "UPSTREAM", "apply", "clip_options", "is_fixed", "status"]

logger = logging.getLogger("keras_mirror_kit")

UPSTREAM = "tensorflow/tensorflow#33929"
#: Keras versions the workaround was tested on: `low <= version < high`.
TESTED_KERAS = versions.TESTED_KERAS
_OPTIONS = ("clipnorm", "global_clipnorm", "clipvalue")
_FIXED: weakref.WeakSet[Any] = weakref.WeakSet()  # optimizers `apply` fixed


def clip_options(optimizer: Any) -> dict[str, float]:
    """The clipping options an optimizer (or a loss scaler's inner one) has set, by name."""
    inner = inner_optimizer(optimizer)
    given = {name: getattr(inner, name, None) for name in _OPTIONS}
    return {name: float(value) for name, value in given.items() if value and value > 0}


def _bug_in_source(optimizer_class: Any = None) -> bool:
    """True unless Keras' TensorFlow optimizer shows it clips after its all-reduce."""
    optimizer_class = optimizer_class or tf_optimizer_class()
    try:
        apply_source = inspect.getsource(optimizer_class._backend_apply_gradients)  # noqa: SLF001
        reduce_source = inspect.getsource(
            optimizer_class._backend_update_step  # noqa: SLF001
        ) + inspect.getsource(optimizer_class._all_reduce_sum_gradients)  # noqa: SLF001
    except (AttributeError, OSError, TypeError):
        return True  # unreadable: cannot tell, so assume the bug is there
    if "clip" in reduce_source:
        return False
    return "_clip_gradients(" in apply_source


def status(keras_version: str | None = None) -> str:
    """Says what the kit does for gradient clipping on more than one replica.

    Args:
        keras_version: Version to judge (default: the installed `keras.__version__`).

    Returns:
        `"tested"` (inside `TESTED_KERAS`: the workaround applies), `"fixed-upstream"`
        (outside it, and Keras' TensorFlow optimizer clips after its all-reduce), or
        `"refused"` (outside it and the bug is still there, or the source is unreadable:
        the kit refuses a clipping optimizer on several replicas).

    Example:

    ```python
    status("3.15.1")  # "tested"
    ```
    """
    if keras_version_in(TESTED_KERAS, keras_version):
        return "tested"
    return "refused" if _bug_in_source() else "fixed-upstream"


def is_fixed(optimizer: Any) -> bool:
    """Whether `apply` made this optimizer clip the all-reduced gradient.

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


def _refusal(options: dict[str, float], replicas: int) -> ValueError:
    low, high = (".".join(map(str, v)) for v in TESTED_KERAS)
    given = ", ".join(f"{name}={value:g}" for name, value in options.items())
    return ValueError(
        f"Gradient clipping ({given}) on {replicas} replicas is refused on Keras "
        f"{keras.__version__}: its optimizers clip each replica's gradient before the "
        "all-reduce, so the applied gradient can be up to "
        f"{replicas} times the threshold (see keras_mirror_kit.workarounds."
        f"keras_gradient_clipping; tf.keras 2 refused it too, {UPSTREAM}). The kit clips "
        f"the reduced gradient on Keras {low} <= version < {high} only. Use a Keras version "
        f"in that range, train on one replica, or drop the clipping option. Received: "
        f"keras.__version__={keras.__version__!r}, {given}, replicas={replicas}"
    )


def _install(optimizer: Any) -> None:
    """Moves this optimizer instance's clipping after its all-reduce (module docstring)."""
    keras_clip = optimizer._clip_gradients  # noqa: SLF001  (bound: Keras' own)
    keras_reduce = optimizer._all_reduce_sum_gradients  # noqa: SLF001

    @functools.wraps(keras_clip)
    def clip_gradients(grads: Any) -> Any:
        return grads  # clipped after the sum, in `all_reduce_sum_gradients`

    @functools.wraps(keras_reduce)
    def all_reduce_sum_gradients(grads_and_vars: Any) -> Any:
        reduced = list(keras_reduce(grads_and_vars))
        clipped = keras_clip([grad for grad, _ in reduced])
        return [(grad, variable) for grad, (_, variable) in zip(clipped, reduced)]

    # On the instance, bypassing Keras' attribute tracking; the class is untouched.
    object.__setattr__(optimizer, "_clip_gradients", clip_gradients)
    object.__setattr__(optimizer, "_all_reduce_sum_gradients", all_reduce_sum_gradients)
    _FIXED.add(optimizer)
    logger.debug("keras-mirror-kit: %s: gradients are clipped after the all-reduce", UPSTREAM)


def apply(optimizer: Any, replicas: int) -> bool:
    """Makes a kit-built model's optimizer clip the all-reduced gradient, as one device does.

    With one replica nothing is done (a replica's gradient is the whole gradient).

    Args:
        optimizer: The model's optimizer (a `LossScaleOptimizer`'s inner optimizer is the
            one fixed), or None.
        replicas: The strategy's `num_replicas_in_sync` (all workers' replicas).

    Returns:
        True if the optimizer now carries the fix.

    Raises:
        ValueError: On a Keras version outside `TESTED_KERAS` that still clips before the
            all-reduce, for an optimizer with `clipnorm`, `global_clipnorm` or `clipvalue`
            on more than one replica (raised before any step).

    Example:

    ```python
    apply(model.optimizer, build_model.distribution.num_replicas)
    ```
    """
    inner = inner_optimizer(optimizer)
    if inner is None or replicas <= 1:
        return False
    if is_fixed(inner):
        return True
    verdict = status()
    if verdict == "fixed-upstream":
        return False
    if verdict == "refused":
        options = clip_options(inner)
        if options:
            raise _refusal(options, replicas)
        return False
    _install(inner)
    return True
