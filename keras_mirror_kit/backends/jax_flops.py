"""FLOPs per training sample on the JAX backend, from XLA's own cost analysis.

`count_training_flops(model)` (reached through `keras_mirror_kit.throughput.flops`) lowers,
never runs, one training computation of the model: the forward pass through the model's
stateless API (`model.stateless_call`), its compiled loss and `jax.grad` of that loss with
respect to the trainable weights, as `jax.jit(...).lower(...)` on abstract arguments
(`jax.ShapeDtypeStruct`: nothing is allocated, no weight or statistic changes). The count is
the `flops` of XLA's cost analysis of that computation (`Lowered.cost_analysis()`, the HLO
before the device's optimisations, so the same on a CPU and a GPU; the compiled
computation's where a JAX version has no analysis of the lowered one). What XLA counts:

* a multiply-add is 2 FLOPs, as on the TensorFlow path: a dot of `(m, k) x (k, n)` is
  `2 m k n`, a convolution `2 x` the multiply-adds of the window positions inside the
  input (padding is not counted);
* the backward pass `jax.grad` builds: the gradient of each weight, and the gradient of each
  layer's input except the first layer's (the data is not differentiated);
* every elementwise operation at one FLOP per element, ReLU's `max` and its gradient's
  `select` included (TensorFlow's statistics count those 0): a few per cent more than the
  TensorFlow count for a small model, less for one dominated by matmuls and convolutions;
  `exp`, `log` and `tanh` are XLA's separate `transcendentals`, not counted;
* per sample: the difference between the counts at two batch sizes, divided by the
  difference, as on the TensorFlow path.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import keras

from keras_mirror_kit.backends.flop_count import FlopCount, compiled_loss, label_layout

__all__ = ["count_training_flops", "model_input_shapes"]

logger = logging.getLogger("keras_mirror_kit")

#: The two batch sizes lowered; their difference gives the per-sample count.
_BATCHES = (2, 4)

Shape = tuple[tuple[int, ...], str]  # one sample's shape (no batch dimension) and dtype

# FLOPs per sample, cached per model and input signature: counted once per model.
_CACHE: weakref.WeakKeyDictionary[Any, dict[tuple, FlopCount]] = weakref.WeakKeyDictionary()


def _shape_of(spec: Any) -> tuple[tuple[Any, ...], str]:
    """`(shape without the batch dimension, dtype)` of anything with `.shape` and `.dtype`."""
    dtype = keras.backend.standardize_dtype(getattr(spec, "dtype", None) or "float32")
    return tuple(tuple(spec.shape)[1:]), dtype


def model_input_shapes(model: keras.Model) -> list[Shape] | None:
    """One `(shape, dtype)` per model input (no batch dimension), or None when not known.

    From `model.inputs` (Functional and Sequential models with an `Input`), else from the
    shape a built subclassed model was first called with (one input only).
    """
    try:
        inputs = list(model.inputs)
    except (AttributeError, ValueError):
        inputs = []
    if inputs:
        shapes = [_shape_of(tensor) for tensor in inputs]
    else:
        built = getattr(model, "_build_shapes_dict", None) or {}
        if len(built) != 1:
            return None
        shape = next(iter(built.values()))
        if not isinstance(shape, (tuple, list)) or not shape or isinstance(shape[0], tuple):
            return None
        shapes = [(tuple(shape)[1:], keras.backend.floatx())]
    if any(dim is None for shape, _ in shapes for dim in shape):
        return None
    return shapes  # type: ignore[return-value]


def count_training_flops(
    model: keras.Model,
    input_specs: Sequence[Any] | None = None,
    label_spec: Any | None = None,
) -> FlopCount:
    """The JAX count (`flops.count_training_flops`), cached per model and signature."""
    name = getattr(model, "name", type(model).__name__)
    shapes = (
        [_shape_of(spec) for spec in input_specs]
        if input_specs is not None
        else model_input_shapes(model)
    )
    if not shapes or any(dim is None for shape, _ in shapes for dim in shape):
        raise ValueError(
            f"count_training_flops: the input shape of the model {name!r} is unknown or not "
            "fully defined, so its FLOPs cannot be counted. Pass input_specs=[keras."
            "KerasTensor((None, ...), dtype)], or give the count yourself: "
            f"ThroughputMonitor(flops_per_sample=...). Received: input_specs={input_specs!r}"
        )
    label = None if label_spec is None else _shape_of(label_spec)
    key = (tuple(shapes), label)
    cached = _CACHE.get(model, {}).get(key)
    if cached is not None:
        return cached
    loss_fn, loss_kind = compiled_loss(model)
    training: dict[int, float] = {}
    forward: dict[int, float] = {}
    for batch in _BATCHES:
        xs = [jax.ShapeDtypeStruct((batch, *shape), jnp.dtype(dtype)) for shape, dtype in shapes]
        y = _label_struct(model, label, loss_fn, batch, xs)
        lowered = None
        if loss_fn is not None and y is not None:
            try:
                lowered = _lower_training(model, xs, y, loss_fn)
            except (ValueError, TypeError) as error:
                logger.debug("count_training_flops: the compiled loss did not lower (%s)", error)
                loss_fn, loss_kind = None, "surrogate"
        if lowered is None:
            loss_kind = "surrogate"
            lowered = _lower_training(model, xs, None, None)
        training[batch] = _xla_flops(lowered)
        forward[batch] = _xla_flops(_lower_forward(model, xs))
    small, large = _BATCHES
    count = FlopCount(
        flops_per_sample=(training[large] - training[small]) / (large - small),
        forward_flops_per_sample=(forward[large] - forward[small]) / (large - small),
        loss=loss_kind,
        counter="xla",
    )
    _CACHE.setdefault(model, {})[key] = count
    return count


def _label_struct(
    model: keras.Model,
    given: Shape | None,
    loss_fn: Callable | None,
    batch: int,
    xs: list[jax.ShapeDtypeStruct],
) -> jax.ShapeDtypeStruct | None:
    if given is not None:
        return jax.ShapeDtypeStruct((batch, *given[0]), jnp.dtype(given[1]))
    if loss_fn is None:
        return None
    tensors = [keras.KerasTensor(x.shape, dtype=str(x.dtype)) for x in xs]
    layout = label_layout(model, [tensors[0] if len(tensors) == 1 else tensors], loss_fn, batch)
    if layout is None:
        return None
    shape, class_ids = layout
    return jax.ShapeDtypeStruct(shape, jnp.int32 if class_ids else jnp.float32)


def _variables(model: keras.Model) -> tuple[list[Any], list[Any]]:
    """Abstract stand-ins for the trainable and the other variables (nothing allocated)."""

    def structs(variables: list[Any]) -> list[jax.ShapeDtypeStruct]:
        return [jax.ShapeDtypeStruct(tuple(v.shape), jnp.dtype(v.dtype)) for v in variables]

    return structs(model.trainable_variables), structs(model.non_trainable_variables)


def _outputs(model: keras.Model, trainable: Any, others: Any, xs: Sequence[Any]) -> Any:
    inputs = xs[0] if len(xs) == 1 else list(xs)
    outputs, _ = model.stateless_call(trainable, others, inputs, training=True)
    return outputs


def _lower_training(
    model: keras.Model,
    xs: list[jax.ShapeDtypeStruct],
    y: jax.ShapeDtypeStruct | None,
    loss_fn: Callable | None,
) -> Any:
    """`jax.jit(jax.grad(loss)).lower(...)`: forward, loss and gradients (nothing runs)."""

    def loss(trainable: Any, others: Any, xs: Any, y: Any) -> Any:
        y_pred = _outputs(model, trainable, others, xs)
        if loss_fn is not None:
            return jnp.mean(jnp.asarray(loss_fn(y, y_pred), jnp.float32))
        # Squared, so that the gradients depend on the forward pass.
        return sum(jnp.sum(jnp.square(t.astype(jnp.float32))) for t in jax.tree.leaves(y_pred))

    trainable, others = _variables(model)
    return jax.jit(jax.grad(loss)).lower(trainable, others, xs, y)


def _lower_forward(model: keras.Model, xs: list[jax.ShapeDtypeStruct]) -> Any:
    trainable, others = _variables(model)
    return jax.jit(lambda t, o, x: _outputs(model, t, o, x)).lower(trainable, others, xs)


def _xla_flops(lowered: Any) -> float:
    """The `flops` of XLA's cost analysis: of the lowered computation, else the compiled one."""
    cost = None
    try:
        cost = lowered.cost_analysis()
    except Exception as error:  # noqa: BLE001 - older JAX: only the compiled analysis
        logger.debug("count_training_flops: no cost analysis of the lowered HLO (%s)", error)
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    if not cost or "flops" not in cost:
        cost = lowered.compile().cost_analysis()
        if isinstance(cost, (list, tuple)):
            cost = cost[0] if cost else None
    if not cost or "flops" not in cost:
        raise ValueError(
            "count_training_flops: XLA gave no cost analysis of the training computation "
            "on this JAX version and device, so its FLOPs cannot be counted. Give the count "
            f"yourself: ThroughputMonitor(flops_per_sample=...). Received: cost={cost!r}"
        )
    return float(cost["flops"])
