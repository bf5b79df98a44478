"""The input pipeline: `make_dataset`, its cursor, and where its `preprocess` runs.

Modules: `pipeline` (`make_dataset`), `cursor` (`DatasetCursor`: the epoch, batch and seed
the next iteration starts from), `info` (`DatasetInfo`: what the kit records of a dataset it
built, and its one reader), `preprocess` (`rescale()` and the replica-side twin), `sources`
(a list of items read by `load`, in an `index_shuffle` order; tables), `samples` (per-sample
`load`, batching, this worker's part), `folders` (`image_dataset_from_directory`,
`text_dataset_from_directory` with Keras' signatures), `records` (`tfrecord_dataset` and its
record index), `augment` (random draws keyed on seed, epoch and batch), `sharding` (which
samples each worker decodes).

The names are imported from their modules on first use (PEP 562): `data.info`, which the
core reads on every backend, imports no TensorFlow, and the pipeline's modules (which do)
are imported only when used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from keras_mirror_kit.data.cursor import DatasetCursor
    from keras_mirror_kit.data.folders import (
        image_dataset_from_directory,
        text_dataset_from_directory,
    )
    from keras_mirror_kit.data.info import DatasetInfo, cursor_of, dataset_info
    from keras_mirror_kit.data.pipeline import make_dataset
    from keras_mirror_kit.data.preprocess import (
        PREPROCESS_ON,
        ReplicaVariant,
        preprocess_placement,
        replica_variant,
        rescale,
    )
    from keras_mirror_kit.data.records import tfrecord_dataset

_LAZY = {
    "PREPROCESS_ON": "keras_mirror_kit.data.preprocess",
    "DatasetCursor": "keras_mirror_kit.data.cursor",
    "DatasetInfo": "keras_mirror_kit.data.info",
    "ReplicaVariant": "keras_mirror_kit.data.preprocess",
    "cursor_of": "keras_mirror_kit.data.info",
    "dataset_info": "keras_mirror_kit.data.info",
    "image_dataset_from_directory": "keras_mirror_kit.data.folders",
    "make_dataset": "keras_mirror_kit.data.pipeline",
    "preprocess_placement": "keras_mirror_kit.data.preprocess",
    "replica_variant": "keras_mirror_kit.data.preprocess",
    "rescale": "keras_mirror_kit.data.preprocess",
    "text_dataset_from_directory": "keras_mirror_kit.data.folders",
    "tfrecord_dataset": "keras_mirror_kit.data.records",
}

__all__ = [
    "PREPROCESS_ON",
    "DatasetCursor",
    "DatasetInfo",
    "ReplicaVariant",
    "cursor_of",
    "dataset_info",
    "image_dataset_from_directory",
    "make_dataset",
    "preprocess_placement",
    "replica_variant",
    "rescale",
    "text_dataset_from_directory",
    "tfrecord_dataset",
]


def __getattr__(name: str) -> Any:
    """Imports a name from its module on first use (PEP 562)."""
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's names, the lazy ones included."""
    return sorted(set(globals()) | set(__all__))
