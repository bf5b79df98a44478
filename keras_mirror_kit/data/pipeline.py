"""`make_dataset`: the `tf.data.Dataset` to hand `model.fit` under a distribution.

The tutorial's pipeline (`x / 255.0`, `from_tensor_slices`, `shuffle(10000)`,
`experimental_distribute_dataset`) turns uint8 images into float64 (8x the memory), copies
them into the dataset and again into the distributed dataset. Here the arrays stay in their
stored dtype; each epoch shuffles *indices* (a permutation keyed on `(seed, epoch)`), gathers
one batch at a time and only then runs `preprocess` (for example the cast to float), so the
dataset holds one copy of the arrays in their stored dtype (besides the caller's own).

The permutation is keyed on the epoch, not on a random generator's state, so a run that
resumes at epoch `e` sees exactly the order an uninterrupted run saw at epoch `e`, and a
`DatasetCursor` can start an epoch part-way through. `SyncedCheckpoint(dataset=...)` uses
that to resume mid-epoch without training any batch twice.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from keras_mirror_kit.data.augment import check_deterministic, describe, fold_key, takes_seed
from keras_mirror_kit.data.cursor import DatasetCursor
from keras_mirror_kit.data.info import DatasetInfo, record_dataset
from keras_mirror_kit.data.preprocess import (
    PREPROCESS_ON,
    ReplicaVariant,
    runs_on_replicas_by_default,
)
from keras_mirror_kit.data.samples import BATCH_DOMAIN, map_keyed
from keras_mirror_kit.data.sharding import record_part, worker_slice
from keras_mirror_kit.data.sources import indexed_dataset, to_tensors
from keras_mirror_kit.multi_worker import cluster
from keras_mirror_kit.validation import check_bool, non_negative_int, positive_int
from keras_mirror_kit.workarounds.tf_data_function_instantiation import host_functions

__all__ = [
    "build_dataset",
    "check_batch_function",
    "check_batch_size",
    "check_placement",
    "epoch_info",
    "finish_dataset",
    "make_dataset",
    "multi_worker_expected",
    "resolve_seed",
]


def multi_worker_expected() -> bool:
    """Whether this process trains with other workers (the strategy in scope or the cluster).

    A `MultiWorkerMirroredStrategy` in scope counts even with one worker: a dataset made
    under it is meant for a cluster.
    """
    if tf.distribute.has_strategy() and isinstance(
        tf.distribute.get_strategy(), tf.distribute.MultiWorkerMirroredStrategy
    ):
        return True
    return cluster.tf_config_num_workers() > 1


def make_dataset(
    x: Any,
    y: Any = None,
    batch_size: int | None = None,
    *,
    shuffle: bool = True,
    seed: int | None = None,
    preprocess: Callable[[Any], Any] | None = None,
    preprocess_on: str = "auto",
    drop_remainder: bool = False,
    num_replicas: int | None = None,
    prefetch: bool = True,
    load: Callable[..., Any] | None = None,
    strict: bool = False,
) -> tf.data.Dataset:
    """Builds a memory-frugal, resumable `tf.data.Dataset` of batches for `model.fit`.

    Hand the result to `model.fit` as it is: Keras distributes it over the replicas (do not
    call `experimental_distribute_dataset` yourself; that copies the data again).

    Two forms. **Arrays**: `x` holds the samples themselves (NumPy arrays, a tuple or dict of
    them, a pandas `DataFrame` or a dict of columns); each batch is gathered from them.
    **Items and `load`**: `x` lists one item per sample (file paths, ids, a tuple or dict of
    such columns) and `load(item)` returns the sample's features, traced by tf.data and run
    sample by sample in a parallel, deterministic map (`.npy` files, images, audio, a
    decoder of your own); only the items stay in memory.

    Args:
        x: Features: a NumPy array, a tuple/dict of arrays with the same first dimension, a
            pandas `DataFrame` or a dict of columns (one feature per column; strings become
            `tf.string`); with `load`, the items `load` reads (for example a list of paths).
        y: Labels with the same first dimension (an array, a list, a pandas `Series`), or
            None.
        batch_size: The GLOBAL batch size (e.g. `dist.global_batch_size`).
        shuffle: Shuffle the order every epoch (a permutation keyed on seed and epoch).
        seed: Shuffle seed; with a seed, the order of every epoch is reproducible. A random
            one is drawn when None (single host only: a multi-worker run needs the same
            seed on every worker); `SyncedCheckpoint` saves it, so a resume reuses it. It
            also keys the random draws of `preprocess` and `load` (see below).
        preprocess: Function applied to each batch of features after batching (for example
            `kmk.rescale()` to cast uint8 images to float in [0, 1], or Keras' random
            preprocessing layers); it takes the features alone (labels pass through), so
            a function of `(features, labels)` as `Dataset.map` takes is a `TypeError`
            when the dataset is built. Its random draws are keyed on (seed, epoch, batch): Keras
            layers and `keras.random` with a `SeedGenerator` draw stateless seeds from that
            key, and a function with a `seed` parameter without a default receives it (an
            int64 tensor of shape [2], for `tf.random.stateless_*` and
            `tf.image.stateless_random_*`). Two runs then augment identically, and a
            resumed run as the uninterrupted one.
            Stateful random ops (`tf.random.uniform`, `tf.image.random_*`) are named in a
            WARNING (or refused with `strict=True`).
        preprocess_on: Where `preprocess` runs for a model built by the kit (a
            `@kmk.distributed` factory or a `with kmk.distributed(...)` block): `"replica"`
            (its `fit`, `evaluate` and `predict` receive the stored dtype, and each replica
            applies `preprocess` to its slice of the batch on its own device: a quarter of
            the bytes to copy for uint8 images), `"host"` (in the input pipeline, before
            the batch is split), or `"auto"` (the default: `"replica"` for `kmk.rescale()`,
            which works sample by sample, `"host"` for any other function, which might
            depend on the whole batch or use ops that cannot run on the device). Pass
            `"replica"` for a function of your own that is per-sample and traceable. Any
            other consumer of the dataset (a plain Keras model, your own loop, or a
            pipeline built on top of it such as `ds.repeat()`) always gets the
            host-preprocessed batches.
        drop_remainder: Drop the last partial batch. Default False: every epoch holds
            every sample, as Keras' `fit(x, y)` and its loaders give them. A last batch
            of any size is fine for `evaluate`, validation and `predict` (each replica
            takes its part, some none), and trains as on one device (TensorFlow, a model
            the kit built); `fit` refuses, before any step, a last training batch that
            leaves a replica without a sample (1 sample on 2 replicas), or, for a
            `train_step` the kit does not weigh and on JAX, one that does not split
            evenly: pass True then. Given to `evaluate`, or to `fit` as
            `validation_data`, of a model the kit built, a dataset that drops its last
            batch is evaluated whole all the same (on TensorFlow; JAX refuses a last
            batch it cannot split).
        num_replicas: Deprecated, without effect (a `DeprecationWarning` when given).
        prefetch: Add a `prefetch(tf.data.AUTOTUNE)` at the end.
        load: A function of one item of `x` returning that sample's features (tensors of
            the same shape for every sample), or None for the arrays form. Its random draws
            are keyed on (seed, epoch, sample) as `preprocess`'s are, and it may take a
            `seed` parameter too. The epoch's order is
            `tf.random.experimental.index_shuffle` of the positions, so an iteration resumed
            at batch k computes its samples directly: nothing before it is loaded. In a
            multi-worker run each worker loads only its own part of every global batch.
        strict: Refuse (`ValueError`) a `preprocess` or `load` whose random draws the kit
            cannot key, instead of a WARNING.

    Returns:
        A `tf.data.Dataset` of `(x_batch, y_batch)` (or `x_batch`) with known cardinality,
        auto-shard policy DATA and tf.data autotuning off (see
        `keras_mirror_kit.workarounds.tf_data_iterator_stall`). The kit records its
        `DatasetCursor` (see `cursor_of`) and where `preprocess` runs (see
        `preprocess_placement`). Iterated, it always yields the preprocessed batches.

    Raises:
        TypeError: On a missing or non-integer batch size, a non-callable `preprocess` or
            `load`, or a table column of Python objects that are not strings.
        ValueError: On an empty dataset, arrays of different lengths, a non-positive batch
            size, a batch larger than the data when dropping the remainder, an unknown
            `preprocess_on`, `preprocess_on="replica"` without a `preprocess` (or with one
            that takes a `seed`), or, with `strict=True`, random draws the kit cannot key.

    Example:

    ```python
    dist = build_model.distribution
    train_ds = kmk.make_dataset(x_train, y_train, dist.global_batch_size, seed=0,
                                preprocess=kmk.rescale())
    model.fit(train_ds, epochs=10)

    # Files: one path per sample, decoded by `load`.
    def load(path):
        return tf.image.resize(tf.io.decode_jpeg(tf.io.read_file(path), channels=3), (64, 64))

    files_ds = kmk.make_dataset(paths, labels, dist.global_batch_size, seed=0, load=load)
    ```
    """
    return build_dataset(
        x,
        y,
        batch_size,
        shuffle=shuffle,
        seed=seed,
        preprocess=preprocess,
        preprocess_on=preprocess_on,
        drop_remainder=drop_remainder,
        num_replicas=num_replicas,
        prefetch=prefetch,
        load=load,
        strict=strict,
    )


def build_dataset(
    x: Any,
    y: Any,
    batch_size: int | None,
    *,
    shuffle: bool = True,
    seed: int | None = None,
    preprocess: Callable[[Any], Any] | None = None,
    preprocess_on: str = "auto",
    drop_remainder: bool = False,
    num_replicas: int | None = None,
    prefetch: bool = True,
    load: Callable[..., Any] | None = None,
    strict: bool = False,
    label_map: Callable[[Any], Any] | None = None,
) -> tf.data.Dataset:
    """`make_dataset`, plus `label_map` (applied to each batch of labels of a `load` source)."""
    batch_size = check_batch_size(batch_size)
    placement = check_placement(preprocess, preprocess_on)
    if load is not None and not callable(load):
        raise TypeError(f"`load` must be callable. Received: load={load!r}")
    strict = check_bool("strict", strict)
    seed, seed_given = resolve_seed(seed, shuffle, "make_dataset")
    if num_replicas is not None:
        positive_int("num_replicas", num_replicas)
        warnings.warn(
            "make_dataset(num_replicas=) is deprecated and has no effect: evaluation and "
            "prediction take a last batch of any size, and fit() refuses a training dataset "
            "whose last batch does not split evenly over the model's replicas.",
            DeprecationWarning,
            stacklevel=3,
        )
    drop = check_bool("drop_remainder", drop_remainder)
    features = to_tensors(x, "x")
    labels = None if y is None else to_tensors(y, "y")
    tensors = (features,) if labels is None else (features, labels)
    n = _num_samples(tensors)
    whole = functools.partial(
        build_dataset, x, y, batch_size, shuffle=shuffle, seed=seed,
        preprocess=preprocess, preprocess_on=preprocess_on, drop_remainder=False,
        prefetch=prefetch, load=load, strict=strict, label_map=label_map,
    )  # fmt: skip
    info = epoch_info(n, batch_size, drop, seed, seed_given, placement, whole)
    cursor, num_batches = info.cursor, info.cursor.num_batches
    if load is not None:
        part = worker_slice()
        record_part(cursor, part)

        def batches(apply: Callable[[Any], Any] | None, check: bool) -> tf.data.Dataset:
            return indexed_dataset(
                cursor,
                features,
                labels,
                n=n,
                batch_size=batch_size,
                num_batches=num_batches,
                drop=drop,
                shuffle=shuffle,
                load=load,
                preprocess=apply,
                part=part,
                strict=strict if check else None,
                label_map=label_map,
            )
    else:
        with host_functions():  # the kit's own functions: no user code
            indices = _batch_indices(cursor, n, batch_size, num_batches, shuffle)

        def batches(apply: Callable[[Any], Any] | None, check: bool) -> tf.data.Dataset:
            graphs: list[tf.Graph] = []

            def gather(index: tf.Tensor, key: tf.Tensor) -> Any:
                picked = tf.nest.map_structure(lambda t: tf.gather(t, index), tensors)
                if apply is not None:
                    return (picked[0], key, *picked[1:])
                return picked[0] if y is None else picked

            with host_functions():
                dataset = indices.map(
                    gather, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True
                )
            if apply is not None:  # the user's function, in a map of its own
                dataset = map_keyed(dataset, apply, graphs, tf.data.AUTOTUNE)
            if check:
                for graph in graphs:
                    check_deterministic(graph, f"preprocess={describe(apply)}", strict)
            return dataset

    return finish_dataset(batches, info, preprocess, preprocess_on, y is not None, prefetch)


def resolve_seed(seed: Any, shuffle: bool, who: str) -> tuple[int, bool]:
    """`(seed, seed_given)`: the seed checked, or one drawn at random (not multi-worker)."""
    if seed is not None:
        return non_negative_int("seed", seed), True
    if shuffle and multi_worker_expected():
        raise ValueError(
            f"{who}() needs a `seed` in a multi-worker run: every worker must shuffle "
            "in the same order before the data is sharded, or the workers' slices of a "
            "global batch overlap. Pass the same seed on every worker. Received: seed=None"
        )
    return int(np.random.default_rng().integers(0, 2**31 - 1)), False


def finish_dataset(
    batches: Callable[[Callable[[Any], Any] | None, bool], tf.data.Dataset],
    info: DatasetInfo,
    preprocess: Callable[[Any], Any] | None,
    preprocess_on: str,
    has_y: bool,
    prefetch: bool,
) -> tf.data.Dataset:
    """The kit dataset from `batches(apply, check)`: prefetch, options, its `DatasetInfo`,
    and the stored-dtype twin when `preprocess` runs on the replicas."""

    def build(apply: Callable[[Any], Any] | None, dataset_info: DatasetInfo) -> tf.data.Dataset:
        dataset = batches(apply, dataset_info.variant is None or apply is not None)
        if prefetch:
            dataset = dataset.prefetch(tf.data.AUTOTUNE)
        dataset = _with_kit_options(dataset)
        record_dataset(dataset, dataset_info)
        return dataset

    if info.preprocess_on != "replica":
        return build(preprocess, info)
    assert preprocess is not None
    stored_batches = batches(None, False).element_spec
    stored = tf.nest.map_structure(
        lambda spec: tf.TensorSpec([None, *spec.shape[1:]], spec.dtype),
        stored_batches[0] if has_y else stored_batches,
    )
    variant = ReplicaVariant(
        preprocess,
        has_y,
        stored,
        lambda twin: build(None, dataclasses.replace(info, variant=twin)),
        requested=preprocess_on == "replica",
    )
    return build(preprocess, dataclasses.replace(info, variant=variant))


def check_batch_size(batch_size: Any) -> int:
    """`batch_size` checked: a positive integer (`TypeError` for None, with what to pass)."""
    if batch_size is None:
        raise TypeError(
            "make_dataset() needs `batch_size` (the global batch size, e.g. "
            "`dist.global_batch_size`). Received: batch_size=None"
        )
    return positive_int("batch_size", batch_size)


def check_placement(preprocess: Any, preprocess_on: str) -> str | None:
    """Where `preprocess` runs for kit-built models: "replica", "host" or None (none given)."""
    if preprocess is not None:
        check_batch_function(preprocess, "preprocess")
    if preprocess_on not in PREPROCESS_ON:
        raise ValueError(
            f"`preprocess_on` must be one of {', '.join(map(repr, PREPROCESS_ON))}. "
            f"Received: preprocess_on={preprocess_on!r}"
        )
    if preprocess is None:
        if preprocess_on == "replica":
            raise ValueError(
                "preprocess_on='replica' moves `preprocess` onto the replicas, but no "
                "`preprocess` was given. Pass one (for example preprocess=kmk.rescale()) or "
                "leave preprocess_on at its default. Received: preprocess=None, "
                "preprocess_on='replica'"
            )
        return None
    if preprocess_on == "replica" and takes_seed(preprocess):
        raise ValueError(
            "A `preprocess` with a `seed` parameter runs in the input pipeline, where the kit "
            "gives it each batch's seed; on the replicas it would get none. Use "
            "preprocess_on='host' (or 'auto'), or drop the `seed` parameter. "
            f"Received: preprocess={preprocess!r}, preprocess_on='replica'"
        )
    if preprocess_on == "replica" or (
        preprocess_on == "auto" and runs_on_replicas_by_default(preprocess)
    ):
        return "replica"
    return "host"


def check_batch_function(function: Any, argument: str) -> None:
    """Refuses a non-callable, or a function of `(features, labels)` as `Dataset.map` takes."""
    if not callable(function):
        raise TypeError(f"`{argument}` must be callable. Received: {argument}={function!r}")
    if _required_positional(function) > 1:
        raise TypeError(
            f"`{argument}` is called with each batch of features alone (x -> x), not with "
            "(features, labels) as a function given to Dataset.map is: labels pass through "
            "unchanged. For keras-io's `ds.map(lambda x, y: (data_augmentation(x), y))` "
            f"pass {argument}=data_augmentation, or a function of the features: "
            f"{argument}=lambda x: ... Received: {argument}={describe(function)}"
        )


def _required_positional(function: Any) -> int:
    """How many positional arguments `function` needs (besides `seed`); 0 if unknown."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return 0
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(
        1
        for p in parameters
        if p.kind in kinds and p.default is inspect.Parameter.empty and p.name != "seed"
    )


