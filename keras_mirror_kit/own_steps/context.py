"""The step being traced: where the replica's rows sit in the batch, and what it weighs.

`StepContext` is made once per replica, at the start of each own step the kit wraps, from
the replica's part of the data: its rows, every replica's rows (one all-reduce of an
N-vector; none where the trace shows even parts: `workarounds.even_rows`), hence the
batch's total, the replica's offset in the batch (tf.distribute gives replica `r` the rows
after those of replicas `0..r-1`) and its share `rows / total`. The
kit's wrappers of the optimizers, metrics and random draws read it through `current()`,
per thread: MirroredStrategy traces each replica in a thread of its own.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import tensorflow as tf

from keras_mirror_kit.workarounds import even_rows

__all__ = ["StepContext", "current", "stepping"]


class StepContext:
    """One replica's place in the batch of the step being traced.

    Args:
        rows: The replica's rows (an int32 scalar tensor).
        replica_context: The replica context of the step (the default one on one device).
        probe: The probe this step runs for (`own_steps.probe`), or None in training.
        seed_generator: The model's `keras.random.SeedGenerator` for the step's unseeded
            draws (`own_steps.random_draws`), or None.
    """

    def __init__(
        self, rows: tf.Tensor, replica_context: Any, probe: Any = None, seed_generator: Any = None
    ) -> None:
        self.replica_context = replica_context
        self.replicas = int(getattr(replica_context, "num_replicas_in_sync", 1) or 1)
        self.probe = probe
        self.seed_generator = seed_generator
        self.metrics: Any = None  # the step's `metrics.StepMetrics`, on several replicas
        self.rows = tf.cast(rows, tf.int32)
        #: The rows of every replica when the trace shows them even (`even_rows`), else None.
        self.even = even_rows(replica_context, rows) if self.replicas > 1 else None
        if self.even is not None:  # no all-reduce
            replica = tf.cast(replica_context.replica_id_in_sync_group, tf.int32)
            self.offset = replica * self.even
            self.total = tf.constant(self.even * self.replicas, tf.int32)
        elif self.replicas > 1:
            replica = replica_context.replica_id_in_sync_group
            mine = tf.one_hot(replica, self.replicas, dtype=tf.int32) * self.rows
            every = replica_context.all_reduce(tf.distribute.ReduceOp.SUM, mine)
            self.offset = tf.reduce_sum(
                every * tf.cast(tf.range(self.replicas) < replica, tf.int32)
            )
            self.total = tf.reduce_sum(every)
        else:
            self.offset = tf.constant(0, tf.int32)
            self.total = self.rows

    @property
    def share(self) -> tf.Tensor:
        """`rows / total`, float32: what the replica's step weighs in the batch's."""
        return tf.math.divide_no_nan(
            tf.cast(self.rows, tf.float32), tf.cast(self.total, tf.float32)
        )

    def rows_and_total(self) -> tuple[tf.Tensor, tf.Tensor]:
        """The replica's rows and the batch's, float32 (`one_device_losses`' `share`)."""
        return tf.cast(self.rows, tf.float32), tf.cast(self.total, tf.float32)

    def all_reduce(self, values: Any) -> Any:
        """The sum over the replicas of `values` (a structure of tensors); `values` alone."""
        if self.replicas <= 1:
            return values
        return self.replica_context.all_reduce(tf.distribute.ReduceOp.SUM, values)


class _Current(threading.local):
    step: StepContext | None = None


_current = _Current()


def current() -> StepContext | None:
    """The context of the own step this thread is tracing, or None."""
    return _current.step


@contextlib.contextmanager
def stepping(step: StepContext) -> Iterator[StepContext]:
    """Makes `step` this thread's current step while the block runs."""
    previous, _current.step = _current.step, step
    try:
        yield step
    finally:
        _current.step = previous
