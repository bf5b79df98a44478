"""Workaround for a Keras 3 bug: gradient accumulation fails under a `tf.distribute` strategy.

Upstream: keras-team/keras#20582 (open; a fix is proposed in keras-team/keras#23592). Keras'
optimizers accumulate gradients when given `gradient_accumulation_steps=N`:
`BaseOptimizer._backend_apply_gradients` chooses, with `ops.cond`, between "add this
micro-batch's gradients to the accumulators" and "apply the update and reset them". On the
TensorFlow backend, under a strategy with a merge call (`MirroredStrategy`, and
`MultiWorkerMirroredStrategy` outside XLA), the update branch all-reduces the gradients
(`merge_call`), and TensorFlow refuses a `merge_call` inside a conditional in replica
context: `RuntimeError: merge_call called while defining a new graph or a tf.function`,
when `fit` traces its first step (Keras 3.15.1, TensorFlow 2.21, also under
`LossScaleOptimizer`). `tests/test_gradient_accumulation.py::
test_plain_keras_accumulation_still_fails_under_mirrored_strategy` reproduces it with plain
Keras, so an upgrade that fixes it fails that test.

Even where the conditional runs, Keras adds each replica's *local* gradients to its own copy
of the (mirrored) accumulators, so the copies differ: a checkpoint, which saves one copy,
would lose the other replicas' partial sums, and a resume with another replica count could
not use them.

The fix, applied per optimizer *instance* (the class is untouched; models the kit did not
build are untouched), replaces `_backend_apply_gradients` of the optimizer that accumulates
(the inner optimizer of a `LossScaleOptimizer`). On every micro-batch, in replica context
and outside any conditional, it all-reduces (sums) the replicas' gradients into the
micro-batch's global gradient and computes what an update would apply: the mean of the
accumulated and the current global gradients over N, clipped as Keras clips (the class's
`_clip_gradients`: `keras_gradient_clipping` makes the instance's the identity, since it
clips after Keras' own all-reduce, which this path does not use). Whether this micro-batch
completes an update is read from the mirrored step counter, so every replica decides alike.
Then a `merge_call` (cross-replica context, where a conditional may choose between branches)
updates each device's copy of each variable with `extended.update`:

* a micro-batch that does not complete an update adds its global gradient to the
  accumulator, so every copy holds the same value, the sum of the global gradients so far,
  which does not depend on the replica count;
* the micro-batch that completes an update applies the mean gradient with the optimizer's
  own `update_step` (Keras' per-variable rule: SGD, Adam, ...), after weight decay computed
  as Keras' `_apply_weight_decay` does (re-implemented here, since Keras' version runs in
  replica context), and resets the accumulator. `use_ema=True` is refused (Keras' EMA
  update is not re-implemented).

Every micro-batch therefore costs one all-reduce, as without accumulation: accumulation
here saves memory (a larger effective batch than fits), not communication. The step
counter (`iterations` = micro-batches, which Keras also passes to a learning-rate schedule)
and the accumulators are Keras' own optimizer variables, saved and restored by checkpoints.

Version guard: installed on the Keras versions it was tested on (`TESTED_KERAS`). On
another version, if Keras' TensorFlow optimizer defines its own `_backend_apply_gradients`
(the shape of the upstream fix), the bug is taken as fixed and nothing is done; otherwise the
kit refuses gradient accumulation on such a version with a `ValueError`, before any step.
Strategies without merge calls (XLA-compiled steps on GPUs, `jit_compile=True`) are refused
when the step is traced (before it runs): use `jit_compile=False`.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any

import keras
import tensorflow as tf

from keras_mirror_kit.upstream import keras_private, tensorflow_private, versions
from keras_mirror_kit.workarounds import inner_optimizer, keras_version_in

__all__ = ["TESTED_KERAS", "UPSTREAM", "accumulating_optimizer", "apply", "is_fixed", "status"]

logger = logging.getLogger("keras_mirror_kit")

UPSTREAM = "keras-team/keras#20582"
#: Keras versions the workaround was tested on: `low <= version < high`.
TESTED_KERAS = versions.TESTED_KERAS
_FIXED: weakref.WeakSet[Any] = weakref.WeakSet()  # optimizers `apply` fixed


def accumulating_optimizer(optimizer: Any) -> Any:
    """The optimizer holding `gradient_accumulation_steps`: a `LossScaleOptimizer`'s inner one."""
    return inner_optimizer(optimizer)


def status(keras_version: str | None = None) -> str:
    """`"tested"`, `"fixed-upstream"` or `"refused"`: what the kit does on this Keras version.

    `"fixed-upstream"` means outside `TESTED_KERAS` with Keras' TensorFlow optimizer defining its
    own `_backend_apply_gradients` (the shape of the upstream fix).
    """
    if keras_version_in(TESTED_KERAS, keras_version):
        return "tested"
    try:
        TFOptimizer = keras_private.tf_optimizer()  # noqa: N806
    except ImportError:
        return "refused"
    return "fixed-upstream" if "_backend_apply_gradients" in vars(TFOptimizer) else "refused"


def is_fixed(optimizer: Any) -> bool:
    """Whether `apply` gave this (accumulating) optimizer the distributed accumulation path."""
    try:
        return optimizer in _FIXED
    except TypeError:  # not weak-referenceable
        return False


