"""The data given to `fit`, `evaluate` and `predict` of a model the kit built: checks and batches.

Two rules of the quickstart that Keras does not enforce, checked before any step:

* The training dataset yields batches of the distribution's **global** batch size. A dataset
  batched per replica (or to anything else) trains with another batch than the one the
  learning rate was scaled for, and the kit's throughput figures count the wrong samples.
  The batch size is read where it is known without running the pipeline: a dataset built
  by `kmk.make_dataset`, or a `Dataset.batch(n)` / `padded_batch(n)` followed only by
  transformations that keep the batch (map, prefetch, cache, repeat, take, skip, shuffle,
  filter, options). Other pipelines (unbatch, rebatch, generators) are not checked.
* The dataset is not already distributed: `strategy.experimental_distribute_dataset` (or
  `distribute_datasets_from_function`) copies the data again; Keras distributes a plain
  `tf.data.Dataset` itself.

And the batch actually used (`BatchPlan`): NumPy arrays or tensors given without
`batch_size` are batched with the distribution's global batch size (Keras' default of 32
knows nothing of the replicas); a `batch_size` given is honoured. The plan also says how
many samples one epoch holds when that is known (arrays, or a `kmk.make_dataset` dataset
that keeps its last partial batch), so `ThroughputMonitor` counts a smaller last batch
exactly.
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np

from keras_mirror_kit.data.info import DatasetInfo, dataset_info
from keras_mirror_kit.distribution import Distribution
from keras_mirror_kit.tensorflow_objects import (
    is_dataset,
    is_distributed_dataset,
    is_tensor,
    tensorflow_if_imported,
)

__all__ = [
    "BatchPlan",
    "arrays_as_dataset",
    "check_input",
    "check_training_split",
    "dataset_batch_size",
    "dataset_cursor",
    "KitPipeline",
    "is_array_data",
    "kit_pipeline",
    "plan_batches",
    "replica_parts",
    "training_last_batch",
]

_BATCHING = ("_BatchDataset", "_ParallelBatchDataset", "_PaddedBatchDataset")
# Transformations whose epoch holds exactly the samples of their input's epoch.
_KEEPS_EPOCH = (
    "_MapDataset",
    "_ParallelMapDataset",
    "_PrefetchDataset",
    "CacheDataset",
    "_CacheDataset",
    "_OptionsDataset",
    "_MaxIntraOpParallelismDataset",
    "_PrivateThreadPoolDataset",
)
# Transformations whose elements are the batches of their input, unchanged in size.
_KEEPS_BATCH = (
    *_KEEPS_EPOCH,
    "_RepeatDataset",
    "_TakeDataset",
    "_SkipDataset",
    "_ShuffleDataset",
    "_FilterDataset",
    "_AssertCardinalityDataset",
)
_MAPS = ("_MapDataset", "_ParallelMapDataset")
_CACHES = ("CacheDataset", "_CacheDataset")
# Steps after a kit dataset that keep its batches, their order and their positions: an
# iteration that starts at the kit dataset's batch k yields the pipeline's batch k first.
_RESUMES_EXACTLY = (
    *_MAPS,
    "_PrefetchDataset",
    "_OptionsDataset",
    "_MaxIntraOpParallelismDataset",
    "_PrivateThreadPoolDataset",
)


@dataclass(frozen=True)
class BatchPlan:
    """Samples per step of one `fit`/`evaluate`/`predict` call, and per epoch when known.

    `epoch_samples` may leave a smaller last step. `known=False` when the data's batch size
    could not be read (a generator, a `PyDataset`, a pipeline that unbatches): `batch_size`
    is then the distribution's global batch size, assumed.
    """

    batch_size: int
    epoch_samples: int | None = None
    known: bool = True

    def last_batch_size(self, steps: int | None) -> int | None:
        """The size of a `steps`-step epoch's last batch if partial; None if full or unknown."""
        if not steps or self.epoch_samples is None:
            return None
        last = self.epoch_samples - (steps - 1) * self.batch_size
        return last if 0 < last < self.batch_size else None


