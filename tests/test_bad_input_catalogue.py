"""The bad-input catalogue: every misuse of the public API gets a clear error, of the kit's
own type and message, before any training step. docs/reliability.md lists the same cases
(checked below).

How to add a case (one entry in `CASES`, one row in docs/reliability.md's table):

- In this process (`Case`): `trigger` is a callable (given `tmp_path` when `needs_tmp`) that
  must raise exactly `error` (not a subclass) with `message` in its text. If the misuse is
  caught by `model.fit`, make the trigger end with this module's `fit(model, ...)` (and do any
  preparatory training with `model.fit` directly) and set `fits=True`: the test then checks
  that this fit was really entered and that no step ran (no batch begun, optimizer
  iterations 0). Without `fits=True` the trigger must not call `fit()`.
- In a fresh interpreter (`ChildCase`), for what needs another process: another Keras
  backend, a fresh TensorFlow runtime, environment variables read at import. `code` runs in
  the child with `env` added to its environment; the harness reports the exception's
  qualified type name and message as JSON, compared with `error` and `message`. In `code`,
  call `fit(model, *args, **kwargs)` (the harness's, which wraps `model.fit`) for the
  failing fit and set `fits=True`, as above.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mirror_kit as kmk
from keras_mirror_kit.checkpoint.optimizer_match import OptimizerMismatchError
from keras_mirror_kit.multi_worker import launch
from tests import models
from tests.subproc import REPO, last_json, run_python

X = np.random.default_rng(1).normal(size=(64, 6)).astype("float32")
Y = (X[:, 0] > 0).astype("int32")


class Steps(keras.callbacks.Callback):
    """Counts the training steps begun."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def on_train_batch_begin(self, batch, logs=None):
        self.count += 1


@dataclass
class FitAttempt:
    model: keras.Model
    steps: Steps


# The fits a case expected to fail, in order; reset by the test before each case.
ATTEMPTS: list[FitAttempt] = []


def fit(model, callbacks=(), data=None, **kwargs):
    """The fit a case expects to fail: recorded, and its steps counted."""
    data = data if data is not None else kmk.make_dataset(X, Y, 16, seed=0)
    steps = Steps()
    ATTEMPTS.append(FitAttempt(model, steps))
    model.fit(data, epochs=1, verbose=0, callbacks=[*callbacks, steps], **kwargs)


def kit_model(**kwargs) -> keras.Model:
    @kmk.distributed(per_replica_batch_size=8, **kwargs)
    def build():
        return models.compile_sgd(models.sequential())

    return build()


