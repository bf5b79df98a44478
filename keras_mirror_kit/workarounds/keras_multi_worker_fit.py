"""Makes Keras 3's `model.fit` work under a multi-worker `MultiWorkerMirroredStrategy`.

Upstream issues: keras-team/keras#20585 and tensorflow/tensorflow#72388 (both open when
this was written, against Keras 3.15 and TensorFlow 2.21). With more than one worker,
Keras 3's TensorFlow trainer fails in two places:

1. `TensorFlowTrainer._maybe_symbolic_build` reduces the first data batch with
   `strategy.reduce("MEAN", batch, axis=None)` only to learn its shapes. Under
   `MultiWorkerMirroredStrategy` the batch is a `PerReplica` (one per local device), which
   the collective reduction cannot take inside a structure: `ValueError: Attempt to convert
   a value (PerReplica:{...}) ... to a Tensor`, before the first step.
2. `reduce_per_replica(..., reduction="auto")`, which turns each step's logs (loss and
   metrics) into single values, calls `strategy.reduce("MEAN", v, axis=0)` on scalars,
   which fails. With one device per worker `strategy.run` returns plain tensors, not
   `PerReplica` values; they hold this worker's figures only, and must be all-reduced
   too, or every worker logs a different loss.

The fixes: (1) build from the first local replica's batch (its shapes are those of every
replica; no collective is issued, exactly as a `MirroredStrategy` build sees them), and
(2) average each log value over all replicas of all workers with
`strategy.reduce("MEAN", v, axis=None)` (a collective all-reduce, also for plain tensors),
which is what `reduce_per_replica` does for local replicas under `MirroredStrategy`.
Gradients and variable updates are untouched: they were already right.

Why this mechanism: the two behaviours live in a method of Keras' `TensorFlowTrainer` class
and in a module-level function that the trainer looks up in its own module's globals each
time it builds a train, test or predict function. Patching a model instance cannot reach
the module function, and copying Keras' `_make_function` (120 lines) into this kit would
silently fork Keras. So both are wrapped in place, and each wrapper first checks the model's
strategy: unless it is a `MultiWorkerMirroredStrategy` with more than one worker (the only
case where the original raises), the wrapper calls the original with the same arguments and
returns its result. Single-host training therefore runs exactly Keras' own code. The
wrappers are installed only when `create_strategy` builds a multi-worker strategy (never
on import), at most once per process (`apply` is idempotent), and only on the Keras
versions this was tested on (`TESTED_KERAS`). For any other strategy Keras' private modules
are not even looked at; if they lack what is wrapped, a `KerasWorkaroundWarning` says so and
nothing is installed. On another version, if the source of Keras no
longer contains the two failing calls the fix is taken to be upstream and nothing is done;
otherwise a `KerasWorkaroundWarning` says so and the wrappers are installed. Setting
`KMK_KERAS_WORKAROUND=off` disables them (`on` installs them on any version without the
warning). The test suite runs two workers without the wrappers and expects the upstream
failure, so a Keras release that fixes it is noticed.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import re
import threading
import warnings
from typing import Any

import keras
import tensorflow as tf

from keras_mirror_kit.upstream import keras_private, versions
from keras_mirror_kit.workarounds import keras_version_in
from keras_mirror_kit.workarounds.keras_uneven_first_batch import (
    SYMBOLIC_BUILD_BUG,
    first_local_part,
)

__all__ = [
    "ENV_VAR",
    "TESTED_KERAS",
    "UPSTREAM_ISSUES",
    "KerasWorkaroundWarning",
    "apply",
    "is_applied",
    "is_multi_worker",
    "keras_version_in",
    "mode",
    "status",
]

logger = logging.getLogger("keras_mirror_kit")

UPSTREAM_ISSUES = ("keras-team/keras#20585", "tensorflow/tensorflow#72388")
#: Keras versions the workaround was tested on: `low <= version < high`.
TESTED_KERAS = versions.TESTED_KERAS
ENV_VAR = "KMK_KERAS_WORKAROUND"
_MODES = ("auto", "on", "off")
_INSTALLED: list[Any] = []  # the two replacements `_install` set, while they are set

# The two calls that fail under a multi-worker strategy, as they read in Keras' source.
_SYMBOLIC_BUILD_BUG = SYMBOLIC_BUILD_BUG
_REDUCE_PER_REPLICA_BUG = re.compile(r"strategy\.reduce\(\s*[\"']MEAN[\"']\s*,\s*v\s*,\s*axis=0")

_lock = threading.Lock()
_originals: dict[str, Any] = {}


class KerasWorkaroundWarning(UserWarning):
    """The multi-worker `model.fit` workaround runs on a Keras version it was not tested on."""


def _trainer_module() -> Any:
    return keras_private.tensorflow_trainer_module()


def is_multi_worker(strategy: Any) -> bool:
    """Whether `strategy` is a `MultiWorkerMirroredStrategy` spanning more than one worker."""
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return False
    in_multi_worker_mode = getattr(strategy.extended, "_in_multi_worker_mode", None)
    return bool(in_multi_worker_mode()) if callable(in_multi_worker_mode) else False


def mode() -> str:
    """`KMK_KERAS_WORKAROUND`, lower-cased: `auto` (default), `on` or `off` (else `ValueError`)."""
    raw = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if raw not in _MODES:
        raise ValueError(
            f"The environment variable {ENV_VAR} must be one of {', '.join(_MODES)}. "
            f"Received: {ENV_VAR}={raw!r}"
        )
    return raw


def _source(obj: Any) -> str | None:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return None


def _bugs_present() -> bool | None:
    """True if Keras' source still has a failing call, False if neither, None if unknown."""
    trainer = _trainer_module()
    build = _source(_original("_maybe_symbolic_build", trainer))
    reduce = _source(_original("reduce_per_replica", trainer))
    if build is None or reduce is None:
        return None
    return bool(_SYMBOLIC_BUILD_BUG.search(build) or _REDUCE_PER_REPLICA_BUG.search(reduce))


