"""Batches that split unevenly (or leave a replica empty) train and evaluate as on one replica.

Upstream: the 1/num_replicas loss scaling of keras-team/keras#20609 (Keras 3.8, open against
Keras 3.15; no report of the uneven case was found). Under a `tf.distribute` strategy each
replica's loss is the mean over its own part of the batch divided by the number of
replicas, and the parts' gradients are summed. That is the one-device loss only when the
parts are equal: tf.distribute splits a last batch of 13 samples 7/6 over 2 replicas, and
the 6 samples then weigh 7/6 as much as the 7 (weights 7.2e-4 from one device after an
epoch of 269 rows at a global batch of 64). And a part can be empty (1 sample on 2
replicas; 9 on 4 is split 3/3/3/0), where TensorFlow 2.21's oneDNN Conv2D on CPU returns
its input unchanged (`probe_empty_conv()`), so a BatchNormalization after it fails with
`Incompatible shapes`.

What the kit does, on each model it builds (its class and other models are untouched):

* **Training** (`train_step`, for models that keep Keras' own): one scalar all-reduce per
  step counts the batch's rows, and each replica's loss is weighted by its share of them
  (`N * rows / total`), so the summed gradients are those of the one-device mean. Each
  compiled loss is weighted by its own denominator: its rows, the valid entries of a
  Keras mask, or the summed `sample_weight` of a `"mean_with_sample_weight"` reduction; a
  `"sum"` reduction needs none. `add_loss` terms are weighted like the compiled loss (as
  means over the replica's part, Keras' convention); weight regularizers count once, as on
  one device. The loss tracker is given the one-device loss of the step, weighted by its
  rows, so `loss` in `logs` is the one-device figure. A model whose class overrides
  `compute_loss` has its result weighted by the rows share (taken as a mean over the
  replica's part). A training part with no rows is refused before any step where the data
  says so (`keras_mirror_kit.fit_inputs`), and fails with the kit's message otherwise.
* **Evaluation** (`test_step`): Keras' loss tracker and metrics already weigh each
  replica's part by its rows (exact for a loss that is a mean over rows; a masked or
  `"mean_with_sample_weight"` loss is weighted by rows here, as Keras does); a replica
  with no rows skips the step (its metrics are unchanged), so it never runs a layer on an
  empty batch. The per-output loss trackers of a model with several outputs
  (`val_cls_loss`, ...) are the exception: Keras weighs each update by the static batch
  size, None under a strategy, so every replica's part counts once whatever its rows; the
  kit weighs each by the replica's share of the batch's rows (one scalar all-reduce per
  step), so each step counts once, as on one device. A class that overrides
  `compute_metrics` keeps Keras' `test_step`.
* **Prediction** (`predict_step`): a replica with no rows predicts one row of zeros and
  returns none of it.

Models whose class overrides `train_step` (or `test_step`/`predict_step`) keep that step
as written; uneven training batches are then refused (`trains_exactly`). Remove this
module when `tests/test_uneven_training.py::test_plain_keras_still_weighs_parts_unequally`
fails (Keras weighs the parts itself) and `probe_empty_conv()` is False on every CPU.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import keras
import tensorflow as tf

from keras_mirror_kit.upstream import keras_private, versions
from keras_mirror_kit.workarounds import KerasPatch, even_rows, rows_of

__all__ = [
    "EMPTY_PART",
    "TESTED_KERAS",
    "UPSTREAM",
    "apply",
    "is_applied",
    "probe_empty_conv",
    "trains_exactly",
]

UPSTREAM = "keras-team/keras#20609"
EMPTY_PART = (
    "keras-mirror-kit: a replica received no samples of this training batch (its last "
    "batch is smaller than the replicas can share). Drop the last partial batch "
    "(Dataset.batch(..., drop_remainder=True), kmk.make_dataset(..., drop_remainder=True)) "
    "or pass steps_per_epoch."
)
#: Keras versions the workaround was tested on: `low <= version < high`.
TESTED_KERAS = versions.TESTED_KERAS
# The models `apply` ran on, and the steps it replaced on each.
_APPLIED: weakref.WeakKeyDictionary[Any, frozenset[str]] = weakref.WeakKeyDictionary()
_UNWEIGHTED = (None, "none", "sum")  # reductions whose per-replica values simply add up
# What the steps call on the model (Keras' trainer and `Model` internals).
_READ = (
    "train_step",
    "test_step",
    "predict_step",
    "compute_loss",
    "compute_metrics",
    "get_metrics_result",
    "_compute_loss",
    "_get_own_losses",
    "_aggregate_additional_loss",
    "_get_regularization_losses",
)


def _target() -> str | None:
    """None when Keras' trainer has what the replaced steps call, else what differs."""
    import inspect

    trainer = keras_private.tensorflow_trainer()
    missing = [name for name in _READ if not callable(getattr(keras.Model, name, None))]
    if missing:
        return f"keras.Model has no {', '.join(missing)}"
    if "_loss_tracker" not in inspect.getsource(trainer.train_step):
        return "the TensorFlow trainer's train_step no longer updates _loss_tracker"
    return None


