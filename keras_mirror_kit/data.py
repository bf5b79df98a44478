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

Where `preprocess` runs (`preprocess_on`). In the input pipeline, the batches hold its
output: float32 for `rescale()`, four times the bytes of uint8 images, copied to every
device. So for a model built by a `@kmk.distributed` factory (or compiled in `with
kmk.distributed(...)`), `rescale()` (and any per-sample function given with
`preprocess_on="replica"`) runs on each replica's device instead: the model's `fit`,
`evaluate` and `predict` iterate a twin of the dataset that yields the stored dtype (same
cursor, same order) and apply `preprocess` at the start of every replica step
(`keras_mirror_kit.replica_preprocess`). Every other consumer (a plain Keras model, a loop
of your own) iterates the dataset itself and sees the host-preprocessed batches, so its
results never change.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from keras_mirror_kit.validation import non_negative_int, positive_int

__all__ = [
    "PREPROCESS_ON",
    "DatasetCursor",
    "cursor_of",
    "make_dataset",
    "preprocess_placement",
    "replica_variant",
    "rescale",
]

logger = logging.getLogger("keras_mirror_kit")

_EPOCH, _SKIP, _SEED = 0, 1, 2

#: The values of `make_dataset(preprocess_on=...)`.
PREPROCESS_ON = ("auto", "host", "replica")
_VARIANT = "_kmk_replica_variant"


class DatasetCursor:
    """Where the next iteration of a `make_dataset` dataset starts: epoch and batch.

    Each new iterator over the dataset reads the cursor once, when its first batch is
    requested: it uses the permutation of `epoch`, starts after `skip_batches` batches, and
    then moves the cursor to the next epoch with no skip. Set it before an epoch begins to
    choose the order and start of that epoch.

    The dataset's length stays `num_batches` (Keras needs a known epoch length), so an
    iteration that skipped `k` batches and is read to its end wraps around to the epoch's
    first `k` batches. `SyncedCheckpoint` ends a resumed epoch after its remaining batches,
    so nothing is trained twice.

    The shuffle seed lives in the cursor too, so that a resumed run can shuffle exactly as
    the interrupted one did even when that one drew its seed at random.

    Args:
        num_batches: Batches in one full epoch.
        seed: The shuffle seed.
        seed_given: Whether the user chose the seed (False: drawn at random).
        num_samples: Samples the epoch's order is a permutation of, or None when unknown
            (a resume compares it with the checkpoint's).

    Example:

    ```python
    cursor = kmk.cursor_of(train_ds)
    cursor.set(epoch=3, skip_batches=10)   # next epoch: order of epoch 3, from batch 10
    ```
    """

    def __init__(
        self,
        num_batches: int,
        seed: int = 0,
        seed_given: bool = True,
        num_samples: int | None = None,
    ) -> None:
        self.num_batches = num_batches
        self.num_samples = num_samples
        self.seed_given = seed_given
        # A lookup table, not a tf.Variable: a table is not mirrored when the dataset is
        # made inside a strategy's scope, and it is read on the host by the input pipeline.
        with tf.device("/cpu:0"):
            self._table = tf.lookup.experimental.MutableHashTable(
                key_dtype=tf.int64, value_dtype=tf.int64, default_value=0
            )
        self.set_seed(seed)

    @property
    def seed(self) -> int:
        """The shuffle seed the next iteration uses."""
        return int(self._table.lookup(tf.constant([_SEED], tf.int64)).numpy()[0])

    def set_seed(self, seed: int) -> None:
        """Replaces the shuffle seed (a resume uses the interrupted run's).

        Args:
            seed: A non-negative integer.

        Returns:
            None.

        Raises:
            ValueError: If `seed` is negative or not an integer.

        Example:

        ```python
        cursor.set_seed(1234)
        ```
        """
        non_negative_int("seed", seed)
        self._table.insert(tf.constant([_SEED], tf.int64), tf.constant([int(seed)], tf.int64))

    def set(self, epoch: int, skip_batches: int = 0) -> None:
        """Sets the epoch whose order the next iteration uses, and batches to skip.

        Args:
            epoch: Epoch number (keys the shuffle permutation); >= 0.
            skip_batches: Batches of that epoch already consumed; 0 <= skip < num_batches.

        Returns:
            None.

        Raises:
            ValueError: On a negative epoch or a skip outside the epoch.

        Example:

        ```python
        cursor.set(epoch=2)
        ```
        """
        if epoch < 0:
            raise ValueError(f"`epoch` must be >= 0. Received: epoch={epoch}")
        if not 0 <= skip_batches < max(1, self.num_batches):
            raise ValueError(
                f"`skip_batches` must be in [0, {self.num_batches}). "
                f"Received: skip_batches={skip_batches}"
            )
        self._table.insert(
            tf.constant([_EPOCH, _SKIP], tf.int64),
            tf.constant([int(epoch), int(skip_batches)], tf.int64),
        )

    def get(self) -> tuple[int, int]:
        """Returns `(epoch, skip_batches)` that the next iteration will use.

        Returns:
            A pair of ints.

        Example:

        ```python
        epoch, skip = cursor.get()
        ```
        """
        values = self._table.lookup(tf.constant([_EPOCH, _SKIP], tf.int64)).numpy()
        return int(values[0]), int(values[1])

    def _take(self) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """Reads epoch, skip and seed and advances to the next epoch (in the input pipeline)."""
        keys = tf.constant([_EPOCH, _SKIP], tf.int64)
        values = self._table.lookup(keys)
        seed = self._table.lookup(tf.constant([_SEED], tf.int64))[0]
        with tf.control_dependencies([values, seed]):
            update = self._table.insert(keys, tf.stack([values[0] + 1, tf.constant(0, tf.int64)]))
        with tf.control_dependencies([update]):
            return tf.identity(values[0]), tf.identity(values[1]), tf.identity(seed)


