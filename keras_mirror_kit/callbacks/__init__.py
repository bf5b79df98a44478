"""Keras callbacks of keras-mirror-kit, for models built by `kmk.distributed()` (and others).

```python
from keras_mirror_kit.callbacks import SyncedCheckpoint, ThroughputMonitor
```
"""

from keras_mirror_kit.callbacks.synced_checkpoint import ReplicaDivergenceError, SyncedCheckpoint
from keras_mirror_kit.callbacks.throughput_monitor import ThroughputMonitor

__all__ = [
    "ReplicaDivergenceError",
    "SyncedCheckpoint",
    "ThroughputMonitor",
]
