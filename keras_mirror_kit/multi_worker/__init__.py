"""Beyond one host: the multi-worker strategy and the local launcher, together.

* `cluster` (core layer, imports TensorFlow): reads `TF_CONFIG` or Slurm's variables,
  builds `MultiWorkerMirroredStrategy` for `kmk.distributed()`, and installs the Keras
  `model.fit` workaround it needs (`keras_mirror_kit.workarounds.keras_multi_worker_fit`).
* `launch` (command line, never imports TensorFlow): `keras-mirror-kit launch -n N`, which
  starts N local workers with their `TF_CONFIG`, relays their output, restarts them
  (`--max-restarts`) and reaps them.

This module holds what both sides share and imports nothing, so the launcher starts fast.

Example:

```python
from keras_mirror_kit.multi_worker import READY_FILE_ENV
READY_FILE_ENV  # 'KMK_LAUNCH_READY_FILE'
```
"""

from __future__ import annotations

__all__ = ["READY_FILE_ENV"]

#: Set by `launch` for each worker: the file a worker creates once its strategy has joined
#: the cluster (`cluster.create_strategy`), so the launcher can tell a worker that never
#: joined from one that failed later.
READY_FILE_ENV = "KMK_LAUNCH_READY_FILE"
