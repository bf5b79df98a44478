"""keras-mirror-kit: data-parallel Keras 3 training on every replica with one decorator.

```python
import keras_mirror_kit as kmk

@kmk.distributed(per_replica_batch_size=64)
def build_model(): ...
```
"""

from keras_mirror_kit import datasets, models
from keras_mirror_kit._version import __version__
from keras_mirror_kit.batch_norm import synchronize_batch_norm
from keras_mirror_kit.batching import global_batch_size, per_replica_batch_size
from keras_mirror_kit.callbacks import ReplicaDivergenceError, SyncedCheckpoint, ThroughputMonitor
from keras_mirror_kit.checkpoint_store import (
    CheckpointError,
    CheckpointWriteError,
    CorruptCheckpointWarning,
)
from keras_mirror_kit.data import DatasetCursor, cursor_of, make_dataset, rescale
from keras_mirror_kit.devices import nccl_available, simulate_replicas
from keras_mirror_kit.distributed import DistributedFactory, distributed
from keras_mirror_kit.distribution import Distribution, current, distribution_of
from keras_mirror_kit.lr_scaling import scale_learning_rate
from keras_mirror_kit.schedules import WarmupSchedule
from keras_mirror_kit.throughput import ThroughputMeter

__all__ = [
    "CheckpointError",
    "CheckpointWriteError",
    "CorruptCheckpointWarning",
    "DatasetCursor",
    "Distribution",
    "DistributedFactory",
    "ReplicaDivergenceError",
    "SyncedCheckpoint",
    "ThroughputMeter",
    "ThroughputMonitor",
    "WarmupSchedule",
    "__version__",
    "current",
    "cursor_of",
    "datasets",
    "distributed",
    "distribution_of",
    "global_batch_size",
    "make_dataset",
    "models",
    "nccl_available",
    "per_replica_batch_size",
    "rescale",
    "scale_learning_rate",
    "simulate_replicas",
    "synchronize_batch_norm",
]