def _num_samples(arrays: tuple[Any, ...]) -> int:
    lengths = {len(leaf) for part in arrays for leaf in tf.nest.flatten(part)}
    if len(lengths) != 1:
        raise ValueError(
            "All arrays given to make_dataset() must have the same first dimension. "
            f"Received lengths: {sorted(lengths)}"
        )
    n = lengths.pop()
    if n == 0:
        raise ValueError("make_dataset() received empty arrays. Received: len(x)=0")
    return n


def epoch_info(
    n: int,
    batch_size: int,
    drop: bool,
    seed: int,
    seed_given: bool,
    placement: str | None,
    whole: Callable[[], Any] | None = None,
) -> DatasetInfo:
    """The `DatasetInfo` (and new cursor) of a kit dataset of `n` samples in batches;
    `whole` builds it keeping its last partial batch, kept when this one drops it."""
    num_batches = _num_batches(n, batch_size, drop)
    cursor = DatasetCursor(num_batches, seed=seed, seed_given=seed_given, num_samples=n)
    drops_some = drop and num_batches * batch_size < n  # evaluation iterates `whole`
    return DatasetInfo(
        cursor,
        batch_size,
        epoch_samples=num_batches * batch_size if drop else n,
        preprocess_on=placement,
        whole=whole if drops_some else None,
    )


