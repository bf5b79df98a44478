"""`workarounds.even_rows`: a step skips the all-reduce of its rows only where every replica
holds the same static rows.

tf.function traces a step with the static shapes of the batch it is called on, per
replica: a global batch of 9 on 2 replicas is traced as parts of 5 and 4 rows, each replica
seeing only its own. `even_rows` compares the replicas' counts while the step is traced,
so a replica never takes its own static rows for everyone's (which would weigh 5/4 parts as
if both held 5). Runs on this process' 2 logical CPUs.
"""

from __future__ import annotations

import pytest
import tensorflow as tf

from keras_mirror_kit.workarounds import even_rows, rows_of

TWO = ["/cpu:0", "/cpu:1"]


def _seen(batch: int, *, eager: bool = False, batches: int = 1) -> list[int | None]:
    """What `even_rows` answered on each replica, each trace (or eager call), for the first
    `batches` batches of `batch` rows (the last partial batch kept)."""
    strategy = tf.distribute.MirroredStrategy(TWO)
    seen: list[int | None] = []

    def step(x: tf.Tensor) -> tf.Tensor:
        rows = rows_of(x)
        seen.append(even_rows(tf.distribute.get_replica_context(), rows))
        return tf.reduce_sum(x)

    def on_replicas(data):
        return strategy.run(step, args=(data,))

    run = on_replicas if eager else tf.function(on_replicas, reduce_retracing=True)
    rows = tf.data.Dataset.range(10 * batch).map(lambda i: tf.cast(i, tf.float32))
    dataset = strategy.experimental_distribute_dataset(rows.batch(batch))
    for _, data in zip(range(batches), dataset, strict=False):
        run(data)
    return seen


@pytest.mark.parametrize("eager", [False, True], ids=["traced", "eager"])
def test_an_even_split_is_known_on_every_replica(eager: bool) -> None:
    assert _seen(8, eager=eager) == [4, 4]


@pytest.mark.parametrize("eager", [False, True], ids=["traced", "eager"])
def test_a_split_of_5_and_4_is_not_taken_for_even(eager: bool) -> None:
    """Each replica's trace shows static rows (5 on one, 4 on the other): neither is even."""
    assert _seen(9, eager=eager) == [None, None]


def test_rows_the_trace_does_not_know_are_not_even() -> None:
    """A retrace on a second shape relaxes the rows to unknown (`reduce_retracing`)."""
    strategy = tf.distribute.MirroredStrategy(TWO)
    seen: list[int | None] = []

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
    def unknown(x: tf.Tensor) -> tf.Tensor:
        def step(part: tf.Tensor) -> tf.Tensor:
            seen.append(even_rows(tf.distribute.get_replica_context(), rows_of(part)))
            return tf.reduce_sum(part)

        return strategy.run(step, args=(x,))

    unknown(tf.ones([6]))
    assert seen == [None, None]


def test_outside_a_mirrored_strategy_nothing_is_assumed() -> None:
    assert even_rows(tf.distribute.get_replica_context(), tf.constant(4)) is None
