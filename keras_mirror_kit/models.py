"""The canonical model: the CIFAR-10 CNN of the classic MirroredStrategy tutorial."""

from __future__ import annotations

import keras

__all__ = ["tutorial_cnn"]


def tutorial_cnn(input_shape: tuple[int, int, int] = (32, 32, 3), num_classes: int = 10):
    """Returns the tutorial's CNN, uncompiled, exactly as the tutorial defines it.

    Conv2D(32, 3x3, relu), MaxPooling2D(2x2), Flatten, Dense(64, relu),
    Dense(num_classes, softmax). Call it inside a `distributed()` factory.

    Args:
        input_shape: Image shape, channels last.
        num_classes: Number of output classes.

    Returns:
        An uncompiled `keras.Sequential`.

    Raises:
        ValueError: If Keras rejects the shapes (e.g. images smaller than 4x4).

    Example:

    ```python
    @kmk.distributed(per_replica_batch_size=64)
    def build_model():
        model = kmk.models.tutorial_cnn()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
        return model
    ```
    """
    return keras.Sequential(
        [
            keras.Input(input_shape),
            keras.layers.Conv2D(32, (3, 3), activation="relu"),
            keras.layers.MaxPooling2D((2, 2)),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(num_classes, activation="softmax"),
        ],
        name="cifar10_cnn",
    )
