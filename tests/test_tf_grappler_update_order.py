"""`workarounds.tf_grappler_update_order`: a read of a variable ordered before its update,
in plain TensorFlow (no Keras, no strategy), with and without the kit's `after_all`.

The read waits for a slow op; the update does not. Auto control dependencies order the read
first, through an edge Grappler's dependency optimizer removes when an `IdentityN` (as
`ReplicaContext.all_reduce` puts over an optimizer's gradients) also joins them, and then
bypasses that `IdentityN`: the update runs first and the read sees its value.
"""

from __future__ import annotations

import tensorflow as tf

from keras_mirror_kit.workarounds.tf_grappler_update_order import after_all

RUNS = 10


def _reads_of_the_updated_value(fixed: bool) -> int:
    """In how many of `RUNS` steps the read saw the value the later update wrote."""
    with tf.device("/cpu:0"):
        big = tf.random.stateless_normal([300, 300], seed=[1, 2])
        other, read_one = tf.Variable(0.0), tf.Variable(10.0)

        @tf.function
        def step(x: tf.Tensor) -> tf.Tensor:
            slow = tf.reduce_sum(tf.linalg.matmul(tf.linalg.matmul(big, big), big))
            with tf.control_dependencies([slow]):
                read = read_one.read_value()  # before the update below: must see 10.0
            gradients = [read * x + 0.0 * slow, x * 3.0]  # the second does not use the read
            if fixed:
                share = after_all(gradients, tf.ones_like(x))
                gradients = [g * share for g in gradients]
            first, second = tf.identity_n(gradients)  # as all_reduce bundles them
            other.assign_sub(first)
            read_one.assign_sub(second)
            return read

        seen = 0
        for _ in range(RUNS):
            other.assign(0.0)
            read_one.assign(10.0)
            seen += float(step(tf.constant(1.0))) != 10.0
        return seen


def test_plain_tensorflow_still_lets_the_update_run_before_the_read() -> None:
    """Upstream: when this fails, Grappler orders them again and the workaround can go."""
    assert _reads_of_the_updated_value(fixed=False) > 0


def test_every_update_after_every_gradient_keeps_the_read_first() -> None:
    assert _reads_of_the_updated_value(fixed=True) == 0