def _keras_can_convert_arrays() -> Any:
    """Keras' own test for the data its `ArrayDataAdapter` batches with `batch_size`."""
    from keras_mirror_kit.upstream import keras_private

    return keras_private.can_convert_arrays()  # None: fall back to NumPy arrays and tensors


def is_array_data(x: Any) -> bool:
    """Whether `x` is in-memory arrays that Keras batches itself with `batch_size`.

    NumPy arrays, tensors, and anything else Keras' array adapter takes (objects with
    `__array__` such as pandas frames, sparse tensors and matrices), or a structure of them;
    and a list of strings (one text input: KerasHub's tasks batch it with `batch_size`);
    not datasets, generators, `PyDataset`s or None.
    """
    if x is None or is_dataset(x) or is_distributed_dataset(x):
        return False
    if _string_list(x):
        return True
    can_convert = _keras_can_convert_arrays()
    if can_convert is not None:
        return bool(can_convert((x,)))
    leaves = keras.tree.flatten(x)
    return bool(leaves) and all(
        (isinstance(leaf, np.ndarray) or is_tensor(leaf)) and len(np.shape(leaf)) > 0
        for leaf in leaves
    )


def _string_list(x: Any) -> bool:
    """A list of strings: one text input, as KerasHub's tasks and `tf.data` read a list
    (Keras' own adapter reads a list as several inputs, and takes none of strings)."""
    return isinstance(x, list) and bool(x) and all(isinstance(s, (str, bytes)) for s in x)


def _scalar_list_as_array(data: Any) -> Any:
    """A list of strings or numbers as one NumPy array (as `tf.data` reads it); else `data`."""
    scalars = (str, bytes, int, float, np.generic)
    if isinstance(data, list) and data and all(isinstance(s, scalars) for s in data):
        return np.asarray(data)
    return data


def _num_samples(x: Any) -> int:
    if _string_list(x):
        return len(x)
    first = keras.tree.flatten(x)[0]
    shape = getattr(first, "shape", None)
    return int(shape[0]) if shape is not None else len(first)


def _epoch_samples(dataset: Any) -> int | None:
    info = _find(dataset, _KEEPS_EPOCH)[0]
    return info.epoch_samples if info is not None else None


def _array_epoch_samples(x: Any, validation_split: float | None) -> int:
    """Samples one epoch of in-memory arrays trains on (Keras' `validation_split` cut)."""
    samples = _num_samples(x)
    if validation_split:
        samples = int(math.floor(samples * (1.0 - validation_split)))
    return samples


def plan_batches(
    x: Any,
    dist: Distribution,
    batch_size: int | None = None,
    validation_split: float = 0.0,
    steps_per_epoch: int | None = None,
) -> BatchPlan:
    """The `BatchPlan` of one `fit`, `evaluate` or `predict` call (see the module docstring)."""
    if is_array_data(x):
        size = int(batch_size) if batch_size else dist.global_batch_size
        samples = _array_epoch_samples(x, validation_split)
        return BatchPlan(size, None if steps_per_epoch else samples)
    size = dataset_batch_size(x)
    if size is None:
        return BatchPlan(dist.global_batch_size, known=False)
    return BatchPlan(size, None if steps_per_epoch else _epoch_samples(x))


def _walk(dataset: Any) -> Iterator[Any]:
    """The nodes of a pipeline from `dataset` down its single inputs (at most 256)."""
    node = dataset
    for _ in range(256):
        if node is None:
            return
        yield node
        node = getattr(node, "_input_dataset", None)


def _find(dataset: Any, through: tuple[str, ...]) -> tuple[DatasetInfo | None, Any]:
    """The first kit `DatasetInfo` down the pipeline through `through` nodes, and the node
    where the walk stopped."""
    node = None
    for node in _walk(dataset):
        info = dataset_info(node)
        if info is not None or type(node).__name__ not in through:
            return info, node
    return None, node


