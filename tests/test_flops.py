"""FLOPs per training sample (`keras_mirror_kit.throughput.flops`) against hand counts.

Layer by layer. The hand counts follow the convention `keras_mirror_kit/throughput/flops.py`
states: a multiply-add is 2 FLOPs; the backward pass is the weight gradients plus the input
gradients of every layer but the first; a bias add, its gradient and a pooling window
element are 1 FLOP per element. Each count must be within 2% of the hand count (the loss's
own few FLOPs are the only thing the hand counts leave out).
"""

from __future__ import annotations

import keras
import pytest
import tensorflow as tf

import keras_mirror_kit as kmk
from keras_mirror_kit.backends.tensorflow_flops import model_input_specs
from keras_mirror_kit.throughput.flops import (
    FlopCount,
    count_training_flops,
    model_compute_dtype,
    training_flops_per_sample,
)
from keras_mirror_kit.validation import optional_positive_number
from tests import models

TOLERANCE = 0.02


def compiled(layers: list, loss: str = "mse") -> keras.Model:
    model = keras.Sequential(layers)
    model.compile(optimizer="sgd", loss=loss)
    return model


def dense(n_in: int, n_out: int, first: bool) -> tuple[int, int]:
    """(forward, backward) FLOPs of one Dense layer per sample."""
    macs = 2 * n_in * n_out
    return macs + n_out, macs + n_out + (0 if first else macs)


def conv(out_hw: tuple[int, int], k: int, c_in: int, c_out: int, first: bool) -> tuple[int, int]:
    """(forward, backward) FLOPs of one Conv2D layer per sample (k x k kernel)."""
    outputs = out_hw[0] * out_hw[1] * c_out
    macs = 2 * outputs * k * k * c_in
    return macs + outputs, macs + outputs + (0 if first else macs)


def maxpool(out_hw: tuple[int, int], channels: int, k: int = 2) -> tuple[int, int]:
    outputs = out_hw[0] * out_hw[1] * channels
    return k * k * outputs, k * k * outputs + outputs


def check(count: FlopCount, parts: list[tuple[int, int]]) -> None:
    forward = sum(f for f, _ in parts)
    total = forward + sum(b for _, b in parts)
    assert count.flops_per_sample == pytest.approx(total, rel=TOLERANCE)
    assert count.forward_flops_per_sample == pytest.approx(forward, rel=TOLERANCE)


def test_dense_layers_match_the_hand_count():
    model = compiled(
        [keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(8)]
    )
    count = count_training_flops(model)
    check(count, [dense(64, 32, first=True), dense(32, 8, first=False)])
    # The matmuls exactly: forward 2, backward 2 (+1 input gradient for the second layer).
    assert count.by_op_type["MatMul"] == 2 * (2 * 64 * 32) + 3 * (2 * 32 * 8)
    assert count.loss == "compiled"


def test_conv2d_layers_match_the_hand_count_with_padding_and_strides():
    model = compiled(
        [
            keras.Input((17, 17, 3)),
            keras.layers.Conv2D(8, 3, padding="same", activation="relu"),  # 17x17x8
            keras.layers.Conv2D(4, 3, strides=2),  # valid: 8x8x4
        ]
    )
    count = count_training_flops(model)
    check(count, [conv((17, 17), 3, 3, 8, first=True), conv((8, 8), 3, 8, 4, first=False)])
    # The first layer's input needs no gradient: no input-gradient convolution for it.
    assert count.by_op_type["Conv2DBackpropInput"] == 2 * 8 * 8 * 4 * 9 * 8
    assert count.by_op_type["Conv2DBackpropFilter"] == count.by_op_type["Conv2D"]


def tutorial_hand_count() -> list[tuple[int, int]]:
    return [
        conv((30, 30), 3, 3, 32, first=True),
        maxpool((15, 15), 32),
        dense(15 * 15 * 32, 64, first=False),
        dense(64, 10, first=False),
    ]


def test_the_tutorial_cnn_matches_the_hand_count():
    model = kmk.models.tutorial_cnn()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    count = count_training_flops(model)
    check(count, tutorial_hand_count())
    assert count.flops_per_sample == pytest.approx(6.0016e6, rel=1e-3)  # docs/performance.md
    assert 2.2 < count.flops_per_sample / count.forward_flops_per_sample < 3.0
    assert count.loss == "compiled" and "Relu" in count.uncounted_op_types
    assert training_flops_per_sample(model) == count.flops_per_sample