def cursor_of(dataset: Any) -> DatasetCursor | None:
    """Returns the `DatasetCursor` of a dataset built by `make_dataset`, else None.

    Args:
        dataset: Any object.

    Returns:
        The cursor, or None when `dataset` was not built by `make_dataset`.

    Example:

    ```python
    assert kmk.cursor_of(kmk.make_dataset(x, y, 32)) is not None
    ```
    """
    return getattr(dataset, "_kmk_cursor", None)


class _Rescale:
    """`x -> cast(x, dtype) * scale`; per sample, equal by value (so steps can be reused)."""

    def __init__(self, scale: float, dtype: str) -> None:
        self.scale = scale
        self.dtype = dtype

    def __call__(self, x: Any) -> Any:
        return tf.cast(x, self.dtype) * tf.constant(self.scale, self.dtype)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Rescale) and (self.scale, self.dtype) == (
            other.scale,
            other.dtype,
        )

    def __hash__(self) -> int:
        return hash((_Rescale, self.scale, self.dtype))

    def __repr__(self) -> str:
        return f"kmk.rescale(scale={self.scale!r}, dtype={self.dtype!r})"


def rescale(scale: float = 1.0 / 255.0, dtype: str = "float32") -> Callable[[Any], Any]:
    """Returns a per-batch `preprocess` function: cast to `dtype`, multiply by `scale`.

    It works sample by sample, so `make_dataset` runs it on each replica's device for models
    the kit built (`preprocess_on="auto"`): the stored dtype (uint8) crosses to the devices
    instead of float32, with the same values.

    Args:
        scale: Multiplier applied after the cast (default maps uint8 pixels to [0, 1]).
        dtype: Floating dtype to cast to.

    Returns:
        A function `x -> cast(x, dtype) * scale` (a callable object; two with the same
        `scale` and `dtype` are equal).

    Example:

    ```python
    ds = kmk.make_dataset(x_train, y_train, 128, preprocess=kmk.rescale())
    ```
    """
    return _Rescale(scale, dtype)