@dataclass(frozen=True)
class KitPipeline:
    """A pipeline built on a kit dataset, as `kit_pipeline` read it (nothing is run).

    Attributes:
        cursor: The `DatasetCursor` of the kit dataset it is built on.
        steps: The steps after the kit dataset, as `Dataset` method names, first to last
            (`("map", "prefetch")`; empty for the kit dataset itself).
        exact: Whether an iteration that starts at the kit dataset's batch k yields the
            pipeline's batch k first, every epoch (maps in order, prefetches, options).
        breaks: Why a step makes a mid-epoch resume inexact although the batches are the
            kit dataset's (`.cache()`, a map with `deterministic=False`), naming the step;
            None otherwise.
        maps: `(function, graph)` of each map step: the user's function, its traced graph.
    """

    cursor: Any
    steps: tuple[str, ...]
    exact: bool
    breaks: str | None
    maps: tuple[tuple[Any, Any], ...]


def _method_name(node: Any) -> str:
    """`_ParallelMapDataset` -> `"parallel_map"`: the `Dataset` method that made `node`."""
    name = type(node).__name__.strip("_").removesuffix("Dataset") or "dataset"
    return name[0].lower() + "".join(f"_{c.lower()}" if c.isupper() else c for c in name[1:])


def _unordered(node: Any, top: Any) -> bool:
    """Whether a map node hands on its results as they are ready (deterministic=False)."""
    if type(node).__name__ != "_ParallelMapDataset":
        return False  # a sequential map keeps the order, whatever the options say
    flag = getattr(node, "_deterministic", "default")
    if flag == "default":
        options = top.options() if hasattr(top, "options") else None
        return options is not None and options.deterministic is False
    return flag == "false"


def kit_pipeline(dataset: Any) -> KitPipeline | None:
    """The `KitPipeline` of `dataset` if it is a kit dataset or built on one, else None.

    Walks the single inputs down from `dataset` (`train_ds.map(f).prefetch(2)` finds
    `train_ds`); a pipeline that joins several inputs (`zip`, `concatenate`) is not walked.
    """
    steps: list[str] = []
    maps: list[tuple[Any, Any]] = []
    exact, breaks = True, None
    for node in _walk(dataset):
        info = dataset_info(node)
        if info is not None:
            exact = exact and not breaks
            return KitPipeline(info.cursor, tuple(steps), exact, breaks, tuple(maps))
        kind, step = type(node).__name__, _method_name(node)
        steps.insert(0, step)
        exact = exact and kind in _RESUMES_EXACTLY
        if kind in _MAPS:
            wrapper = node._map_func  # noqa: SLF001 (the user's function, traced)
            maps.insert(0, (getattr(wrapper, "_func", None), wrapper.function.graph))
            if _unordered(node, dataset):
                breaks = (
                    f"{step}(..., deterministic=False) hands on each batch when it is ready, "
                    "not in the kit dataset's order (map with deterministic=True: the order "
                    "is kept and the calls still run in parallel)"
                )
        elif kind in _CACHES:
            breaks = (
                "cache() replays in every later epoch the batches of the first epoch it "
                "read, so the kit's order and random draws of each epoch are lost, and a "
                "resumed run caches from the batch it resumes at (drop cache(): a kit "
                "dataset holds its arrays in memory already, and a file source reads only "
                "the batches of each epoch)"
            )
    return None


def dataset_batch_size(dataset: Any) -> int | None:
    """The batch size a dataset yields, if known without running it (module docstring), or None."""
    info, node = _find(dataset, _KEEPS_BATCH)
    if info is not None:
        return info.batch_size
    tf = tensorflow_if_imported()  # a tf.data node exists only once TensorFlow is imported
    if tf is not None and type(node).__name__ in _BATCHING:
        value = tf.get_static_value(getattr(node, "_batch_size", None))
        return int(value) if value is not None else None
    return None


def dataset_cursor(dataset: Any) -> Any:
    """The `DatasetCursor` of the `kmk.make_dataset` dataset a pipeline is built on, or None.

    Found through transformations that keep the batches (`ds.prefetch(1)`, `ds.repeat()`).
    """
    info = _find(dataset, _KEEPS_BATCH)[0]
    return info.cursor if info is not None else None