def _original(name: str, trainer: Any) -> Any:
    if name in _originals:
        return _originals[name]
    if name == "_maybe_symbolic_build":
        return keras_private.tensorflow_trainer()._maybe_symbolic_build
    return getattr(trainer, name)


def status(keras_version: str | None = None) -> str:
    """`"tested"`, `"fixed-upstream"` or `"untested"`: whether this Keras needs the workaround.

    Outside `TESTED_KERAS`, `"fixed-upstream"` when Keras' source no longer has the failing
    calls, `"untested"` when it still has them or cannot be read.
    """
    if keras_version_in(TESTED_KERAS, keras_version):
        return "tested"
    return "fixed-upstream" if _bugs_present() is False else "untested"


def is_applied() -> bool:
    """Whether `apply` has installed the wrappers in this process."""
    try:
        trainer = _trainer_module()
        return (
            trainer.reduce_per_replica in _INSTALLED
            and keras_private.tensorflow_trainer()._maybe_symbolic_build in _INSTALLED
        )
    except (ImportError, AttributeError):
        return False


def apply(strategy: Any) -> bool:
    """Installs the wrappers if `strategy` needs them (idempotent); True if they are installed.

    Nothing is installed for a strategy that is not a multi-worker `MultiWorkerMirroredStrategy`,
    with `KMK_KERAS_WORKAROUND=off`, or when a Keras outside `TESTED_KERAS` is judged fixed
    upstream; one outside the range that still has the failing calls gets a
    `KerasWorkaroundWarning` and the wrappers. An invalid `KMK_KERAS_WORKAROUND` raises
    `ValueError`.
    """
    chosen = mode()
    if not is_multi_worker(strategy):
        return bool(_originals)  # Keras' private modules are not touched on this path
    if chosen == "off":
        logger.info(
            "keras-mirror-kit: %s=off, so Keras' model.fit runs unpatched under %s (it "
            "fails with more than one worker on Keras %s; see %s)",
            ENV_VAR,
            type(strategy).__name__,
            keras.__version__,
            " and ".join(UPSTREAM_ISSUES),
        )
        return is_applied()
    with _lock:
        try:
            if is_applied():
                return True
            state = status() if chosen == "auto" else "tested"
        except (ImportError, AttributeError) as err:
            return _unavailable(err)
        if state == "fixed-upstream":
            logger.info(
                "keras-mirror-kit: Keras %s no longer has the multi-worker fit bug (%s); "
                "the kit's workaround is not needed and was not installed",
                keras.__version__,
                " and ".join(UPSTREAM_ISSUES),
            )
            return False
        if state == "untested":
            low, high = (".".join(map(str, v)) for v in TESTED_KERAS)
            message = (
                f"keras-mirror-kit: Keras {keras.__version__} is outside the versions its "
                f"multi-worker model.fit workaround was tested on ({low} <= version < "
                f"{high}), and its source still contains the calls that fail under "
                f"MultiWorkerMirroredStrategy ({' and '.join(UPSTREAM_ISSUES)}). The "
                "workaround is installed anyway; check that every worker ends training "
                f"with the same weights, or set {ENV_VAR}=off to run Keras unpatched."
            )
            warnings.warn(message, KerasWorkaroundWarning, stacklevel=2)
            logger.warning(message)
        try:
            _install()
        except (ImportError, AttributeError) as err:
            return _unavailable(err)
    logger.info(
        "keras-mirror-kit: installed the multi-worker model.fit workaround for Keras %s (%s)",
        keras.__version__,
        " and ".join(UPSTREAM_ISSUES),
    )
    return True