class ReplicaVariant:
    """The stored-dtype twin of a `make_dataset` dataset whose `preprocess` runs on replicas.

    Built on first use (by `fit`, `evaluate` or `predict` of a model the kit built), then
    kept: it shares the dataset's cursor, batch size and order, and yields the gathered
    batches before `preprocess` (for example uint8 images).

    Args:
        preprocess: The `preprocess` the replica steps apply to the features.
        has_y: Whether elements are `(features, labels)` (else the features alone).
        stored: `tf.TensorSpec`s of one batch of features before `preprocess`.
        build: Builds the twin (called once).
        requested: Whether the user asked for it (`preprocess_on="replica"`), rather than
            `"auto"` choosing it.

    Example:

    ```python
    variant = replica_variant(train_ds)
    raw = variant.dataset()        # uint8 batches, same cursor as train_ds
    ```
    """

    def __init__(
        self,
        preprocess: Callable[[Any], Any],
        has_y: bool,
        stored: Any,
        build: Callable[[], tf.data.Dataset],
        requested: bool = False,
    ) -> None:
        self.preprocess = preprocess
        self.has_y = has_y
        self.stored = stored
        self.requested = requested
        self._build: Callable[[], tf.data.Dataset] | None = build
        self._dataset: tf.data.Dataset | None = None

    @property
    def key(self) -> tuple[Any, bool]:
        """What a replica step depends on: `(preprocess, has_y)`."""
        return self.preprocess, self.has_y

    def dataset(self) -> tf.data.Dataset:
        """Returns the twin dataset, building it on the first call.

        Returns:
            A `tf.data.Dataset` of stored-dtype batches, tagged like `make_dataset`'s.

        Example:

        ```python
        raw = replica_variant(train_ds).dataset()
        ```
        """
        if self._dataset is None:
            assert self._build is not None
            self._dataset = self._build()
            setattr(self._dataset, _VARIANT, self)
            self._build = None
        return self._dataset

    def is_twin(self, dataset: Any) -> bool:
        """Whether `dataset` is this twin (already built).

        Args:
            dataset: Any object.

        Returns:
            True for the stored-dtype twin itself.

        Example:

        ```python
        assert variant.is_twin(variant.dataset())
        ```
        """
        return self._dataset is not None and dataset is self._dataset


def replica_variant(dataset: Any) -> ReplicaVariant | None:
    """The `ReplicaVariant` of a `make_dataset` dataset (or of its twin), else None.

    Only the object `make_dataset` returned carries it: a pipeline built on top of it
    (`ds.repeat()`, `ds.map(f)`) preprocesses on the host.

    Args:
        dataset: Any object.

    Returns:
        The variant when kit-built models run `preprocess` on the replicas for `dataset`.

    Example:

    ```python
    assert replica_variant(kmk.make_dataset(x, y, 32, preprocess=kmk.rescale()))
    ```
    """
    variant = getattr(dataset, _VARIANT, None)
    return variant if isinstance(variant, ReplicaVariant) else None


def preprocess_placement(dataset: Any) -> str | None:
    """Where a `make_dataset` dataset's `preprocess` runs when a kit-built model trains on it.

    Args:
        dataset: Any object.

    Returns:
        `"replica"` (models built by the kit receive the stored dtype and apply
        `preprocess` on each replica's device; other consumers still get host-preprocessed
        batches), `"host"` (in the input pipeline, for every consumer), or None (no
        `preprocess`, or not the object `make_dataset` returned).

    Example:

    ```python
    ds = kmk.make_dataset(x, y, 64, preprocess=kmk.rescale())
    assert kmk.preprocess_placement(ds) == "replica"
    ```
    """
    if replica_variant(dataset) is not None:
        return "replica"
    return "host" if getattr(dataset, "_kmk_preprocess_on_host", False) else None


def _default_replicas() -> int:
    """The active strategy's replicas; else those of the Distributions created so far."""
    if tf.distribute.has_strategy():
        return int(tf.distribute.get_strategy().num_replicas_in_sync)
    from keras_mirror_kit.distribution import known_replica_counts

    counts = known_replica_counts()
    return max(counts) if counts else 1


def _multi_worker_expected() -> bool:
    if tf.distribute.has_strategy() and isinstance(
        tf.distribute.get_strategy(), tf.distribute.MultiWorkerMirroredStrategy
    ):
        return True
    from keras_mirror_kit.multi_worker.cluster import tf_config_num_workers

    return tf_config_num_workers() > 1


