"""Workarounds for upstream bugs, one module per bug, each named for what it works around.

Each module names its upstream issue (or says that none was found), is applied only to
what the kit builds (plain Keras models and Keras' classes are untouched), decides by a
canary where it patches Keras (`KerasPatch`: applied, retired where upstream fixed the bug,
or refused with its feature before any step; the private symbols it patches are resolved in
`keras_mirror_kit.upstream`), and has the test or benchmark below that shows whether the bug
is still there, so it can be removed when upstream fixes it.

* `keras_multi_worker_fit`: Keras' `model.fit` fails under `MultiWorkerMirroredStrategy`
  (first-batch build, per-replica log reduction). Upstream: keras-team/keras#20585,
  tensorflow/tensorflow#72388. Remove when Keras' source no longer has the failing calls
  (`tests/test_multi_worker.py::test_workaround_version_guard`).
* `keras_uneven_first_batch`: `fit` and `evaluate` fail when the first batch does not
  split evenly over the replicas (a small validation set, one sample on two replicas):
  the symbolic build averages the replicas' parts. Upstream: keras-team/keras#19246. The
  same build takes that batch from data that cannot give it back (a generator, a
  `PyDataset`): batches lost or reordered (no upstream report found); the kit builds from
  the element spec there. Remove when
  `tests/test_uneven_evaluation.py::test_plain_keras_still_fails_on_an_uneven_first_batch`
  and `tests/test_ecosystem_inputs.py::
  test_plain_keras_still_loses_batches_of_a_generator_under_a_strategy` fail.
* `tf_generator_buffers`: on several replicas TensorFlow writes into the NumPy arrays a
  generator or a `PyDataset` yields (shared through `from_generator`): repeated batches
  train on overwritten labels, a `PyDataset`'s own arrays change. Each batch's arrays are
  copied as they are yielded. No upstream report found (related:
  tensorflow/tensorflow#45964). Remove when `tests/test_ecosystem_inputs.py::
  test_plain_keras_still_overwrites_a_generators_arrays_on_two_replicas` fails.
* `tf_grappler_update_order`: Grappler's dependency optimizer lets a variable's update run
  before a read of it that comes first (when an `IdentityN`, such as `all_reduce`'s, joined
  them): an own `train_step` (keras-io's WGAN-GP) trained other weights from run to run on
  2 replicas. Each update of an own step's optimizer is ordered after every gradient of its
  application. No upstream report found. Remove when `tests/
  test_tf_grappler_update_order.py::test_plain_tensorflow_still_lets_the_update_run_before_the_read`
  fails.
* `keras_replica_shares`: a batch that tf.distribute splits unevenly (13 samples: 7/6)
  trains other weights than one device, since each replica's mean loss is divided by the
  number of replicas; and a replica with no rows computes on an empty batch (a wrong shape
  from oneDNN's CPU Conv2D). Each replica's loss is weighted by its share; evaluation and
  prediction never compute on an empty part. Upstream: the scaling of keras-team/keras#20609.
  Remove when `tests/test_uneven_training.py::test_plain_keras_still_weighs_parts_unequally`
  fails and `probe_empty_conv()` is False.
* `keras_jit_replicas`: `jit_compile=True` fails at the first step with several replicas
  in one process; refused at `compile()`. Upstream: keras-team/keras#19005. Remove when
  `tests/test_jit_compile.py::test_plain_keras_jit_still_fails_on_two_replicas` fails.
* `keras_loss_scale`: float16 loss scaling decides overflow from replica 0 alone. Upstream:
  the code of keras-team/keras#18691. Remove when
  `tests/test_loss_scale.py::test_plain_keras_still_trusts_replica_0` fails.
* `keras_grad_accumulation`: gradient accumulation fails under a strategy (`merge_call` in
  `ops.cond`) and keeps per-replica accumulators. Upstream: keras-team/keras#20582. Remove
  when `tests/test_gradient_accumulation.py::
  test_plain_keras_accumulation_still_fails_under_mirrored_strategy` fails.
* `keras_gradient_clipping`: `clipnorm`, `global_clipnorm` and `clipvalue` clip each
  replica's gradient before the all-reduce (up to N times the threshold). Upstream:
  tensorflow/tensorflow#33929 (tf.keras 2 refused it). Remove when
  `tests/test_optimizer_options.py::test_plain_keras_still_clips_each_replica` fails.
* `keras_ema_overwrite`: `use_ema=True` with `ema_overwrite_frequency` fails under any
  strategy (`merge_call` in `ops.cond`). No upstream report found. Remove when
  `tests/test_optimizer_options.py::
  test_plain_keras_ema_overwrite_still_fails_under_a_strategy` fails.
* `keras_own_step_losses`: a `train_step` a model writes itself gets Keras' 1/N loss
  scaling only for the losses that go through Keras (`Loss` objects, `compute_loss`), so a
  loss written as `ops.mean` trains with N times one device's gradient and the others are
  logged divided. Inside the kit's own steps (`keras_mirror_kit.own_steps`) every loss is
  one device's. Upstream: the scaling of keras-team/keras#20609. Remove when
  `tests/test_own_train_steps.py::test_plain_keras_still_scales_losses_per_replica` fails.
* `keras_pydataset_epochs`: a `PyDataset` with workers, under a strategy over several
  devices, can train an epoch on another order than plain Keras (the previous epoch's
  generator stops the new epoch's enqueuer). No upstream report found. When
  `tests/test_ecosystem_inputs.py::
  test_plain_keras_still_lets_a_stale_generator_stop_the_next_epochs_enqueuer` fails,
  remove that part only: the same patches read a `PyDataset` in the order of its cursor
  (`data.py_dataset_cursor`: mid-epoch resume), which is a feature, not a workaround.
* `keras_activity_regularizer_sum`: before Keras 3.14 a layer's activity regularizer is a
  sum over the batch, which on several replicas is not one device's penalty: refused there
  before any step. No upstream report found (Keras 3.14 divides it by the batch size).
  Remove when the oldest supported Keras is 3.14.
* `keras_step_fetch`: Keras 3.16 reads a one-step execution's batch outside the compiled
  step, which is then traced from the batches that came first (a resumed run rounds
  otherwise; per-output losses weighed by a batch size known in one trace only): on kit
  models it reads inside a compiled function again. No upstream report found. Retires
  itself where `_make_function` has no eager fetch (Keras 3.15 and older).
* `keras_epoch_rounding`: epochs and evaluations rounded up to a multiple of
  `steps_per_execution`. No upstream report found (see the module). Remove when Keras
  truncates the last execution as `compile()` documents.
* `tf_data_iterator_stall`: `fit` stalls at epoch ends on a lost wake-up of `tf.data`'s
  autotuning thread (TensorFlow, not Keras). No upstream report found (see the module).
  Remove when `benchmarks/end_of_fit_stall.py` shows no stall with autotuning on.
* `tf_data_function_instantiation`: every new iterator (one per epoch in `fit`) runs
  Grappler and the MLIR passes again on every function of its pipeline, which TensorFlow
  instantiates as multi-device ones: the kit's own functions are built single-device. No
  upstream report found (see the module). Remove when `tests/
  test_tf_data_function_instantiation.py::test_plain_tf_data_functions_are_still_multi_device`
  fails.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from keras_mirror_kit.upstream import versions
from keras_mirror_kit.upstream.versions import keras_version_in, parse_version, version_in

logger = logging.getLogger("keras_mirror_kit")

__all__ = [
    "KerasPatch",
    "Owned",
    "ThreadBlock",
    "Verdict",
    "inner_optimizer",
    "even_rows",
    "keras_version_in",
    "parse_version",
    "rows_of",
    "tf_optimizer_class",
    "version_in",
]


class Verdict(NamedTuple):
    """What a workaround's canary decided on the installed Keras.

    `state` is `"applied"` (its bug is there and what it patches has the shape it expects),
    `"retired"` (the bug is fixed upstream: Keras' own code runs) or `"refused"` (it cannot
    tell, or what it patches changed: the feature it protects is refused before any step);
    `reason` says what the canary saw.
    """

    state: str
    reason: str


class KerasPatch:
    """A workaround's patches of Keras, applied once after its canary, never skipped silently.

    `apply(patch)` decides once (thread-safe) from the canary: `target()` returns None when
    what the module patches has the shape it expects (else what differs), `bug()` returns
    whether Keras still has the bug (None: cannot tell). On a Keras inside `tested`, or
    wherever the canary sees the bug and the expected shape, `patch` runs ("applied"); where
    the bug is fixed upstream the workaround retires itself, said once at INFO ("retired");
    otherwise nothing is patched and `require` refuses the protected feature, said once at
    WARNING ("refused").

    Args:
        tested: The module's `TESTED_KERAS`, `(low, high)`: `low <= version < high`.
        name: The workaround module's short name, for messages.
        feature: What it protects, for messages ("generators and PyDatasets on several
            replicas").
        instead: What the user can write instead when it is refused.
        target: Returns None when the patch target has the expected shape, else a text.
        bug: Returns whether the bug is still in Keras (None: cannot tell).

    Example:

    ```python
    _PATCH = KerasPatch(TESTED_KERAS, name="tf_generator_buffers", feature="generators",
                        instead="pass a tf.data.Dataset", target=_target, bug=_bug)

    def install() -> bool:
        return _PATCH.apply(_patch)  # _patch() replaces what it wraps in Keras

    _PATCH.require("fit() on a generator")  # ValueError where refused
    ```
    """

    def __init__(
        self,
        tested: tuple[tuple[int, int, int], tuple[int, int, int]],
        *,
        name: str = "workaround",
        feature: str = "this feature",
        instead: str = "use a Keras version the kit was tested on",
        target: Callable[[], str | None] | None = None,
        bug: Callable[[], bool | None] | None = None,
    ) -> None:
        self.tested = tested
        self.name, self.feature, self.instead = name, feature, instead
        self._target, self._bug = target, bug
        self._lock = threading.Lock()
        self._verdict: Verdict | None = None
        self._keras: str | None = None
        self._patched = self._said = False

    def _decide(self, version: str) -> Verdict:
        """The canary's verdict for Keras `version` (nothing patched)."""
        try:
            differs = self._target() if self._target is not None else None
        except (ImportError, AttributeError, TypeError, ValueError) as err:
            differs = str(err)
        try:
            present = self._bug() if self._bug is not None else True
        except (ImportError, AttributeError, TypeError, ValueError, OSError):
            present = None
        if present is False:
            return Verdict("retired", f"the bug is not in Keras {version}")
        if differs:
            return Verdict("refused", f"what it patches changed on Keras {version}: {differs}")
        if present is True or keras_version_in(self.tested, version):
            return Verdict("applied", "bug present, patch target as expected")
        return Verdict("refused", f"it cannot tell whether Keras {version} still has the bug")

    def verdict(self) -> Verdict:
        """The canary's verdict on the installed Keras (decided once, without patching)."""
        version = versions.keras_version()
        with self._lock:
            if self._verdict is None or self._keras != version:
                self._verdict, self._keras = self._decide(version), version
            return self._verdict

    def apply(self, patch: Callable[[], None]) -> bool:
        """Runs `patch` once where the canary says so.

        Args:
            patch: Applies the module's patches (called at most once).

        Returns:
            Whether the patches are in place (False: retired or refused, logged once).

        Raises:
            Exception: What `patch` raised (it runs again at the next call).
        """
        verdict = self.verdict()
        with self._lock:
            if self._patched:
                return True
            if verdict.state == "applied":
                patch()
                self._patched = True
                if not keras_version_in(self.tested):
                    logger.info(
                        "keras-mirror-kit: %s applied on Keras %s, outside the versions it "
                        "was tested on, after its self-check (%s)",
                        self.name,
                        self._keras,
                        verdict.reason,
                    )
                return True
            if not self._said:
                self._said = True
                if verdict.state == "retired":
                    logger.info(
                        "keras-mirror-kit: %s retires itself: %s",
                        self.name,
                        verdict.reason,
                    )
                else:
                    logger.warning(
                        "keras-mirror-kit: %s cannot protect %s (%s); the kit refuses it "
                        "before any step",
                        self.name,
                        self.feature,
                        verdict.reason,
                    )
            return False

    def require(self, what: str) -> None:
        """Refuses `what` (a use of the protected feature) where the workaround is refused.

        Args:
            what: The use, as the message's subject ("fit() on a Python generator").

        Raises:
            ValueError: When the canary refused the workaround on this Keras.
        """
        verdict = self.verdict()
        if verdict.state != "refused":
            return
        raise ValueError(
            f"keras-mirror-kit: {what} needs the kit's workaround {self.name} ({self.feature}), "
            f"which refuses this Keras: {verdict.reason}. The kit was tested on "
            f"{versions.TESTED_KERAS_TEXT}. Instead: {self.instead}. "
            f"Received: keras=={self._keras}"
        )


class ThreadBlock:
    """A patch of TensorFlow installed once, that acts only in threads inside its block.

    `install()` runs the first time a block is entered (thread-safe) and says whether the
    patch is in place; the patched code asks `active()` whether the thread that runs it is
    inside a block (blocks nest, per thread).

    Args:
        install: Installs the patch; returns False where it cannot (called at most once).

    Example:

    ```python
    _BLOCK = ThreadBlock(_install)  # _install() wraps a TensorFlow function once

    def wrapped(*args):
        return original(*args) if not _BLOCK.active() else changed(*args)

    with _BLOCK.block():
        dataset = build()
    ```
    """

    def __init__(self, install: Callable[[], bool]) -> None:
        self._install = install
        self._lock = threading.Lock()
        self._installed: bool | None = None
        self._local = threading.local()

    def installed(self) -> bool:
        """Installs the patch the first time; whether it is in place."""
        with self._lock:
            if self._installed is None:
                self._installed = bool(self._install())
            return self._installed

    def active(self) -> bool:
        """Whether the calling thread is inside a block."""
        return getattr(self._local, "depth", 0) > 0

    @contextlib.contextmanager
    def block(self) -> Iterator[None]:
        """Makes the patch act in this thread while the block runs (installed first)."""
        self.installed()
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1


class Owned:
    """The objects (datasets, generators) the kit's models read, held weakly.

    An object that cannot be weakly referenced is never in it (`in` says False).

    Example:

    ```python
    _OWNED = Owned()
    _OWNED.add(py_dataset)
    assert py_dataset in _OWNED
    ```
    """

    def __init__(self) -> None:
        self._objects: weakref.WeakSet[Any] = weakref.WeakSet()

    def add(self, thing: Any) -> None:
        """Marks `thing` as read by a kit-built model.

        Args:
            thing: A dataset or generator (weakly referable).

        Raises:
            TypeError: When `thing` cannot be weakly referenced.
        """
        self._objects.add(thing)

    def __contains__(self, thing: Any) -> bool:
        try:
            return thing in self._objects
        except TypeError:  # not weakly referable: never added
            return False


def inner_optimizer(optimizer: Any) -> Any:
    """The optimizer that does the work: a `LossScaleOptimizer`'s inner one, else itself."""
    import keras

    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer


def tf_optimizer_class() -> Any:
    """Keras' TensorFlow optimizer base class (`TFOptimizer`), whose source the canaries read."""
    from keras_mirror_kit.upstream import keras_private

    return keras_private.tf_optimizer()


def rows_of(structure: Any) -> Any:
    """The rows of the first tensor in `structure`: an int32 scalar tensor, constant when
    the trace knows them (1 without a tensor)."""
    import tensorflow as tf

    for leaf in tf.nest.flatten(structure):
        if leaf is not None and getattr(leaf, "shape", None) is not None:
            if not leaf.shape.rank:
                return tf.constant(1)
            static = leaf.shape[0]
            return tf.constant(static) if static is not None else tf.shape(leaf)[0]
    return tf.constant(1)


def even_rows(ctx: Any, rows: Any) -> int | None:
    """The rows every replica of `ctx` holds in the step being traced, when the trace shows
    them equal (`rows` from `rows_of`), else None. Under a one-host `MirroredStrategy`
    the replicas' static counts are compared while the step is traced (a merge call: no
    op at run time; tf.function traces a batch split 5/4 with those static shapes);
    elsewhere (several hosts) the answer is None."""
    import tensorflow as tf

    if not isinstance(getattr(ctx, "strategy", None), tf.distribute.MirroredStrategy):
        return None
    static = tf.get_static_value(rows)
    mine = -1 if static is None else int(static)
    every = set(ctx.merge_call(_local_values, args=(mine,)))
    return every.pop() if len(every) == 1 and mine >= 0 else None


def _local_values(strategy: Any, value: Any) -> tuple[Any, ...]:
    return tuple(strategy.experimental_local_results(value))
