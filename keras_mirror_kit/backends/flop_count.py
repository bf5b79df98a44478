"""What a FLOP count is (`FlopCount`) and the compute dtype it is compared at, on any backend.

Kept apart from `throughput.flops` (the public entry, which asks the backend) and from
the backends' counters (`tensorflow_flops`, `jax_flops`), which all use it: it imports
Keras, not TensorFlow or JAX.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import keras

__all__ = ["FlopCount", "compiled_loss", "model_compute_dtype"]


@dataclass(frozen=True)
class FlopCount:
    """The FLOPs of one training sample, as `count_training_flops` counted them.

    Attributes:
        flops_per_sample: Forward pass, loss and backward pass, per sample (about 3 times
            `forward_flops_per_sample` for a deep model).
        forward_flops_per_sample: The forward pass alone, per sample.
        by_op_type: Per-sample FLOPs of the training computation by TensorFlow op type
            (`"Conv2D"`, `"Conv2DBackpropFilter"`, `"MatMul"`, ...); empty on JAX, where
            XLA's cost analysis gives one total.
        loss: `"compiled"` when the model's compiled loss was traced, `"surrogate"` when
            it could not be (no single compiled loss, or labels whose shape is unknown):
            the sum of the squared outputs then stands in; the backward pass through the
            model is the same, only the loss's own few FLOPs per sample differ.
        uncounted_op_types: Float-valued op types met that have no FLOP statistic
            (activations such as `Relu`, or control flow); they count 0. Empty on JAX
            (XLA counts every elementwise operation).
        counter: What counted: `"tensorflow"` (TensorFlow's FLOP statistics of the traced
            graph) or `"xla"` (XLA's cost analysis of the lowered computation, on JAX).
    """

    flops_per_sample: float
    forward_flops_per_sample: float
    by_op_type: Mapping[str, float] = field(default_factory=dict)
    loss: str = "compiled"
    uncounted_op_types: tuple[str, ...] = ()
    counter: str = "tensorflow"


def model_compute_dtype(model: Any) -> str:
    """The compute dtype of the layers holding most of the model's trainable weights.

    Mixed precision keeps a few layers (the outputs) in float32; the dtype that matters for
    the peak FLOP/s is the one the bulk of the arithmetic runs in.
    """
    weight_by_dtype: dict[str, int] = {}
    for layer in model._flatten_layers(include_self=False, recursive=True):
        own = sum(int(math.prod(v.shape)) for v in layer._trainable_variables)
        if own:
            dtype = str(getattr(layer, "compute_dtype", None) or "float32")
            weight_by_dtype[dtype] = weight_by_dtype.get(dtype, 0) + own
    if not weight_by_dtype:
        return str(getattr(model, "compute_dtype", None) or keras.backend.floatx())
    return max(weight_by_dtype, key=weight_by_dtype.__getitem__)


def compiled_loss(model: keras.Model) -> tuple[Callable | None, str]:
    """The model's single compiled loss as a callable, or None (then a surrogate is used)."""
    loss = getattr(model, "loss", None)
    if loss is None or isinstance(loss, (list, tuple, dict)):
        return None, "surrogate"
    try:
        fn = keras.losses.get(loss)
    except (ValueError, TypeError):
        return None, "surrogate"
    return (fn, "compiled") if callable(fn) else (None, "surrogate")


def label_layout(
    model: keras.Model, inputs: Any, loss_fn: Callable, batch: int
) -> tuple[tuple[int, ...], bool] | None:
    """The label batch a counter traces with when none is given: `(shape, class ids?)`.

    From the model's output for `inputs` (KerasTensors, as the backend's counter passes
    them); None when that fails or the model has several outputs (the surrogate is used).
    """
    try:
        outputs = model.compute_output_spec(*inputs)
    except Exception:  # noqa: BLE001 - any failure means: labels unknown, use the surrogate
        return None
    if isinstance(outputs, (list, tuple, dict)):
        return None
    if "sparse" in getattr(loss_fn, "__name__", type(loss_fn).__name__).lower():
        return (batch,), True
    return (batch, *tuple(outputs.shape)[1:]), False
