"""FLOPs per training sample on the TensorFlow backend, from the model's traced graph.

`count_training_flops(model)` (reached through `keras_mirror_kit.throughput.flops`) traces
(never runs) one training computation of the model, forward pass, loss and backward pass
(the gradients of the loss with respect to the trainable weights), as a TensorFlow graph,
keeps the operations the gradients depend on, and adds up their floating-point operations
with TensorFlow's own FLOP statistics (the ones `tf.compat.v1.profiler` reports as
`float_ops`). What is counted:

* a multiply-add is 2 FLOPs: a matmul of `(m, k) x (k, n)` is `2 m k n`; a convolution is
  `2 x output elements x kernel height x kernel width x input channels (per group)`;
* the backward pass as TensorFlow builds it: the gradient of each weight, and the gradient
  of each layer's input except where nothing needs it (the model's first layer: the input
  data needs no gradient, so its input-gradient convolution or matmul is never run and not
  counted). For a stack of matmul/conv layers the backward pass is about twice the forward;
* elementwise arithmetic TensorFlow has a statistic for (bias adds, batch-normalization
  arithmetic, pooling, softmax, the loss) at one FLOP per element (pooling: per window
  element). Operations without one count 0: activations such as ReLU, casts, reshapes;
  `FlopCount.uncounted_op_types` lists the float-valued ones met;
* per sample: the difference between the counts at two batch sizes, divided by the
  difference, so what does not grow with the batch (the weight-decay terms of the loss) is
  left out. The optimizer's update and the metrics are not part of the traced computation:
  they cost a fixed amount per step (a few FLOPs per weight), not per sample.

Three deviations from TensorFlow's profiler, all toward the exact multiply-add count: the
input- and filter-gradient convolutions count `2 x output-gradient elements x kernel
elements per output channel`, the same as the forward convolution (the profiler scales by
the input image size instead, 14% too much for a 3x3 `valid` convolution on 32x32 images);
a batched matmul with an adjoint first operand (the weight gradient of `EinsumDense`) takes
its inner dimension from the right axis; and `Einsum` (in `MultiHeadAttention`) is counted,
which the profiler does not.

The count is the same whatever the distribution strategy, the dtype policy or
`jit_compile`: it is the arithmetic of one sample, not of a device.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from keras_mirror_kit.backends.flop_count import FlopCount, compiled_loss, label_layout
from keras_mirror_kit.upstream import tensorflow_private

__all__ = ["count_training_flops", "model_input_specs"]

logger = logging.getLogger("keras_mirror_kit")

#: The two batch sizes traced; their difference gives the per-sample count.
_BATCHES = (2, 4)

# Float-valued op types that do no arithmetic worth a FLOP (data movement, bookkeeping).
_NO_ARITHMETIC = frozenset(
    {
        "Identity", "IdentityN", "Reshape", "Squeeze", "ExpandDims", "Cast", "Const",
        "Placeholder", "ReadVariableOp", "Shape", "ShapeN", "Size", "Rank", "Fill", "ZerosLike",
        "OnesLike", "Transpose", "ConcatV2", "Pack", "Unpack", "Slice", "StridedSlice",
        "StridedSliceGrad", "GatherV2", "Tile", "BroadcastTo", "Pad", "PadV2", "NoOp",
        "StopGradient", "PreventGradient", "Select", "SelectV2", "Snapshot", "Split", "SplitV",
        "BroadcastGradientArgs", "Range", "Prod", "Where", "OneHot", "MaxPoolGradGrad",
        "ResourceGather", "UnsortedSegmentSum", "DynamicStitch", "Bitcast", "EnsureShape",
        "CheckNumerics", "AssignVariableOp", "VarHandleOp", "StatelessRandomUniformV2",
        "StatelessRandomGetKeyCounter", "RandomUniform", "RandomStandardNormal",
    }
)  # fmt: skip


def model_input_specs(model: keras.Model) -> list[tf.TensorSpec] | None:
    """One `tf.TensorSpec` (batch dimension None) per model input, or None when not fully known.

    Read from `model.inputs` (Functional and Sequential models with an `Input`), else from
    the shape a built subclassed model was first called with (one input only).
    """
    specs: list[tf.TensorSpec] = []
    try:
        inputs = list(model.inputs)
    except (AttributeError, ValueError):
        inputs = []
    if inputs:
        for tensor in inputs:
            specs.append(tf.TensorSpec((None, *tuple(tensor.shape)[1:]), tensor.dtype))
    else:
        shapes = getattr(model, "_build_shapes_dict", None) or {}
        if len(shapes) != 1:
            return None
        shape = next(iter(shapes.values()))
        if not isinstance(shape, (tuple, list)) or not shape or isinstance(shape[0], tuple):
            return None
        specs.append(tf.TensorSpec((None, *tuple(shape)[1:]), keras.backend.floatx()))
    if any(dim is None for spec in specs for dim in spec.shape[1:]):
        return None
    return specs


# FLOPs per sample, cached per model and input signature: counted once per model.
_CACHE: weakref.WeakKeyDictionary[Any, dict[tuple, FlopCount]] = weakref.WeakKeyDictionary()


def count_training_flops(
    model: keras.Model,
    input_specs: list[tf.TensorSpec] | None = None,
    label_spec: tf.TensorSpec | None = None,
) -> FlopCount:
    """The TensorFlow count (`flops.count_training_flops`), cached per model and signature."""
    name = getattr(model, "name", type(model).__name__)
    specs = input_specs if input_specs is not None else model_input_specs(model)
    if not specs or any(dim is None for spec in specs for dim in tuple(spec.shape)[1:]):
        raise ValueError(
            f"count_training_flops: the input shape of the model {name!r} is unknown or not "
            "fully defined, so its FLOPs cannot be counted. Pass input_specs=[tf.TensorSpec("
            "(None, ...), dtype)], or give the count yourself: "
            f"ThroughputMonitor(flops_per_sample=...). Received: input_specs={specs!r}"
        )
    key = (
        tuple((tuple(spec.shape)[1:], tf.as_dtype(spec.dtype).name) for spec in specs),
        None if label_spec is None else (tuple(label_spec.shape)[1:], label_spec.dtype.name),
    )
    cached = _CACHE.get(model, {}).get(key)
    if cached is not None:
        return cached
    loss_fn, loss_kind = compiled_loss(model)
    training: dict[int, dict[str, float]] = {}
    forward: dict[int, dict[str, float]] = {}
    uncounted: set[str] = set()
    for batch in _BATCHES:
        x_specs = [tf.TensorSpec((batch, *tuple(s.shape)[1:]), s.dtype) for s in specs]
        y_spec = _label_spec(model, label_spec, loss_fn, batch, x_specs)
        if loss_fn is not None and y_spec is not None:
            try:
                graph_fn = _trace_training(model, x_specs, y_spec, loss_fn)
            except (ValueError, TypeError, tf.errors.InvalidArgumentError) as error:
                logger.debug("count_training_flops: the compiled loss did not trace (%s)", error)
                loss_fn, loss_kind = None, "surrogate"
        if loss_fn is None or y_spec is None:
            loss_kind = "surrogate"
            graph_fn = _trace_training(model, x_specs, None, None)
        training[batch] = _graph_flops(graph_fn, uncounted)
        forward[batch] = _graph_flops(_trace_forward(model, x_specs), set())
    small, large = _BATCHES
    by_type = {
        op: (training[large].get(op, 0.0) - training[small].get(op, 0.0)) / (large - small)
        for op in sorted(set(training[small]) | set(training[large]))
    }
    by_type = {op: value for op, value in by_type.items() if value}
    total = sum(by_type.values())
    fwd = (sum(forward[large].values()) - sum(forward[small].values())) / (large - small)
    count = FlopCount(
        flops_per_sample=total,
        forward_flops_per_sample=fwd,
        by_op_type=by_type,
        loss=loss_kind,
        uncounted_op_types=tuple(sorted(uncounted)),
    )
    _CACHE.setdefault(model, {})[key] = count
    return count


def _label_spec(
    model: keras.Model,
    given: tf.TensorSpec | None,
    loss_fn: Callable | None,
    batch: int,
    x_specs: list[tf.TensorSpec],
) -> tf.TensorSpec | None:
    if given is not None:
        return tf.TensorSpec((batch, *tuple(given.shape)[1:]), given.dtype)
    if loss_fn is None:
        return None
    layout = label_layout(model, _keras_tensors(x_specs), loss_fn, batch)
    if layout is None:
        return None
    shape, class_ids = layout
    return tf.TensorSpec(shape, tf.int32 if class_ids else tf.float32)


def _keras_tensors(specs: list[tf.TensorSpec]) -> list[Any]:
    tensors = [keras.KerasTensor(tuple(s.shape), dtype=tf.as_dtype(s.dtype).name) for s in specs]
    return tensors if len(tensors) > 1 else tensors[:1]


def _call(model: keras.Model, xs: tuple[tf.Tensor, ...], training: bool) -> Any:
    return model(xs[0] if len(xs) == 1 else list(xs), training=training)


def _trace_training(
    model: keras.Model,
    x_specs: list[tf.TensorSpec],
    y_spec: tf.TensorSpec | None,
    loss_fn: Callable | None,
) -> Any:
    """Traces forward, loss and gradients into a concrete function (nothing runs)."""

    def step(*args: tf.Tensor) -> list[tf.Tensor]:
        xs = args[: len(x_specs)]
        with tf.GradientTape() as tape:
            y_pred = _call(model, xs, training=True)
            if loss_fn is not None:
                loss = tf.reduce_mean(tf.cast(loss_fn(args[-1], y_pred), tf.float32))
            else:  # squared, so that the gradients depend on the forward pass
                loss = tf.add_n(
                    [
                        tf.reduce_sum(tf.square(tf.cast(t, tf.float32)))
                        for t in tf.nest.flatten(y_pred)
                    ]
                )
        grads = tape.gradient(loss, model.trainable_variables)
        return [g for g in grads if g is not None]

    specs = list(x_specs) + ([y_spec] if loss_fn is not None else [])
    return tf.function(step, autograph=False).get_concrete_function(*specs)


def _trace_forward(model: keras.Model, x_specs: list[tf.TensorSpec]) -> Any:
    def forward(*xs: tf.Tensor) -> Any:
        return _call(model, xs, training=True)

    return tf.function(forward, autograph=False).get_concrete_function(*x_specs)


def _graph_flops(concrete: Any, uncounted: set[str]) -> dict[str, float]:
    """FLOPs by op type of the ops the concrete function's outputs depend on."""
    tf_ops = tensorflow_private.flop_statistics()  # the registry, FLOP statistics registered
    graph = concrete.graph
    stack = [t.op for t in concrete.outputs]
    seen: set[Any] = set()
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    totals: dict[str, float] = {}
    for op in seen:
        flops = _own_flops(op)
        if flops is None:
            try:
                with tensorflow_private.silenced_deprecations():  # their shape helper warns once
                    stats = tf_ops.get_stats_for_node_def(graph, op.node_def, "flops")
            except (ValueError, TypeError):
                stats = None
            flops = float(stats.value) if stats is not None and stats.value else None
        if flops is None:
            if op.type not in _NO_ARITHMETIC and any(t.dtype.is_floating for t in op.outputs):
                uncounted.add(op.type)
            continue
        totals[op.type] = totals.get(op.type, 0.0) + flops
    return totals


