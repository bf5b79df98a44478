"""Deterministic randomness in a kit dataset's `preprocess` and `load`.

Both run in a parallel `map`: random ops that draw from shared state (a Keras
`SeedGenerator`'s variable, `tf.random.uniform`, `tf.image.random_*`) then draw in whatever
order the parallel calls happen to run, so two runs differ and a resumed run matches
neither. The kit keys every draw on the dataset's seed, the epoch and the batch's position
in the epoch (or the sample's index, for `load`):

* Keras: while the kit traces its map function, `SeedGenerator.next` (patched once at class
  level, inert outside that context) returns a stateless seed folded from that key, the
  generator's own seed and the number of draws traced before it, instead of advancing its
  state variable. Keras' random preprocessing layers and `keras.random.*` (seeded with a
  `SeedGenerator`, or unseeded: the global generator) draw through it.
* A function with a `seed` parameter (without a default) receives the key itself (an
  int64 tensor of shape [2]), for `tf.random.stateless_*` and `tf.image.stateless_random_*`.
* Stateful TensorFlow random ops and variable writes are found by walking the traced
  function (nested functions included): a WARNING names them, or `strict=True` refuses.

`random_crop_flip()` is an augmentation of the kit's own, keyed the same way: a random
window of each image and a random flip. Per batch it is a `seed`-taking function; given
to `image_dataset_from_directory(augment=)` it crops while decoding (a JPEG's window is
decoded alone, `tf.io.decode_and_crop_jpeg`).
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import tensorflow as tf

from keras_mirror_kit.upstream import keras_private

__all__ = [
    "FLIP_MODES",
    "STATEFUL_RANDOM_OPS",
    "RandomCropFlip",
    "check_deterministic",
    "decode_like_keras",
    "describe",
    "fold_key",
    "random_crop_flip",
    "resize_like_keras",
    "stateful_ops",
    "stateless_draws",
    "takes_seed",
]

logger = logging.getLogger("keras_mirror_kit")

#: Op types whose output depends on state shared by every call of the traced function.
STATEFUL_RANDOM_OPS = frozenset(
    {
        "Multinomial",
        "NonDeterministicInts",
        "ParameterizedTruncatedNormal",
        "RandomCrop",
        "RandomGamma",
        "RandomPoisson",
        "RandomPoissonV2",
        "RandomShuffle",
        "RandomStandardNormal",
        "RandomUniform",
        "RandomUniformInt",
        "RngReadAndSkip",
        "RngSkip",
        "SampleDistortedBoundingBox",
        "SampleDistortedBoundingBoxV2",
        "StatefulRandomBinomial",
        "StatefulStandardNormal",
        "StatefulStandardNormalV2",
        "StatefulTruncatedNormal",
        "StatefulUniform",
        "StatefulUniformFullInt",
        "StatefulUniformInt",
        "TruncatedNormal",
    }
)
# Writes whose result depends on the order of the calls (a counter, a generator's state).
_VARIABLE_WRITES = frozenset({"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"})

_local = threading.local()
_installed = False
_install_lock = threading.Lock()


def fold_key(key: tf.Tensor, *data: Any) -> tf.Tensor:
    """`key` (int64, shape [2]) folded with each of `data` in turn: a new stateless seed."""
    key = tf.reshape(key, [2])
    for value in data:
        key = tf.random.experimental.stateless_fold_in(key, tf.cast(value, tf.int64))
    return key


class _Draws:
    """The stateless seeds handed out while one map function is traced."""

    def __init__(self, key: tf.Tensor) -> None:
        self.key = key
        self.count = 0

    def seed(self, generator: Any) -> tf.Tensor:
        self.count += 1
        own = generator._initial_seed  # noqa: SLF001 (None: a seed drawn at random)
        value = fold_key(self.key, int(own or 0) % (2**31), self.count)
        return tf.cast(value, generator.state.dtype)


def _install() -> None:
    """Patches `SeedGenerator.next` once (a no-op outside `stateless_draws`)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        SeedGenerator = keras_private.seed_generator_class()  # noqa: N806
        # Unseeded draws use Keras' global generator: create it eagerly, not in a trace.
        with tf.init_scope():
            keras_private.global_seed_generator()
        original = SeedGenerator.next

        def next_seed(self: Any, ordered: bool = True) -> Any:
            draws = getattr(_local, "draws", None)
            if draws is None:
                return original(self, ordered=ordered)
            return draws.seed(self)

        next_seed.__wrapped__ = original  # type: ignore[attr-defined]
        SeedGenerator.next = next_seed
        _installed = True


