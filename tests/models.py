"""Small models of every Keras flavour for tests."""

from __future__ import annotations

import keras


def sequential(units: int = 4) -> keras.Model:
    return keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(units, activation="relu"), keras.layers.Dense(3)]
    )


def functional(units: int = 4) -> keras.Model:
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(units, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3)(hidden))


class Subclassed(keras.Model):
    def __init__(self, units: int = 4, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(units, activation="relu")
        self.out = keras.layers.Dense(3)

    def call(self, inputs):
        return self.out(self.hidden(inputs))


def subclassed(units: int = 4) -> keras.Model:
    model = Subclassed(units)
    model(keras.ops.zeros((1, 6)))  # creates the variables now
    return model


def subclassed_lazy(units: int = 4) -> keras.Model:
    """Variables are created on the first batch, inside fit."""
    return Subclassed(units)


def compile_sgd(model: keras.Model, lr: float = 0.1) -> keras.Model:
    model.compile(
        optimizer=keras.optimizers.SGD(lr),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model
