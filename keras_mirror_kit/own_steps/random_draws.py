"""Random numbers drawn in an own step: each replica draws its rows of one device's draw.

Under a `tf.distribute` strategy every replica runs the step with the same seed state, so
`keras.random.normal((batch_size, latent_dim), seed=self.seed_generator)` gives every
replica the same numbers for its part: N replicas train on N copies of `batch / N`
latent vectors where one device draws `batch` different ones (and a stateful
`tf.random.uniform` draws numbers no checkpoint can reproduce). Inside an own step the
kit wraps (`context.current()`), a draw whose first dimension is `k` times the replica's
rows (`k` blocks of rows: a batch, or `concatenate([fake, real])`) is drawn at the batch's
size, `k * total` rows, from the same seed, and the replica keeps its rows of each block:
one device's numbers, whatever the number of replicas. A draw of another shape is one
device's draw as it is.

Covered: Keras' `normal`, `uniform`, `truncated_normal`, `randint` and `dropout` (the
`Dropout` layers too), and TensorFlow's stateful `tf.random.normal`, `tf.random.uniform`
and `tf.random.truncated_normal`. Inside such a step, a draw given no seed (a Keras draw
without `seed=`, and those three TensorFlow draws, whose state hides in the op) draws
from the model's own `SeedGenerator` (`StepContext.seed_generator`, mirrored, saved with
every checkpoint) instead: Keras' global generator is one per thread, and tf.distribute
traces each replica in a thread of its own. Other random draws are left as they are (the
probe names TensorFlow's stateful ones).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from keras_mirror_kit.own_steps.context import StepContext, current
from keras_mirror_kit.upstream import keras_private

__all__ = ["install"]

_install_lock = threading.Lock()
_installed: list[bool] = []


def _first_dim(shape: Any) -> Any:
    """The first dimension of a shape given as a tuple, list, TensorShape or tensor."""
    if isinstance(shape, tf.Tensor):
        return shape[0]
    first = list(shape)[0] if len(shape) else None
    return first.value if hasattr(first, "value") and not isinstance(first, int) else first


def _rest(shape: Any) -> Any:
    if isinstance(shape, tf.Tensor):
        return shape[1:]
    return list(shape)[1:]


def _with_first(first: Any, shape: Any) -> Any:
    if isinstance(shape, tf.Tensor) or isinstance(first, tf.Tensor):
        rest = tf.cast(_rest(shape), tf.int32) if isinstance(shape, tf.Tensor) else _rest(shape)
        return tf.concat([[tf.cast(first, tf.int32)], tf.cast(rest, tf.int32)], axis=0)
    return (first, *_rest(shape))


MAX_BLOCKS = 4  # a draw of up to 4 times the replica's rows is per row (fake, real, ...)


def _blocks(step: StepContext, first: Any) -> tuple[Any, Any] | None:
    """`(k, exact)`: the draw is `k` blocks of the replica's rows; None: not per row."""
    rows = tf.get_static_value(step.rows)
    static_first = tf.get_static_value(first) if isinstance(first, tf.Tensor) else first
    if rows is not None and static_first is not None:
        if rows <= 0 or static_first % rows or not 0 < static_first // rows <= MAX_BLOCKS:
            return None
        return static_first // rows, True
    if static_first is not None and static_first == 0:
        return None
    first = tf.cast(first, tf.int32)
    safe_rows = tf.maximum(step.rows, 1)
    k = first // safe_rows
    exact = tf.logical_and(step.rows > 0, tf.equal(first % safe_rows, 0))
    return k, tf.logical_and(exact, tf.logical_and(k > 0, k <= MAX_BLOCKS))


def _rows_of_blocks(step: StepContext, k: Any) -> tf.Tensor:
    """The indices, in the batch's draw of `k * total` rows, of this replica's `k * rows`."""
    blocks = tf.range(tf.cast(k, tf.int32))[:, None] * step.total
    return tf.reshape(blocks + step.offset + tf.range(step.rows)[None, :], [-1])


def _consistent(draw: Callable[[Any], tf.Tensor], shape: Any) -> tf.Tensor:
    """`draw(shape)`, or this replica's rows of `draw(batch's shape)` (module docstring).

    `draw` must draw from a seed already taken (it is called once or twice, in the
    branches of a `tf.cond`, and must advance no generator itself).
    """
    step = current()
    if step.replicas <= 1 and step.probe is None:
        return draw(shape)
    first = _first_dim(shape)
    found = _blocks(step, first) if first is not None else None
    if found is None:
        return draw(shape)
    k, exact = found

    def per_row() -> tf.Tensor:
        whole = draw(_with_first(k * step.total, shape))
        return tf.gather(whole, _rows_of_blocks(step, k))

    if exact is True:
        return per_row()
    return tf.cond(exact, per_row, lambda: draw(shape))


def _outside_steps(original: Callable[..., Any], inside: Callable[..., Any]) -> Callable[..., Any]:
    """`inside` within an own step (`current()`), Keras' `original` everywhere else."""

    @functools.wraps(original)
    def draw(*args: Any, **kwargs: Any) -> Any:
        if current() is None:
            return original(*args, **kwargs)
        return inside(*args, **kwargs)

    return draw


