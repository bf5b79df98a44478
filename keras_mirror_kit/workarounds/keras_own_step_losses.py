"""Inside a training step a model writes itself, every loss is what one device computes.

Upstream: the 1/num_replicas loss scaling of keras-team/keras#20609 (open against Keras
3.15). Under a `tf.distribute` strategy Keras divides the value of every `Loss` object, of
`compute_loss` and of the `add_loss` terms by the number of replicas
(Keras' `losses.loss.scale_loss_for_distribution`), and its TensorFlow optimizer sums the
replicas' gradients. Keras' own `train_step` relies on that pair. A `train_step` a model
writes itself gets the division only for the losses that go through Keras: a loss written
as `ops.mean(...)` (keras-io's VAE) is not divided, so N replicas apply N times one
device's gradient; and the losses that are divided are logged divided (the Keras guide's
`CustomModel` logs half its loss on 2 replicas). TensorFlow's `tf.nn.compute_average_loss`
divides by the replica count as well, and `tf.nn.scale_regularization_loss` too.

The kit gives such a step one rule instead (`keras_mirror_kit.own_steps`): the step
computes what one device computes on the replica's part of the batch, and the kit weighs
each replica's gradients by its share of the batch's rows before Keras sums them. For
that, inside `one_device_losses(share)` (in the calling thread: tf.distribute traces each
replica in a thread of its own):

* Keras' `scale_loss_for_distribution` and `unscale_loss_for_distribution` return their
  value unchanged: a `Loss` object, `compute_loss` and `add_loss` give the mean over the
  replica's part, as on one device;
* `tf.nn.compute_average_loss` without `global_batch_size` gives the mean over the
  replica's part; with `global_batch_size=G` it gives the replica's sum over `G` divided
  by the replica's share of the rows, so that the share-weighted sum over the replicas is
  one device's sum over `G`;
* `tf.nn.scale_regularization_loss` gives the sum, as on one device.

The patches are installed once (`install`), on first use, and do nothing outside the
context: other models, Keras' own steps and code outside a kit step are untouched. Remove
this module when Keras no longer scales losses per replica (the test
`tests/test_own_train_steps.py::test_plain_keras_still_scales_losses_per_replica` fails).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

from keras_mirror_kit.upstream import keras_private, versions
from keras_mirror_kit.workarounds import KerasPatch, keras_version_in

__all__ = [
    "TESTED_KERAS",
    "UPSTREAM",
    "install",
    "is_active",
    "one_device_losses",
    "require",
    "status",
]

UPSTREAM = "keras-team/keras#20609"
#: Keras versions the workaround was tested on: `low <= version < high`.
TESTED_KERAS = versions.TESTED_KERAS

# `share()` of the step being traced in this thread: `(rows, total)` float32 tensors.
_local = threading.local()
_SCALERS = ("scale_loss_for_distribution", "unscale_loss_for_distribution")


def _target() -> str | None:
    """None when Keras' `losses.loss` has the two scalers `_patch` wraps, else what differs."""
    module = keras_private.loss_module()
    missing = [name for name in _SCALERS if not callable(getattr(module, name, None))]
    return f"Keras' losses.loss has no {', '.join(missing)}" if missing else None


# The own-step rule (every loss one device's) is a feature as well as a workaround: the
# patches stay where Keras stops scaling per replica, so the canary checks their target.
_PATCH = KerasPatch(
    TESTED_KERAS,
    name="keras_own_step_losses",
    feature="models that write their own train_step, on several replicas",
    instead="train the model on one device (kmk.distributed(..., devices=['/gpu:0']))",
    target=_target,
)


def status(keras_version: str | None = None) -> str:
    """`"tested"` or `"refused"`: whether the kit trains own steps on several replicas here
    (the installed Keras by its canary; another version by the tested range)."""
    if keras_version is not None:
        return "tested" if keras_version_in(TESTED_KERAS, keras_version) else "refused"
    return "tested" if _PATCH.verdict().state == "applied" else "refused"


def _share() -> Callable[[], tuple[Any, Any]] | None:
    return getattr(_local, "share", None)


def is_active() -> bool:
    """Whether this thread is inside `one_device_losses` (a kit step being traced)."""
    return _share() is not None


@contextlib.contextmanager
def one_device_losses(share: Callable[[], tuple[Any, Any]]) -> Iterator[None]:
    """Within it, in this thread, losses are one device's (module docstring).

    `share()` returns the replica's rows and the batch's rows (float32 tensors); it is
    called only by a `tf.nn.compute_average_loss` given `global_batch_size`.
    """
    install()
    previous, _local.share = _share(), share
    try:
        yield
    finally:
        _local.share = previous


def _unscaled(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    @functools.wraps(original)
    def scale(value: Any) -> Any:
        return value if is_active() else original(value)

    return scale


def _compute_average_loss(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def compute_average_loss(
        per_example_loss: Any, sample_weight: Any = None, global_batch_size: Any = None
    ) -> Any:
        share = _share()
        if share is None:
            return original(per_example_loss, sample_weight, global_batch_size)
        import tensorflow as tf

        if global_batch_size is None:  # one device: the mean over its (here: this) part
            rows_here = tf.shape(tf.convert_to_tensor(per_example_loss))[0]
            return original(per_example_loss, sample_weight, rows_here)
        value = original(per_example_loss, sample_weight, global_batch_size)
        rows, total = share()
        return value * tf.cast(tf.math.divide_no_nan(total, rows), value.dtype)

    return compute_average_loss


def _scale_regularization_loss(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    @functools.wraps(original)
    def scale_regularization_loss(regularization_loss: Any) -> Any:
        if not is_active():
            return original(regularization_loss)
        import tensorflow as tf

        return tf.reduce_sum(regularization_loss)

    return scale_regularization_loss


def require(what: str) -> None:
    """`ValueError` for `what` where the canary refused the patches on this Keras."""
    _PATCH.require(what)


def install() -> bool:
    """Installs the patches once (idempotent); False where the canary refused them."""
    return _PATCH.apply(_patch)


def _patch() -> None:
    import tensorflow as tf

    loss_module = keras_private.loss_module()

    for name in ("scale_loss_for_distribution", "unscale_loss_for_distribution"):
        setattr(loss_module, name, _unscaled(getattr(loss_module, name)))
    tf.nn.compute_average_loss = _compute_average_loss(tf.nn.compute_average_loss)
    tf.nn.scale_regularization_loss = _scale_regularization_loss(tf.nn.scale_regularization_loss)
