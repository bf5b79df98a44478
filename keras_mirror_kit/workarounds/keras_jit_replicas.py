"""`jit_compile=True` with several replicas in one process: refused before any step.

Upstream: keras-team/keras#19005 (also #20763, #21366; open against Keras 3.15 and
TensorFlow 2.21). Keras compiles its whole train step with XLA, all-reduce and variable
updates included; under `MirroredStrategy` with more than one local replica the first step
fails with a raw `InvalidArgumentError: ... Trying to access resource .../replica_1/...
from device CPU:0` (or GPU:0). One replica per process (one device, or one device per
worker of a multi-worker job) compiles and trains. The kit refuses the combination when
the model is compiled (and again at `fit`, for a `jit_compile` set afterwards), with an
error naming the setting, the replica count and the issue; compiling each replica's
forward and backward pass alone with XLA, the all-reduce and update outside it, is what a
fix would do, and Keras offers no hook for it.

Keras' default `jit_compile="auto"` quietly means no XLA under any `tf.distribute`
strategy; on a machine with GPUs the kit says so once (INFO), since a user who measured
XLA on one GPU will otherwise look for it in vain.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

__all__ = ["UPSTREAM", "check", "note_auto"]

logger = logging.getLogger("keras_mirror_kit")

UPSTREAM = "keras-team/keras#19005"
_noted = threading.Event()


def check(model: Any, local_replicas: int, where: str) -> None:
    """Refuses (`ValueError`) a model that would run XLA over several local replicas."""
    if local_replicas <= 1 or getattr(model, "jit_compile", False) is not True:
        return
    raise ValueError(
        f"{where}: the model is compiled with jit_compile=True, but XLA cannot compile "
        f"Keras' train step over {local_replicas} replicas in one process: the first step "
        "would fail with 'Trying to access resource .../replica_1/...' "
        f"({UPSTREAM}, also #20763 and #21366). Compile with jit_compile=False (or leave "
        "Keras' default, 'auto', which turns XLA off under tf.distribute), or run one "
        f"replica per process. Received: jit_compile=True, replicas={local_replicas}"
    )


def note_auto(model: Any, has_gpus: bool) -> None:
    """Says once (INFO) that `jit_compile="auto"` meant no XLA under the strategy."""
    config = getattr(getattr(model, "_compile_config", None), "config", None) or {}
    if _noted.is_set() or not has_gpus or config.get("jit_compile", "auto") != "auto":
        return
    if getattr(model, "jit_compile", None) is False:
        _noted.set()
        logger.info(
            "keras-mirror-kit: jit_compile='auto' (Keras' default) means no XLA under "
            "tf.distribute, so %r trains without XLA; jit_compile=True is refused with "
            "several replicas per process (%s)",
            getattr(model, "name", "the model"),
            UPSTREAM,
        )