def _keras_draws() -> dict[str, Callable[..., Any]]:
    """Keras' TensorFlow draws, each taking its seed once and drawing through `_consistent`
    (called inside own steps only: `_outside_steps`)."""
    from keras.config import floatx

    keras_random = keras_private.tensorflow_random()
    draw_seed = keras_private.draw_seed

    def take_seed(seed: Any) -> Any:
        step = current()
        if seed is None and step is not None and step.seed_generator is not None:
            seed = step.seed_generator
        return keras_random._cast_seed(draw_seed(seed))  # noqa: SLF001

    def normal(
        shape: Any, mean: Any = 0.0, stddev: Any = 1.0, dtype: Any = None, seed: Any = None
    ) -> Any:
        dtype = dtype or floatx()
        seed = take_seed(seed)
        return _consistent(
            lambda s: tf.random.stateless_normal(
                s, mean=mean, stddev=stddev, dtype=dtype, seed=seed
            ),
            shape,
        )

    def uniform(
        shape: Any, minval: Any = 0.0, maxval: Any = 1.0, dtype: Any = None, seed: Any = None
    ) -> Any:
        dtype = dtype or floatx()
        seed = take_seed(seed)
        return _consistent(
            lambda s: tf.random.stateless_uniform(
                s,
                minval=tf.cast(minval, dtype),
                maxval=tf.cast(maxval, dtype),
                dtype=dtype,
                seed=seed,
            ),
            shape,
        )

    def truncated_normal(
        shape: Any, mean: Any = 0.0, stddev: Any = 1.0, dtype: Any = None, seed: Any = None
    ) -> Any:
        dtype = dtype or floatx()
        seed = take_seed(seed)
        return _consistent(
            lambda s: tf.random.stateless_truncated_normal(
                s, mean=mean, stddev=stddev, dtype=dtype, seed=seed
            ),
            shape,
        )

    def randint(
        shape: Any, minval: Any, maxval: Any, dtype: Any = "int32", seed: Any = None
    ) -> Any:
        intermediate = "int64" if dtype in ("int64", "uint32", "uint64") else "int32"
        seed = take_seed(seed)
        return _consistent(
            lambda s: tf.cast(
                tf.random.stateless_uniform(
                    s, minval=minval, maxval=maxval, dtype=intermediate, seed=seed
                ),
                dtype,
            ),
            shape,
        )

    original_dropout = keras_random.dropout

    def dropout(inputs: Any, rate: Any, noise_shape: Any = None, seed: Any = None) -> Any:
        step = current()
        if step.replicas <= 1 and step.probe is None:
            return original_dropout(inputs, rate, noise_shape, seed)
        if (isinstance(rate, (int, float)) and not 0 < rate < 1) or not inputs.shape.rank:
            return original_dropout(inputs, rate, noise_shape, seed)
        shape = keras_random._get_concrete_noise_shape(inputs, noise_shape)  # noqa: SLF001
        seed = take_seed(seed)
        ones = tf.ones((), inputs.dtype)
        mask = _consistent(
            lambda s: tf.nn.experimental.stateless_dropout(
                tf.broadcast_to(ones, s), rate=rate, noise_shape=s, seed=seed
            ),
            shape,
        )
        return inputs * mask  # x * (scale or 0): one device's x * scale * keep, bit for bit

    return {
        "normal": normal,
        "uniform": uniform,
        "truncated_normal": truncated_normal,
        "randint": randint,
        "dropout": dropout,
    }


def _tensorflow_draw(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """`tf.random.<name>` drawing from Keras' global seed generator inside an own step."""
    keras_random = keras_private.tensorflow_random()

    @functools.wraps(original)
    def draw(shape: Any, *args: Any, **kwargs: Any) -> Any:
        if current() is None:
            return original(shape, *args, **kwargs)
        names = {
            "normal": ("mean", "stddev", "dtype", "seed", "name"),
            "truncated_normal": ("mean", "stddev", "dtype", "seed", "name"),
            "uniform": ("minval", "maxval", "dtype", "seed", "name"),
        }[name]
        given = dict(zip(names, args, strict=False)) | kwargs
        dtype = tf.as_dtype(given.get("dtype") or tf.float32)
        if name == "uniform":
            low, high = given.get("minval", 0), given.get("maxval")
            if dtype.is_integer:
                return keras_random.randint(shape, low, high, dtype=dtype.name)
            return keras_random.uniform(shape, low, 1 if high is None else high, dtype=dtype.name)
        draw_fn = keras_random.normal if name == "normal" else keras_random.truncated_normal
        return draw_fn(shape, given.get("mean", 0.0), given.get("stddev", 1.0), dtype=dtype.name)

    return draw


def install() -> None:
    """Installs the replica-consistent draws once (they act inside own steps only)."""
    with _install_lock:
        if _installed:
            return
        keras_random = keras_private.tensorflow_random()
        for name, function in _keras_draws().items():
            setattr(keras_random, name, _outside_steps(getattr(keras_random, name), function))
        for name in ("normal", "uniform", "truncated_normal"):
            setattr(tf.random, name, _tensorflow_draw(name, getattr(tf.random, name)))
        _installed.append(True)
