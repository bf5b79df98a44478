"""The bad-input catalogue: every misuse of the public API gets a clear error before any
training step. docs/reliability.md lists the same cases (checked below)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mirror_kit as kmk
from tests import models
from tests.subproc import REPO, run_python

X = np.random.default_rng(1).normal(size=(64, 6)).astype("float32")
Y = (X[:, 0] > 0).astype("int32")


class Steps(keras.callbacks.Callback):
    """Counts training steps; the catalogue asserts it stays at 0."""

    count = 0

    def on_train_batch_begin(self, batch, logs=None):
        Steps.count += 1


def kit_model(**kwargs) -> keras.Model:
    @kmk.distributed(per_replica_batch_size=8, **kwargs)
    def build():
        return models.compile_sgd(models.sequential())

    return build()


def plain_model() -> keras.Model:
    return models.compile_sgd(models.sequential())


def fit(model, callbacks=(), data=None, **kwargs):
    data = data if data is not None else kmk.make_dataset(X, Y, 16, seed=0, num_replicas=2)
    model.fit(data, epochs=1, verbose=0, callbacks=[*callbacks, Steps()], **kwargs)


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
    model.compile(optimizer=keras.optimizers.SGD(), loss="mse")


def checkpoint_of_another_model(tmp: Path):
    model = kit_model()
    ds = kmk.make_dataset(X, Y, 16, seed=0)
    model.fit(ds, epochs=1, verbose=0, callbacks=[kmk.SyncedCheckpoint(tmp, dataset=ds)])
    Steps.count = 0

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


def restore_false_over_old_checkpoints(tmp: Path):
    model = kit_model()
    ds = kmk.make_dataset(X, Y, 16, seed=0)
    model.fit(ds, epochs=1, verbose=0, callbacks=[kmk.SyncedCheckpoint(tmp, dataset=ds)])
    Steps.count = 0
    fit(kit_model(), [kmk.SyncedCheckpoint(tmp, restore=False)])


def subprocess_error(code: str, env: dict[str, str] | None = None) -> Callable[[], None]:
    def trigger():
        proc = run_python(code, check=False, env=env)
        raise RuntimeError(proc.stderr[-2000:])

    return trigger


@dataclass(frozen=True)
class Case:
    name: str
    trigger: Callable[..., object]
    error: type[BaseException]
    message: str
    needs_tmp: bool = False


CASES = [
    Case("no batch size", lambda: kmk.distributed(), ValueError, "needs a batch size"),
    Case("both batch sizes", lambda: kmk.distributed(8, global_batch_size=16), ValueError,
         "not both"),
    Case("zero per-replica batch", lambda: kmk.distributed(0), ValueError,
         "per_replica_batch_size=0"),
    Case("float batch size", lambda: kmk.distributed(8.0), TypeError,
         "per_replica_batch_size=8.0"),
    Case("global batch not divisible by replicas",
         lambda: kmk.distributed(global_batch_size=15).distribution, ValueError,
         "must divide evenly"),
    Case("unknown strategy", lambda: kmk.distributed(8, strategy="tpu"), ValueError,
         "strategy='tpu'"),
    Case("devices given as a string", lambda: kmk.distributed(8, devices="/gpu:0"), TypeError,
         "devices='/gpu:0'"),
    Case("device that does not exist",
         lambda: kmk.distributed(8, devices=["/gpu:3"]).distribution, ValueError,
         "does not exist on this host"),
    Case("unknown all-reduce", lambda: kmk.distributed(8, cross_device_ops="ring").distribution,
         ValueError, "cross_device_ops='ring'"),
    Case("NCCL without GPUs", lambda: kmk.distributed(8, cross_device_ops="nccl").distribution,
         ValueError, "needs GPU replicas"),
    Case("unknown learning-rate rule", lambda: kmk.distributed(8, lr_scaling_rule="cubic"),
         ValueError, "rule='cubic'"),
    Case("non-positive learning rate", lambda: kmk.scale_learning_rate(-1e-3, 64, 128),
         ValueError, "base_learning_rate=-0.001"),
    Case("factory returns no model", factory_returning(lambda: None), TypeError,
         "must return a keras.Model"),
    Case("model built outside the scope", lambda: outside_model_factory()(), ValueError,
         "model returned by `build` was created outside the strategy's scope"),
    Case("optimizer created outside the scope", lambda: outside_optimizer_factory()(),
         ValueError, "optimizer of the model returned by `build` was created outside"),
    Case("layer built outside the scope", lambda: outside_layer_factory()(), ValueError,
         "were created outside the strategy's scope"),
    Case("late compile with an optimizer made outside", late_compile_outside_optimizer,
         ValueError, "was created outside the strategy's scope"),
    Case("kmk.current() outside distributed()", kmk.current, RuntimeError,
         "outside a distributed() context"),
    Case("simulate_replicas after TensorFlow started",
         subprocess_error("import tensorflow as tf, keras_mirror_kit as kmk\n"
                          "tf.constant(1)\nkmk.simulate_replicas(2)\n"),
         RuntimeError, "was called after TensorFlow initialised its devices"),
    Case("bad KMK_SIMULATE_REPLICAS",
         subprocess_error("import keras_mirror_kit as kmk\nkmk.distributed(8).distribution\n",
                          env={"KMK_SIMULATE_REPLICAS": "two"}),
         RuntimeError, "KMK_SIMULATE_REPLICAS='two'"),
    Case("make_dataset without a batch size", lambda: kmk.make_dataset(X, Y), TypeError,
         "batch_size=None"),
    Case("make_dataset batch larger than the data", lambda: kmk.make_dataset(X, Y, 128),
         ValueError, "larger than the data"),
    Case("make_dataset arrays of different lengths", lambda: kmk.make_dataset(X, Y[:10], 8),
         ValueError, "same first dimension"),
    Case("partial batch that leaves a replica empty",
         lambda: kmk.make_dataset(X[:17], Y[:17], 8, shuffle=False, num_replicas=2),
         ValueError, "does not split evenly over 2 replicas"),
    Case("ThroughputMonitor on a non-kit model without a batch size",
         lambda: fit(plain_model(), [kmk.ThroughputMonitor()], data=(X, Y)), ValueError,
         "global_batch_size"),
    Case("ThroughputMonitor with a non-positive batch size",
         lambda: kmk.ThroughputMonitor(global_batch_size=0), ValueError, "global_batch_size=0"),
    Case("ThroughputMonitor contradicting the distribution",
         lambda: fit(kit_model(), [kmk.ThroughputMonitor(global_batch_size=99)]), ValueError,
         "global_batch_size=99"),
    Case("SyncedCheckpoint with save_freq=0", lambda: kmk.SyncedCheckpoint("c", save_freq=0),
         ValueError, "save_freq=0"),
    Case("SyncedCheckpoint keeping nothing", lambda: kmk.SyncedCheckpoint("c", keep=0),
         ValueError, "keep=0"),
    Case("SyncedCheckpoint dataset not built by make_dataset",
         lambda: kmk.SyncedCheckpoint("c", dataset=tf.data.Dataset.range(3)), ValueError,
         "must be a dataset built by kmk.make_dataset"),
    Case("checkpoint directory is a file", file_as_checkpoint_dir, kmk.CheckpointError,
         "is not a directory", needs_tmp=True),
    Case("checkpoint written by another model", checkpoint_of_another_model,
         kmk.CheckpointError, "does not match this model", needs_tmp=True),
    Case("restore=False over an earlier run's checkpoints",
         restore_false_over_old_checkpoints, kmk.CheckpointError,
         "restore=False would start a new run", needs_tmp=True),
    Case("make_dataset without a seed in a multi-worker run",
         dataset_without_seed_in_a_multi_worker_run, ValueError,
         "needs a `seed` in a multi-worker run"),
    Case("SyncedCheckpoint(dataset=) with steps_per_epoch",
         lambda: fit(kit_model(), [kmk.SyncedCheckpoint(
             "c", dataset=kmk.make_dataset(X, Y, 16, seed=0))], steps_per_epoch=2,
             data=kmk.make_dataset(X, Y, 16, seed=0).repeat()), ValueError,
         "steps_per_epoch=2"),
    Case("WarmupSchedule with zero warmup steps", lambda: kmk.WarmupSchedule(0.1, 0),
         ValueError, "warmup_steps=0"),
    Case("TF_CONFIG that is not JSON", with_tf_config("{bad json"), ValueError,
         "TF_CONFIG is invalid: it is not valid JSON"),
    Case("TF_CONFIG task index out of range",
         with_tf_config('{"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, '
                        '"task": {"type": "worker", "index": 5}}'),
         ValueError, "task index 5 is out of range"),
    Case("CIFAR-10 requested offline with download=False",
         lambda: kmk.datasets.load_cifar10(cache_dir="/nonexistent-kmk", download=False),
         kmk.datasets.CIFAR10NotAvailableError, "download=False"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_misuse_raises_a_clear_error_before_any_training_step(case, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Steps.count = 0
    if case.error is RuntimeError and case.trigger.__name__ == "trigger":
        with pytest.raises(RuntimeError) as info:
            case.trigger()
    else:
        with pytest.raises(case.error) as info:
            case.trigger(tmp_path) if case.needs_tmp else case.trigger()
    assert case.message in str(info.value)
    assert Steps.count == 0  # no training step ran


def test_the_catalogue_is_long_enough_and_documented():
    assert len(CASES) >= 20
    doc = (REPO / "docs" / "reliability.md").read_text()
    table = {m.group(1).strip() for m in re.finditer(r"^\| ([^|]+) \|", doc, re.M)}
    missing = [c.name for c in CASES if c.name not in table]
    assert not missing, f"docs/reliability.md lacks: {missing}"
