"""The step the workers of a `MultiWorkerMirroredStrategy` stop at on a signal.

`checkpoint.preemption.PreemptionGuard` asks for one (`stop_agreement`) when a `fit()` runs
on several workers. It uses TensorFlow's coordination service (its key-value store, as
TensorFlow's own `PreemptionCheckpointHandler` does) and no collective while no signal
comes; see `checkpoint/preemption.py` for the protocol.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

from keras_mirror_kit.upstream import tensorflow_private

__all__ = ["StopAgreement"]

logger = logging.getLogger("keras_mirror_kit")

_WAIT_MS = 600_000  # a peer's acknowledgment or end of fit() (a dead peer fails sooner)
_STOP = "stop"  # the step key's value once a fit() ended without a stop
_serial = [0]  # fit() with several workers in this process; the same on every worker


class StopAgreement:
    """The step the workers stop at, agreed through TensorFlow's coordination service."""

    def __init__(self, strategy: Any, wake: Any) -> None:
        multi_worker_util = tensorflow_private.multi_worker_util()
        resolver = strategy.cluster_resolver
        spec = resolver.cluster_spec()
        self._context = tensorflow_private.eager_context()
        self.rank = multi_worker_util.id_in_cluster(spec, resolver.task_type, resolver.task_id)
        self.workers = multi_worker_util.worker_count(spec, resolver.task_type)
        _serial[0] += 1
        self._prefix = f"keras_mirror_kit/preemption/{_serial[0]}"
        self.target: int | None = None
        self._wake = wake
        self._thread = threading.Thread(
            target=self._watch, name="kmk-preemption-watch", daemon=True
        )
        self._thread.start()

    def _set(self, key: str, value: str) -> bool:
        """Sets a key once; False when it was set already (by another worker)."""
        import tensorflow as tf

        try:
            self._context.set_config_key_value(f"{self._prefix}/{key}", value)
        except tf.errors.AlreadyExistsError:
            return False
        return True

    def _get(self, key: str) -> str:
        return self._context.get_config_key_value(f"{self._prefix}/{key}", _WAIT_MS)

    def _watch(self) -> None:
        """Waits for the step to stop at (or the end of the fit()), then acknowledges it."""
        try:
            value = self._get("step")
            if value != _STOP:
                self.target = int(value)
                self._wake()
            self._set(f"ack/{self.rank}", "1")
        except Exception as err:  # noqa: BLE001 (the cluster went away: nothing to agree)
            logger.debug("keras-mirror-kit: preemption watch ended: %s", err)

    def propose(self, step: int) -> None:
        """Publishes `step` unless a worker did first; waits for every acknowledgment."""
        if not self._set("claim", str(self.rank)) or not self._set("step", str(step)):
            return  # another worker's step comes through _watch (it waits for ours)
        for rank in range(self.workers):
            self._get(f"ack/{rank}")

    def end(self, late: bool) -> bool:
        """At the end of fit(): whether any worker got a signal not acted on yet."""
        self._set(f"end/{self.rank}", "1" if late else "0")
        ends = [self._get(f"end/{rank}") for rank in range(self.workers)]
        return "1" in ends

    def release(self) -> None:
        """Ends the watching thread (the step key set to `stop` if nobody set it)."""
        with contextlib.suppress(Exception):  # the cluster may be gone (a failed fit())
            self._set("step", _STOP)
        self._thread.join(timeout=10)