def _num_batches(n: int, batch_size: int, drop: bool) -> int:
    if drop and batch_size > n:
        raise ValueError(
            f"`batch_size` ({batch_size}) is larger than the data ({n} samples), so with "
            "drop_remainder=True every batch would be dropped. Use a smaller batch size or "
            f"drop_remainder=False. Received: batch_size={batch_size}"
        )
    return n // batch_size if drop else math.ceil(n / batch_size)


def _batch_indices(
    cursor: DatasetCursor, n: int, batch_size: int, num_batches: int, shuffle: bool
) -> tf.data.Dataset:
    """One epoch of index batches (and each batch's random key), from the cursor's (epoch,
    skip, seed) at its first batch."""

    def next_batch(state: Any, step: tf.Tensor) -> Any:
        # The state lives per iterator: on its first batch, read the cursor and compute
        # that epoch's order; later batches reuse it.
        def fresh() -> Any:
            epoch, skip, seed_now = cursor._take()  # noqa: SLF001
            order = tf.range(n, dtype=tf.int64)
            if shuffle:
                order = tf.random.experimental.stateless_shuffle(
                    order, seed=tf.stack([seed_now, epoch])
                )
            return epoch, skip, seed_now, order

        epoch, skip, seed_now, order = tf.cond(state[0] < 0, fresh, lambda: state)
        position = (step + skip) % num_batches
        start = position * batch_size
        index = order[start : tf.minimum(start + batch_size, n)]
        key = fold_key(tf.stack([seed_now, epoch]), BATCH_DOMAIN, position)
        return (epoch, skip, seed_now, order), (index, key)

    minus_one, zero = tf.constant(-1, tf.int64), tf.constant(0, tf.int64)
    initial = (minus_one, zero, zero, tf.zeros([n], tf.int64))
    return tf.data.Dataset.range(num_batches).scan(initial, next_batch)


def _with_kit_options(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """Auto-shard by DATA, and no tf.data autotuning model thread.

    Destroying an iterator whose autotuning thread is asleep can block for up to 60 s (a
    TensorFlow lost wake-up; `keras_mirror_kit.workarounds.tf_data_iterator_stall`), and
    Keras destroys one at every epoch end. The map and prefetch keep AUTOTUNE, which then
    means TensorFlow's fixed defaults (as fast here: gather and cast are cheap).
    """
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    options.autotune.enabled = False
    return dataset.with_options(options)