def _bug() -> bool | None:
    """Whether Keras still divides each replica's loss by the number of replicas."""
    import inspect

    source = inspect.getsource(keras_private.loss_module().scale_loss_for_distribution)
    return "num_replicas" in source


# Retired (Keras weighs the parts itself) or refused, the model keeps Keras' steps and
# `trains_exactly` is False: a training batch that splits unevenly is refused before any
# step (`fit_inputs.check_training_split`).
_PATCH = KerasPatch(
    TESTED_KERAS,
    name="keras_replica_shares",
    feature="batches that split unevenly over the replicas",
    instead=(
        "drop the last partial batch (kmk.make_dataset(..., drop_remainder=True), "
        "Dataset.batch(..., drop_remainder=True))"
    ),
    target=_target,
    bug=_bug,
)


def probe_empty_conv() -> bool:
    """Whether this TensorFlow's CPU Conv2D returns a wrong shape for an empty batch.

    TensorFlow 2.21 with oneDNN (on by default on x86) returns the input of shape
    `(0, 28, 28, 3)` where `(0, 7, 7, 16)` is due; `TF_ENABLE_ONEDNN_OPTS=0` gives the
    right shape. The kit never relies on the answer: no replica computes on an empty part.
    """
    with tf.device("/cpu:0"):
        out = tf.nn.conv2d(
            tf.zeros((0, 28, 28, 3)), tf.zeros((3, 3, 3, 16)), strides=4, padding="SAME"
        )
    return tuple(out.shape) != (0, 7, 7, 16)


def _replicated() -> tf.distribute.ReplicaContext | None:
    """The replica context of a step that runs on several replicas, else None."""
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync <= 1:
        return None
    return ctx


def _keras_step(model: Any, name: str) -> bool:
    """Whether the model keeps Keras' own `name` (a step, `compute_loss`, `compute_metrics`:
    not overridden by its class or instance)."""
    TensorFlowTrainer = keras_private.tensorflow_trainer()  # noqa: N806
    if name in vars(model):
        return False  # set on the instance before the kit prepared the model
    return getattr(type(model), name, None) is getattr(TensorFlowTrainer, name)


def is_applied(model: Any) -> bool:
    """Whether `apply(model)` gave this model its steps."""
    try:
        return model in _APPLIED
    except TypeError:
        return False


def trains_exactly(model: Any) -> bool:
    """Whether a training batch split unevenly over the replicas trains as on one device."""
    try:
        return "train_step" in _APPLIED.get(model, ())
    except TypeError:
        return False


class _Step:
    """What the loss weighting of the step being traced needs: rows, total, replicas (the
    total without an all-reduce where the trace shows even parts: `even_rows`)."""

    def __init__(self, ctx: tf.distribute.ReplicaContext, rows: tf.Tensor) -> None:
        self.ctx = ctx
        self.n = ctx.num_replicas_in_sync
        self.even = even_rows(ctx, rows)
        self.rows = tf.cast(rows, tf.float32)
        if self.even is None:
            self.total = ctx.all_reduce(tf.distribute.ReduceOp.SUM, self.rows)
        else:
            self.total = tf.constant(float(self.even * self.n))
        self.share = self.weight(self.rows, self.total)

    def weight(self, part: tf.Tensor, whole: tf.Tensor) -> tf.Tensor:
        """`N * part / whole`: 1 on an even split, the replica's share otherwise."""
        return tf.stop_gradient(tf.math.divide_no_nan(part * float(self.n), whole))


class _State(threading.local):
    """Per model and per thread (MirroredStrategy traces each replica in a thread of its
    own, switching at each merge call): the step being traced, None outside the kit's
    `train_step` and outside its compiled loss."""

    step: _Step | None = None

    @contextlib.contextmanager
    def tracing(self, step: _Step) -> Iterator[None]:
        previous, self.step = self.step, step
        try:
            yield
        finally:
            self.step = previous