@contextmanager
def stateless_draws(key: tf.Tensor) -> Iterator[None]:
    """While tracing inside: Keras `SeedGenerator`s draw stateless seeds folded from `key`."""
    _install()
    previous = getattr(_local, "draws", None)
    _local.draws = _Draws(key)
    try:
        yield
    finally:
        _local.draws = previous


def takes_seed(function: Callable[..., Any]) -> bool:
    """Whether `function` has a parameter `seed` without a default (it gets the key).

    A `seed=None` default is TensorFlow's op-level seed of a stateful op
    (`tf.image.random_flip_left_right(image, seed=None)`): such a function is not given
    the key, and its stateful draws are named by `check_deterministic`.
    """
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
    seed = parameters.get("seed")
    return seed is not None and seed.default is inspect.Parameter.empty


def describe(function: Any) -> str:
    """A function's name (`random_flip_left_right`, `load.<locals>.<lambda>`), else its repr."""
    if inspect.isfunction(function) or inspect.ismethod(function):
        return function.__qualname__
    return repr(function)


def _op_types(graph_def: Any) -> Iterator[tuple[str, str]]:
    for node in graph_def.node:
        yield node.op, node.name
    for function in graph_def.library.function:
        for node in function.node_def:
            yield node.op, f"{function.signature.name}/{node.name}"


def stateful_ops(graph: tf.Graph) -> list[str]:
    """The stateful random ops and variable writes in `graph` and its nested functions."""
    found: list[str] = []
    for op_type, name in _op_types(graph.as_graph_def()):
        if op_type in STATEFUL_RANDOM_OPS or op_type in _VARIABLE_WRITES:
            label = f"{op_type} ({name.rsplit('/', 1)[-1]})"
            if label not in found:
                found.append(label)
    return found


_KEYED_REMEDY = (
    "Use Keras' random preprocessing layers or keras.random with a SeedGenerator (the kit "
    "makes them deterministic), or give the function a `seed` parameter (without a "
    "default) and use tf.random.stateless_* / tf.image.stateless_random_* with it."
)


def check_deterministic(
    graph: tf.Graph, what: str, strict: bool, remedy: str = _KEYED_REMEDY
) -> None:
    """Warns (or, with `strict`, raises) when `graph` draws from shared random state."""
    found = stateful_ops(graph)
    if not found:
        return
    message = (
        f"{what} uses random ops or variable writes that draw from state shared by all "
        "parallel calls, so its results differ from run to run and a resumed run cannot "
        f"match: {', '.join(found[:8])}{' ...' if len(found) > 8 else ''}. {remedy}"
    )
    if strict:
        raise ValueError(f"{message} Received: strict=True")
    logger.warning("keras-mirror-kit: %s Pass strict=True to refuse it.", message)


#: The flips `random_crop_flip(flip=)` takes (Keras' `RandomFlip` modes), or None.
FLIP_MODES = ("horizontal", "vertical", "horizontal_and_vertical")
_CROP_STREAM = 0x43524F50  # folded into the key: the crop's draws are its own
_JPEG_MAGIC = b"\xff\xd8\xff"  # what `tf.image.decode_image` recognises as a JPEG


