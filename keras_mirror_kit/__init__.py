"""keras-mirror-kit: data-parallel Keras 3 training on every replica with one decorator.

```python
import keras_mirror_kit as kmk

@kmk.distributed(per_replica_batch_size=64)
def build_model(): ...
```
"""

from keras_mirror_kit._version import __version__
from keras_mirror_kit.batching import global_batch_size, per_replica_batch_size
from keras_mirror_kit.data import DatasetCursor, cursor_of, make_dataset, rescale
from keras_mirror_kit.devices import nccl_available, simulate_replicas
from keras_mirror_kit.distributed import DistributedFactory, distributed
from keras_mirror_kit.distribution import Distribution, current, distribution_of
from keras_mirror_kit.lr_scaling import scale_learning_rate
from keras_mirror_kit.schedules import WarmupSchedule

__all__ = [
    "DatasetCursor",
    "Distribution",
    "DistributedFactory",
    "WarmupSchedule",
    "__version__",
    "current",
    "cursor_of",
    "distributed",
    "distribution_of",
    "global_batch_size",
    "make_dataset",
    "nccl_available",
    "per_replica_batch_size",
    "rescale",
    "scale_learning_rate",
    "simulate_replicas",
]
