"""A deterministic little training job shared by the checkpoint tests."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import keras
import numpy as np

import keras_mirror_kit as kmk

N, BATCH = 96, 16  # 6 batches per epoch (global batch 16)


def data(n: int = N) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 6)).astype("float32")
    y = ((x[:, 0] > 0).astype("int32") + (x[:, 1] > 0)).astype("int32")
    return x, y


OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01),
}


def build(
    optimizer: str = "adam",
    devices=None,
    batch_norm: bool = False,
    seed: int = 3,
    random_layers: bool = False,
):
    """A kit-built model with fixed initial weights (`random_layers`: Dropout, GaussianNoise)."""

    @kmk.distributed(global_batch_size=BATCH, devices=devices)
    def factory():
        keras.utils.set_random_seed(seed)
        layers = [keras.Input((6,)), keras.layers.Dense(8, activation="relu")]
        if batch_norm:
            layers.append(keras.layers.BatchNormalization())
        if random_layers:
            layers += [keras.layers.Dropout(0.3), keras.layers.GaussianNoise(0.2)]
        layers.append(keras.layers.Dense(3))
        model = keras.Sequential(layers)
        model.compile(
            optimizer=OPTIMIZERS[optimizer](),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return model

    return factory()


def set_back(model: keras.Model, seed: int | None = 3) -> Callable[..., keras.Model]:
    """`reset(weights=None)`: sets every variable of `model` (its weights, a random layer's
    seed-generator state) and of its optimizer back to its value now (the optimizer built
    first, as its first `fit` would build it, so that there is a state), then gives it
    `weights` if given; and, unless `seed` is None, calls `keras.utils.set_random_seed(seed)`
    as `build` does before it builds (Keras' own seeds, such as `fit`'s shuffle of arrays,
    come from it). One model, traced once, serves runs that each start as a new `build`'s
    would, bit for bit."""
    if not model.optimizer.built:
        with model.distribute_strategy.scope():
            model.optimizer.build(model.trainable_variables)
    variables = [*model.variables, *model.optimizer.variables]
    values = [v.numpy().copy() for v in variables]

    def reset(weights: list[np.ndarray] | None = None) -> keras.Model:
        if seed is not None:
            keras.utils.set_random_seed(seed)
        for variable, value in zip(variables, values, strict=True):
            variable.assign(value)  # every replica's copy; the learning rate too
        if weights is not None:
            model.set_weights(weights)
        return model

    return reset


def dataset(seed: int = 11, n: int = N):
    x, y = data(n)
    return kmk.make_dataset(x, y, BATCH, seed=seed)


class StopAt(keras.callbacks.Callback):
    """Simulates a crash: raises at (epoch, batch)."""

    def __init__(self, epoch: int, batch: int) -> None:
        super().__init__()
        self.at = (epoch, batch)
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise KeyboardInterrupt("simulated crash")


class CountBatches(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.batches = 0

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1


def max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def copy_of(directory: Path, tmp_path: Path, name: str = "ckpt") -> Path:
    """A copy of a checkpoint directory at `tmp_path / name`: a test resumes the copy of a
    run its module made once, never the run itself."""
    target = tmp_path / name
    shutil.copytree(directory, target)
    return target
