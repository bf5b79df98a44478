"""From batches of items (paths, records) to batches of samples: `load`, batching, sharding.

The sources (`sources.py` for an indexable list, `records.py` for TFRecord shards) yield one
element per global batch, in the epoch's order, already positioned by the cursor:

* `items`: what `load` receives, one per sample (a leading dimension of L samples),
* `labels`: the batch's labels (or absent),
* `ids`: int64 [L], each sample's index in the source (keys its random draws in `load`),
* `epoch_key`: int64 [2], `(seed, epoch)`, and `position`: the batch's index in the epoch
  (they key `preprocess`'s random draws),
* `last`: whether it is the iteration's final batch.

Each batch is cut to this worker's block (the whole batch on one worker, see `sharding`),
padded to a fixed number of slots with copies (so that re-batching after the per-sample map
keeps every batch's boundary, even a short batch in the middle of a resumed iteration),
unbatched, loaded sample by sample in a parallel, deterministic map (no Python per
sample), batched again, stripped of the padding, filled back to the global batch on several
workers, and only then given to `preprocess`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from keras_mirror_kit.data.augment import (
    check_deterministic,
    describe,
    fold_key,
    stateless_draws,
    takes_seed,
)
from keras_mirror_kit.data.sharding import WorkerSlice, fill_batch, own_range
from keras_mirror_kit.workarounds.tf_data_function_instantiation import host_functions

__all__ = [
    "BATCH_DOMAIN",
    "SAMPLE_DOMAIN",
    "apply_keyed",
    "load_batches",
    "map_keyed",
    "slot_count",
]

# Keys of a batch's and of a sample's random draws are folded from (seed, epoch) with
# different first values, so that they never coincide.
BATCH_DOMAIN, SAMPLE_DOMAIN = 0, 1


def apply_keyed(function: Callable[..., Any], value: Any, key: tf.Tensor) -> Any:
    """`function(value)` with its random draws keyed on `key` (and `seed=key` if it takes one)."""
    with stateless_draws(key):
        if takes_seed(function):
            return function(value, seed=key)
        return function(value)


def map_keyed(
    dataset: tf.data.Dataset,
    function: Callable[..., Any],
    graphs: list[tf.Graph],
    num_parallel_calls: int,
) -> tf.data.Dataset:
    """`dataset` of `(features, key, *labels)` mapped to `(function(features), *labels)` by
    `apply_keyed`, in a deterministic parallel map of its own (a user's function: built
    multi-device); each traced graph is appended to `graphs` (`check_deterministic`)."""

    def preprocess_batch(features: Any, key: tf.Tensor, *labels: Any) -> Any:
        graphs.append(tf.compat.v1.get_default_graph())
        features = apply_keyed(function, features, key)
        return (features, *labels) if labels else features

    return dataset.map(preprocess_batch, num_parallel_calls=num_parallel_calls, deterministic=True)


def _own_count(size: int, part: WorkerSlice | None) -> int:
    if part is None:
        return size
    pieces = part.num_workers * part.replicas_per_worker
    piece = -(-size // pieces)
    start = min(size, part.rank * part.replicas_per_worker * piece)
    return min(size, (part.rank + 1) * part.replicas_per_worker * piece) - start


def slot_count(batch_size: int, last_size: int, part: WorkerSlice | None) -> int:
    """Samples this worker loads per batch: its block of a full batch or of the short one."""
    return max(1, _own_count(batch_size, part), _own_count(last_size, part) if last_size else 0)


def load_batches(
    batches: tf.data.Dataset,
    *,
    load: Callable[..., Any],
    has_y: bool,
    slots: int,
    part: WorkerSlice | None,
    label_map: Callable[[Any], Any] | None = None,
    preprocess: Callable[[Any], Any] | None = None,
    strict: bool | None = False,
    labels_from_load: bool = False,
    short_batches: bool = True,
) -> tf.data.Dataset:
    """Batches of `(features, labels)` (or features) from a dataset of batches of items.

    The labels are the batches' own, or, with `labels_from_load`, the second element of the
    `(features, labels)` pair `load` returns (a record holds both).

    Random draws from shared state in `load` and `preprocess` are named in a WARNING, or
    refused with `strict=True`; `strict=None` skips the check (the stored-dtype twin, whose
    dataset was checked). Without `short_batches` (one worker, every batch full) the
    batches go through unpadded.
    """
    padded = short_batches or part is not None

    def to_slots(batch: dict[str, Any]) -> dict[str, Any]:
        if not padded:
            per_sample = {"items": batch["items"], "id": batch["ids"]}
            if has_y and not labels_from_load:
                per_sample["labels"] = batch["labels"]
            for name in ("epoch_key", "position"):
                per_sample[name] = tf.repeat(batch[name][tf.newaxis], slots, axis=0)
            return per_sample
        size = tf.shape(batch["ids"], out_type=tf.int64)[0]
        if part is None:
            start, end = tf.constant(0, tf.int64), size
        else:
            start, end = own_range(size, part)
        count = end - start
        wanted = tf.where(batch["last"], tf.maximum(count, 1), tf.constant(slots, tf.int64))
        offsets = tf.minimum(tf.range(wanted), tf.maximum(count - 1, 0))
        picks = tf.minimum(start + offsets, size - 1)  # an empty block keeps one filler
        per_sample = {
            "items": tf.nest.map_structure(lambda t: tf.gather(t, picks), batch["items"]),
            "id": tf.gather(batch["ids"], picks),
            "valid": tf.range(wanted) < count,
        }
        if has_y and not labels_from_load:
            per_sample["labels"] = tf.nest.map_structure(
                lambda t: tf.gather(t, picks), batch["labels"]
            )
        repeat = {k: batch[k] for k in ("epoch_key", "position")}
        repeat.update(size=size, start=start)
        for name, value in repeat.items():
            per_sample[name] = tf.repeat(value[tf.newaxis], wanted, axis=0)
        return per_sample

    graphs: list[tuple[tf.Graph, str]] = []

    def load_one(sample: dict[str, Any]) -> dict[str, Any]:
        graphs.append((tf.compat.v1.get_default_graph(), f"load={describe(load)}"))
        key = fold_key(sample["epoch_key"], SAMPLE_DOMAIN, sample["id"])
        loaded = dict(sample)
        del loaded["items"]
        value = apply_keyed(load, sample["items"], key)
        if labels_from_load:
            loaded["features"], loaded["labels"] = value
        else:
            loaded["features"] = value
        return loaded

    def finish(batch: dict[str, Any]) -> Any:
        def valid(part_of_batch: Any) -> Any:
            # Padding is rare (a short batch); a full batch is passed on without a copy.
            return tf.cond(
                tf.reduce_all(batch["valid"]),
                lambda: part_of_batch,
                lambda: tf.nest.map_structure(
                    lambda t: tf.boolean_mask(t, batch["valid"]), part_of_batch
                ),
            )

        features, labels = batch["features"], batch.get("labels")
        if part is not None:
            # This worker's block, placed in a batch of the global size. An empty block (a
            # short last batch that ends before it) keeps its one filler sample to copy:
            # the sharding drops every position outside the block.
            size, start = batch["size"][0], batch["start"][0]
            features = fill_batch(features, size, start)
            labels = fill_batch(labels, size, start) if has_y else None
        elif padded:
            features = valid(features)
            labels = valid(labels) if has_y else None
        if preprocess is not None:
            graphs.append((tf.compat.v1.get_default_graph(), f"preprocess={describe(preprocess)}"))
            key = fold_key(batch["epoch_key"][0], BATCH_DOMAIN, batch["position"][0])
            features = apply_keyed(preprocess, features, key)
        if has_y and label_map is not None:
            labels = label_map(labels)
        return (features, labels) if has_y else features

    parallel = dict(num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    with host_functions():  # the kit's own functions: no user code
        dataset = batches.map(to_slots).unbatch()
    dataset = dataset.map(load_one, **parallel).batch(slots)  # the user's `load`
    with host_functions() if preprocess is None else contextlib.nullcontext():
        dataset = dataset.map(finish, **parallel)
    if strict is not None:
        for graph, what in graphs:
            check_deterministic(graph, what, strict)
    return dataset
