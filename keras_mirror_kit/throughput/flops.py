"""FLOPs per training sample, counted from the model's own training computation.

`count_training_flops(model)` counts, never runs, one training computation of the model
(forward pass, loss and the gradients of the loss with respect to the trainable weights)
with the counter of the Keras backend it runs on, asked through
`keras_mirror_kit.backends.current()`:

* TensorFlow (`backends/tensorflow_flops.py`): the traced graph, with TensorFlow's own FLOP
  statistics and the kit's exact multiply-add formulas for convolution gradients, batched
  matmuls and einsums;
* JAX (`backends/jax_flops.py`): XLA's cost analysis of `jax.jit(jax.grad(loss)).lower(...)`.

On both a multiply-add is 2 FLOPs, the first layer's input gradient is not counted (the data
needs none) and the count per sample is the difference between two batch sizes. They differ
in the elementwise arithmetic (XLA counts ReLU and its gradient, TensorFlow does not): the
JAX count of a small CNN is a few per cent higher (docs/throughput.md gives the figures).
The count is the same whatever the distribution, the dtype policy or `jit_compile`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from keras_mirror_kit import backends
from keras_mirror_kit.backends.flop_count import FlopCount, model_compute_dtype

__all__ = [
    "FlopCount",
    "count_training_flops",
    "model_compute_dtype",
    "training_flops_per_sample",
]


def count_training_flops(
    model: Any,
    input_specs: Sequence[Any] | None = None,
    label_spec: Any | None = None,
) -> FlopCount:
    """Counts the FLOPs of one training sample of `model`: forward, loss and backward.

    Nothing runs and no weight or statistic changes: on TensorFlow the computation is traced
    as a graph and its operations' FLOPs added up; on JAX it is lowered by XLA on abstract
    arguments and XLA's cost analysis gives the FLOPs. Both count at two batch sizes and
    keep the difference (see the module docstring for what is counted). The result is
    cached per model and input signature. The tutorial CNN takes well under a second on
    either backend.

    Args:
        model: A built `keras.Model` (for instance after the first `fit` step, or one with
            an `Input`). It may have been built under any distribution or dtype policy.
            Compiled with one loss, that loss is counted; otherwise a surrogate loss (the
            sum of the squared outputs) stands in.
        input_specs: The inputs of one sample, with the batch dimension first (its size is
            ignored): anything with `.shape` and `.dtype`, such as
            `keras.KerasTensor((None, 32, 32, 3))` on either backend or a `tf.TensorSpec`.
            Default: the model's input shapes.
        label_spec: The labels of one sample (batch dimension first), likewise. Default:
            integer class indices for a sparse loss, the output's shape otherwise.

    Returns:
        A `FlopCount` (`counter` says which backend's counter counted).

    Raises:
        ValueError: If the model is not built, or its input shapes are unknown: pass
            `input_specs`, or give the count yourself where it is used
            (`ThroughputMonitor(flops_per_sample=...)`).
        RuntimeError: If Keras runs on a backend the kit does not support.

    Example:

    ```python
    model = kmk.models.tutorial_cnn()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    count_training_flops(model).flops_per_sample   # about 6.0e6 (6.07e6 on JAX)
    ```
    """
    name = getattr(model, "name", type(model).__name__)
    if not getattr(model, "built", False):
        raise ValueError(
            f"count_training_flops: the model {name!r} is not built yet, so its weights and "
            "shapes are unknown. Count after the first training step, or build it (give it "
            "an Input). Received: model.built=False"
        )
    count: FlopCount = backends.current().count_training_flops(model, input_specs, label_spec)
    return count


def training_flops_per_sample(model: Any) -> float:
    """`count_training_flops(model).flops_per_sample` (raises as it does)."""
    return count_training_flops(model).flops_per_sample
