"""The models whose FLOPs are counted on both backends (`tests/test_flops_jax.py`).

Built with whatever backend Keras runs on: the TensorFlow test process and the JAX child
(`tests/jax_tools_child.py`) build the same models from here.
"""

from __future__ import annotations

from typing import Any


def flop_models() -> dict[str, Any]:
    import keras

    import keras_mirror_kit as kmk

    def compiled(layers: list, loss: str = "mse") -> keras.Model:
        model = keras.Sequential(layers)
        model.compile(optimizer="sgd", loss=loss)
        return model

    tutorial = kmk.models.tutorial_cnn()
    tutorial.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return {
        "dense": compiled(
            [keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(8)]
        ),
        "conv_valid": compiled(
            [
                keras.Input((17, 17, 3)),
                keras.layers.Conv2D(8, 3, activation="relu"),  # 15x15x8
                keras.layers.Conv2D(4, 3, strides=2),  # 7x7x4
            ]
        ),
        # 'same' padding: XLA counts the multiply-adds inside the image only.
        "conv_same": compiled(
            [keras.Input((4, 4, 8)), keras.layers.Conv2D(8, 3, padding="same", use_bias=False)]
        ),
        "tutorial_cnn": tutorial,
    }