@pytest.mark.slow
def test_a_batch_normalization_model_matches_the_hand_count():
    """BatchNormalization adds 17 FLOPs per element: 6 forward (2 means, a squared
    deviation, scale, shift) and 11 backward, as TensorFlow differentiates the unfused
    normalization Keras 3 uses; counted here as part of the analytic figure."""
    model = compiled(
        [
            keras.Input((32, 32, 3)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(10, activation="softmax"),
        ],
        loss="sparse_categorical_crossentropy",
    )
    elements = 30 * 30 * 32
    parts = [
        conv((30, 30), 3, 3, 32, first=True),
        (6 * elements, 11 * elements),
        maxpool((15, 15), 32),
        dense(15 * 15 * 32, 10, first=False),
    ]
    check(count_training_flops(model), parts)
    # Without the normalization's arithmetic the count would be 12% off: it is counted.
    without_bn = sum(f + b for f, b in parts) - 17 * elements
    assert count_training_flops(model).flops_per_sample > 1.1 * without_bn


def test_einsum_dense_and_attention_are_counted():
    """EinsumDense runs as a batched matmul whose weight gradient has an adjoint operand."""
    model = compiled(
        [keras.Input((5, 16)), keras.layers.EinsumDense("abc,cde->abde", output_shape=(5, 4, 8))]
    )
    count = count_training_flops(model)
    assert count.by_op_type["BatchMatMulV2"] == 2 * (2 * 5 * 16 * 32)  # forward, weights
    inputs = keras.Input((6, 16))
    attention = keras.Model(inputs, keras.layers.MultiHeadAttention(2, 8)(inputs, inputs))
    attention.compile(loss="mse")
    # Scores and weighted sum (Einsum ops): 2 heads x 6 x 6 x 8 multiply-adds each, forward;
    # backward: both operands' gradients of both (4 more).
    assert count_training_flops(attention).by_op_type["Einsum"] == 6 * 2 * (2 * 6 * 6 * 8)


def test_the_count_does_not_depend_on_strategy_or_dtype_policy():
    @kmk.distributed(per_replica_batch_size=8, mixed_precision="mixed_bfloat16")
    def build() -> keras.Model:
        model = kmk.models.tutorial_cnn()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        return model

    mirrored = build()
    assert build.distribution.num_replicas == 2
    assert model_compute_dtype(mirrored) == "bfloat16"
    plain = kmk.models.tutorial_cnn()
    plain.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    assert model_compute_dtype(plain) == "float32"
    assert count_training_flops(mirrored).flops_per_sample == pytest.approx(
        count_training_flops(plain).flops_per_sample, rel=1e-9
    )


def test_counting_changes_no_weight_and_is_cached():
    model = models.compile_sgd(models.functional())
    before = [w.numpy().copy() for w in model.weights]
    first = count_training_flops(model)
    assert count_training_flops(model) is first  # once per model and input signature
    assert all((w.numpy() == b).all() for w, b in zip(model.weights, before, strict=True))


def test_a_subclassed_model_is_counted_from_its_first_call_and_a_lazy_one_is_refused():
    built = models.compile_sgd(models.subclassed())
    assert [tuple(s.shape) for s in model_input_specs(built)] == [(None, 6)]
    check(count_training_flops(built), [dense(6, 4, first=True), dense(4, 3, first=False)])
    lazy = models.compile_sgd(models.subclassed_lazy())
    with pytest.raises(ValueError, match="not built yet"):
        count_training_flops(lazy)


def test_unknown_input_shapes_are_a_clear_error_and_specs_can_be_given():
    model = keras.Sequential([keras.Input((None, 64)), keras.layers.Dense(8)])
    assert model_input_specs(model) is None
    with pytest.raises(ValueError, match=r"flops_per_sample=\.\.\."):
        count_training_flops(model)
    count = count_training_flops(model, input_specs=[tf.TensorSpec((None, 5, 64))])
    forward, backward = dense(64, 8, first=True)
    if "BatchMatMulV2" in count.by_op_type:
        # Keras before 3.15 multiplies a rank-3 input by a broadcast kernel (BatchMatMulV2),
        # whose kernel gradient is summed over the 5 vectors: what runs is what is counted.
        summed = count.by_op_type.get("Sum", 0.0)
        assert 0 < summed <= 0.07 * 5 * (forward + backward), count.by_op_type
        backward += summed / 5
    check(count, [(5 * forward, 5 * backward)])  # the Dense applies to each of 5 vectors


def test_a_model_without_a_single_compiled_loss_uses_the_surrogate():
    model = keras.Sequential([keras.Input((128,)), keras.layers.Dense(8)])  # not compiled
    count = count_training_flops(model)
    assert count.loss == "surrogate"
    check(count, [dense(128, 8, first=True)])  # the forward pass is in: the loss needs it


@pytest.mark.parametrize(
    ("value", "error"),
    [(0, ValueError), (-1.0, ValueError), (float("nan"), ValueError), (True, TypeError),
     ("1e6", TypeError)],
)  # fmt: skip
def test_validate_flops_per_sample(value, error):
    assert optional_positive_number("flops_per_sample", None) is None
    assert optional_positive_number("flops_per_sample", 6e6) == 6e6
    with pytest.raises(error, match="flops_per_sample"):
        optional_positive_number("flops_per_sample", value)