def _unavailable(err: BaseException) -> bool:
    """Warns that this Keras lacks what the workaround wraps; returns False (not installed)."""
    message = (
        f"keras-mirror-kit: this Keras ({keras.__version__}) has no "
        "TensorFlow trainer's _maybe_symbolic_build or "
        f"reduce_per_replica ({err}), so the multi-worker model.fit workaround "
        f"({' and '.join(UPSTREAM_ISSUES)}) was not installed; if fit fails with more than "
        "one worker, use a Keras version in TESTED_KERAS"
    )
    warnings.warn(message, KerasWorkaroundWarning, stacklevel=3)
    logger.warning(message)
    return False


def _install() -> None:
    trainer = _trainer_module()
    original_build = keras_private.tensorflow_trainer()._maybe_symbolic_build
    original_reduce = trainer.reduce_per_replica
    _originals.setdefault("_maybe_symbolic_build", original_build)
    _originals.setdefault("reduce_per_replica", original_reduce)

    @functools.wraps(original_build)
    def _maybe_symbolic_build(self: Any, iterator: Any = None, data_batch: Any = None) -> Any:
        strategy = getattr(self, "_distribute_strategy", None)
        if iterator is None or not is_multi_worker(strategy):
            return original_build(self, iterator=iterator, data_batch=data_batch)
        # As Keras does: the first batch of the first epoch's iterator. Then build from the
        # first local replica's part instead of a collective "mean" of the batch.
        it = keras_private.first_step_iterator(iterator)
        if it is not None:  # no step: Keras' own build, without a batch
            data_batch = first_local_part(next(it), strategy)
        return original_build(self, iterator=None, data_batch=data_batch)

    @functools.wraps(original_reduce)
    def reduce_per_replica(values: Any, strategy: Any, reduction: str) -> Any:
        if reduction not in ("auto", "mean") or not is_multi_worker(strategy):
            return original_reduce(values, strategy, reduction)

        def mean_over_all_replicas(value: Any) -> Any:
            if isinstance(value, (tf.Tensor, tf.Variable, tf.distribute.DistributedValues)):
                return strategy.reduce("MEAN", value, axis=None)
            return value

        return tf.nest.map_structure(mean_over_all_replicas, values)

    _INSTALLED[:] = [_maybe_symbolic_build, reduce_per_replica]
    keras_private.tensorflow_trainer()._maybe_symbolic_build = _maybe_symbolic_build
    trainer.reduce_per_replica = reduce_per_replica


def _uninstall() -> None:
    """Restores Keras' own functions (for tests)."""
    with _lock:
        trainer = _trainer_module()
        if "_maybe_symbolic_build" in _originals:
            keras_private.tensorflow_trainer()._maybe_symbolic_build = _originals.pop(
                "_maybe_symbolic_build"
            )
        if "reduce_per_replica" in _originals:
            trainer.reduce_per_replica = _originals.pop("reduce_per_replica")
