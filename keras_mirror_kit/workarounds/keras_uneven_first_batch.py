"""Evaluation and prediction on batches that do not split evenly over the replicas.

Upstream: keras-team/keras#19246 (open against Keras 3.15). Before each `fit` and `evaluate`,
Keras 3's TensorFlow trainer learns the data's shapes for its symbolic build from
`strategy.reduce("MEAN", first_batch, axis=None)`, an element-wise mean of the replicas'
parts of the first batch. When that batch does not split evenly (a validation set of 29
samples in one batch of 32 on 2 replicas: parts of 15 and 14 rows; one sample on two
replicas: 1 and 0), the mean fails after the epoch's work: `InvalidArgumentError: Inputs to
operation AddN of type AddN must have the same size and shape`. Everything else in Keras'
loops takes uneven and empty per-replica batches (tf.distribute splits a partial batch,
and the loss tracker and metrics weigh each part by its real size), so evaluation and
prediction on any number of samples give exactly what one replica gives
(`tests/test_uneven_evaluation.py`).

The fix, on each model the kit builds (its class and other models are untouched): build
from the first local replica's part of the batch, whose shapes (but for the batch size,
which the build does not depend on) are those of every part; no collective is issued.
`keras_multi_worker_fit` fixes the same call for models under a multi-worker strategy that
the kit did not build, with the same function (`first_local_part`).

The same call takes that first batch from `fit`'s own epoch iterator and then resets it,
which loses or reorders batches of data that cannot be iterated again (no upstream report
was found): a Python generator's batches prefetched by the build are gone at the reset (an
epoch trains 0, 1, 1, 2 | 3, 0, 1, 2), and a `PyDataset` with `workers > 1` serves the
batch left over from the build first (every epoch 3, 0, 1, 2). Keras without a strategy
builds nothing from a batch, so plain Keras trains them in order. The fix takes a batch
only from data that `fit` iterates anew each epoch anyway (arrays, a `tf.data.Dataset`);
for a generator, a `PyDataset` and any other data it builds from the element spec of the
distributed dataset (the shapes and dtypes, which is all the build uses), consuming
nothing. `tests/test_ecosystem_inputs.py::
test_plain_keras_still_loses_batches_of_a_generator_under_a_strategy` shows the upstream
behaviour.

The distributed iterator that first batch came from is kept until the next build (no
upstream report found): Keras' reset right after the build destroyed it while its prefetch
was in flight, and TensorFlow's destructor crashed the process, rarely (a segfault in
`EpochIterator.reset` in 2 of 15 fresh-clone CI runs, both in own-step tests).
"""

from __future__ import annotations

import functools
import inspect
import re
import weakref
from typing import Any

import tensorflow as tf

from keras_mirror_kit.upstream import keras_private, tensorflow_private, versions
from keras_mirror_kit.workarounds import KerasPatch, keras_version_in

__all__ = [
    "TESTED_KERAS",
    "UPSTREAM",
    "apply",
    "bug_in_source",
    "first_local_part",
    "is_applied",
    "replays",
    "require",
    "spec_batch",
    "status",
]

UPSTREAM = "keras-team/keras#19246"
#: Keras versions the workaround was tested on: `low <= version < high`.
TESTED_KERAS = versions.TESTED_KERAS
# The failing call, as it reads in Keras' `_maybe_symbolic_build`.
SYMBOLIC_BUILD_BUG = re.compile(r"distribute_strategy\.reduce\(")

_APPLIED: weakref.WeakSet[Any] = weakref.WeakSet()  # models `apply` fixed


def _target() -> str | None:
    """None when Keras' `_maybe_symbolic_build(iterator, data_batch)` is what `apply` wraps."""
    build = keras_private.tensorflow_trainer()._maybe_symbolic_build  # noqa: SLF001
    parameters = list(inspect.signature(build).parameters)
    if not {"iterator", "data_batch"} <= set(parameters):
        return f"_maybe_symbolic_build takes {parameters}"
    return None


def _bug() -> bool | None:
    """Whether Keras' build still reduces a batch or takes one from `fit`'s iterator."""
    try:
        source = inspect.getsource(keras_private.tensorflow_trainer()._maybe_symbolic_build)  # noqa: SLF001
    except (OSError, TypeError):
        return None
    return bool(SYMBOLIC_BUILD_BUG.search(source) or re.search(r"in iterator\b", source))


_PATCH = KerasPatch(
    TESTED_KERAS,
    name="keras_uneven_first_batch",
    feature=(
        "first batches that split unevenly over the replicas, and generators and PyDatasets "
        "whose first batch the build would take"
    ),
    instead=(
        "pass a tf.data.Dataset batched with drop_remainder=True "
        "(kmk.make_dataset(..., drop_remainder=True))"
    ),
    target=_target,
    bug=_bug,
)
# The distributed iterator the last build took its batch from. Keras resets `fit`'s epoch
# iterator right after the build, which destroyed that iterator while its prefetch was in
# flight: a segfault in TensorFlow's destructor, rarely (2 of 15 CI runs, in
# `EpochIterator.reset`). Kept here, it goes at the next build, long idle by then.
_SPENT: list[Any] = []


