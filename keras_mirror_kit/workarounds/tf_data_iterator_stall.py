"""Works around `model.fit` stalling for seconds (up to a minute) at epoch ends and on return.

The symptom. With a `tf.distribute` strategy over two or more local devices, `model.fit`
often (about half of the epoch boundaries and fit returns on a 2-core host) sits idle: the
main thread waits in the destructor of the distributed input iterator
(`~MultiDeviceIterator` -> `RootDataset::Iterator::~Iterator` ->
`UnboundedThreadPool::LogicalThreadWrapper::~LogicalThreadWrapper`), the CPU idle, for up
to as long as the iterator had lived, at most about 60 s. `benchmarks/end_of_fit_stall.py`
measures it.

The cause (TensorFlow, not the input pipeline's work). Every `tf.data` iterator with
autotuning enabled starts a "model thread" (`tensorflow::data::model::Model::OptimizeLoop`)
that sleeps on a condition variable for its optimization period, a period that doubles
after each optimization up to 60 s. The iterator's destructor calls
`CancellationManager::StartCancel()`, whose callback wakes that thread, and then joins it.
But `StartCancel` marks the manager cancelled (`IsCancelled()`) only after its callbacks
have run, while `OptimizeLoop` re-checks `IsCancelled()` as soon as it wakes: when the
woken thread wins that race, it sees "not cancelled" and goes back to sleep for the rest of
its period, and the destructor's join waits that long. A lost wake-up in
`tensorflow/core/framework/model.cc` (`Model::OptimizeLoop`) against
`tsl::CancellationManager::StartCancelWithStatus`; observed with TensorFlow 2.21.0.
No upstream TensorFlow or Keras issue describing it was found (searched for the
`MultiDeviceIterator` destructor hang, `OptimizeLoop` cancellation and slow `fit` returns
under `MirroredStrategy`), so none is named here; the closest Keras change is
keras-team/keras#20396, which makes Keras 3's `EpochIterator` create the next epoch's
iterator at the end of each epoch (so the finished one is destroyed on the main thread at
the next epoch's first step, and the last two when `fit` returns).

Keras makes it frequent: `fit` builds a new distributed iterator every epoch (and one more
for its symbolic build), and each holds several autotuned pipelines: the dataset given to
`fit` (the host side of the `MultiDeviceIterator`) and one small per-device pipeline per
replica that TensorFlow creates itself (`multi_device_iterator_ops._create_device_dataset`:
a generator and `prefetch(1)`, default options, so autotuned, with nothing to tune).

The workaround: no autotuning model thread in the iterators of the kit's path, so nothing
can miss its wake-up.

* `kmk.make_dataset` turns autotuning off in its options (its parallel map and prefetch run
  with TensorFlow's fixed defaults, as fast here as autotuned).
* `per_device_autotune_disabled()` makes the per-device pipelines that TensorFlow builds
  inside the block carry `options.autotune.enabled = False` (a wrapper around the private
  `_create_device_dataset`, installed once; outside the block it calls the original).
  `apply(model)` runs the model's `fit`, `evaluate` and `predict` inside that block.
* For a dataset of your own, `without_autotune(dataset)` turns its autotuning off too.

If this TensorFlow has no `_create_device_dataset`, the block does nothing and one warning
is logged. Remove this module when the upstream loop re-checks cancellation correctly.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import tensorflow as tf

from keras_mirror_kit.upstream import tensorflow_private
from keras_mirror_kit.workarounds import ThreadBlock

__all__ = [
    "PATCHED_METHODS",
    "apply",
    "is_applied",
    "per_device_autotune_disabled",
    "without_autotune",
]

logger = logging.getLogger("keras_mirror_kit")

#: The model methods `apply` runs inside `per_device_autotune_disabled()`.
PATCHED_METHODS = ("fit", "evaluate", "predict")

_APPLIED: weakref.WeakSet[Any] = weakref.WeakSet()  # models `apply` wrapped
_TARGET_MODULE = tensorflow_private.MULTI_DEVICE_ITERATOR_MODULE
_TARGET_NAME = "_create_device_dataset"


M = TypeVar("M")


def without_autotune(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """`dataset` with tf.data autotuning off, so no autotuning model thread can stall its iterator.

    `AUTOTUNE` parallelism and buffer sizes then take TensorFlow's fixed defaults. For a
    dataset of your own: `model.fit(without_autotune(my_dataset), epochs=10)`.
    """
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def _install() -> bool:
    """Wraps TensorFlow's per-device dataset builder (once, by `_BLOCK`); False when it is
    not there."""

    try:
        module = tensorflow_private.import_module(_TARGET_MODULE)
        original = getattr(module, _TARGET_NAME)
    except (ImportError, AttributeError):
        logger.warning(
            "keras-mirror-kit: this TensorFlow (%s) has no %s.%s, so the per-device input "
            "pipelines keep autotuning and model.fit may stall at epoch ends "
            "(see keras_mirror_kit.workarounds.tf_data_iterator_stall).",
            tf.__version__,
            _TARGET_MODULE,
            _TARGET_NAME,
        )
        return False

    @functools.wraps(original)
    def create_device_dataset(*args: Any, **kwargs: Any) -> Any:
        dataset = original(*args, **kwargs)
        if _BLOCK.active():  # this thread is inside a block
            dataset = without_autotune(dataset)
        return dataset

    setattr(module, _TARGET_NAME, create_device_dataset)
    return True


_BLOCK = ThreadBlock(_install)  # the pipelines built inside `per_device_autotune_disabled()`


@contextmanager
def per_device_autotune_disabled() -> Iterator[None]:
    """Inside the block, TensorFlow's per-replica input pipelines are built without autotuning.

    Covers the pipelines `tf.distribute` builds for each replica when a distributed iterator is
    created (by `fit`, `evaluate`, `predict`, or `iter()` on a distributed dataset) in this
    thread. Re-entrant, and per thread: pipelines built outside any such block, including those
    another thread builds while this one is inside, are untouched.
    """
    with _BLOCK.block():
        yield


def is_applied(model: Any) -> bool:
    """Whether `apply(model)` has wrapped this model's methods."""
    try:
        return model in _APPLIED
    except TypeError:  # not weak-referenceable
        return False


def _wrap(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def run_without_per_device_autotune(*args: Any, **kwargs: Any) -> Any:
        with per_device_autotune_disabled():
            return method(*args, **kwargs)

    return run_without_per_device_autotune


def apply(model: M) -> M:
    """Wraps the model's `fit`, `evaluate` and `predict` to run inside the block; returns it.

    Wrapped on this instance only (as `distributed()` wraps `compile`), so other models and the
    class are untouched; applying twice is a no-op.
    """
    if is_applied(model):
        return model
    for name in PATCHED_METHODS:
        method = getattr(model, name, None)
        if callable(method):
            object.__setattr__(model, name, _wrap(method))
    _APPLIED.add(model)
    return model
