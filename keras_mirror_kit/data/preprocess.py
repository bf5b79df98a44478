"""`rescale()`, and where a kit dataset's `preprocess` runs (host, or each replica).

For a model built by a `@kmk.distributed` factory (or compiled in `with
kmk.distributed(...)`), `rescale()` (and any per-sample function given with
`preprocess_on="replica"`) runs on each replica's device instead of the input pipeline: the
model's `fit`, `evaluate` and `predict` iterate a twin of the dataset that yields the stored
dtype (same cursor, same order; a `ReplicaVariant`) and apply `preprocess` at the start of
every replica step (`backends.tensorflow_preprocess`). Every other consumer iterates
the dataset itself and sees the host-preprocessed batches, so its results never change.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from keras_mirror_kit.data.augment import fold_key, takes_seed
from keras_mirror_kit.data.info import dataset_info

__all__ = [
    "PREPROCESS_ON",
    "ReplicaVariant",
    "Then",
    "preprocess_placement",
    "replica_variant",
    "rescale",
    "then",
]

#: The values of `make_dataset(preprocess_on=...)`.
PREPROCESS_ON = ("auto", "host", "replica")


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


class Then:
    """`x -> second(first(x))`, a per-batch `preprocess` made of two (what `then` returns)."""

    def __init__(self, first: Callable[..., Any], second: Callable[..., Any]) -> None:
        self.first = first
        self.second = second

    def __call__(self, x: Any) -> Any:
        return self.second(self.first(x))

    def __repr__(self) -> str:
        return f"then({self.first!r}, {self.second!r})"


class _ThenSeeded(Then):
    """`Then` where a part takes the batch's `seed`: each such part gets its own key."""

    def __call__(self, x: Any, seed: Any) -> Any:  # type: ignore[override]
        for i, function in enumerate((self.first, self.second)):
            x = function(x, seed=fold_key(seed, i)) if takes_seed(function) else function(x)
        return x


def then(first: Callable[..., Any], second: Callable[..., Any]) -> Callable[..., Any]:
    """`x -> second(first(x))`: two per-batch functions as one `preprocess`.

    Random draws of both are keyed as a single `preprocess`'s are; a part with a `seed`
    parameter receives a key of its own (the chain then takes the batch's `seed`).

    Args:
        first: Applied to each batch first.
        second: Applied to what `first` returns.

    Returns:
        The composed callable.

    Raises:
        TypeError: If either is not callable.

    Example:

    ```python
    from keras_mirror_kit.data.preprocess import then

    ds = kmk.make_dataset(x, y, 64, preprocess=then(kmk.rescale(), augmentation))
    ```
    """
    for name, function in (("first", first), ("second", second)):
        if not callable(function):
            raise TypeError(f"`{name}` must be callable. Received: {name}={function!r}")
    seeded = takes_seed(first) or takes_seed(second)
    return (_ThenSeeded if seeded else Then)(first, second)


def runs_on_replicas_by_default(preprocess: Any) -> bool:
    """Whether `preprocess_on="auto"` moves `preprocess` onto the replicas (`rescale()` only)."""
    return isinstance(preprocess, _Rescale)


class ReplicaVariant:
    """The stored-dtype twin of a kit dataset whose `preprocess` runs on the replicas.

    Built on use (by `fit`, `evaluate` or `predict` of a model the kit built): it shares
    the dataset's cursor, batch size and order, and yields the batches before `preprocess`.
    `requested` tells `preprocess_on="replica"` from `"auto"`. The twin is held weakly (its
    `DatasetInfo` names this variant, so a strong reference would keep it alive for ever)
    and built again when a later call needs it after it was freed.
    """

    def __init__(
        self,
        preprocess: Callable[[Any], Any],
        has_y: bool,
        stored: Any,
        build: Callable[[ReplicaVariant], tf.data.Dataset],
        requested: bool = False,
    ) -> None:
        self.preprocess = preprocess
        self.has_y = has_y
        self.stored = stored  # tf.TensorSpecs of one batch of features before preprocess
        self.requested = requested
        self._build = build
        self._twin: Callable[[], tf.data.Dataset | None] = lambda: None

    @property
    def key(self) -> tuple[Any, bool]:
        """What a replica step depends on: `(preprocess, has_y)`."""
        return self.preprocess, self.has_y

    def dataset(self) -> tf.data.Dataset:
        """The twin dataset (built when none is alive, recorded with this variant)."""
        twin = self._twin()
        if twin is None:
            twin = self._build(self)
            self._twin = weakref.ref(twin)
        return twin

    def is_twin(self, dataset: Any) -> bool:
        """Whether `dataset` is this variant's twin."""
        return dataset is not None and dataset is self._twin()


def replica_variant(dataset: Any) -> ReplicaVariant | None:
    """The `ReplicaVariant` of a kit dataset (or of its twin), else None.

    Only the object `make_dataset` returned carries it: a pipeline built on top of it
    (`ds.repeat()`, `ds.map(f)`) preprocesses on the host.
    """
    info = dataset_info(dataset)
    return info.variant if info is not None else None


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
    info = dataset_info(dataset)
    return info.preprocess_on if info is not None else None
