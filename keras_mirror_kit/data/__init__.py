"""The input pipeline: `make_dataset`, its cursor, and where its `preprocess` runs.

Modules: `pipeline` (`make_dataset`), `cursor` (`DatasetCursor`: the epoch, batch and seed
the next iteration starts from), `info` (`DatasetInfo`: what the kit records of a dataset it
built, and its one reader), `preprocess` (`rescale()` and the replica-side twin).
"""

from keras_mirror_kit.data.cursor import DatasetCursor
from keras_mirror_kit.data.info import DatasetInfo, cursor_of, dataset_info
from keras_mirror_kit.data.pipeline import make_dataset
from keras_mirror_kit.data.preprocess import (
    PREPROCESS_ON,
    ReplicaVariant,
    preprocess_placement,
    replica_variant,
    rescale,
)

__all__ = [
    "PREPROCESS_ON",
    "DatasetCursor",
    "DatasetInfo",
    "ReplicaVariant",
    "cursor_of",
    "dataset_info",
    "make_dataset",
    "preprocess_placement",
    "replica_variant",
    "rescale",
]