class OverReplicas(keras.Sequential):
    """A model class whose own `train_step` divides its loss by the replica count, as
    tf.distribute's convention does (the kit weighs the replicas itself)."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
            loss = loss / self.distribute_strategy.num_replicas_in_sync
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"step_loss": loss}


def own_train_step_model() -> keras.Model:
    @kmk.distributed(per_replica_batch_size=8)
    def build():
        model = OverReplicas([keras.Input((6,)), keras.layers.Dense(2, activation="softmax")])
        return models.compile_sgd(model)

    return build()


def stateful_rnn() -> keras.Model:
    model = keras.Sequential(
        [keras.Input(batch_shape=(16, 5, 3)), keras.layers.LSTM(4, stateful=True)]
    )
    model.compile("sgd", "mse")
    return model


def plain_model() -> keras.Model:
    return models.compile_sgd(models.sequential())


def factory_returning(make: Callable[[], object]):
    @kmk.distributed(per_replica_batch_size=8)
    def build():
        return make()

    return build


def outside_model_factory():
    model = plain_model()
    return factory_returning(lambda: model)


def outside_optimizer_factory():
    optimizer = keras.optimizers.Adam()

    @kmk.distributed(per_replica_batch_size=8)
    def build():
        model = models.sequential()
        model.compile(optimizer=optimizer, loss="mse")
        return model

    return build


def outside_layer_factory():
    layer = keras.layers.Dense(3)
    layer.build((None, 6))
    return factory_returning(lambda: keras.Sequential([keras.Input((6,)), layer]))


def late_compile_outside_optimizer():
    @kmk.distributed(per_replica_batch_size=8)
    def build():
        return models.functional()

    model = build()
    used = keras.optimizers.SGD()
    used.build(model.trainable_variables)  # state made outside the scope
    model.compile(optimizer=used, loss="mse")


def checkpoint_of_another_model(tmp: Path):
    model = kit_model()
    ds = kmk.make_dataset(X, Y, 16, seed=0)
    model.fit(ds, epochs=1, verbose=0, callbacks=[kmk.SyncedCheckpoint(tmp, dataset=ds)])

    @kmk.distributed(per_replica_batch_size=8)
    def other():
        m = keras.Sequential([keras.Input((6,)), keras.layers.Dense(7), keras.layers.Dense(3)])
        return models.compile_sgd(m)

    fit(other(), [kmk.SyncedCheckpoint(tmp)])


def file_as_checkpoint_dir(tmp: Path):
    (tmp / "a-file").write_text("mine")
    fit(kit_model(), [kmk.SyncedCheckpoint(tmp / "a-file")])


def with_tf_config(raw: str) -> Callable[[], object]:
    def trigger_with_env():
        import os

        os.environ["TF_CONFIG"] = raw
        try:
            return kmk.distributed(8).distribution
        finally:
            del os.environ["TF_CONFIG"]

    return trigger_with_env


def dataset_without_seed_in_a_multi_worker_run():
    import os

    os.environ["TF_CONFIG"] = (
        '{"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, '
        '"task": {"type": "worker", "index": 0}}'
    )
    try:
        kmk.make_dataset(X, Y, 16)
    finally:
        del os.environ["TF_CONFIG"]


def model_built_before_the_with_block():
    model = models.sequential()  # built outside: it would train on one device
    with kmk.distributed(per_replica_batch_size=8):
        model.compile(optimizer="sgd", loss="mse")


def fit_in_the_with_block_of_a_model_built_elsewhere():
    model = plain_model()
    with kmk.distributed(per_replica_batch_size=8):
        fit(model, [kmk.ThroughputMonitor(global_batch_size=16)])


def dataset_batched_per_replica():
    fit(kit_model(), data=tf.data.Dataset.from_tensor_slices((X, Y)).batch(8))


def dataset_distributed_by_hand():
    model = kit_model()
    data = model.distribute_strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((X, Y)).batch(16)
    )
    fit(model, data=data)


def checkpoint_of_another_optimizer(tmp: Path):
    def with_optimizer(make):
        @kmk.distributed(per_replica_batch_size=8)
        def build():
            model = models.sequential()
            model.compile(optimizer=make(), loss=keras.losses.SparseCategoricalCrossentropy(True))
            return model

        return build()

    ds = kmk.make_dataset(X, Y, 16, seed=0)
    momentum = with_optimizer(lambda: keras.optimizers.SGD(0.01, momentum=0.9))
    momentum.fit(ds, epochs=1, verbose=0, callbacks=[kmk.SyncedCheckpoint(tmp, dataset=ds)])
    fit(with_optimizer(keras.optimizers.RMSprop), [kmk.SyncedCheckpoint(tmp, dataset=ds)], data=ds)


def fit_on_another_dataset_than_the_checkpoints(tmp: Path):
    given = kmk.make_dataset(X, Y, 16, seed=0)
    fit(
        kit_model(),
        [kmk.SyncedCheckpoint(tmp, dataset=given)],
        data=kmk.make_dataset(X, Y, 16, seed=0),
    )


def checkpoint_dataset_with_steps_per_epoch():
    ds = kmk.make_dataset(X, Y, 16, seed=0)
    fit(kit_model(), [kmk.SyncedCheckpoint("c", dataset=ds)], steps_per_epoch=2, data=ds)


def restore_false_over_old_checkpoints(tmp: Path):
    model = kit_model()
    ds = kmk.make_dataset(X, Y, 16, seed=0)
    model.fit(ds, epochs=1, verbose=0, callbacks=[kmk.SyncedCheckpoint(tmp, dataset=ds)])
    fit(kit_model(), [kmk.SyncedCheckpoint(tmp, restore=False)])


@dataclass(frozen=True)
class Case:
    """A misuse triggered in this process."""

    name: str
    trigger: Callable[..., object]
    error: type[BaseException]
    message: str
    needs_tmp: bool = False
    fits: bool = False  # the trigger ends with `fit()`, which must fail before any step


@dataclass(frozen=True)
class ChildCase:
    """A misuse triggered by `code` in a fresh interpreter, with `env` added."""

    name: str
    code: str
    error: type[BaseException]
    message: str
    env: dict[str, str] = field(default_factory=dict)
    fits: bool = False  # `code` ends with the harness's `fit()`, which must fail


# Runs a case's code and reports, as JSON, what it raised and whether a fit step ran.
CHILD_HARNESS = """
import json, sys