class RandomCropFlip:
    """A random window of each image, resized back to its size, and a random flip.

    Made by `random_crop_flip()` (see there). Per batch, `self(images, seed)`; in
    `image_dataset_from_directory(augment=)`, `decode_batch(...)` from the files.
    """

    def __init__(
        self, low: float, high: float, flip: str | None, crop_fraction: Any = None
    ) -> None:
        self.low, self.high = low, high  # checked by random_crop_flip
        self.crop_fraction = (low, high) if crop_fraction is None else crop_fraction
        self.flip_mode = flip

    def draws(self, seed: tf.Tensor, count: Any) -> tf.Tensor:
        """`[count, 5]` uniform draws in [0, 1) keyed on `seed`: fraction, y, x, flips."""
        return tf.random.stateless_uniform(tf.stack([count, 5]), seed=fold_key(seed, _CROP_STREAM))

    def window(self, draw: tf.Tensor, height: Any, width: Any) -> tuple[tf.Tensor, ...]:
        """`(top, left, crop_height, crop_width)` (int32) of an image, from its draws."""
        height, width = tf.cast(height, tf.float32), tf.cast(width, tf.float32)
        fraction = self.low + draw[..., 0] * (self.high - self.low)
        crop_height = tf.clip_by_value(tf.round(fraction * height), 1.0, height)
        crop_width = tf.clip_by_value(tf.round(fraction * width), 1.0, width)
        top = tf.minimum(tf.floor(draw[..., 1] * (height - crop_height + 1)), height - crop_height)
        left = tf.minimum(tf.floor(draw[..., 2] * (width - crop_width + 1)), width - crop_width)
        return tuple(tf.cast(v, tf.int32) for v in (top, left, crop_height, crop_width))

    def flips(self, draw: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """bool `[batch]` each: whether each image is flipped left-right, upside down."""
        never = tf.zeros_like(draw[:, 0], tf.bool)
        horizontal = self.flip_mode in ("horizontal", "horizontal_and_vertical")
        vertical = self.flip_mode in ("vertical", "horizontal_and_vertical")
        return (
            draw[:, 3] < 0.5 if horizontal else never,
            draw[:, 4] < 0.5 if vertical else never,
        )

    def flip_axes(self, draw: tf.Tensor) -> tf.Tensor:
        """int32 `[batch, 3]`: the axes of a (height, width, channels) image to reverse,
        then how many (`tf.reverse(image, row[:row[2]])`: none copies nothing)."""
        horizontal, vertical = self.flips(draw)
        count = tf.cast(horizontal, tf.int32) + tf.cast(vertical, tf.int32)
        first = tf.where(horizontal, 1, 0)  # width first; height (0) when only that
        return tf.stack([first, tf.zeros_like(first), count], axis=1)

    def decode_batch(
        self,
        paths: tf.Tensor,
        draw: tf.Tensor,
        shapes: tf.Tensor | None,
        spec: tf.TensorSpec,
        resize: tuple[Any, ...],
        parallel: int,
        all_jpeg: bool = False,
    ) -> tf.Tensor:
        """A batch of files' windows, decoded, resized as Keras' loader resizes an image
        (`resize`: size, channels, interpolation, data format, crop_to_aspect_ratio,
        pad_to_aspect_ratio) and flipped: a JPEG's window is decoded alone.

        `shapes` (int32 [batch, 3]: height, width, whether a JPEG) are the files' headers,
        read when the dataset was built (`all_jpeg`: of JPEG files only); None reads
        each JPEG's header while decoding.
        """
        channels = resize[1]

        def whole(data: tf.Tensor, one_draw: tf.Tensor) -> tf.Tensor:
            image = tf.image.decode_image(data, channels=channels, expand_animations=False)
            shape = tf.shape(image)
            top, left, crop_height, crop_width = self.window(one_draw, shape[0], shape[1])
            return tf.slice(
                image, tf.stack([top, left, 0]), tf.stack([crop_height, crop_width, -1])
            )

        def jpeg(data: tf.Tensor, window: tf.Tensor) -> tf.Tensor:
            return tf.io.decode_and_crop_jpeg(data, window, channels=channels)

        def either(data: tf.Tensor, one_draw: tf.Tensor) -> tf.Tensor:
            def cropped() -> tf.Tensor:
                shape = tf.io.extract_jpeg_shape(data)
                return jpeg(data, tf.stack(self.window(one_draw, shape[0], shape[1])))

            is_jpeg = tf.equal(tf.strings.substr(data, 0, 3), _JPEG_MAGIC)
            return tf.cond(is_jpeg, cropped, lambda: whole(data, one_draw))

        def run(body: Callable[..., tf.Tensor], *elems: tf.Tensor) -> tf.Tensor:
            def one(e: tuple[tf.Tensor, ...]) -> tf.Tensor:
                window = body(tf.io.read_file(e[0]), *e[2:])
                flipped = tf.reverse(window, e[1][: e[1][2]])  # no axis: not a copy
                return resize_like_keras(flipped, *resize)

            return tf.map_fn(
                one, (paths, axes, *elems), fn_output_signature=spec, parallel_iterations=parallel
            )

        axes = self.flip_axes(draw)
        if channels not in (1, 3):  # RGBA: decode_jpeg gives no alpha channel
            return run(whole, draw)
        if shapes is None:
            return run(either, draw)
        windows = tf.stack(self.window(draw, shapes[:, 0], shapes[:, 1]), axis=1)
        if all_jpeg:
            return run(jpeg, windows)

        def mixed(data: tf.Tensor, window: tf.Tensor, one_draw: tf.Tensor, j: tf.Tensor) -> Any:
            return tf.cond(j, lambda: jpeg(data, window), lambda: whole(data, one_draw))

        return run(mixed, windows, draw, shapes[:, 2] > 0)

    def __call__(self, images: Any, seed: tf.Tensor) -> tf.Tensor:
        """A batch `(batch, height, width, channels)` (or one image) cropped, resized back
        (bilinear, float32) and flipped; the draws keyed on `seed`."""
        images = tf.convert_to_tensor(images)
        single = images.shape.rank == 3
        batch = images[tf.newaxis] if single else images
        shape = tf.shape(batch)
        count, height, width = shape[0], shape[1], shape[2]
        draw = self.draws(seed, count)
        top, left, crop_height, crop_width = (
            tf.cast(v, tf.float32) for v in self.window(draw, height, width)
        )
        rows = tf.cast(tf.maximum(height - 1, 1), tf.float32)
        cols = tf.cast(tf.maximum(width - 1, 1), tf.float32)
        y = tf.stack([top, top + crop_height - 1], axis=1) / rows
        x = tf.stack([left, left + crop_width - 1], axis=1) / cols
        horizontal, vertical = self.flips(draw)  # a box's ends swapped: a flipped crop
        y = tf.where(vertical[:, tf.newaxis], tf.reverse(y, [1]), y)
        x = tf.where(horizontal[:, tf.newaxis], tf.reverse(x, [1]), x)
        boxes = tf.stack([y[:, 0], x[:, 0], y[:, 1], x[:, 1]], axis=1)
        out = tf.image.crop_and_resize(
            tf.cast(batch, tf.float32), boxes, tf.range(count), tf.stack([height, width])
        )
        return out[0] if single else out

    def __repr__(self) -> str:
        return (
            f"kmk.random_crop_flip(crop_fraction={self.crop_fraction!r}, flip={self.flip_mode!r})"
        )


def decode_like_keras(path: tf.Tensor, size: tuple[int, int], channels: int, *resize: Any) -> Any:
    """Keras' `_load_image_tf` of a file: `decode_image`, then `resize_like_keras`."""
    data = tf.io.read_file(path)
    image = tf.image.decode_image(data, channels=channels, expand_animations=False)
    return resize_like_keras(image, size, channels, *resize)


def resize_like_keras(
    image: tf.Tensor,
    size: tuple[int, int],
    channels: int,
    interpolation: str,
    data_format: str,
    crop_to_aspect_ratio: bool,
    pad_to_aspect_ratio: bool,
) -> tf.Tensor:
    """What Keras' `_load_image_tf` does to a decoded image: its resize, verbatim, except
    that a bilinear one starts from float32 (the same values; about 30% faster)."""
    if crop_to_aspect_ratio:
        tf_backend = keras_private.tensorflow_backend()
        image_utils = keras_private.image_utils()

        if data_format == "channels_first":
            image = tf.transpose(image, (2, 0, 1))
        image = image_utils.smart_resize(
            image, size, interpolation=interpolation, data_format=data_format,
            backend_module=tf_backend,
        )  # fmt: skip
    else:
        if pad_to_aspect_ratio:
            image = tf.image.resize_with_pad(image, size[0], size[1], method=interpolation)
        else:
            if interpolation == "bilinear":  # the same values, faster from float32
                image = tf.cast(image, tf.float32)
            image = tf.image.resize(image, size, method=interpolation)
        if data_format == "channels_first":
            image = tf.transpose(image, (2, 0, 1))
    shape = (*size, channels) if data_format == "channels_last" else (channels, *size)
    image.set_shape(shape)
    return image


def random_crop_flip(
    crop_fraction: float | tuple[float, float] = 0.875, flip: str | None = "horizontal"
) -> RandomCropFlip:
    """Random crop and flip, cropped while decoding in `image_dataset_from_directory`.

    Each image gets a random window, `crop_fraction` of its height and of its width (its
    aspect ratio kept) at a uniformly drawn place, resized to the loader's `image_size`
    as Keras resizes a whole image (`interpolation`, `crop_to_aspect_ratio`,
    `pad_to_aspect_ratio`), and a random flip. It is Keras'
    `RandomCrop(224, 224)` after loading at 256x256, `crop_fraction=224 / 256`, without
    decoding what the crop throws away: given to
    `kmk.image_dataset_from_directory(augment=...)` (alone, or first in
    `then(kmk.random_crop_flip(), more_augmentation)`), a JPEG's window is decoded alone
    (`tf.io.decode_and_crop_jpeg`), other formats are decoded whole and sliced, and the
    images stay `image_size` (the validation subset is not cropped: Keras' own images).
    Its draws are keyed on (seed, epoch, batch), as every kit augmentation's, so a
    resumed run crops and flips as the uninterrupted one.

    Anywhere else (`make_dataset(preprocess=...)`, a `then(...)` chain not led by it) it is
    a per-batch function of `(images, seed)`: the windows of the batch's (already resized)
    images are resized back to their size with `tf.image.crop_and_resize` (bilinear,
    float32 out) and flipped, its draws keyed alike; the interpolation differs from the
    decode-time crop's (which resizes the file's own pixels), so the pixels do too.

    Args:
        crop_fraction: The fraction of each side the window keeps, in (0, 1]; or a pair
            `(low, high)` in (0, 1] with `low <= high`, drawn uniformly per image.
        flip: `"horizontal"` (left-right, half of the images), `"vertical"`,
            `"horizontal_and_vertical"` (each drawn on its own, as Keras' `RandomFlip`),
            or None (no flip).

    Returns:
        A `RandomCropFlip`: callable per batch as `f(images, seed)`.

    Raises:
        ValueError: If `crop_fraction` is not in (0, 1] (or its pair is unordered), or
            `flip` is not one of `FLIP_MODES` or None.

    Example:

    ```python
    train_ds, val_ds = kmk.image_dataset_from_directory(
        "PetImages", validation_split=0.2, subset="both", seed=1337,
        image_size=(224, 224), batch_size=dist.global_batch_size,
        augment=kmk.random_crop_flip(crop_fraction=224 / 256))
    ```
    """
    number = isinstance(crop_fraction, (int, float)) and not isinstance(crop_fraction, bool)
    pair = (crop_fraction, crop_fraction) if number else crop_fraction
    valid = isinstance(pair, (tuple, list)) and len(pair) == 2
    valid = valid and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in pair)
    low, high = (float(v) for v in pair) if valid else (0.0, 0.0)
    valid = valid and 0.0 < low <= high <= 1.0
    if not valid:
        raise ValueError(
            "`crop_fraction` must be a number in (0, 1] (the fraction of each side the "
            "window keeps) or a pair (low, high) with 0 < low <= high <= 1. "
            f"Received: crop_fraction={crop_fraction!r}"
        )
    if flip is not None and flip not in FLIP_MODES:
        raise ValueError(
            f"`flip` must be one of {', '.join(map(repr, FLIP_MODES))} or None. "
            f"Received: flip={flip!r}"
        )
    return RandomCropFlip(low, high, flip, crop_fraction if number else (low, high))