def replica_parts(samples: int, replicas: int) -> list[int]:
    """How tf.distribute splits a batch of `samples` over `replicas`: parts of
    `ceil(samples / replicas)` in replica order, the rest to the last ones (13 over 2: 7, 6;
    9 over 4: 3, 3, 3, 0)."""
    part = -(-samples // replicas)
    return [max(0, min(part, samples - i * part)) for i in range(replicas)]


def _plain_epoch_samples(node: Any) -> int | None:
    """The samples of a plain `Dataset.batch(n)`'s input, when its cardinality is known."""
    tf = tensorflow_if_imported()
    source = getattr(node, "_input_dataset", None)
    if tf is None or source is None or type(node).__name__ not in _BATCHING:
        return None
    if tf.get_static_value(getattr(node, "_drop_remainder", False)):
        return None  # no partial batch
    cardinality = int(source.cardinality())
    return cardinality if cardinality >= 0 else None


def training_last_batch(given: dict[str, Any], dist: Distribution) -> tuple[int, int] | None:
    """`(last, batch_size)` of the partial last batch a `fit` call's epoch ends on, where
    known before any step (arrays, kit datasets, a plain `Dataset.batch(n)` of known
    length); None when the epoch ends on a full batch or the size is unknown."""
    x = given.get("x")
    if given.get("steps_per_epoch"):
        return None
    if is_array_data(x):
        size = int(given.get("batch_size") or dist.global_batch_size)
        samples = _array_epoch_samples(x, given.get("validation_split"))
    else:
        info, node = _find(x, _KEEPS_EPOCH)
        if info is not None:
            size, samples = info.batch_size, info.epoch_samples
        else:
            samples = _plain_epoch_samples(node)
            size = dataset_batch_size(node) if samples is not None else None
            if size is None or samples is None:
                return None
    last = samples % size if samples >= size else samples
    return (last, size) if last else None


def check_training_split(given: dict[str, Any], dist: Distribution, exact: bool) -> None:
    """Refuses, before any step, a `fit` whose last batch cannot train as on one device.

    A part with no rows cannot train (a layer would compute on an empty batch, and a
    BatchNormalization's statistics of nothing are NaN); `exact=False` (a model whose
    `train_step` the kit does not weigh) refuses any uneven split as well: each replica's
    loss is the mean over its own part, so the samples of a smaller part weigh more. On
    several workers a partial last batch is refused too: a worker's part of it was
    measured to train otherwise than on one process (6e-4 in the weights after 2 epochs).
    """
    n = dist.num_replicas
    found = training_last_batch(given, dist) if n > 1 else None
    if found is None:
        return
    last, size = found
    if dist.num_workers > 1:
        raise ValueError(
            f"fit() was given data whose last batch holds {last} of {size} samples, on "
            f"{dist.num_workers} workers, where a partial last batch is not shown to train "
            "as on one process. Drop it: kmk.make_dataset(..., drop_remainder=True) (the "
            "kit's loaders too), Dataset.batch(..., drop_remainder=True), or a number of "
            "samples that is a multiple of the batch size. "
            f"Received: batch_size={size}, last batch={last}, workers={dist.num_workers}"
        )
    parts = replica_parts(last, n)
    if min(parts) > 0 and (exact or last % n == 0):
        return
    problem = (
        f"leaves a replica without any (tf.distribute splits it {parts})"
        if min(parts) == 0
        else f"does not split evenly over {n} replicas ({parts}), and the model's own "
        "train_step weighs each replica's part alike, unlike one device"
    )
    raise ValueError(
        f"fit() was given data whose last batch holds {last} samples, which {problem}. "
        "Drop the last partial batch (kmk.make_dataset(..., drop_remainder=True), "
        "Dataset.batch(..., drop_remainder=True), or fewer array rows), or use a number "
        f"of samples whose last batch gives each of the {n} replicas at least one sample. "
        "evaluate() and predict() take a last batch of any size. "
        f"Received: batch_size={size}, last batch={last}, replicas={n}"
    )


def _check_worker_part(x: Any, dist: Distribution, method: str, argument: str) -> None:
    """A file source decoding one worker's part must know the model's replicas per worker.

    Its part is computed when it is built (from the strategy, else a live `Distribution`,
    else the visible GPUs); a part computed for another layout would decode the wrong
    samples, which the sharding would then keep.
    """
    sharding = sys.modules.get("keras_mirror_kit.data.sharding")  # imports TensorFlow
    info = _find(x, _KEEPS_BATCH)[0]
    part = sharding.part_of(info.cursor) if sharding and info is not None else None
    if part is None:
        return
    layout = (part.num_workers, part.num_workers * part.replicas_per_worker)
    if layout != (dist.num_workers, dist.num_replicas):
        raise ValueError(
            f"{method}() was given a dataset that decodes this worker's part of each batch "
            f"for {part.num_workers} workers x {part.replicas_per_worker} replicas, but the "
            f"model runs on {dist.num_workers} worker(s) and {dist.num_replicas} replica(s) in "
            "all. Build the dataset after the model (after calling the decorated factory), "
            "so that it knows the replicas. "
            f"Received: {argument}={type(x).__name__}"
        )


def check_even_batches(given: dict[str, Any], dist: Distribution, method: str) -> None:
    """For a backend that shards each batch over the devices (JAX): every batch of the call's
    data must split evenly, where that is known before any step (arrays, kit datasets)."""
    n = dist.num_replicas
    if n <= 1:
        return
    batch_size = given.get("batch_size") or dist.global_batch_size
    slots = [("x", batch_size)]
    if method == "fit":
        slots.append(("validation_data", given.get("validation_batch_size") or batch_size))
    for argument, size in slots:
        data = given.get(argument)
        if argument == "validation_data" and isinstance(data, (tuple, list)) and data:
            data = data[0]
        if is_array_data(data):
            split = given.get("validation_split") if argument == "x" else None
            samples = _array_epoch_samples(data, split)
            last = samples % int(size) if samples >= int(size) else samples
        else:
            info = _find(data, _KEEPS_EPOCH)[0]
            if info is None:
                continue
            last = info.epoch_samples % info.batch_size
        if last % n:
            raise ValueError(
                f"{method}() on the {dist.backend} backend shards every batch over the "
                f"{n} devices, but the last batch of `{argument}` holds {last} samples, which "
                f"do not split evenly over {n}. Use a number of samples (or a batch size) "
                f"that leaves a remainder divisible by {n}, or drop the last partial batch "
                "(make_dataset(..., drop_remainder=True)); on the TensorFlow backend, "
                "evaluate() and predict() take a last batch of any size. "
                f"Received: {argument} with a last batch of {last}"
            )


def check_input(x: Any, dist: Distribution, method: str, argument: str = "x") -> None:
    """Checks data given to `fit`, `evaluate` or `predict` of a model built under `dist`.

    `ValueError` for a dataset already distributed over the replicas, or, for `fit`'s `x`, one
    batched to another size than the global batch size. `argument` names it in messages.
    """
    if is_distributed_dataset(x):
        raise ValueError(
            f"{method}() was given a dataset already distributed over the replicas (by "
            "strategy.experimental_distribute_dataset or distribute_datasets_from_function). "
            "Give Keras the plain tf.data.Dataset, batched with the global batch size: "
            "Keras distributes it itself, and distributing it yourself copies the data "
            f"again. Received: {argument}={type(x).__name__}"
        )
    _check_worker_part(x, dist, method, argument)
    if method != "fit" or argument != "x":
        return
    size = dataset_batch_size(x)
    if size is not None and size != dist.global_batch_size:
        raise ValueError(
            f"fit() was given a dataset batched to {size} samples per step, but the model "
            f"was built for a global batch of {dist.global_batch_size} "
            f"({dist.per_replica_batch_size} per replica x {dist.num_replicas} replicas). "
            "Batch the dataset with the GLOBAL batch size, e.g. "
            "kmk.make_dataset(x, y, dist.global_batch_size), or build the model with "
            f"distributed(global_batch_size={size}). Received: batch_size={size}"
        )


def _dense_arrays(data: Any) -> bool:
    """Whether `data` is one dense array (NumPy, tensor) or a dict of them (no list, no table)."""
    tf = tensorflow_if_imported()
    leaves = list(data.values()) if isinstance(data, dict) else [data]
    dense = (np.ndarray,) if tf is None else (np.ndarray, tf.Tensor)
    return bool(leaves) and all(
        isinstance(leaf, dense) and not isinstance(leaf, np.ma.MaskedArray) and leaf.ndim > 0
        for leaf in leaves
    )


def _each(data: Any, function: Any) -> Any:
    """`function` of one array, or of each array of a dict of them."""
    return {k: function(v) for k, v in data.items()} if isinstance(data, dict) else function(data)


def _floatx(leaf: Any) -> Any:
    """A float64 array as Keras' floatx, as Keras' array adapter gives it to the model."""
    floatx = keras.config.floatx()
    if isinstance(leaf, np.ndarray) and leaf.dtype == np.float64 and floatx != "float64":
        return leaf.astype(floatx)
    return leaf


def arrays_as_dataset(given: dict[str, Any], dist: Distribution) -> bool:
    """Gives `fit` a kit dataset of its arrays' batches instead, so it can resume mid-epoch.

    `given` is a `fit` call's arguments. Keras' own `validation_split` cut comes first (the
    last fraction of the samples, unshuffled, validates); the training part becomes
    `make_dataset(x, y, batch_size, shuffle=shuffle, drop_remainder=False)`: the same
    samples every epoch, the last partial batch kept, shuffled by a permutation keyed on
    (seed, epoch) that a resumed run computes again (Keras draws a new one in each `fit`);
    the seed comes from Python's `random` (`keras.utils.set_random_seed` seeds it), and
    float64 arrays become Keras' floatx, as Keras' array adapter does; a list of strings or
    numbers is one array, as `tf.data` (and KerasHub's tasks) read it. Left as given:
    anything but one dense array or a dict of them for `x` and `y` (lists of inputs,
    tables, sparse or ragged tensors), `sample_weight`, `shuffle="batch"`,
    `steps_per_epoch`, a split that leaves either part empty (Keras says so), several
    workers (the workers would need one seed). Returns whether it did.
    """
    x, y = _scalar_list_as_array(given.get("x")), _scalar_list_as_array(given.get("y"))
    shuffle = given.get("shuffle", True)
    if (
        not _dense_arrays(x)
        or (y is not None and not _dense_arrays(y))
        or given.get("sample_weight") is not None
        or given.get("steps_per_epoch")
        or shuffle not in (True, False)
        or dist.num_workers > 1
    ):
        return False
    split = given.get("validation_split") if given.get("validation_data") is None else None
    at = _array_epoch_samples(x, split) if split else 0
    if split and not 0 < at < _num_samples(x):
        return False  # Keras' own error: not enough samples to split
    from keras_mirror_kit.data.pipeline import make_dataset  # imports TensorFlow

    x, y = _each(x, _floatx), None if y is None else _each(y, _floatx)
    if at:  # Keras' cut: the first part trains, the last validates
        x, x_val = _each(x, lambda a: a[:at]), _each(x, lambda a: a[at:])
        if y is None:
            given["validation_data"] = (x_val,)
        else:
            y, y_val = _each(y, lambda a: a[:at]), _each(y, lambda a: a[at:])
            given["validation_data"] = (x_val, y_val)
    batch_size = int(given.get("batch_size") or dist.global_batch_size)
    # Not the user's choice, so a resumed run takes the checkpoint's seed instead.
    seed = random.randrange(2**31 - 1)
    dataset = make_dataset(
        x, y, batch_size, shuffle=bool(shuffle), seed=seed, drop_remainder=False
    )
    dataset_info(dataset).cursor.seed_given = False
    given["x"] = dataset
    if given.get("validation_data") is not None and not given.get("validation_batch_size"):
        given["validation_batch_size"] = batch_size  # Keras' default: fit's batch_size
    for name in ("y", "batch_size", "validation_split"):
        given.pop(name, None)
    given["shuffle"] = False  # the kit dataset orders itself
    return True