def _refusal(steps: int) -> ValueError:
    low, high = (".".join(map(str, v)) for v in TESTED_KERAS)
    return ValueError(
        f"Gradient accumulation under tf.distribute is refused on Keras {keras.__version__}: "
        f"Keras' own accumulation cannot run under a strategy ({UPSTREAM}) and the kit "
        f"corrects it on Keras {low} <= version < {high} only (see "
        "keras_mirror_kit.workarounds.keras_grad_accumulation). Use a Keras version in that "
        "range, or a larger per-replica batch without accumulation. Received: "
        f"keras.__version__={keras.__version__!r}, gradient_accumulation_steps={steps}"
    )


def _xla_refusal(steps: int) -> ValueError:
    return ValueError(
        "Gradient accumulation on several replicas cannot run in an XLA-compiled step on "
        "GPUs (a strategy without merge calls): the kit's accumulation takes its update "
        "decision in cross-replica context. Compile the model with jit_compile=False. "
        f"Received: gradient_accumulation_steps={steps}, jit_compile=True"
    )


def _install(optimizer: Any) -> None:
    """Gives this optimizer instance the distributed accumulation path (module docstring)."""
    original = optimizer._backend_apply_gradients  # noqa: SLF001  (bound: Keras' own)
    steps = int(optimizer.gradient_accumulation_steps)
    if optimizer.use_ema:
        raise ValueError(
            "Gradient accumulation on a tf.distribute strategy does not support an "
            "optimizer with use_ema=True in this kit. Drop use_ema or the accumulation. "
            f"Received: use_ema=True, gradient_accumulation_steps={steps}"
        )

    def per_device(
        variable: Any, reduced: Any, total: Any, accumulator: Any, is_update: Any, lr: Any
    ) -> None:
        """One device's copy (update context): update and reset, or accumulate; no sync."""

        def apply_update() -> None:
            if optimizer.weight_decay is not None and optimizer._use_weight_decay(variable):  # noqa: SLF001
                decay = tf.cast(optimizer.weight_decay, variable.dtype)
                variable.assign_sub(variable * decay * tf.cast(lr, variable.dtype))
            optimizer.update_step(total, variable, lr)
            optimizer.assign(accumulator, tf.zeros(accumulator.shape, accumulator.dtype))

        def accumulate() -> None:
            optimizer.assign_add(accumulator, reduced)

        tf.cond(is_update, apply_update, accumulate)

    def decide(
        distribution: tf.distribute.Strategy,
        variables: list[Any],
        accumulators: list[Any],
        reduced: list[Any],
        total: list[Any],
        is_update: Any,
        lr: Any,
    ) -> None:
        """Cross-replica context: each device's copy of every variable, in update context."""
        for variable, accumulator, r, t in zip(variables, accumulators, reduced, total):
            distribution.extended.update(
                variable, per_device, args=(r, t, accumulator, is_update, lr), group=False
            )

    @functools.wraps(original)
    def backend_apply_gradients(grads: Any, trainable_variables: Any) -> Any:
        context = tf.distribute.get_replica_context()
        if not tf.distribute.has_strategy() or context is None:
            return original(grads, trainable_variables)
        if tensorflow_private.strategy_supports_no_merge_call():
            raise _xla_refusal(steps)
        variables = [getattr(v, "value", v) for v in trainable_variables]
        accumulators = [
            optimizer._accumulated_gradients[optimizer._get_variable_index(v)]  # noqa: SLF001
            for v in trainable_variables
        ]
        # The only synchronisation, outside any conditional: the micro-batch's global gradient.
        reduced = context.all_reduce(tf.distribute.ReduceOp.SUM, list(grads))
        # What an update would apply: the mean of the N micro-batches' global gradients,
        # clipped as Keras clips (computed on every micro-batch, used on the N-th). The
        # class's method: the instance's may defer clipping to an all-reduce not used here.
        total = [(r + tf.cast(a.value, r.dtype)) / steps for r, a in zip(reduced, accumulators)]
        total = type(optimizer)._clip_gradients(optimizer, total)  # noqa: SLF001
        # Decided in replica context (every replica decides alike: the counter is mirrored);
        # tensors made in the cross-replica function cannot feed control flow inside
        # `steps_per_execution`'s loop.
        is_update = tf.equal((optimizer._iterations + 1) % steps, 0)  # noqa: SLF001
        lr = optimizer.learning_rate
        context.merge_call(decide, args=(variables, accumulators, reduced, total, is_update, lr))
        return None

    # On the instance, bypassing Keras' attribute tracking; the class is untouched.
    object.__setattr__(optimizer, "_backend_apply_gradients", backend_apply_gradients)
    _FIXED.add(optimizer)
    logger.debug("keras-mirror-kit: %s: accumulation runs under the strategy", UPSTREAM)


def apply(optimizer: Any) -> bool:
    """Gives an accumulating optimizer the distributed accumulation path; True if it now has it.

    Nothing is done for an optimizer that does not accumulate or is already fixed (the inner
    optimizer of a `LossScaleOptimizer` is the one fixed). Raises `ValueError`, before any step,
    on a Keras outside `TESTED_KERAS` without the upstream fix, or for `use_ema=True`.
    """
    inner = accumulating_optimizer(optimizer)
    steps = getattr(inner, "gradient_accumulation_steps", None)
    if inner is None or not steps or steps < 2:
        return False
    if is_fixed(inner):
        return True
    verdict = status()
    if verdict == "fixed-upstream":
        return False
    if verdict == "refused":
        raise _refusal(int(steps))
    _install(inner)
    return True