def _elements(tensor: tf.Tensor) -> int | None:
    shape = tensor.shape
    return shape.num_elements() if shape.is_fully_defined() else None


def _own_flops(op: Any) -> float | None:
    """Multiply-add counts for the ops where the kit's formula replaces TensorFlow's."""
    kind = op.type
    if kind in ("Conv2DBackpropInput", "Conv2DBackpropFilter", "Conv3DBackpropInputV2",
                "Conv3DBackpropFilterV2"):  # fmt: skip
        # inputs: (input or its sizes, filter or its sizes, output gradient)
        out_grad = _elements(op.inputs[2])
        kernel = op.inputs[1] if kind.endswith("Input") or "InputV2" in kind else op.outputs[0]
        if out_grad is None or not kernel.shape.is_fully_defined():
            return None
        dims = kernel.shape.as_list()  # (..spatial.., in_channels_per_group, out_channels)
        return 2.0 * out_grad * math.prod(dims[:-1])
    if kind in ("DepthwiseConv2dNativeBackpropInput", "DepthwiseConv2dNativeBackpropFilter"):
        out_grad = _elements(op.inputs[2])
        kernel = op.inputs[1] if kind.endswith("Input") else op.outputs[0]
        if out_grad is None or not kernel.shape.is_fully_defined():
            return None
        height, width = kernel.shape.as_list()[:2]
        return 2.0 * out_grad * height * width
    if kind in ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"):
        # TensorFlow's statistic reads `transpose_a`, which these ops call `adj_x`.
        a, out = op.inputs[0], op.outputs[0]
        if not a.shape.is_fully_defined() or _elements(out) is None:
            return None
        k = a.shape[-2] if op.get_attr("adj_x") else a.shape[-1]
        return 2.0 * k * _elements(out)
    if kind == "Einsum":
        return _einsum_flops(op)
    return None


def _einsum_flops(op: Any) -> float | None:
    """2 x the product of every index's size, for a two-operand einsum without ellipsis."""
    equation = op.get_attr("equation").decode()
    inputs_part = equation.split("->")[0]
    operands = inputs_part.split(",")
    if "." in equation or len(operands) != 2 or len(op.inputs) != 2:
        return None
    sizes: dict[str, int] = {}
    for letters, tensor in zip(operands, op.inputs, strict=True):
        if not tensor.shape.is_fully_defined() or len(letters) != tensor.shape.rank:
            return None
        for letter, size in zip(letters, tensor.shape.as_list(), strict=True):
            sizes[letter] = size
    return 2.0 * math.prod(sizes.values())
