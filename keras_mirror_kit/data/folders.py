"""`image_dataset_from_directory` and `text_dataset_from_directory` with Keras' signatures.

The files are found, ordered, split and labelled by Keras' own `index_directory` and
`get_training_or_validation_split`, and read as Keras' `_load_image_tf` and
`_path_to_string_content_tf` read them (a bilinear resize from float32: the same values):
the same `file_paths`, `class_names`, labels and pixels as Keras' loaders. What differs:
each epoch is a permutation keyed on `(seed, epoch)`, which `SyncedCheckpoint(dataset=)`
resumes exactly mid-epoch, not a shuffle buffer; and the dataset has one element per
batch, whose files a `tf.map_fn` decodes (a tf.data element per file costs more than
decoding a small image), the batches in a parallel, deterministic map; `preprocess` and
`augment` in a map of their own (see `workarounds.tf_data_function_instantiation`).

With a `seed`, the files are indexed in the order Keras gives them with that seed; without
one, in sorted order, and the kit's permutation (its drawn seed saved by `SyncedCheckpoint`)
does all the shuffling. Files someone else made are checked before training starts
(`data.image_headers`): a symbolic link back to a folder above it (`follow_links=True`)
and an image header that declares more than `max_image_pixels` pixels are refused.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from keras_mirror_kit.data.augment import (
    RandomCropFlip,
    check_deterministic,
    decode_like_keras,
    describe,
    fold_key,
)
from keras_mirror_kit.data.decode_parallelism import parallelism
from keras_mirror_kit.data.image_headers import (
    DEFAULT_MAX_IMAGE_PIXELS,
    check_image_files,
    check_link_loops,
)
from keras_mirror_kit.data.pipeline import (
    check_batch_function,
    check_placement,
    epoch_info,
    finish_dataset,
    multi_worker_expected,
    resolve_seed,
)
from keras_mirror_kit.data.preprocess import Then, then
from keras_mirror_kit.data.samples import BATCH_DOMAIN, map_keyed
from keras_mirror_kit.data.sharding import fill_batch, own_range, record_part, worker_slice
from keras_mirror_kit.data.sources import index_batches, to_tensors
from keras_mirror_kit.upstream import keras_private
from keras_mirror_kit.validation import check_bool, positive_int
from keras_mirror_kit.workarounds.tf_data_function_instantiation import host_functions

__all__ = ["image_dataset_from_directory", "text_dataset_from_directory"]

IMAGE_FORMATS = (".bmp", ".gif", ".jpeg", ".jpg", ".png")
INTERPOLATIONS = ("bilinear", "nearest", "bicubic", "area")
INTERPOLATIONS += ("lanczos3", "lanczos5", "gaussian", "mitchellcubic")
_CHANNELS = {"grayscale": 1, "rgb": 3, "rgba": 4}


class _Load:
    """A per-file decode function of Keras', with its arguments (shown in messages)."""

    def __init__(self, name: str, function: Callable[..., Any], *args: Any) -> None:
        self.name = name
        self.function = function
        self.args = args  # after the path

    def __call__(self, path: tf.Tensor) -> tf.Tensor:
        return self.function(path, *self.args)

    def __repr__(self) -> str:
        return self.name


def _decode_crop(augment: Any) -> tuple[RandomCropFlip | None, Any]:
    """`(crop done while decoding, the rest of augment per batch)` for an image loader."""
    if isinstance(augment, RandomCropFlip):
        return augment, None
    if isinstance(augment, Then) and isinstance(augment.first, RandomCropFlip):
        return augment.first, augment.second
    return None, augment


def _output_spec(load: _Load) -> tf.TensorSpec:
    """What `load` returns for one file (traced once)."""
    traced = tf.function(load, autograph=False).get_concrete_function(tf.TensorSpec([], tf.string))
    out = traced.structured_outputs
    return tf.TensorSpec(out.shape, out.dtype)


