"""A variable's update runs before a read of it that comes first in the program.

No upstream report was found (TensorFlow 2.21's Grappler, `dependency_optimizer.cc`).
Inside a `tf.function`, automatic control dependencies order each read of a variable
before a later update of it. Grappler's dependency optimizer drops such an edge when
another path joins the read to the update (`TransitiveReduction`), and a path through an
`IdentityN` that bundles several gradients counts: `ReplicaContext.all_reduce` (a custom
gradient) puts one over every gradient an optimizer applies. The same pass then bypasses
that `IdentityN` (`OptimizeDependencies`: the consumer of output `i` is wired to input `i`
only), and the other path is gone: the read and the update are no longer ordered, and in
some runs the read sees the updated value.

Seen in an own `train_step` on 2 replicas (keras-io's WGAN-GP: the critic's second step
reads its kernel in the backward pass while that step's update of the same kernel is
already running): other weights from run to run, with SGD in 6 runs of 8 (up to 1e-2), with
Adam rarely. `tests/test_tf_grappler_update_order.py` has a plain TensorFlow reproducer
(no Keras, no strategy; 20 of 20 runs read the later value).

The fix (`after_all`), where the kit weighs each replica's gradients of one optimizer
application (`own_steps.optimizers`): the replica's share is computed after every gradient
of the application, so that each weighted gradient, hence each update, depends on all of
them; Grappler keeps a control dependency when it bypasses an `Identity`. Remove when the
reproducer's canary fails
(`test_plain_tensorflow_still_lets_the_update_run_before_the_read`).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

__all__ = ["after_all"]


def after_all(gradients: list[Any], value: tf.Tensor) -> tf.Tensor:
    """`value`, computed after every one of `gradients` (module docstring).

    Args:
        gradients: The gradients of one optimizer application (tensors, `IndexedSlices`
            or None).
        value: What every gradient is then multiplied by (the replica's share).

    Returns:
        `value` itself when there is no gradient, else an identity of it that runs after
        all of them.

    Example:

    ```python
    share = after_all(grads, step.share)
    grads = [g * share for g in grads]
    ```
    """
    tensors = [g.values if isinstance(g, tf.IndexedSlices) else g for g in gradients]
    tensors = [t for t in tensors if t is not None]
    if not tensors:
        return value
    with tf.control_dependencies(tensors):
        return tf.identity(value)
