"""The input pipeline: `make_dataset`, its cursor, and where its `preprocess` runs.

Modules: `pipeline` (`make_dataset`), `cursor` (`DatasetCursor`: the epoch, batch and seed
the next iteration starts from), `info` (`DatasetInfo`: what the kit records of a dataset it
built, and its one reader), `preprocess` (`rescale()` and the replica-side twin), `sources`
(a list of items read by `load`, in an `index_shuffle` order; tables), `samples` (per-sample
`load`, batching, this worker's part), `folders` (`image_dataset_from_directory`,
`text_dataset_from_directory` with Keras' signatures), `records` (`tfrecord_dataset` and its
record index), `augment` (random draws keyed on
seed, epoch and batch), `sharding` (which samples each worker decodes).
"""

from keras_mirror_kit.data.cursor import DatasetCursor
from keras_mirror_kit.data.folders import image_dataset_from_directory, text_dataset_from_directory
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