def _folder_dataset(
    paths: list[str],
    labels: Any,
    batch_size: int,
    *,
    shuffle: bool,
    seed: int | None,
    load: _Load,
    crop: RandomCropFlip | None,
    shapes: np.ndarray | None,
    label_map: Callable[[Any], Any] | None,
    drop_remainder: bool,
    preprocess: Callable[[Any], Any] | None,
    preprocess_on: str,
    strict: bool,
) -> tf.data.Dataset:
    """A kit dataset of a folder's files: one element per batch, its files decoded by
    `load` in a `map_fn` (the batches in a parallel, deterministic map); `make_dataset(
    paths, labels, load=load)` gives the same batches, at a tf.data element per file."""
    batch_size = positive_int("batch_size", batch_size)
    placement = check_placement(preprocess, preprocess_on)
    strict = check_bool("strict", strict)
    seed, seed_given = resolve_seed(seed, shuffle, "image_dataset_from_directory")
    drop = check_bool("drop_remainder", drop_remainder)
    n = len(paths)
    whole = functools.partial(
        _folder_dataset, paths, labels, batch_size, shuffle=shuffle, seed=seed,
        load=load, crop=crop, shapes=shapes, label_map=label_map, drop_remainder=False,
        preprocess=preprocess, preprocess_on=preprocess_on, strict=strict,
    )  # fmt: skip
    info = epoch_info(n, batch_size, drop, seed, seed_given, placement, whole)
    cursor, num_batches = info.cursor, info.cursor.num_batches
    part = worker_slice()
    record_part(cursor, part)
    items = to_tensors(np.asarray(paths, dtype=str))
    label_values = None if labels is None else to_tensors(labels)
    shape_values = None if shapes is None or crop is None else to_tensors(shapes)
    all_jpeg = shapes is not None and bool(np.all(shapes[:, 2]))
    spec = _output_spec(load)
    own = batch_size if part is None else -(-batch_size // part.num_workers)
    calls, per_batch, one_by_one = parallelism(spec, own)

    def batches(apply: Callable[[Any], Any] | None, check: bool) -> tf.data.Dataset:
        graphs: list[tf.Graph] = []

        def decode(batch: dict[str, tf.Tensor]) -> Any:
            ids = batch["ids"]
            size = tf.shape(ids, out_type=tf.int64)[0]
            key = fold_key(batch["epoch_key"], BATCH_DOMAIN, batch["position"])
            picks = None
            if part is not None:  # this worker's block (one filler when it is empty)
                start, end = own_range(size, part)
                picks = tf.minimum(start + tf.range(tf.maximum(end - start, 1)), size - 1)
                ids = tf.gather(ids, picks)
            files = tf.gather(items, ids)
            if crop is None:
                features = tf.map_fn(
                    load, files, fn_output_signature=spec, parallel_iterations=per_batch
                )
            else:
                draws = crop.draws(key, size)
                draws = draws if picks is None else tf.gather(draws, picks)
                found = None if shape_values is None else tf.gather(shape_values, ids)
                features = crop.decode_batch(
                    files, draws, found, spec, load.args, per_batch, all_jpeg=all_jpeg
                )
            if part is not None:
                features = fill_batch(features, size, start)
            out: tuple[Any, ...] = (features,) if apply is None else (features, key)
            if label_values is not None:
                found = tf.gather(label_values, batch["ids"])
                out += (found if label_map is None else label_map(found),)
            return out[0] if len(out) == 1 else out

        with host_functions():  # the kit's own functions: no user code
            dataset = index_batches(cursor, n, batch_size, num_batches, shuffle)
        # Multi-device where fewer batches than cores fit (its map_fn's files in parallel).
        with host_functions() if one_by_one else contextlib.nullcontext():
            dataset = dataset.map(decode, num_parallel_calls=calls, deterministic=True)
        if apply is not None:  # the user's function, in a map of its own
            dataset = map_keyed(dataset, apply, graphs, calls)
        if check:
            for graph in graphs:
                check_deterministic(graph, f"preprocess={describe(apply)}", strict)
        return dataset

    return finish_dataset(batches, info, preprocess, preprocess_on, labels is not None, True)


def _is_remote(path: str) -> bool:
    """Keras' test of a remote path (gs://, hdfs://, ...): no links, read through gfile."""
    return keras_private.is_remote_path(path)


def _check_common(
    labels: Any, label_mode: Any, class_names: Any, batch_size: Any, fmt: str, who: str
) -> tuple[Any, Any]:
    """Keras' checks of `labels`, `label_mode`, `class_names`; the kit's of the batch size."""
    if labels not in ("inferred", None):
        if not isinstance(labels, (list, tuple)):
            raise ValueError(
                "`labels` must be 'inferred', None or a list/tuple of integer labels, one per "
                f"file in sorted path order. Received: labels={labels!r}"
            )
        if class_names:
            raise ValueError(
                "`class_names` can only be given with labels='inferred'. "
                f"Received: labels={labels!r}, class_names={class_names!r}"
            )
    if label_mode not in {"int", "categorical", "binary", None}:
        raise ValueError(
            "`label_mode` must be one of 'int', 'categorical', 'binary' or None. "
            f"Received: label_mode={label_mode!r}"
        )
    if fmt != "tf":
        raise ValueError(
            f"The kit's {who}() returns a tf.data.Dataset (format='tf') only; use "
            f"keras.utils.{who}(format='grain') for Grain. Received: format={fmt!r}"
        )
    if batch_size is None:
        raise TypeError(
            f"The kit's {who}() yields batches of the global batch size (its cursor counts "
            "batches): pass batch_size=dist.global_batch_size. For unbatched samples use "
            f"keras.utils.{who}(batch_size=None). Received: batch_size=None"
        )
    if labels is None or label_mode is None:
        return None, None
    return labels, label_mode


def _index(
    directory: str,
    labels: Any,
    formats: Sequence[str],
    class_names: Any,
    shuffle: bool,
    seed: int | None,
    validation_split: float | None,
    subset: str | None,
    follow_links: bool,
    verbose: bool,
    label_mode: str | None,
    what: str,
) -> tuple[list[tuple[list[str], Any]], list[str] | None, int | None]:
    """Keras' indexing and split: `[(paths, labels)]` per subset, class names, and the seed."""
    dataset_utils = keras_private.dataset_utils()
    dataset_utils.check_validation_split_arg(validation_split, subset, shuffle, seed)
    if seed is None and shuffle and multi_worker_expected():
        raise ValueError(
            "A multi-worker run needs the same `seed` on every worker (each worker indexes "
            "and shuffles the files itself). Received: seed=None"
        )
    if follow_links:
        check_link_loops(directory, labels, class_names, is_remote=_is_remote)
    paths, found_labels, names = dataset_utils.index_directory(
        directory,
        labels,
        formats=formats,
        class_names=class_names,
        shuffle=shuffle and seed is not None,
        seed=seed,
        follow_links=follow_links,
        verbose=verbose,
    )
    if label_mode == "binary" and len(names) != 2:
        raise ValueError(
            f"label_mode='binary' needs exactly 2 classes. Received: class_names={names!r}"
        )
    subsets = ["training", "validation"] if subset == "both" else [subset]
    parts = []
    for name in subsets:
        part_paths, part_labels = dataset_utils.get_training_or_validation_split(
            paths, found_labels, validation_split, name
        )
        if not part_paths:
            kind = f"{name} " if subset == "both" else ""
            raise ValueError(
                f"No {kind}{what} found in directory {directory}. "
                f"Allowed formats: {tuple(formats)}"
            )
        parts.append((part_paths, part_labels))
    return parts, names, seed


def _label_map(label_mode: str | None, num_classes: int) -> Callable[[Any], Any] | None:
    """Keras' label encoding (`labels_to_dataset_tf`), applied per batch."""
    if label_mode == "binary":
        return lambda labels: tf.expand_dims(tf.cast(labels, "float32"), axis=-1)
    if label_mode == "categorical":
        return lambda labels: tf.one_hot(labels, num_classes)
    return None


def _datasets(
    parts: list[tuple[list[str], Any]],
    class_names: list[str] | None,
    label_mode: str | None,
    load: _Load,
    batch_size: int,
    shuffle: bool,
    seed: int | None,
    subset: str | None,
    options: dict[str, Any],
) -> Any:
    augment, drop_remainder = options.pop("augment"), options.pop("drop_remainder")
    crops = options.pop("crops", False)  # whether a RandomCropFlip crops while decoding
    shapes = options.pop("shapes", None)  # {path: (height, width, is JPEG)} from the headers
    made = []
    for i, (paths, part_labels) in enumerate(parts):
        validation = subset == "validation" or (subset == "both" and i == 1)
        labels = None
        if label_mode is not None:
            labels = np.asarray(part_labels, dtype="int32")
        preprocess, crop, rest = options["preprocess"], None, augment
        if augment is not None and not validation:
            if crops:
                crop, rest = _decode_crop(augment)
            if rest is not None:
                preprocess = rest if preprocess is None else then(preprocess, rest)
        dataset = _folder_dataset(
            paths,
            labels,
            batch_size,
            # Keras' subset="both" gives an unshuffled validation set; one asked for alone
            # is shuffled if asked. Either way it keeps every sample.
            shuffle=shuffle and not (subset == "both" and validation),
            seed=seed,
            load=load,
            crop=crop,
            shapes=None if shapes is None else np.asarray([shapes[p] for p in paths], "int32"),
            label_map=_label_map(label_mode, len(class_names) if class_names else 0),
            drop_remainder=False if validation else drop_remainder,
            **{**options, "preprocess": preprocess},
        )
        dataset.class_names = class_names  # as Keras' loader sets them
        dataset.file_paths = paths
        made.append(dataset)
    return made if subset == "both" else made[0]


def _check_subset_options(
    subset: Any, augment: Any, drop_remainder: Any, preprocess_on: Any
) -> None:
    """`augment` and `drop_remainder=True` concern training data: not a validation subset."""
    if augment is not None:
        check_batch_function(augment, "augment")
        if preprocess_on == "replica":
            raise ValueError(
                "`augment` runs in the input pipeline, where the kit keys its random draws "
                "on each batch; preprocess_on='replica' would move it onto the replicas. "
                "Leave preprocess_on at 'auto' (or 'host') with `augment`. Received: "
                "preprocess_on='replica', augment=" + repr(augment)
            )
    if subset != "validation":
        return
    if augment is not None:
        raise ValueError(
            "`augment` is applied to the training subset only, and subset='validation' "
            "builds the validation subset: leave `augment` out here (pass it to the "
            "subset='training' call), or use subset='both'. Received: subset='validation', "
            f"augment={augment!r}"
        )
    if drop_remainder:
        raise ValueError(
            "A validation subset keeps every sample (its last batch may be partial, which "
            "evaluation takes on any number of replicas). Received: subset='validation', "
            "drop_remainder=True"
        )


def image_dataset_from_directory(
    directory: str,
    labels: Any = "inferred",
    label_mode: str | None = "int",
    class_names: list[str] | None = None,
    color_mode: str = "rgb",
    batch_size: int | None = 32,
    image_size: Any = (256, 256),
    shuffle: bool = True,
    seed: int | None = None,
    validation_split: float | None = None,
    subset: str | None = None,
    interpolation: str = "bilinear",
    follow_links: bool = False,
    crop_to_aspect_ratio: bool = False,
    pad_to_aspect_ratio: bool = False,
    data_format: str | None = None,
    format: str = "tf",  # noqa: A002 (Keras' name)
    verbose: bool = True,
    *,
    preprocess: Callable[[Any], Any] | None = None,
    preprocess_on: str = "auto",
    augment: Callable[[Any], Any] | None = None,
    drop_remainder: bool = False,
    strict: bool = False,
    max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS,
) -> Any:
    """Keras' `image_dataset_from_directory`, as a kit dataset that resumes exactly mid-epoch.

    Same arguments, defaults, `file_paths`, `class_names`, labels and pixels as
    `keras.utils.image_dataset_from_directory` (the files are indexed, split, labelled and
    decoded by Keras' own functions). What differs: each epoch's order is a permutation
    keyed on `(seed, epoch)` rather than a shuffle buffer, so `SyncedCheckpoint(dataset=)`
    resumes it exactly mid-epoch; files are decoded in a parallel map (in a multi-worker
    run each worker decodes only its own part of every batch); `drop_remainder=True`
    drops the last partial batch of the training data (kept by default, as Keras keeps
    it); and `preprocess`
    (for example Keras' random augmentation layers) runs per batch with random draws keyed
    on `(seed, epoch, batch)`, so augmentation is reproducible and resumes exactly. And
    files someone else made are checked when the dataset is built, before any training
    step: each image's header (the first few KiB) is read, and one that declares more
    than `max_image_pixels` pixels (a decompression bomb), or is not a BMP, GIF, JPEG or
    PNG file whatever its name, is refused; with `follow_links=True` a symbolic link back
    to a folder above it (a loop Keras' walk never leaves) is refused.

    Args:
        directory: Directory of the images; with `labels="inferred"`, one subdirectory per
            class.
        labels: `"inferred"` (from the subdirectories), None (no labels), or a list/tuple
            of integer labels, one per image file in sorted path order.
        label_mode: `"int"` (int32), `"categorical"` (float32 one-hot), `"binary"`
            (float32, shape (batch, 1), exactly 2 classes), or None (no labels).
        class_names: With `labels="inferred"`, the subdirectories to use, in label order.
        color_mode: `"grayscale"`, `"rgb"` or `"rgba"` (1, 3 or 4 channels).
        batch_size: The GLOBAL batch size (e.g. `dist.global_batch_size`); None (Keras:
            unbatched) is refused.
        image_size: `(height, width)` to resize to (an int for a square).
        shuffle: Shuffle every epoch (False: files in sorted order).
        seed: Seed of the file order (as Keras') and of every epoch's permutation and
            random draws; drawn at random when None (single host only). Needed with
            `validation_split` and `shuffle`.
        validation_split: Fraction of the files held out for validation.
        subset: `"training"`, `"validation"` or `"both"` (a list of two datasets, the
            validation one not shuffled), with `validation_split`.
        interpolation: Resize method: `"bilinear"`, `"nearest"`, `"bicubic"`, `"area"`,
            `"lanczos3"`, `"lanczos5"`, `"gaussian"` or `"mitchellcubic"`.
        follow_links: Visit subdirectories that are symbolic links.
        crop_to_aspect_ratio: Resize without distortion, cropping to the target ratio.
        pad_to_aspect_ratio: Resize without distortion, padding to the target ratio.
        data_format: `"channels_last"` or `"channels_first"`; None:
            `keras.config.image_data_format()`.
        format: `"tf"` only (Keras' `"grain"` is refused).
        verbose: Print the number of files and classes found (Keras' message).
        preprocess: Function applied to each batch of images (see `make_dataset`), in
            every subset.
        preprocess_on: Where `preprocess` runs for kit-built models (see `make_dataset`).
        augment: Function applied to each batch of images of the training subset only,
            after `preprocess` (random augmentation, e.g. a `keras.Sequential` of
            `RandomFlip` and `RandomRotation` layers: its draws are keyed as
            `preprocess`'s are): with `subset="both"` the validation subset is exactly
            Keras' own. Not allowed with `subset="validation"`. `kmk.random_crop_flip()`
            (alone, or first in `then(...)`) crops and flips while the files are decoded,
            before `preprocess`: the images stay `image_size`.
        drop_remainder: Drop the last partial batch of the training data (default
            False: every file in every epoch, as Keras' loader; see `make_dataset`). A
            validation subset (`subset="validation"`, or the second of `subset="both"`)
            keeps every sample.
        strict: Refuse a `preprocess` whose random draws the kit cannot key, instead of a
            WARNING.
        max_image_pixels: The most pixels an image file may declare in its header (a GIF:
            over all its frames); defaults to Pillow's `MAX_IMAGE_PIXELS`, 89,478,485
            (about 9459x9459). Raise it for larger trusted images; None skips the header
            check (Keras' behaviour: every file is decoded whole, whatever it declares).

    Returns:
        A kit `tf.data.Dataset` of `(images, labels)` (or images) batches: float32 images
        of shape `(batch, height, width, channels)` (channels first with that data format),
        with Keras' attributes `class_names` and `file_paths`. With `subset="both"`, a list
        `[training, validation]`.

    Raises:
        TypeError: On `batch_size=None` or a non-integer batch size.
        ValueError: On an argument Keras refuses (unknown `label_mode`, `color_mode`,
            `interpolation`, a bad `image_size`, `validation_split` or `subset`, a split
            without a seed, no images found), `format="grain"`, no `seed` in a
            multi-worker run with `shuffle`, a non-positive `max_image_pixels`, a
            symbolic-link loop with `follow_links=True`, or an image file that declares
            more than `max_image_pixels` pixels (`image_headers.ImageTooLargeError`) or
            whose header is not a BMP, GIF, JPEG or PNG one (`ImageHeaderError`); the
            message names the file.

    Example:

    ```python
    train_ds, val_ds = kmk.image_dataset_from_directory(
        "PetImages", validation_split=0.2, subset="both", seed=1337,
        image_size=(180, 180), batch_size=dist.global_batch_size)
    model.fit(train_ds, validation_data=val_ds, epochs=25,
              callbacks=[kmk.SyncedCheckpoint("ckpt", save_freq=100, dataset=train_ds)])
    ```
    """
    labels, label_mode = _check_common(
        labels, label_mode, class_names, batch_size, format, "image_dataset_from_directory"
    )
    if color_mode not in _CHANNELS:
        raise ValueError(
            "`color_mode` must be one of 'rgb', 'rgba', 'grayscale'. "
            f"Received: color_mode={color_mode!r}"
        )
    if isinstance(image_size, int):
        image_size = (image_size, image_size)
    elif not isinstance(image_size, (list, tuple)) or len(image_size) != 2:
        raise ValueError(
            f"`image_size` must be a tuple of 2 integers. Received: image_size={image_size!r}"
        )
    interpolation = str(interpolation).lower()
    if interpolation not in INTERPOLATIONS:
        raise ValueError(
            f"`interpolation` must be one of {INTERPOLATIONS}. "
            f"Received: interpolation={interpolation!r}"
        )
    if crop_to_aspect_ratio and pad_to_aspect_ratio:
        raise ValueError(
            "Only one of `crop_to_aspect_ratio` and `pad_to_aspect_ratio` can be True. "
            "Received: crop_to_aspect_ratio=True, pad_to_aspect_ratio=True"
        )
    if max_image_pixels is not None:
        max_image_pixels = positive_int("max_image_pixels", max_image_pixels)
    _load_image_tf = keras_private.load_image()
    data_format = keras_private.standardize_data_format(data_format)
    _check_subset_options(subset, augment, drop_remainder, preprocess_on)
    parts, names, seed = _index(
        directory,
        labels,
        IMAGE_FORMATS,
        class_names,
        shuffle,
        seed,
        validation_split,
        subset,
        follow_links,
        verbose,
        label_mode,
        "images",
    )
    shapes = None
    if max_image_pixels is not None:
        every = [path for paths, _ in parts for path in paths]
        sizes = check_image_files(
            every,
            max_image_pixels,
            is_remote=_is_remote,
            remote_opener=lambda path: tf.io.gfile.GFile(path, "rb"),
        )
        shapes = {p: (s.height, s.width, s.format == "jpeg") for p, s in zip(every, sizes)}
    size = tuple(int(v) for v in image_size)
    fast = interpolation == "bilinear" and not (crop_to_aspect_ratio or pad_to_aspect_ratio)
    load = _Load(
        f"decode_image(image_size={size}, color_mode={color_mode!r}, "
        f"interpolation={interpolation!r})",
        decode_like_keras if fast else _load_image_tf,
        size,
        _CHANNELS[color_mode],
        interpolation,
        data_format,
        crop_to_aspect_ratio,
        pad_to_aspect_ratio,
    )
    options = dict(
        preprocess=preprocess,
        preprocess_on=preprocess_on,
        augment=augment,
        drop_remainder=drop_remainder,
        strict=strict,
        crops=True,
        shapes=shapes,
    )
    return _datasets(parts, names, label_mode, load, batch_size, shuffle, seed, subset, options)


def text_dataset_from_directory(
    directory: str,
    labels: Any = "inferred",
    label_mode: str | None = "int",
    class_names: list[str] | None = None,
    batch_size: int | None = 32,
    max_length: int | None = None,
    shuffle: bool = True,
    seed: int | None = None,
    validation_split: float | None = None,
    subset: str | None = None,
    follow_links: bool = False,
    format: str = "tf",  # noqa: A002 (Keras' name)
    verbose: bool = True,
    *,
    preprocess: Callable[[Any], Any] | None = None,
    preprocess_on: str = "auto",
    augment: Callable[[Any], Any] | None = None,
    drop_remainder: bool = False,
    strict: bool = False,
) -> Any:
    """Keras' `text_dataset_from_directory`, as a kit dataset that resumes exactly mid-epoch.

    Same arguments, defaults, file order, `class_names`, labels and strings as
    `keras.utils.text_dataset_from_directory` (Keras' own indexing and reading of `.txt`
    files); each epoch's order is a permutation keyed on `(seed, epoch)`, so
    `SyncedCheckpoint(dataset=)` resumes it exactly mid-epoch. As with
    `image_dataset_from_directory`, the last partial batch is kept unless
    `drop_remainder=True`, and with `follow_links=True` a symbolic link back to a folder
    above it (a loop Keras' walk never leaves) is refused before the files are indexed.

    Args:
        directory: Directory of the `.txt` files; with `labels="inferred"`, one
            subdirectory per class.
        labels: `"inferred"`, None, or a list/tuple of integer labels in sorted path order.
        label_mode: `"int"`, `"categorical"`, `"binary"` or None.
        class_names: With `labels="inferred"`, the subdirectories to use, in label order.
        batch_size: The GLOBAL batch size; None (Keras: unbatched) is refused.
        max_length: Keep at most this many bytes of each file.
        shuffle: Shuffle every epoch (False: files in sorted order).
        seed: Seed of the file order and of every epoch's permutation; drawn at random
            when None (single host only). Needed with `validation_split` and `shuffle`.
        validation_split: Fraction of the files held out for validation.
        subset: `"training"`, `"validation"` or `"both"` (a list of two datasets).
        follow_links: Visit subdirectories that are symbolic links.
        format: `"tf"` only.
        verbose: Print the number of files and classes found (Keras' message).
        preprocess: Function applied to each batch of strings (see `make_dataset`), in
            every subset.
        preprocess_on: Where `preprocess` runs for kit-built models (see `make_dataset`).
        augment: Function applied to each batch of strings of the training subset only,
            after `preprocess`. Not allowed with `subset="validation"`.
        drop_remainder: Drop the last partial batch of the training data (default
            False: every file in every epoch, as Keras' loader; see `make_dataset`). A
            validation subset (`subset="validation"`, or the second of `subset="both"`)
            keeps every sample.
        strict: Refuse a `preprocess` whose random draws the kit cannot key.

    Returns:
        A kit `tf.data.Dataset` of `(texts, labels)` (or texts) batches, `tf.string`
        texts, with Keras' `class_names` attribute (and `file_paths`). With
        `subset="both"`, a list `[training, validation]`.

    Raises:
        TypeError: On `batch_size=None` or a non-integer batch size.
        ValueError: On an argument Keras refuses, `format="grain"`, no `seed` in a
            multi-worker run with `shuffle`, or a symbolic-link loop with
            `follow_links=True` (the message names the link).

    Example:

    ```python
    train_ds = kmk.text_dataset_from_directory(
        "aclImdb/train", batch_size=dist.global_batch_size, validation_split=0.2,
        subset="training", seed=1337)
    ```
    """
    labels, label_mode = _check_common(
        labels, label_mode, class_names, batch_size, format, "text_dataset_from_directory"
    )
    _path_to_string_content_tf = keras_private.path_to_string_content()
    _check_subset_options(subset, augment, drop_remainder, preprocess_on)
    parts, names, seed = _index(
        directory,
        labels,
        (".txt",),
        class_names,
        shuffle,
        seed,
        validation_split,
        subset,
        follow_links,
        verbose,
        label_mode,
        "text files",
    )
    load = _Load(f"read_text(max_length={max_length!r})", _path_to_string_content_tf, max_length)
    options = dict(
        preprocess=preprocess,
        preprocess_on=preprocess_on,
        augment=augment,
        drop_remainder=drop_remainder,
        strict=strict,
    )
    return _datasets(parts, names, label_mode, load, batch_size, shuffle, seed, subset, options)
