"""`distributed()` as a decorator and a context, in a 2-replica process (see conftest)."""

from __future__ import annotations

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mirror_kit as kmk
from tests import models

X = np.random.default_rng(0).normal(size=(64, 6)).astype("float32")
Y = (X[:, 0] > 0).astype("int32") + (X[:, 1] > 0).astype("int32")


@pytest.mark.slow
def test_decorator_builds_under_the_strategy_and_exposes_distribution():
    seen = {}

    @kmk.distributed(per_replica_batch_size=16)
    def build_model(units=4):
        """Builds the test model."""
        dist = kmk.current()
        seen["dist"] = dist
        seen["strategy"] = tf.distribute.get_strategy()
        seen["lr"] = dist.scale_learning_rate(0.1, base_batch_size=16)
        return models.compile_sgd(models.sequential(units), seen["lr"])

    assert build_model.__name__ == "build_model"
    assert build_model.__doc__ == "Builds the test model."
    model = build_model(units=5)
    dist = build_model.distribution
    assert seen["dist"] is dist
    assert seen["strategy"] is dist.strategy
    assert isinstance(dist.strategy, tf.distribute.MirroredStrategy)
    assert dist.num_replicas == 2
    assert len(dist.devices) == 2 and all("CPU" in d for d in dist.devices)
    assert dist.per_replica_batch_size == 16 and dist.global_batch_size == 32
    assert dist.is_chief is True
    assert seen["lr"] == pytest.approx(0.2)  # linear: 0.1 x (32 / 16)
    assert model.layers[0].units == 5  # arguments pass through
    assert kmk.distribution_of(model) is dist
    # every variable is mirrored on both replicas
    for variable in model.variables:
        assert len(dist.strategy.experimental_local_results(variable.value)) == 2
    history = model.fit(X, Y, batch_size=dist.global_batch_size, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_context_manager_binds_distribution_and_current_is_scoped():
    config = kmk.distributed(global_batch_size=64)
    with config as dist:
        assert kmk.current() is dist
        model = models.compile_sgd(models.functional())
    assert dist.per_replica_batch_size == 32 and dist.global_batch_size == 64
    assert kmk.distribution_of(model) is dist
    with pytest.raises(RuntimeError, match="outside a distributed"):
        kmk.current()
    # re-entering reuses the same strategy
    with config as again:
        assert again is dist


def test_nesting_the_same_distribution_works_and_another_is_a_clear_error():
    outer = kmk.distributed(per_replica_batch_size=4)
    other = kmk.distributed(per_replica_batch_size=8, devices=["/cpu:0"])
    _ = other.distribution  # created outside any scope
    with outer as d_outer:
        with outer as d_again:
            assert d_again is d_outer and kmk.current() is d_outer
        assert kmk.current() is d_outer
        with pytest.raises(RuntimeError, match="cannot mix strategies") as raised:
            with other:
                pass
        assert "`distribution_strategy=dist.strategy`" in str(raised.value)  # KerasTuner's
        assert kmk.current() is d_outer


@pytest.mark.slow
@pytest.mark.parametrize("flavour", ["sequential", "functional", "subclassed", "subclassed_lazy"])
def test_every_model_flavour_trains_through_the_decorator(flavour):
    @kmk.distributed(per_replica_batch_size=8)
    def build():
        return models.compile_sgd(getattr(models, flavour)())

    model = build()
    before = [v.numpy().copy() for v in model.trainable_variables]
    assert bool(before) == (flavour != "subclassed_lazy")
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    if flavour == "subclassed_lazy":
        model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
        assert len(model.trainable_variables) == 4
    else:
        assert any(
            not np.allclose(b, v.numpy()) for b, v in zip(before, model.trainable_variables)
        )
    for variable in model.variables:
        values = build.distribution.strategy.experimental_local_results(variable.value)
        np.testing.assert_array_equal(values[0].numpy(), values[1].numpy())


def test_one_replica_on_an_explicit_device():
    @kmk.distributed(per_replica_batch_size=8, devices=["/cpu:0"])
    def build():
        return models.compile_sgd(models.sequential())

    build()
    assert build.distribution.num_replicas == 1
    assert build.distribution.global_batch_size == 8


def test_info_log_line_says_what_was_chosen(caplog):
    caplog.set_level(logging.INFO, logger="keras_mirror_kit")
    with kmk.distributed(per_replica_batch_size=64):
        pass
    lines = [r.getMessage() for r in caplog.records if r.name == "keras_mirror_kit"]
    assert len(lines) == 1
    line = lines[0]
    expected = (
        "MirroredStrategy",
        "CPU:0",
        "CPU:1",
        "2 replicas",
        "all-reduce=reduction_to_one_device",
        "global batch 128 = 64 per replica x 2",
    )
    for fragment in expected:
        assert fragment in line


@pytest.mark.slow
def test_uncompiled_model_compiles_later_inside_the_scope():
    @kmk.distributed(per_replica_batch_size=8)
    def build():
        return models.functional()

    model = build()
    assert not model.compiled
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))
    assert model.optimizer._distribution_strategy is build.distribution.strategy  # noqa: SLF001
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    opt_vars = model.optimizer.variables
    assert opt_vars and all(
        len(build.distribution.strategy.experimental_local_results(v.value)) == 2 for v in opt_vars
    )