def bug_in_source(keras_trainer_class: Any = None) -> bool | None:
    """Whether Keras' `_maybe_symbolic_build` still reduces the batch (None: unreadable)."""
    try:
        if keras_trainer_class is None:
            keras_trainer_class = keras_private.tensorflow_trainer()
        source = inspect.getsource(keras_trainer_class._maybe_symbolic_build)
    except (ImportError, AttributeError, OSError, TypeError):
        return None
    return bool(SYMBOLIC_BUILD_BUG.search(source))


def first_local_part(batch: Any, strategy: tf.distribute.Strategy) -> Any:
    """`batch` with each distributed value replaced by its first local replica's part."""
    return tf.nest.map_structure(
        lambda v: (
            strategy.experimental_local_results(v)[0]
            if isinstance(v, tf.distribute.DistributedValues)
            else v
        ),
        batch,
    )


# The data adapters whose data `fit` iterates anew each epoch: taking a batch is harmless.
_REPLAYED_ADAPTERS = ("ArrayDataAdapter", "TFDatasetAdapter")


def replays(iterator: Any) -> bool:
    """Whether `fit`'s epoch iterator reads data that a peek cannot lose or reorder."""
    adapter = getattr(iterator, "data_adapter", None)
    return type(adapter).__name__ in _REPLAYED_ADAPTERS


def spec_batch(iterator: Any) -> Any:
    """The element spec of `fit`'s distributed dataset (the first replica's), or None."""
    dataset = getattr(iterator, "_distributed_dataset", None)
    spec = getattr(dataset, "element_spec", None)
    if spec is None:
        return None
    PerReplicaSpec = tensorflow_private.per_replica_spec()  # noqa: N806
    return tf.nest.map_structure(
        lambda s: s._value_specs[0] if isinstance(s, PerReplicaSpec) else s,  # noqa: SLF001
        spec,
        expand_composites=False,
    )


def is_applied(model: Any) -> bool:
    """Whether `apply(model)` replaced this model's `_maybe_symbolic_build`."""
    try:
        return model in _APPLIED
    except TypeError:
        return False


def apply(model: Any, before_build: Any = None, after_build: Any = None) -> bool:
    """Builds this model from the first replica's part of a first batch, or from the data's
    spec where a batch cannot be taken back (module docstring; idempotent).

    `before_build(model)` runs before Keras' build, `after_build(model, batch, iterator)`
    after it with the first batch as distributed over the replicas (None where none was
    taken) and `fit`'s epoch iterator (`keras_mirror_kit.own_steps`). Not applied where its
    canary retired it (Keras' build neither reduces nor takes a batch) or refused it (then
    `require` refuses generators and PyDatasets); True when the model has the fix.
    """
    if is_applied(model):
        return True
    if not _PATCH.apply(lambda: None):  # the patch is per model, below
        return False
    original = getattr(model, "_maybe_symbolic_build", None)
    if original is None:
        return False

    @functools.wraps(original)
    def maybe_symbolic_build(iterator: Any = None, data_batch: Any = None) -> Any:
        strategy = getattr(model, "_distribute_strategy", None)
        if before_build is not None:
            before_build(model)
        if iterator is None or strategy is None:
            return original(iterator=iterator, data_batch=data_batch)
        batch = None
        if replays(iterator):
            # As Keras does: the first batch of the first epoch.
            it = keras_private.first_step_iterator(iterator)
            if it is None:  # no step: Keras' own build, without a batch
                return original(iterator=None, data_batch=None)
            batch = next(it)
            _SPENT[:] = [it]  # destroyed at the next build, not at Keras' reset below
            data_batch = first_local_part(batch, strategy)
        else:
            data_batch = spec_batch(iterator)
            if data_batch is None:  # not Keras' TensorFlow epoch iterator: Keras' own way
                return original(iterator=iterator, data_batch=None)
        built = original(iterator=None, data_batch=data_batch)
        if after_build is not None:
            after_build(model, batch, iterator)
        return built

    object.__setattr__(model, "_maybe_symbolic_build", maybe_symbolic_build)
    _APPLIED.add(model)
    return True


def require(x: Any, method: str) -> None:
    """Refuses, before any step, data whose first batch the build would take (a generator,
    a `PyDataset`) where the canary refused this workaround on the installed Keras."""
    import keras

    if isinstance(x, keras.utils.PyDataset) or inspect.isgenerator(x):
        _PATCH.require(f"{method}() on a {type(x).__name__} on several replicas")


def status(keras_version: str | None = None) -> str:
    """`"tested"`, `"fixed-upstream"` or `"untested"` for this (or the given) Keras version."""
    if keras_version_in(TESTED_KERAS, keras_version):
        return "tested"
    return "fixed-upstream" if bug_in_source() is False else "untested"
