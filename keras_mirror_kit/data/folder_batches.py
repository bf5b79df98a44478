"""The batches of a folder's files (`image_dataset_from_directory`, `text_dataset_from_directory`).

What an epoch's start costs: Keras makes a new iterator for every epoch, and tf.data then
instantiates every function of the pipeline again, each one optimized by Grappler (with
its nested functions: `tf.cond` branches, `tf.map_fn` and `tf.while_loop` bodies). On small
folders this, not the decoding, dominated an epoch (45 ms to the first batch of 480 small
JPEGs against 14 ms for Keras' loader, of which about 35 ms instantiating a `scan` with a
`tf.cond` and a per-batch `tf.map_fn`). So one worker reads a folder with two functions
and no control flow of the kit's: a `scan` that reads the cursor (`_take_if`) and gathers
each batch's files, labels and random draws; an `unbatch`; a per-file decode in a parallel,
deterministic map; and `batch` (a third, small function only with a `preprocess` or when a
short batch can come mid-iteration). In a multi-worker run each worker decodes its own
block of every global batch in a per-batch `tf.map_fn` (`fill_batch` completes it).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import tensorflow as tf

from keras_mirror_kit.data.augment import RandomCropFlip, check_deterministic, describe, fold_key
from keras_mirror_kit.data.cursor import DatasetCursor
from keras_mirror_kit.data.pipeline import (
    check_placement,
    epoch_info,
    finish_dataset,
    resolve_seed,
)
from keras_mirror_kit.data.samples import BATCH_DOMAIN, apply_keyed
from keras_mirror_kit.data.sharding import (
    WorkerSlice,
    fill_batch,
    own_range,
    record_part,
    worker_slice,
)
from keras_mirror_kit.data.sources import index_batches, to_tensors
from keras_mirror_kit.validation import check_bool, positive_int

__all__ = ["Load", "folder_dataset"]

# What the files of one batch may occupy decoded, summed over the batches decoded at once.
_IN_FLIGHT_BYTES = 256 * 2**20


class Load:
    """A per-file decode function of Keras', with its arguments (shown in messages)."""

    def __init__(self, name: str, function: Callable[..., Any], *args: Any) -> None:
        self.name = name
        self.function = function
        self.args = args  # after the path

    def __call__(self, path: tf.Tensor) -> tf.Tensor:
        return self.function(path, *self.args)

    def __repr__(self) -> str:
        return self.name


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _sample_bytes(spec: tf.TensorSpec) -> int:
    known = spec.shape.is_fully_defined() and spec.dtype != tf.string
    return spec.shape.num_elements() * spec.dtype.size if known else 4096


