"""Mixed precision for the layers a factory builds, and only those.

`keras.config.set_dtype_policy` is global; `policy_scope` sets it while the factory runs and
restores the previous policy afterwards, so layers built elsewhere are unaffected. Variables
stay float32 (that is what the mixed policies do); computations run in float16 or bfloat16.
The model's output layers are kept in float32, where a softmax or a loss needs the range,
and for `mixed_float16` Keras' `compile()` wraps the optimizer in a `LossScaleOptimizer`
(dynamic loss scaling), as it does for any model built under that policy. On more than one
replica, Keras 3.15's `LossScaleOptimizer` trusts the first replica alone to say whether a
step overflowed; `keras_mirror_kit.workarounds.keras_loss_scale` makes every replica agree for the
models the kit builds (or refuses float16 there on a Keras it was not tested on).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import keras

__all__ = ["MIXED_PRECISION_POLICIES", "keep_outputs_float32", "policy_scope", "validate_policy"]

MIXED_PRECISION_POLICIES = ("mixed_float16", "mixed_bfloat16")


def validate_policy(policy: object) -> str | None:
    """`mixed_precision` if it is None or in `MIXED_PRECISION_POLICIES`; else `ValueError`."""
    if policy is None or policy in MIXED_PRECISION_POLICIES:
        return policy  # type: ignore[return-value]
    raise ValueError(
        "`mixed_precision` must be 'mixed_float16', 'mixed_bfloat16' or None. "
        f"Received: mixed_precision={policy!r}"
    )


@contextmanager
def policy_scope(policy: str | None) -> Iterator[None]:
    """Sets the global Keras dtype policy inside the block (None: left alone), then restores it."""
    if policy is None:
        yield
        return
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


def _output_operations(model: keras.Model) -> list[Any]:
    try:
        outputs = model.outputs
    except (AttributeError, ValueError):  # subclassed models have no symbolic outputs
        return []
    operations = []
    for tensor in keras.tree.flatten(outputs or []):
        history = getattr(tensor, "_keras_history", None)
        if history is not None:
            operations.append(history.operation)
    return operations


def keep_outputs_float32(model: keras.Model) -> list[str]:
    """Switches the layers producing the model's outputs to float32; returns their names.

    A subclassed model has no symbolic outputs, so nothing is switched: its last layer needs
    `dtype="float32"` from the user.
    """
    switched = []
    pending = _output_operations(model)
    while pending:
        operation = pending.pop()
        if isinstance(operation, keras.Model):
            pending.extend(_output_operations(operation))
            continue
        if isinstance(operation, keras.layers.Layer) and operation.compute_dtype in (
            "float16",
            "bfloat16",
        ):
            operation.dtype_policy = "float32"
            switched.append(operation.name)
    return switched