def test_late_compile_with_an_optimizer_made_outside_re_creates_it_or_refuses_its_state():
    @kmk.distributed(per_replica_batch_size=8)
    def build():
        return models.functional()

    model = build()
    outside = keras.optimizers.Adam(3e-4)
    model.compile(optimizer=outside, loss="mse")  # no state yet: re-created in the scope
    assert model.optimizer is not outside and model.optimizer.get_config() == outside.get_config()
    assert model.optimizer._distribution_strategy is kmk.distribution_of(model).strategy
    outside.build(model.trainable_variables)  # now it holds state made outside the scope
    with pytest.raises(ValueError, match="optimizer created outside the strategy's scope"):
        model.compile(optimizer=outside, loss="mse")


def test_model_built_outside_the_scope_is_rejected():
    prebuilt = models.compile_sgd(models.sequential())

    @kmk.distributed(per_replica_batch_size=8)
    def build():
        return prebuilt

    with pytest.raises(ValueError, match="created outside the strategy's scope") as info:
        build()
    assert "inside the decorated factory" in str(info.value)


def test_layer_built_outside_the_scope_is_rejected():
    layer = keras.layers.Dense(3)
    layer.build((None, 6))

    @kmk.distributed(per_replica_batch_size=8)
    def build():
        return keras.Sequential([keras.Input((6,)), layer])

    with pytest.raises(ValueError, match=r"variable\(s\) .* created outside") as info:
        build()
    assert "kernel" in str(info.value)


def test_optimizer_created_outside_the_scope_is_rejected():
    optimizer = keras.optimizers.Adam(1e-3)

    @kmk.distributed(per_replica_batch_size=8)
    def build():
        model = models.sequential()
        model.compile(optimizer=optimizer, loss="mse")
        return model

    with pytest.raises(ValueError, match="optimizer .* created outside") as info:
        build()
    assert "Adam" in str(info.value)


def test_factory_must_return_a_keras_model():
    @kmk.distributed(per_replica_batch_size=8)
    def build():
        return "not a model"

    with pytest.raises(TypeError, match="must return a keras.Model. Received: str"):
        build()


@pytest.mark.parametrize(
    ("kwargs", "exc", "fragment"),
    [
        ({}, ValueError, "needs a batch size"),
        ({"per_replica_batch_size": 8, "global_batch_size": 16}, ValueError, "not both"),
        ({"per_replica_batch_size": 0}, ValueError, "per_replica_batch_size=0"),
        ({"per_replica_batch_size": 8.5}, TypeError, "per_replica_batch_size=8.5"),
        ({"global_batch_size": -2}, ValueError, "global_batch_size=-2"),
        ({"per_replica_batch_size": 8, "strategy": "tpu"}, ValueError, "strategy='tpu'"),
        ({"per_replica_batch_size": 8, "devices": "/cpu:0"}, TypeError, "devices='/cpu:0'"),
        ({"per_replica_batch_size": 8, "lr_scaling_rule": "log"}, ValueError, "rule='log'"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, exc, fragment):
    with pytest.raises(exc) as info:
        kmk.distributed(**kwargs)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "exc", "fragment"),
    [
        ({"global_batch_size": 33}, ValueError, "global_batch_size=33"),
        ({"global_batch_size": 1}, ValueError, "divide evenly"),
        ({"devices": ["/gpu:0"]}, ValueError, "does not exist"),
        ({"devices": ["/cpu:0", "/cpu:0"]}, ValueError, "twice"),
        ({"devices": []}, ValueError, "at least one device"),
        ({"devices": ["nonsense"]}, ValueError, "nonsense"),
        ({"cross_device_ops": "ring"}, ValueError, "cross_device_ops='ring'"),
        ({"cross_device_ops": "nccl"}, ValueError, "needs GPU replicas"),
    ],
)
def test_bad_arguments_fail_before_any_model_is_built(kwargs, exc, fragment):
    kwargs.setdefault("per_replica_batch_size", None)
    if "global_batch_size" in kwargs:
        kwargs.pop("per_replica_batch_size")
    else:
        kwargs["per_replica_batch_size"] = 8
    calls = []

    @kmk.distributed(**kwargs)
    def build():
        calls.append(1)
        return models.sequential()

    with pytest.raises(exc) as info:
        build()
    assert fragment in str(info.value)
    assert calls == []  # the factory never ran


def test_explicit_cross_device_ops_and_ready_made_strategy():
    ops = tf.distribute.HierarchicalCopyAllReduce()
    with kmk.distributed(per_replica_batch_size=4, cross_device_ops=ops) as dist:
        assert dist.cross_device_ops == "HierarchicalCopyAllReduce"
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with kmk.distributed(per_replica_batch_size=4, strategy=strategy) as dist:
        assert dist.strategy is strategy and dist.num_replicas == 1


def test_current_outside_any_context_names_the_fix():
    with pytest.raises(RuntimeError, match=r"@kmk.distributed\(...\)"):
        kmk.current()