def make_dataset(
    x: Any,
    y: Any = None,
    batch_size: int | None = None,
    *,
    shuffle: bool = True,
    seed: int | None = None,
    preprocess: Callable[[Any], Any] | None = None,
    preprocess_on: str = "auto",
    drop_remainder: bool | None = None,
    num_replicas: int | None = None,
    prefetch: bool = True,
) -> tf.data.Dataset:
    """Builds a memory-frugal, resumable `tf.data.Dataset` of batches for `model.fit`.

    Hand the result to `model.fit` as it is: Keras distributes it over the replicas (do not
    call `experimental_distribute_dataset` yourself; that copies the data again).

    Args:
        x: Features: a NumPy array (or a tuple/dict of arrays with the same first dim).
        y: Labels with the same first dimension, or None.
        batch_size: The GLOBAL batch size (e.g. `dist.global_batch_size`).
        shuffle: Shuffle the order every epoch (a permutation keyed on seed and epoch).
        seed: Shuffle seed; with a seed, the order of every epoch is reproducible. A random
            one is drawn when None (single host only: a multi-worker run needs the same
            seed on every worker); `SyncedCheckpoint` saves it, so a resume reuses it.
        preprocess: Function applied to each batch of `x` after batching (for example
            `kmk.rescale()` to cast uint8 images to float in [0, 1]).
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
        drop_remainder: Drop the last partial batch. Defaults to `shuffle` (dropped for
            training, kept for evaluation).
        num_replicas: Replicas the batches are split over, used to check that a kept
            partial batch leaves no replica empty; defaults to the active strategy's, or
            else to the largest replica count of the `Distribution`s created so far.
        prefetch: Add a `prefetch(tf.data.AUTOTUNE)` at the end.

    Returns:
        A `tf.data.Dataset` of `(x_batch, y_batch)` (or `x_batch`) with known cardinality,
        auto-shard policy DATA, tf.data autotuning off (see
        `keras_mirror_kit.workarounds.tf_data_iterator_stall`),
        a `DatasetCursor` (see `cursor_of`) and, when `preprocess` runs on the replicas for
        kit-built models, a `ReplicaVariant` (see `preprocess_placement`). Iterated, it
        always yields the preprocessed batches.

    Raises:
        TypeError: On a missing or non-integer batch size or a non-callable `preprocess`.
        ValueError: On an empty dataset, arrays of different lengths, a non-positive batch
            size, a batch larger than the data when dropping the remainder, a partial
            final batch that would leave a replica empty, an unknown `preprocess_on`, or
            `preprocess_on="replica"` without a `preprocess`.

    Example:

    ```python
    dist = build_model.distribution
    train_ds = kmk.make_dataset(x_train, y_train, dist.global_batch_size, seed=0,
                                preprocess=kmk.rescale())
    model.fit(train_ds, epochs=10)
    ```
    """
    if batch_size is None:
        raise TypeError(
            "make_dataset() needs `batch_size` (the global batch size, e.g. "
            "`dist.global_batch_size`). Received: batch_size=None"
        )
    batch_size = positive_int("batch_size", batch_size)
    if preprocess is not None and not callable(preprocess):
        raise TypeError(f"`preprocess` must be callable. Received: preprocess={preprocess!r}")
    if preprocess_on not in PREPROCESS_ON:
        raise ValueError(
            f"`preprocess_on` must be one of {', '.join(map(repr, PREPROCESS_ON))}. "
            f"Received: preprocess_on={preprocess_on!r}"
        )
    if preprocess_on == "replica" and preprocess is None:
        raise ValueError(
            "preprocess_on='replica' moves `preprocess` onto the replicas, but no "
            "`preprocess` was given. Pass one (for example preprocess=kmk.rescale()) or "
            "leave preprocess_on at its default. Received: preprocess=None, "
            "preprocess_on='replica'"
        )
    if seed is not None:
        seed = non_negative_int("seed", seed)
    elif shuffle and _multi_worker_expected():
        raise ValueError(
            "make_dataset() needs a `seed` in a multi-worker run: every worker must shuffle "
            "in the same order before the data is sharded, or the workers' slices of a "
            "global batch overlap. Pass the same seed on every worker. Received: seed=None"
        )
    replicas = (
        _default_replicas() if num_replicas is None else positive_int("num_replicas", num_replicas)
    )
    drop = shuffle if drop_remainder is None else bool(drop_remainder)

    arrays = (x,) if y is None else (x, y)
    lengths = {len(leaf) for part in arrays for leaf in tf.nest.flatten(part)}
    if len(lengths) != 1:
        raise ValueError(
            "All arrays given to make_dataset() must have the same first dimension. "
            f"Received lengths: {sorted(lengths)}"
        )
    n = lengths.pop()
    if n == 0:
        raise ValueError("make_dataset() received empty arrays. Received: len(x)=0")
    if drop and batch_size > n:
        raise ValueError(
            f"`batch_size` ({batch_size}) is larger than the data ({n} samples), so with "
            "drop_remainder=True every batch would be dropped. Use a smaller batch size or "
            f"drop_remainder=False. Received: batch_size={batch_size}"
        )
    remainder = n % batch_size
    if not drop and remainder and remainder % replicas:
        raise ValueError(
            f"The last batch would hold {remainder} samples, which does not split evenly over "
            f"{replicas} replicas (Keras cannot train or evaluate on an uneven or empty "
            "per-replica batch). Pass drop_remainder=True, or use a batch size that leaves a "
            f"remainder divisible by {replicas}. Received: batch_size={batch_size}, len(x)={n}"
        )
    num_batches = n // batch_size if drop else math.ceil(n / batch_size)
    seed_given = seed is not None
    if seed is None:
        seed = int(np.random.default_rng().integers(0, 2**31 - 1))

    with tf.device("/cpu:0"):
        tensors = tf.nest.map_structure(tf.convert_to_tensor, arrays)
    cursor = DatasetCursor(num_batches, seed=seed, seed_given=seed_given, num_samples=n)

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
            return epoch, skip, order

        epoch, skip, order = tf.cond(state[0] < 0, fresh, lambda: state)
        position = (step + skip) % num_batches
        start = position * batch_size
        index = order[start : tf.minimum(start + batch_size, n)]
        return (epoch, skip, order), index

    def build(apply: Callable[[Any], Any] | None) -> tf.data.Dataset:
        def gather(index: tf.Tensor) -> Any:
            picked = tf.nest.map_structure(lambda t: tf.gather(t, index), tensors)
            features = picked[0]
            if apply is not None:
                features = apply(features)
            return features if y is None else (features, picked[1])

        initial = (
            tf.constant(-1, tf.int64),
            tf.constant(0, tf.int64),
            tf.zeros([n], tf.int64),
        )
        dataset = tf.data.Dataset.range(num_batches).scan(initial, next_batch)
        dataset = dataset.map(gather, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        if prefetch:
            dataset = dataset.prefetch(tf.data.AUTOTUNE)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.DATA
        )
        # No autotuning model thread: destroying an iterator whose model thread is asleep
        # can block for up to 60 s (a TensorFlow lost wake-up; see
        # keras_mirror_kit.workarounds.tf_data_iterator_stall), and Keras destroys one at
        # every epoch end. The
        # map and prefetch keep AUTOTUNE, which then means TensorFlow's fixed defaults (as
        # fast here: gather and cast are cheap).
        options.autotune.enabled = False
        dataset = dataset.with_options(options)
        dataset._kmk_cursor = cursor  # noqa: SLF001
        # Read by keras_mirror_kit.fit_inputs (batch checks, exact throughput of a last batch).
        dataset._kmk_batch_size = batch_size  # noqa: SLF001
        dataset._kmk_epoch_samples = n if not drop else num_batches * batch_size  # noqa: SLF001
        return dataset

    dataset = build(preprocess)
    if preprocess is not None and (
        preprocess_on == "replica"
        or (preprocess_on == "auto" and isinstance(preprocess, _Rescale))
    ):
        stored = tf.nest.map_structure(
            lambda t: tf.TensorSpec([None, *t.shape[1:]], t.dtype), tensors[0]
        )
        variant = ReplicaVariant(
            preprocess,
            y is not None,
            stored,
            lambda: build(None),
            requested=preprocess_on == "replica",
        )
        setattr(dataset, _VARIANT, variant)
    elif preprocess is not None:
        dataset._kmk_preprocess_on_host = True  # noqa: SLF001
    return dataset
