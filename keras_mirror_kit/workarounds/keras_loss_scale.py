"""Workaround for a Keras 3 bug: float16 loss scaling trusts replica 0 alone.

Keras' `LossScaleOptimizer` (`mixed_precision="mixed_float16"`) skips a step and halves the
loss scale when a gradient is not finite. On the TensorFlow backend, under a
`tf.distribute` strategy with a merge call (`MirroredStrategy`, and
`MultiWorkerMirroredStrategy` outside XLA), `LossScaleOptimizer._tf_apply` computes the
flag on every replica from that replica's *local* gradients, then keeps the first local
replica's (`experimental_local_results(finite_per_replica)[0]`, under the comment "Each
replica computed the same `finite` value, since `grads` is all-reduced across replicas";
they are not: the all-reduce happens later, inside the inner optimizer). Measured with
Keras 3.15.1 on 2 logical CPU replicas, one step of a Dense model whose input overflows
float16 on one replica only: overflow on replica 0 -> step skipped, scale 32768 -> 16384
(right); overflow on replica 1 -> the all-reduced infinite gradient is applied, the weights
become non-finite and the scale stays 32768, so every later step trains on NaN. Under
`MultiWorkerMirroredStrategy` each worker keeps its own first replica's flag, so workers
can take different branches, one of them waiting in a gradient all-reduce that the others
never join. The code came with keras-team/keras#18691 (the fix of keras-team/keras#18666);
no report of this consequence was found upstream (keras-team/keras issues searched on
2026-11-30). `tests/test_loss_scale.py::test_plain_keras_still_trusts_replica_0` reproduces
it with plain Keras, so an upgrade that fixes it fails that test.

The fix, the least invasive that works: the model's `LossScaleOptimizer` *instance* gets a
`check_finite` that all-reduces the verdict (the sum over replicas of "this replica's
gradients are not finite"; one scalar all-reduce per step), so every replica of every worker
sees the same flag, in both of Keras' code paths (the merge-call path above, and the
no-merge-call path under XLA, where each replica branches on its own flag). Nothing else
changes: the branches, the scale update and the gradients are Keras' own; no Keras class or
module is patched, and models the kit did not build are untouched. `prepare_model` applies
it when a kit-built model with more than one replica has a `LossScaleOptimizer` (also after
a later `compile()` of a model the factory returned uncompiled).

Version guard: installed on the Keras versions it was tested on (`TESTED_KERAS`). On another
version, if `LossScaleOptimizer`'s source no longer picks the first replica's flag (or its
`check_finite` all-reduces), the bug is taken as fixed upstream and nothing is done;
otherwise the kit refuses such a model with a `ValueError` that recommends
`mixed_precision="mixed_bfloat16"` (bfloat16 has float32's range and needs no loss scaling).
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
import weakref
from typing import Any

import keras
import tensorflow as tf

from keras_mirror_kit.upstream import versions
from keras_mirror_kit.workarounds import keras_version_in

__all__ = ["TESTED_KERAS", "UPSTREAM", "apply", "fix_optimizer", "is_fixed", "status"]

logger = logging.getLogger("keras_mirror_kit")

UPSTREAM = "keras-team/keras#18691"
#: Keras versions the workaround was tested on: `low <= version < high`.
TESTED_KERAS = versions.TESTED_KERAS
_FIXED: weakref.WeakSet[Any] = weakref.WeakSet()  # LossScaleOptimizers `apply` fixed
_FOLLOWING: weakref.WeakSet[Any] = weakref.WeakSet()  # models whose compile() re-applies it
_FIRST_REPLICA_FLAG = re.compile(r"experimental_local_results\(\s*finite_per_replica\s*\)\s*\[0\]")


def _bug_in_source(optimizer_class: Any) -> bool:
    """True unless Keras' source shows the flag is no longer taken from replica 0 alone."""
    try:
        apply_source = inspect.getsource(optimizer_class._tf_apply)  # noqa: SLF001
        check_source = inspect.getsource(optimizer_class.check_finite)
    except (AttributeError, OSError, TypeError):
        return True  # unreadable: cannot tell, so assume the bug is there
    if "all_reduce" in check_source:
        return False
    return bool(_FIRST_REPLICA_FLAG.search(apply_source))