class _SharedLoss:
    """A compiled loss function, weighted by the replica's share of its denominator."""

    def __init__(self, loss_fn: Any, state: _State) -> None:
        functools.update_wrapper(self, loss_fn, updated=())
        self.loss_fn, self.state = loss_fn, state

    def __getattr__(self, name: str) -> Any:  # reduction, name, get_config, ...
        return getattr(self.loss_fn, name)

    def __call__(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> Any:
        value = self.loss_fn(y_true, y_pred, sample_weight)
        step = self.state.step
        reduction = getattr(self.loss_fn, "reduction", "sum_over_batch_size")
        if step is None or reduction in _UNWEIGHTED:
            return value
        mask = _mask_of(y_pred)
        if reduction == "mean_with_sample_weight" and sample_weight is not None:
            weights = tf.cast(sample_weight, tf.float32)
            if mask is not None:  # as Keras merges them (`losses.loss.apply_mask`)
                valid, weights = keras_private.squeeze_or_expand_to_same_rank(
                    tf.cast(mask, tf.float32), weights
                )
                weights = weights * valid
            part = tf.reduce_sum(weights)
        elif mask is not None:
            part = tf.reduce_sum(tf.cast(mask, tf.float32))
        else:
            return value * tf.cast(step.share, value.dtype)
        whole = step.ctx.all_reduce(tf.distribute.ReduceOp.SUM, part)
        return value * tf.cast(step.weight(part, whole), value.dtype)


def _mask_of(y_pred: Any) -> Any:
    leaves = [leaf for leaf in tf.nest.flatten(y_pred) if leaf is not None]
    return keras_private.keras_mask(leaves[0]) if len(leaves) == 1 else None


def _share_compiled_losses(model: Any, state: _State) -> None:
    """Wraps each built compiled loss function (once) in `_SharedLoss`."""
    compiled = getattr(model, "_compile_loss", None)
    flat = getattr(compiled, "_flat_losses", None)
    if not flat:
        return
    for i, entry in enumerate(flat):
        if not isinstance(entry.loss, _SharedLoss):
            flat[i] = entry._replace(loss=_SharedLoss(entry.loss, state))


def _shared_loss(
    model: Any, state: _State, step: _Step, x: Any, y: Any, y_pred: Any, sample_weight: Any
) -> Any:
    """The replica's part of the one-device loss (compiled, `add_loss`, regularizers)."""
    if not _keras_step(model, "compute_loss") or getattr(model, "_losses_override", None):
        # The class's own compute_loss, as a mean over the replica's part: its compiled
        # losses (through `super()`) stay unweighted, the whole is weighted once.
        loss = model._compute_loss(  # noqa: SLF001
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
        )
        return loss * tf.cast(step.share, loss.dtype)
    losses = []
    if model._compile_loss is not None:  # noqa: SLF001
        with state.tracing(step):  # each compiled loss weighted by its own share
            loss = model._compile_loss(y, y_pred, sample_weight)  # noqa: SLF001
        if loss is not None:
            losses.append(loss)
    own = list(model._get_own_losses())  # noqa: SLF001  add_loss, activity regularizers
    for layer in model._flatten_layers(include_self=False):  # noqa: SLF001
        own.extend(layer._get_own_losses())  # noqa: SLF001
    for loss in own:  # a mean over the replica's part, as Keras takes it
        loss = model._aggregate_additional_loss(loss)  # noqa: SLF001  (scaled by 1/N)
        losses.append(loss * tf.cast(step.share, loss.dtype))
    for loss in model._get_regularization_losses():  # noqa: SLF001  once in all
        losses.append(model._aggregate_additional_loss(loss))  # noqa: SLF001
    if not losses:
        raise ValueError("No loss to compute. Provide a `loss` argument in `compile()`.")
    if len(losses) == 1:
        return losses[0]
    return tf.add_n([tf.cast(v, losses[0].dtype) for v in losses])


def _train_step(model: Any, state: _State, original: Any) -> Any:
    data_adapter_utils = keras_private.data_adapter_utils()

    @functools.wraps(original)
    def train_step(data: Any) -> Any:
        ctx = _replicated()
        if ctx is None:
            return original(data)
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        rows = rows_of(x)
        step = _Step(ctx, rows)
        if not step.even:  # parts the trace cannot show to be even and not empty
            check = tf.debugging.assert_positive(rows, message=EMPTY_PART)
            # The check gates the forward pass (local), not the all-reduce of the rows,
            # which then overlaps the forward pass: no barrier before it.
            x = _after(check, x)
        _share_compiled_losses(model, state)
        with tf.GradientTape() as tape:
            if model._call_has_training_arg:  # noqa: SLF001
                y_pred = model(x, training=True)
            else:
                y_pred = model(x)
            loss = _shared_loss(model, state, step, x, y, y_pred, sample_weight)
            # The one-device loss of this step, weighted by its rows, over the replicas.
            total, rows = (tf.cast(v, loss.dtype) for v in (step.total, step.rows))
            model._loss_tracker.update_state(  # noqa: SLF001
                tf.math.divide_no_nan(loss * total, rows), sample_weight=step.rows
            )
            if model.optimizer is not None:
                loss = model.optimizer.scale_loss(loss)
        if model.trainable_weights:
            trainable_weights = model.trainable_weights
            gradients = tape.gradient(loss, trainable_weights)
            model.optimizer.apply_gradients(zip(gradients, trainable_weights))
        else:
            warnings.warn("The model does not have any trainable weights.", stacklevel=2)
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    return train_step


def _after(check: Any, structure: Any) -> Any:
    """`structure` with each dense tensor made to wait for `check`."""

    def gated(leaf: Any) -> Any:
        if not isinstance(leaf, tf.Tensor):
            return leaf
        with tf.control_dependencies([check]):
            return tf.identity(leaf)

    return keras.tree.map_structure(gated, structure)


def _dense_only(data: Any) -> bool:
    """Whether every leaf of `data` is a dense tensor (or None): rows can be added."""
    return all(leaf is None or isinstance(leaf, tf.Tensor) for leaf in tf.nest.flatten(data))


class _EvaluationShare(threading.local):
    """The replica's share of the batch's rows in the evaluation step being traced."""

    share: tf.Tensor | None = None


_evaluation = _EvaluationShare()
_SHARED_TRACKERS: weakref.WeakSet[Any] = weakref.WeakSet()


def _share_output_losses(model: Any) -> None:
    """Weighs each per-output loss tracker's unweighted update by the replica's share."""
    for metric in getattr(getattr(model, "_compile_loss", None), "metrics", None) or []:
        if metric in _SHARED_TRACKERS:
            continue
        original = metric.update_state

        @functools.wraps(original)
        def update_state(values: Any, sample_weight: Any = None, _original: Any = original) -> Any:
            share = _evaluation.share
            if share is not None and sample_weight is None:
                sample_weight = share
            return _original(values, sample_weight=sample_weight)

        object.__setattr__(metric, "update_state", update_state)
        _SHARED_TRACKERS.add(metric)


def _test_step(model: Any, original: Any) -> Any:
    data_adapter_utils = keras_private.data_adapter_utils()

    if not (_keras_step(model, "compute_metrics") and _keras_step(model, "get_metrics_result")):
        return original  # the skipped branch must return what the step returns

    @functools.wraps(original)
    def test_step(data: Any) -> Any:
        ctx = _replicated()
        if ctx is None:
            return original(data)
        x = data_adapter_utils.unpack_x_y_sample_weight(data)[0]
        rows = rows_of(x)
        _share_output_losses(model)
        share = _Step(ctx, rows).share / float(ctx.num_replicas_in_sync)  # rows / total
        previous, _evaluation.share = _evaluation.share, share
        try:
            return tf.cond(rows > 0, lambda: original(data), model.get_metrics_result)
        finally:
            _evaluation.share = previous

    return test_step


def _one_row(leaf: tf.Tensor) -> tf.Tensor:
    """One row of zeros (empty strings) shaped like the rows of the dense tensor `leaf`."""
    shape = tf.concat([[1], tf.shape(leaf)[1:]], axis=0)
    if leaf.dtype == tf.string:
        return tf.fill(shape, "")
    return tf.zeros(shape, leaf.dtype)


def _predict_step(original: Any) -> Any:
    data_adapter_utils = keras_private.data_adapter_utils()

    @functools.wraps(original)
    def predict_step(data: Any) -> Any:
        if _replicated() is None or not _dense_only(data):
            return original(data)
        rows = rows_of(data_adapter_utils.unpack_x_y_sample_weight(data)[0])

        def padded(leaf: Any) -> Any:
            if not isinstance(leaf, tf.Tensor) or not leaf.shape.rank:
                return leaf
            return tf.cond(rows > 0, lambda: leaf, lambda: _one_row(leaf))

        out = original(keras.tree.map_structure(padded, data))
        return keras.tree.map_structure(
            lambda t: t[:rows] if isinstance(t, tf.Tensor) and t.shape.rank else t, out
        )

    return predict_step


def apply(model: Any) -> bool:
    """Gives this model the exact steps of the module docstring (idempotent).

    Each step the model's class does not override is replaced on the instance; on one
    replica (or outside a strategy) each calls Keras' own. Not applied where the canary
    retired or refused it (logged once; uneven training batches are then refused before any
    step); True when the model has the steps.
    """
    if is_applied(model):
        return True
    if not _PATCH.apply(lambda: None):  # the steps are replaced per model, below
        return False
    state = _State()
    makers = {
        "train_step": lambda step: _train_step(model, state, step),
        "test_step": lambda step: _test_step(model, step),
        "predict_step": _predict_step,
    }
    replaced = [name for name in makers if _keras_step(model, name)]
    for name in replaced:
        object.__setattr__(model, name, makers[name](getattr(model, name)))
    _APPLIED[model] = frozenset(replaced)
    return True
