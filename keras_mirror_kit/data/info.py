"""`DatasetInfo`: what the kit knows of a dataset it built, held beside it, not on it.

`make_dataset` records one frozen `DatasetInfo` per dataset it returns (and one for the
stored-dtype twin of `keras_mirror_kit.data.preprocess.ReplicaVariant`), in a weak map:
the fit checks (`keras_mirror_kit.fit_inputs`), the callbacks and the replica steps read it
through `dataset_info`, the one reader. Nothing is stamped on the `tf.data.Dataset`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from keras_mirror_kit.data.cursor import DatasetCursor

__all__ = ["DatasetInfo", "cursor_of", "dataset_info", "record_dataset"]


@dataclass(frozen=True)
class DatasetInfo:
    """A dataset built by the kit: its position, batch and epoch, and where preprocess runs.

    Args:
        cursor: Where the next iteration starts (`DatasetCursor`).
        batch_size: Samples per full batch (the global batch size).
        epoch_samples: Samples one epoch yields (its last batch may hold fewer).
        preprocess_on: `"replica"` (kit-built models apply `preprocess` on each replica),
            `"host"` (in the input pipeline) or None (no `preprocess`).
        variant: The stored-dtype twin when `preprocess_on == "replica"`, else None.
        whole: For a dataset that drops its last partial batch, a function that builds
            the same dataset keeping it (what `evaluate` and `validation_data` iterate),
            else None.
    """

    cursor: DatasetCursor
    batch_size: int
    epoch_samples: int
    preprocess_on: str | None = None
    # A `data.preprocess.ReplicaVariant` (typed loosely: that module reads this one).
    variant: Any = None
    whole: Any = None


_INFOS: weakref.WeakKeyDictionary[Any, DatasetInfo] = weakref.WeakKeyDictionary()


def record_dataset(dataset: Any, info: DatasetInfo) -> None:
    """Records `info` for `dataset` (held weakly: the dataset is freed as before)."""
    _INFOS[dataset] = info


def dataset_info(dataset: Any) -> DatasetInfo | None:
    """The `DatasetInfo` of a dataset the kit built (this very object), else None."""
    try:
        return _INFOS.get(dataset)
    except TypeError:  # unhashable or not weak-referenceable
        return None


def cursor_of(dataset: Any) -> DatasetCursor | None:
    """Returns the `DatasetCursor` of a dataset built by `make_dataset`, else None.

    Args:
        dataset: Any object.

    Returns:
        The cursor, or None when `dataset` is not an object `make_dataset` returned.

    Example:

    ```python
    assert kmk.cursor_of(kmk.make_dataset(x, y, 32)) is not None
    ```
    """
    info = dataset_info(dataset)
    return info.cursor if info is not None else None