def status(keras_version: str | None = None) -> str:
    """`"tested"`, `"fixed-upstream"` or `"refused"`: what the kit does on this Keras version.

    Outside `TESTED_KERAS` Keras' source decides: `"refused"` while `LossScaleOptimizer` still
    trusts replica 0 alone or its source is unreadable (a multi-replica one is then refused).
    """
    if keras_version_in(TESTED_KERAS, keras_version):
        return "tested"
    if _bug_in_source(keras.optimizers.LossScaleOptimizer):
        return "refused"
    return "fixed-upstream"


def is_fixed(optimizer: Any) -> bool:
    """Whether `apply` gave this `LossScaleOptimizer` the replica-agreeing finite check."""
    try:
        return optimizer in _FIXED
    except TypeError:  # not weak-referenceable
        return False


def _agreed(finite: tf.Tensor) -> tf.Tensor:
    """All replicas' verdict: finite only if every replica's gradients are finite."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return finite
    not_finite = tf.cast(tf.logical_not(tf.cast(finite, tf.bool)), tf.float32)
    total = context.all_reduce(tf.distribute.ReduceOp.SUM, not_finite)
    return tf.equal(total, 0.0)


def _refusal(replicas: int) -> ValueError:
    low, high = (".".join(map(str, v)) for v in TESTED_KERAS)
    return ValueError(
        f"mixed_precision='mixed_float16' (a LossScaleOptimizer) on {replicas} replicas is "
        f"refused on Keras {keras.__version__}: its LossScaleOptimizer decides from the "
        "first replica's gradients alone whether a step overflowed, so an overflow on "
        "another replica writes inf/NaN into the weights (see "
        "keras_mirror_kit.workarounds.keras_loss_scale). The kit corrects this on Keras "
        f"{low} <= version < {high} only. Use mixed_precision='mixed_bfloat16' (same "
        "speed on recent GPUs, no loss scaling needed), train on one replica, or use a "
        f"Keras version in that range. Received: keras.__version__={keras.__version__!r}, "
        f"replicas={replicas}"
    )


def fix_optimizer(optimizer: Any, replicas: int) -> bool:
    """Makes one `LossScaleOptimizer` decide overflow from every replica (other: no-op)."""
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return False
    if is_fixed(optimizer):
        return True
    verdict = status()
    if verdict == "fixed-upstream":
        return False
    if verdict == "refused":
        raise _refusal(replicas)
    local_check = optimizer.check_finite  # the bound method: Keras' own check

    @functools.wraps(local_check)
    def check_finite(grads: Any) -> Any:
        return _agreed(local_check(grads))

    # On the instance, bypassing Keras' attribute tracking; the class is untouched.
    object.__setattr__(optimizer, "check_finite", check_finite)
    _FIXED.add(optimizer)
    logger.debug("keras-mirror-kit: %s agrees on finite gradients across replicas", UPSTREAM)
    return True


def _follow_compile(model: Any, replicas: int) -> None:
    """Re-applies the fix after every later `compile()` of this model instance."""
    if model in _FOLLOWING:
        return
    original = model.compile

    @functools.wraps(original)
    def compile(*args: Any, **kwargs: Any) -> Any:  # noqa: A001
        result = original(*args, **kwargs)
        fix_optimizer(getattr(model, "optimizer", None), replicas)
        return result

    object.__setattr__(model, "compile", compile)
    _FOLLOWING.add(model)


def apply(model: Any, strategy: tf.distribute.Strategy) -> bool:
    """Makes a kit-built model's `LossScaleOptimizer` skip a step when any replica overflows.

    With one replica nothing is done; with more, the optimizer gets a finite check all replicas
    agree on, now or after a later `compile()` of an uncompiled model. True if the optimizer now
    carries the fix. Raises `ValueError`, before any step, on a Keras outside `TESTED_KERAS` that
    still trusts replica 0 alone (the message points to `mixed_bfloat16`).
    """
    replicas = int(strategy.num_replicas_in_sync)
    if replicas <= 1:
        return False
    if not getattr(model, "compiled", True):
        _follow_compile(model, replicas)
    return fix_optimizer(getattr(model, "optimizer", None), replicas)
