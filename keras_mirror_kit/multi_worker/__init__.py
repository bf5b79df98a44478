"""Beyond one host: the multi-worker strategy and the local launcher, together.

* `cluster` (core layer; imports TensorFlow where it makes a strategy): reads `TF_CONFIG` or
  Slurm's variables, builds `MultiWorkerMirroredStrategy` for `kmk.distributed()`, and
  installs the Keras `model.fit` workaround it needs
  (`keras_mirror_kit.workarounds.keras_multi_worker_fit`).
* `launch` (command line, never imports TensorFlow): `keras-mirror-kit launch -n N`, which
  starts N local workers with their `TF_CONFIG`, relays their output, restarts them
  (`--max-restarts`) and reaps them.
* `gpus` (standard library only): which GPUs are visible (`visible_gpus`), for both.

This module holds the names both sides share (the launcher's ready file and network mode;
`SyncedCheckpoint`'s exit status on a stop signal, which the launcher reads; the security
page both name) and imports nothing, so the launcher starts fast.

Example:

```python
from keras_mirror_kit.multi_worker import READY_FILE_ENV
READY_FILE_ENV  # 'KMK_LAUNCH_READY_FILE'
```
"""

from __future__ import annotations

__all__ = ["NETWORK_ENV", "PREEMPTED_EXIT_CODE", "READY_FILE_ENV", "SECURITY_DOCS_URL"]

#: Set by `launch` for each worker: the file a worker creates once its strategy has joined
#: the cluster (`cluster.create_strategy`), so the launcher can tell a worker that never
#: joined from one that failed later.
READY_FILE_ENV = "KMK_LAUNCH_READY_FILE"

#: Set by `launch` for each worker: `isolated` (the workers share a network namespace of
#: their own) or `host` (this host's network; the launcher has warned). With it set,
#: `distributed()` does not log its own warning about servers listening on all interfaces.
NETWORK_ENV = "KMK_LAUNCH_NETWORK"

#: What a training job exposes, and how to secure a cluster's network.
SECURITY_DOCS_URL = "https://keras-mirror-kit.github.io/keras-mirror-kit/security/"

PREEMPTED_EXIT_CODE = 75
"""The exit status of a process whose `fit()` saved its state on a stop signal.

`EX_TEMPFAIL` of `sysexits.h` ("a temporary failure; the user is invited to retry"):
`keras-mirror-kit launch --max-restarts` and schedulers restart the job, which resumes from
the checkpoint. `kmk.Preempted` is the `SystemExit` that carries it.
"""
