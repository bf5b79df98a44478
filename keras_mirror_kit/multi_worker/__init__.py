"""Beyond one host: the multi-worker strategy and the local launcher, together.

* `cluster` (core layer, imports TensorFlow): reads `TF_CONFIG` or Slurm's variables,
  builds `MultiWorkerMirroredStrategy` for `kmk.distributed()`, and installs the Keras
  `model.fit` workaround it needs (`keras_mirror_kit.workarounds.keras_multi_worker_fit`).
* `launch` (command line, never imports TensorFlow): `keras-mirror-kit launch -n N`, which
  starts N local workers with their `TF_CONFIG`, relays their output, restarts them
  (`--max-restarts`) and reaps them.

This module holds what both sides share (which GPUs are visible; `SyncedCheckpoint`'s exit
status on a stop signal, which the launcher reads) and imports only the standard library,
so the launcher starts fast.

Example:

```python
from keras_mirror_kit.multi_worker import READY_FILE_ENV
READY_FILE_ENV  # 'KMK_LAUNCH_READY_FILE'
```
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping

__all__ = ["GPU_ENV", "PREEMPTED_EXIT_CODE", "READY_FILE_ENV", "visible_gpus"]

GPU_ENV = "CUDA_VISIBLE_DEVICES"
NVIDIA_SMI_TIMEOUT_S = 30.0

#: Set by `launch` for each worker: the file a worker creates once its strategy has joined
#: the cluster (`cluster.create_strategy`), so the launcher can tell a worker that never
#: joined from one that failed later.
READY_FILE_ENV = "KMK_LAUNCH_READY_FILE"

PREEMPTED_EXIT_CODE = 75
"""The exit status of a process whose `fit()` saved its state on a stop signal.

`EX_TEMPFAIL` of `sysexits.h` ("a temporary failure; the user is invited to retry"):
`keras-mirror-kit launch --max-restarts` and schedulers restart the job, which resumes from
the checkpoint. `kmk.Preempted` is the `SystemExit` that carries it.
"""


def _parse_visible_devices(value: str) -> list[str]:
    """CUDA's reading of CUDA_VISIBLE_DEVICES: the entries before an empty or negative one."""
    gpus: list[str] = []
    for entry in (part.strip() for part in value.split(",")):
        if not entry or entry.startswith("-"):
            break
        gpus.append(entry)
    return gpus


def visible_gpus(
    environ: Mapping[str, str] | None = None, nvidia_smi: str | None = "nvidia-smi"
) -> list[str]:
    """The GPUs the launcher can hand out, as `CUDA_VISIBLE_DEVICES` entries.

    When `CUDA_VISIBLE_DEVICES` is set, its entries, read as CUDA reads them (up to the
    first empty or negative entry, so `-1` and `""` mean no GPU; indexes and `GPU-...`
    UUIDs are kept as written). Otherwise the `GPU <i>:` lines of `nvidia-smi -L`, as
    indexes `"0"`, `"1"`, ...; no GPU when `nvidia-smi` is missing or fails. TensorFlow
    is not imported.

    Args:
        environ: The environment to read (default: `os.environ`).
        nvidia_smi: The `nvidia-smi` program (a name on `PATH` or a path), or None to
            consult only `CUDA_VISIBLE_DEVICES`.

    Returns:
        The GPU entries, possibly empty.

    Example:

    ```python
    visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"})   # ["2", "3"]
    visible_gpus({}, nvidia_smi=None)                # []
    ```
    """
    environ = os.environ if environ is None else environ
    if GPU_ENV in environ:
        return _parse_visible_devices(environ[GPU_ENV])
    program = shutil.which(nvidia_smi) if nvidia_smi else None
    if program is None:
        return []
    try:
        listing = subprocess.run(
            [program, "-L"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    if listing.returncode != 0:
        return []
    gpus = []
    for line in listing.stdout.splitlines():
        head = line.split(":", 1)[0].split()
        if len(head) == 2 and head[0] == "GPU" and head[1].isdigit():
            gpus.append(head[1])
    return gpus