def _parallelism(spec: tf.TensorSpec, per_batch: int) -> tuple[int, int]:
    """`(batches decoded at once, files decoded at once in each)`: twice as many files as
    cores in flight (one batch's end does not idle a core), and at most
    `_IN_FLIGHT_BYTES` of decoded batches (at least one batch)."""
    cores = _cores()
    calls = max(1, min(cores, _IN_FLIGHT_BYTES // max(1, _sample_bytes(spec) * per_batch)))
    return calls, max(2, -(-2 * cores // calls))


def _output_spec(load: Load) -> tf.TensorSpec:
    """What `load` returns for one file (traced once)."""
    traced = tf.function(load, autograph=False).get_concrete_function(tf.TensorSpec([], tf.string))
    out = traced.structured_outputs
    return tf.TensorSpec(out.shape, out.dtype)


class _Files:
    """What a folder dataset reads, as host tensors: paths, labels, headers' shapes."""

    def __init__(
        self,
        paths: list[str],
        labels: Any,
        shapes: np.ndarray | None,
        crop: RandomCropFlip | None,
        label_map: Callable[[Any], Any] | None,
    ) -> None:
        self.items = to_tensors(np.asarray(paths, dtype=str))
        self.labels = None if labels is None else to_tensors(labels)
        self.shapes = None if shapes is None or crop is None else to_tensors(shapes)
        self.all_jpeg = shapes is not None and bool(np.all(shapes[:, 2]))
        self.label_map = label_map

    def labels_of(self, ids: tf.Tensor) -> tf.Tensor:
        """The labels of the files `ids` (as Keras encodes them)."""
        assert self.labels is not None
        found = tf.gather(self.labels, ids)
        return found if self.label_map is None else self.label_map(found)


def _per_file(
    cursor: DatasetCursor,
    files: _Files,
    *,
    n: int,
    batch_size: int,
    num_batches: int,
    shuffle: bool,
    load: Load,
    crop: RandomCropFlip | None,
    spec: tf.TensorSpec,
    apply: Callable[[Any], Any] | None,
    short_inside: bool,
    graphs: list[tf.Graph],
) -> tf.data.Dataset:
    """One worker's batches: a scan of the files of each batch, a per-file decode, `batch`.

    `short_inside`: a short last batch can come before the iteration's end (a resumed
    one wraps around): it is padded to `batch_size` with copies and cut after `batch`.
    """
    has_y = files.labels is not None
    finish_needed = apply is not None or short_inside

    def emit(batch: Mapping[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        ids = batch["ids"]
        out = {"file": tf.gather(files.items, ids)}
        if has_y:
            out["label"] = files.labels_of(ids)
        if crop is None and apply is None and not short_inside:
            return out  # the common case: nothing more to make (see `index_batches`)
        size = tf.shape(ids, out_type=tf.int64)[0]
        if crop is not None or apply is not None:
            key = fold_key(batch["epoch_key"], BATCH_DOMAIN, batch["position"])
            if crop is not None:
                out["draw"] = crop.draws(key, size)
                if files.shapes is not None:
                    out["shape"] = tf.gather(files.shapes, ids)
            if apply is not None:
                out["key"] = tf.repeat(key[tf.newaxis], size, axis=0)
        if short_inside:
            wanted = tf.where(batch["last"], size, tf.constant(batch_size, tf.int64))
            picks = tf.minimum(tf.range(wanted), size - 1)
            out = {name: tf.gather(value, picks) for name, value in out.items()}
            out["size"] = tf.fill([wanted], size)
        return out

    def decode(file: dict[str, tf.Tensor]) -> Any:
        if crop is None:
            features = load(file["file"])
        else:
            features = crop.decode_file(
                file["file"], file["draw"], file.get("shape"), load.args, files.all_jpeg
            )
        if finish_needed:
            return {**{k: v for k, v in file.items() if k not in ("file", "draw", "shape")},
                    "features": features}  # fmt: skip
        return (features, file["label"]) if has_y else features

    def finish(batch: dict[str, tf.Tensor]) -> Any:
        features, labels = batch["features"], batch.get("label")
        if short_inside:  # the padding's copies cut off (a full batch is not copied)
            size = batch["size"][0]
            features = features[:size]
            labels = None if labels is None else labels[:size]
        if apply is not None:
            graphs.append(tf.compat.v1.get_default_graph())
            features = apply_keyed(apply, features, batch["key"][0])
        return (features, labels) if has_y else features

    cores = _cores()
    in_flight = max(1, min(2 * cores, _IN_FLIGHT_BYTES // max(1, _sample_bytes(spec))))
    dataset = index_batches(cursor, n, batch_size, num_batches, shuffle, emit=emit).unbatch()
    dataset = dataset.map(decode, num_parallel_calls=in_flight, deterministic=True)
    dataset = dataset.batch(batch_size)
    if finish_needed:
        dataset = dataset.map(finish, num_parallel_calls=cores, deterministic=True)
    return dataset


def _per_batch(
    cursor: DatasetCursor,
    files: _Files,
    *,
    n: int,
    batch_size: int,
    num_batches: int,
    shuffle: bool,
    load: Load,
    crop: RandomCropFlip | None,
    spec: tf.TensorSpec,
    apply: Callable[[Any], Any] | None,
    part: WorkerSlice,
    graphs: list[tf.Graph],
) -> tf.data.Dataset:
    """A worker's blocks of the global batches, each decoded in a `map_fn`, filled back."""
    own = -(-batch_size // part.num_workers)
    calls, per_batch = _parallelism(spec, own)

    def decode(batch: dict[str, tf.Tensor]) -> Any:
        ids = batch["ids"]
        size = tf.shape(ids, out_type=tf.int64)[0]
        key = fold_key(batch["epoch_key"], BATCH_DOMAIN, batch["position"])
        start, end = own_range(size, part)  # this worker's block (one filler when empty)
        picks = tf.minimum(start + tf.range(tf.maximum(end - start, 1)), size - 1)
        mine = tf.gather(files.items, tf.gather(ids, picks))
        if crop is None:
            features = tf.map_fn(
                load, mine, fn_output_signature=spec, parallel_iterations=per_batch
            )
        else:
            draws = tf.gather(crop.draws(key, size), picks)
            picked = tf.gather(ids, picks)
            found = None if files.shapes is None else tf.gather(files.shapes, picked)
            features = crop.decode_batch(
                mine, draws, found, spec, load.args, per_batch, all_jpeg=files.all_jpeg
            )
        features = fill_batch(features, size, start)
        if apply is not None:
            graphs.append(tf.compat.v1.get_default_graph())
            features = apply_keyed(apply, features, key)
        return features if files.labels is None else (features, files.labels_of(ids))

    dataset = index_batches(cursor, n, batch_size, num_batches, shuffle)
    return dataset.map(decode, num_parallel_calls=calls, deterministic=True)


def folder_dataset(
    paths: list[str],
    labels: Any,
    batch_size: int,
    *,
    shuffle: bool,
    seed: int | None,
    load: Load,
    crop: RandomCropFlip | None,
    shapes: np.ndarray | None,
    label_map: Callable[[Any], Any] | None,
    drop_remainder: bool,
    preprocess: Callable[[Any], Any] | None,
    preprocess_on: str,
    strict: bool,
) -> tf.data.Dataset:
    """A kit dataset of a folder's files decoded by `load`; `make_dataset(paths, labels,
    load=load)` gives the same batches."""
    batch_size = positive_int("batch_size", batch_size)
    placement = check_placement(preprocess, preprocess_on)
    strict = check_bool("strict", strict)
    seed, seed_given = resolve_seed(seed, shuffle, "image_dataset_from_directory")
    drop = check_bool("drop_remainder", drop_remainder)
    n = len(paths)
    whole = functools.partial(
        folder_dataset, paths, labels, batch_size, shuffle=shuffle, seed=seed,
        load=load, crop=crop, shapes=shapes, label_map=label_map, drop_remainder=False,
        preprocess=preprocess, preprocess_on=preprocess_on, strict=strict,
    )  # fmt: skip
    info = epoch_info(n, batch_size, drop, seed, seed_given, placement, whole)
    cursor, num_batches = info.cursor, info.cursor.num_batches
    part = worker_slice()
    record_part(cursor, part)
    files = _Files(paths, labels, shapes, crop, label_map)
    spec = _output_spec(load)
    common = dict(
        n=n, batch_size=batch_size, num_batches=num_batches, shuffle=shuffle, load=load,
        crop=crop, spec=spec,
    )  # fmt: skip

    def batches(apply: Callable[[Any], Any] | None, check: bool) -> tf.data.Dataset:
        graphs: list[tf.Graph] = []
        if part is None:
            short_inside = not drop and n % batch_size != 0 and num_batches > 1
            dataset = _per_file(
                cursor, files, apply=apply, short_inside=short_inside, graphs=graphs, **common
            )
        else:
            dataset = _per_batch(cursor, files, apply=apply, part=part, graphs=graphs, **common)
        if check:
            for graph in graphs:
                check_deterministic(graph, f"preprocess={describe(apply)}", strict)
        return dataset

    return finish_dataset(batches, info, preprocess, preprocess_on, labels is not None, True)
