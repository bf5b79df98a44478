"""Keras callbacks of keras-mirror-kit, for models built by `kmk.distributed()` (and others).

```python
from keras_mirror_kit.callbacks import SyncedCheckpoint, ThroughputMonitor
```

Each callback is imported from its module on first use (PEP 562), so `ThroughputMonitor`
imports without the checkpoint machinery (and without TensorFlow on Keras' JAX backend).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from keras_mirror_kit.callbacks.synced_checkpoint import (
        ReplicaDivergenceError,
        SyncedCheckpoint,
    )
    from keras_mirror_kit.callbacks.throughput_monitor import ThroughputMonitor

_LAZY = {
    "ReplicaDivergenceError": "keras_mirror_kit.callbacks.synced_checkpoint",
    "SyncedCheckpoint": "keras_mirror_kit.callbacks.synced_checkpoint",
    "ThroughputMonitor": "keras_mirror_kit.callbacks.throughput_monitor",
}

__all__ = [
    "ReplicaDivergenceError",
    "SyncedCheckpoint",
    "ThroughputMonitor",
]


def __getattr__(name: str) -> Any:
    """Imports a callback from its module on first use (PEP 562)."""
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's names, the lazy ones included."""
    return sorted(set(globals()) | set(__all__))