REPORT = {"raised": False, "fit_attempted": False, "steps": 0, "iterations": None}
FITTED = []


def fit(model, *args, **kwargs):
    import keras

    class Steps(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            REPORT["steps"] += 1

    REPORT["fit_attempted"] = True
    FITTED.append(model)
    kwargs["callbacks"] = [*kwargs.get("callbacks", []), Steps()]
    return model.fit(*args, **kwargs)


try:
    exec(compile(CODE, "<case>", "exec"), {"__name__": "__main__", "fit": fit})
except BaseException as e:
    REPORT.update(raised=True, type=f"{type(e).__module__}.{type(e).__qualname__}",
                  message=str(e))
if FITTED:
    import keras

    REPORT["iterations"] = int(keras.ops.convert_to_numpy(FITTED[0].optimizer.iterations))
print("RESULT " + json.dumps(REPORT), flush=True)
"""


def optimizer_with_other_accumulation():
    @kmk.distributed(per_replica_batch_size=8, gradient_accumulation_steps=4)
    def build():
        model = models.sequential()
        model.compile(optimizer=keras.optimizers.SGD(gradient_accumulation_steps=2), loss="mse")
        return model

    return build()


def qualified_name(error: type[BaseException]) -> str:
    return f"{error.__module__}.{error.__qualname__}"


CASES = [
    Case("no batch size", lambda: kmk.distributed(), ValueError, "needs a batch size"),
    Case(
        "both batch sizes",
        lambda: kmk.distributed(8, global_batch_size=16),
        ValueError,
        "not both",
    ),
    Case(
        "zero per-replica batch",
        lambda: kmk.distributed(0),
        ValueError,
        "per_replica_batch_size=0",
    ),
    Case(
        "float batch size", lambda: kmk.distributed(8.0), TypeError, "per_replica_batch_size=8.0"
    ),
    Case(
        "global batch not divisible by replicas",
        lambda: kmk.distributed(global_batch_size=15).distribution,
        ValueError,
        "must divide evenly",
    ),
    Case(
        "unknown strategy",
        lambda: kmk.distributed(8, strategy="tpu"),
        ValueError,
        "strategy='tpu'",
    ),
    Case(
        "devices given as a string",
        lambda: kmk.distributed(8, devices="/gpu:0"),
        TypeError,
        "devices='/gpu:0'",
    ),
    Case(
        "device that does not exist",
        lambda: kmk.distributed(8, devices=["/gpu:3"]).distribution,
        ValueError,
        "does not exist on this host",
    ),
    Case(
        "unknown all-reduce",
        lambda: kmk.distributed(8, cross_device_ops="ring").distribution,
        ValueError,
        "cross_device_ops='ring'",
    ),
    Case(
        "NCCL without GPUs",
        lambda: kmk.distributed(8, cross_device_ops="nccl").distribution,
        ValueError,
        "needs GPU replicas",
    ),
    Case(
        "unknown learning-rate rule",
        lambda: kmk.distributed(8, lr_scaling_rule="cubic"),
        ValueError,
        "rule='cubic'",
    ),
    Case(
        "non-positive learning rate",
        lambda: kmk.scale_learning_rate(-1e-3, 64, 128),
        ValueError,
        "base_learning_rate=-0.001",
    ),
    Case(
        "factory returns no model",
        factory_returning(lambda: None),
        TypeError,
        "must return a keras.Model",
    ),
    Case(
        "model built outside the scope",
        lambda: outside_model_factory()(),
        ValueError,
        "model returned by `build` was created outside the strategy's scope",
    ),
    Case(
        "optimizer created outside the scope",
        lambda: outside_optimizer_factory()(),
        ValueError,
        "optimizer of the model returned by `build` was created outside",
    ),
    Case(
        "layer built outside the scope",
        lambda: outside_layer_factory()(),
        ValueError,
        "were created outside the strategy's scope",
    ),
    Case(
        "late compile with an optimizer holding state from outside",
        late_compile_outside_optimizer,
        ValueError,
        "optimizer created outside the strategy's scope that already holds state",
    ),
    Case(
        "kmk.current() outside distributed()",
        kmk.current,
        RuntimeError,
        "outside a distributed() context",
    ),
    ChildCase(
        "simulate_replicas after TensorFlow started",
        "import tensorflow as tf, keras_mirror_kit as kmk\n"
        "tf.constant(1)\nkmk.simulate_replicas(2)\n",
        RuntimeError,
        "was called after TensorFlow initialised its devices",
    ),
    ChildCase(
        "bad KMK_SIMULATE_REPLICAS",
        "import keras_mirror_kit as kmk\nkmk.distributed(8).distribution\n",
        ValueError,
        "KMK_SIMULATE_REPLICAS='two'",
        env={"KMK_SIMULATE_REPLICAS": "two"},
    ),
    Case(
        "make_dataset without a batch size",
        lambda: kmk.make_dataset(X, Y),
        TypeError,
        "batch_size=None",
    ),
    Case(
        "make_dataset batch larger than the data",
        lambda: kmk.make_dataset(X, Y, 128, drop_remainder=True),
        ValueError,
        "larger than the data",
    ),
    Case(
        "make_dataset arrays of different lengths",
        lambda: kmk.make_dataset(X, Y[:10], 8),
        ValueError,
        "same first dimension",
    ),
    Case(
        "training on a last batch that leaves a replica empty",
        lambda: fit(kit_model(), data=kmk.make_dataset(X[:17], Y[:17], 16, shuffle=False)),
        ValueError,
        "leaves a replica without any",
        fits=True,
    ),
    Case(
        "a model's own train_step that divides its loss by the number of replicas",
        lambda: fit(own_train_step_model()),
        ValueError,
        "was 1/2 of one device's",
        fits=True,
    ),
    Case(
        "a stateful RNN on several replicas",
        lambda: factory_returning(stateful_rnn)(),
        ValueError,
        "has stateful layers",
    ),
    Case(
        "ThroughputMonitor on a non-kit model without a batch size",
        lambda: fit(plain_model(), [kmk.ThroughputMonitor()], data=(X, Y)),
        ValueError,
        "global_batch_size",
        fits=True,
    ),
    Case(
        "ThroughputMonitor with a non-positive batch size",
        lambda: kmk.ThroughputMonitor(global_batch_size=0),
        ValueError,
        "global_batch_size=0",
    ),
    Case(
        "ThroughputMonitor contradicting the distribution",
        lambda: fit(kit_model(), [kmk.ThroughputMonitor(global_batch_size=99)]),
        ValueError,
        "global_batch_size=99",
        fits=True,
    ),
    Case(
        "SyncedCheckpoint with save_freq=0",
        lambda: kmk.SyncedCheckpoint("c", save_freq=0),
        ValueError,
        "save_freq=0",
    ),
    Case(
        "SyncedCheckpoint keeping nothing",
        lambda: kmk.SyncedCheckpoint("c", keep=0),
        ValueError,
        "keep=0",
    ),
    Case(
        "SyncedCheckpoint dataset not built by make_dataset",
        lambda: kmk.SyncedCheckpoint("c", dataset=tf.data.Dataset.range(3)),
        ValueError,
        "must be a dataset built by kmk.make_dataset",
    ),
    Case(
        "checkpoint directory is a file",
        file_as_checkpoint_dir,
        kmk.CheckpointError,
        "is not a directory",
        needs_tmp=True,
        fits=True,
    ),
    Case(
        "checkpoint written by another model",
        checkpoint_of_another_model,
        kmk.CheckpointError,
        "does not match this model",
        needs_tmp=True,
        fits=True,
    ),
    Case(
        "restore=False over an earlier run's checkpoints",
        restore_false_over_old_checkpoints,
        kmk.CheckpointError,
        "restore=False would start a new run",
        needs_tmp=True,
        fits=True,
    ),
    Case(
        "make_dataset without a seed in a multi-worker run",
        dataset_without_seed_in_a_multi_worker_run,
        ValueError,
        "needs a `seed` in a multi-worker run",
    ),
    Case(
        "SyncedCheckpoint(dataset=) with steps_per_epoch",
        checkpoint_dataset_with_steps_per_epoch,
        ValueError,
        "steps_per_epoch=2",
        fits=True,
    ),
    Case(
        "WarmupSchedule with zero warmup steps",
        lambda: kmk.WarmupSchedule(0.1, 0),
        ValueError,
        "warmup_steps=0",
    ),
    Case(
        "TF_CONFIG that is not JSON",
        with_tf_config("{bad json"),
        ValueError,
        "TF_CONFIG is invalid: it is not valid JSON",
    ),
    Case(
        "TF_CONFIG task index out of range",
        with_tf_config(
            '{"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, '
            '"task": {"type": "worker", "index": 5}}'
        ),
        ValueError,
        "task index 5 is out of range",
    ),
    Case(
        "model built before the with block, compiled in it",
        model_built_before_the_with_block,
        ValueError,
        "compiled inside `with kmk.distributed(...)` was created outside the strategy's scope",
    ),
    Case(
        "fit inside the with block of a model built elsewhere",
        fit_in_the_with_block_of_a_model_built_elsewhere,
        ValueError,
        "not built under its strategy",
        fits=True,
    ),
    Case(
        "dataset batched to another size than the global batch",
        dataset_batched_per_replica,
        ValueError,
        "batched to 8 samples per step",
        fits=True,
    ),
    Case(
        "dataset distributed with experimental_distribute_dataset",
        dataset_distributed_by_hand,
        ValueError,
        "already distributed over the replicas",
        fits=True,
    ),
    Case(
        "evaluate(steps=) that Keras would round up",
        lambda: kit_model(steps_per_execution=4).evaluate(
            kmk.make_dataset(X, Y, 16, seed=0).repeat(), steps=3, verbose=0
        ),
        ValueError,
        "steps=3 is not a multiple",
    ),
    ChildCase(
        "Keras on a backend without a data-parallel API",
        "import keras_mirror_kit as kmk\nkmk.distributed(per_replica_batch_size=8)",
        RuntimeError,
        "no data-parallel API for the 'numpy' backend",
        env={"KERAS_BACKEND": "numpy"},
    ),
    Case(
        "launch given a first word that is no script, file or program",
        lambda: launch.resolve_target("pyhton3"),
        launch.LaunchError,
        "cannot run 'pyhton3': no such file here and no program of that name on PATH",
    ),
    Case(
        "checkpoint of another optimizer with as many variables",
        checkpoint_of_another_optimizer,
        OptimizerMismatchError,  # a CheckpointError and a ValueError
        "does not match this model's optimizer",
        needs_tmp=True,
        fits=True,
    ),
    Case(
        "fit on another dataset than SyncedCheckpoint(dataset=)",
        fit_on_another_dataset_than_the_checkpoints,
        ValueError,
        "given another kmk.make_dataset object",
        needs_tmp=True,
        fits=True,
    ),
    Case(
        "launch -n 2 where 3 GPUs are visible",
        lambda: launch.assign_gpus(2, ["0", "1", "2"]),
        launch.LaunchError,
        "cannot split the 3 visible GPU(s) (0,1,2) evenly among 2 workers",
    ),
    Case(
        "launch --gpus-per-worker asking for more GPUs than visible",
        lambda: launch.assign_gpus(2, ["0", "1", "2"], 2),
        launch.LaunchError,
        "--gpus-per-worker 2 needs 4 GPUs for 2 workers",
    ),
    ChildCase(
        "hierarchical_copy on an odd number of replicas",
        "import keras_mirror_kit as kmk\n"
        "kmk.distributed(8, cross_device_ops='hierarchical_copy').distribution",
        ValueError,
        "needs an even number of replicas",
        env={"KMK_SIMULATE_REPLICAS": "3"},
    ),
    Case(
        "CIFAR-10 requested offline with download=False",
        lambda: kmk.datasets.load_cifar10(cache_dir="/nonexistent-kmk", download=False),
        kmk.datasets.CIFAR10NotAvailableError,
        "download=False",
    ),
    Case(
        "make_dataset with an unknown preprocess_on",
        lambda: kmk.make_dataset(X, Y, 16, preprocess_on="gpu"),
        ValueError,
        "preprocess_on='gpu'",
    ),
    Case(
        "make_dataset(preprocess_on='replica') without a preprocess",
        lambda: kmk.make_dataset(X, Y, 16, preprocess_on="replica"),
        ValueError,
        "no `preprocess` was given",
    ),
    Case(
        "an uncatchable preemption signal",
        lambda tmp: kmk.SyncedCheckpoint(tmp, preemption_signals=[signal.SIGKILL]),
        ValueError,
        "SIGKILL cannot be caught",
        needs_tmp=True,
    ),
    Case(
        "an unknown preemption signal name",
        lambda tmp: kmk.SyncedCheckpoint(tmp, preemption_signals=["SIGNOPE"]),
        ValueError,
        "unknown signal 'SIGNOPE'",
        needs_tmp=True,
    ),
    Case(
        "one preemption signal instead of a list",
        lambda tmp: kmk.SyncedCheckpoint(tmp, preemption_signals=signal.SIGTERM),
        TypeError,
        "must be a list or tuple of signals",
        needs_tmp=True,
    ),
    Case(
        "async_save that is not a bool",
        lambda tmp: kmk.SyncedCheckpoint(tmp, async_save="yes"),
        TypeError,
        "async_save='yes'",
        needs_tmp=True,
    ),
    Case(
        "keep_best with an unknown mode",
        lambda tmp: kmk.SyncedCheckpoint(tmp, keep_best=2, monitor="val_loss", mode="up"),
        ValueError,
        "mode='up'",
        needs_tmp=True,
    ),
    Case(
        "restore from a directory that does not exist",
        lambda tmp: kmk.restore(plain_model(), tmp / "nope"),
        kmk.CheckpointError,
        "There is no checkpoint directory",
        needs_tmp=True,
    ),
    Case(
        "zero gradient accumulation steps",
        lambda: kmk.distributed(8, gradient_accumulation_steps=0),
        ValueError,
        "gradient_accumulation_steps=0",
    ),
    Case(
        "optimizer created with another gradient_accumulation_steps",
        optimizer_with_other_accumulation,
        ValueError,
        "distributed(gradient_accumulation_steps=4) asks for another value",
    ),
    Case(
        "ThroughputMonitor with a non-positive FLOP count",
        lambda: kmk.ThroughputMonitor(flops_per_sample=0),
        ValueError,
        "`flops_per_sample` must be a positive, finite number",
    ),
]


def check_in_process(case: Case, tmp_path: Path) -> None:
    with pytest.raises(BaseException) as info:
        case.trigger(tmp_path) if case.needs_tmp else case.trigger()
    assert type(info.value) is case.error, f"raised {type(info.value)!r}: {info.value}"
    assert case.message in str(info.value)
    if not case.fits:
        assert ATTEMPTS == [], "the trigger called fit(): declare the case fits=True"
        return
    assert len(ATTEMPTS) == 1, "fits=True, but the error was raised before fit() was called"
    (attempt,) = ATTEMPTS
    assert attempt.steps.count == 0, "a training step began before the error"
    assert int(keras.ops.convert_to_numpy(attempt.model.optimizer.iterations)) == 0


def check_in_child(case: ChildCase, tmp_path: Path) -> None:
    proc = run_python(
        f"CODE = {case.code!r}\n{CHILD_HARNESS}", check=False, env=case.env, cwd=tmp_path
    )
    report = last_json(proc)
    assert report["raised"], f"nothing was raised; stderr:\n{proc.stderr[-3000:]}"
    assert report["type"] == qualified_name(case.error), report
    assert case.message in report["message"], report["message"]
    if not case.fits:
        assert not report["fit_attempted"], "the code called fit(): declare the case fits=True"
        return
    assert report["fit_attempted"], "fits=True, but the error was raised before fit()"
    assert report["steps"] == 0 and report["iterations"] == 0, report


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_misuse_raises_the_kits_error_before_any_training_step(case, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ATTEMPTS.clear()
    if isinstance(case, ChildCase):
        check_in_child(case, tmp_path)
    else:
        check_in_process(case, tmp_path)


class RaiseAfterTheFirstStep(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        raise ValueError("raised after a step")


def test_the_in_process_check_fails_on_an_error_after_a_step(tmp_path):
    # A control for `check_in_process`: an error raised once a step has run is caught out.
    late = Case(
        "late",
        lambda: fit(kit_model(), [RaiseAfterTheFirstStep()]),
        ValueError,
        "raised after a step",
        fits=True,
    )
    ATTEMPTS.clear()
    with pytest.raises(AssertionError, match="a training step began before the error"):
        check_in_process(late, tmp_path)
    # ... and so is a case that says it fits but fails before fit() is entered.
    early = Case(
        "early",
        lambda: fit(kit_model(), [kmk.ThroughputMonitor(global_batch_size=0)]),
        ValueError,
        "global_batch_size=0",
        fits=True,
    )
    ATTEMPTS.clear()
    with pytest.raises(AssertionError, match="before fit\\(\\) was called"):
        check_in_process(early, tmp_path)


@pytest.mark.slow
def test_the_child_harness_reports_the_type_message_and_steps(tmp_path):
    # A control for `check_in_child`: a fit that trains one step and then raises is seen.
    code = """
import keras, numpy as np
model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse")

class Boom(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        raise KeyError("after one step")

fit(model, np.zeros((4, 2)), np.zeros((4, 1)), batch_size=2, verbose=0, callbacks=[Boom()])
"""
    report = last_json(run_python(f"CODE = {code!r}\n{CHILD_HARNESS}", check=False, cwd=tmp_path))
    assert report["raised"] and report["type"] == "builtins.KeyError", report
    assert "after one step" in report["message"]
    assert report["fit_attempted"] and report["steps"] == 1 and report["iterations"] == 1


def test_the_catalogue_is_long_enough_and_documented():
    assert len(CASES) >= 20
    assert len({c.name for c in CASES}) == len(CASES)
    doc = (REPO / "docs" / "reliability.md").read_text()
    table = {
        m.group(1).strip(): m.group(2).strip()
        for m in re.finditer(r"^\| ([^|]+) \| ([^|]+)", doc, re.M)
    }
    missing = [c.name for c in CASES if c.name not in table]
    assert not missing, f"docs/reliability.md lacks: {missing}"
    wrong = {
        c.name: table[c.name].split(":")[0]
        for c in CASES
        if not table[c.name].startswith(f"{c.error.__name__}:")
    }
    assert not wrong, f"docs/reliability.md shows other error types: {wrong}"
