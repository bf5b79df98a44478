"""A kit-built model compiled again after its factory, as Keras' fine-tuning guide does.

keras-io's "Transfer learning & fine-tuning": a frozen base and a new head trained, then
`base.trainable = True` and `model.compile(...)` again with a small learning rate, outside
the factory. Plain Keras under a hand-made `MirroredStrategy` fails that second compile
("Mixing different tf.distribute.Strategy objects"); a kit model's later `compile()` runs
inside its strategy's scope and gets the distribution's settings again.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_mirror_kit as kmk

ONE, TWO = ["/cpu:0"], ["/cpu:0", "/cpu:1"]
GLOBAL = 16
TOLERANCE = 1e-6
RNG = np.random.default_rng(3)
X = RNG.normal(size=(64, 6)).astype("float32")
Y = (X[:, 0] + X[:, 1] > 0).astype("int32")


def _fine_tuning(devices: list[str], steps_per_execution: int | None = None):
    """The guide's two phases on `devices`: (model, base)."""

    @kmk.distributed(
        global_batch_size=GLOBAL, devices=devices, steps_per_execution=steps_per_execution
    )
    def build():
        keras.utils.set_random_seed(5)
        base = keras.Sequential(
            [keras.Input((6,)), keras.layers.Dense(8, activation="relu")], name="base"
        )
        base.trainable = False
        inputs = keras.Input((6,))
        outputs = keras.layers.Dense(2)(base(inputs, training=False))
        model = keras.Model(inputs, outputs)
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return model

    model = build()
    return model, model.get_layer("base")


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _two_phases(devices: list[str], second_optimizer) -> keras.Model:
    model, base = _fine_tuning(devices)
    model.fit(X, Y, epochs=1, shuffle=False, verbose=0)
    base.trainable = True
    model.compile(optimizer=second_optimizer(), loss=_loss())  # outside the factory
    model.fit(X, Y, epochs=1, shuffle=False, verbose=0)
    return model


@pytest.mark.parametrize(
    "second",
    [lambda: keras.optimizers.SGD(0.01), lambda: "sgd"],
    ids=["optimizer made outside the scope", "string"],
)
def test_a_second_compile_outside_the_factory_trains_on_two_replicas_as_on_one(second):
    one, two = _two_phases(ONE, second), _two_phases(TWO, second)
    for a, b in zip(one.get_weights(), two.get_weights(), strict=True):
        assert float(np.max(np.abs(a - b))) <= TOLERANCE
    assert int(two.optimizer.iterations.numpy()) == 64 // GLOBAL  # the new optimizer's steps
    assert two.optimizer._distribution_strategy is kmk.distribution_of(two).strategy


def test_an_optimizer_made_outside_the_scope_is_re_created_inside_with_its_config():
    model, _ = _fine_tuning(TWO)
    outside = keras.optimizers.Adam(1e-5, beta_1=0.8)
    model.compile(optimizer=outside, loss=_loss())
    assert model.optimizer is not outside
    assert isinstance(model.optimizer, keras.optimizers.Adam)
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(1e-5)
    assert model.optimizer.beta_1 == 0.8
    assert model.optimizer._distribution_strategy is kmk.distribution_of(model).strategy


def test_an_optimizer_holding_state_from_outside_the_scope_is_refused():
    model, _ = _fine_tuning(TWO)
    used = keras.optimizers.SGD(0.1)
    weight = keras.Variable(np.ones((2,), "float32"))
    used.apply_gradients([(np.ones((2,), "float32"), weight)])  # built, one step taken
    with pytest.raises(ValueError, match=r"already holds state.*iterations=1"):
        model.compile(optimizer=used, loss=_loss())


def test_a_second_compile_keeps_the_distributions_settings():
    model, base = _fine_tuning(TWO, steps_per_execution=4)
    assert model.steps_per_execution == 4
    base.trainable = True
    model.compile(optimizer="adam", loss=_loss())  # Keras' default: steps_per_execution=1
    assert model.steps_per_execution == 4
    with pytest.raises(ValueError, match=r"steps_per_execution=2.*one place"):
        model.compile(optimizer="adam", loss=_loss(), steps_per_execution=2)


def _scheduled(devices: list[str]) -> keras.Model:
    @kmk.distributed(global_batch_size=GLOBAL, devices=devices)
    def build():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
        schedule = kmk.WarmupSchedule(0.1, warmup_steps=4)
        model.compile(optimizer=keras.optimizers.SGD(schedule), loss=_loss())
        return model

    return build()


@pytest.mark.parametrize(
    "callback",
    [
        lambda: keras.callbacks.ReduceLROnPlateau(monitor="loss"),
        lambda: keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.1 * 0.5**epoch),
    ],
    ids=["ReduceLROnPlateau", "LearningRateScheduler"],
)
def test_a_learning_rate_callback_on_a_schedule_is_refused_before_any_step(callback):
    model = _scheduled(TWO)
    with pytest.raises(ValueError, match=r"sets the optimizer's learning rate.*WarmupSchedule"):
        model.fit(X, Y, epochs=2, verbose=0, callbacks=[callback()])
    assert int(model.optimizer.iterations.numpy()) == 0  # before any step


def test_a_learning_rate_scheduler_on_a_scaled_rate_is_said_once(caplog):
    import logging

    model, _ = _fine_tuning(TWO)
    scheduler = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.05)
    with caplog.at_level(logging.WARNING, logger="keras_mirror_kit"):
        model.fit(X, Y, epochs=1, verbose=0, callbacks=[scheduler])
        model.fit(X, Y, epochs=1, verbose=0, callbacks=[scheduler])
    lines = [r for r in caplog.records if "LearningRateScheduler sets" in r.getMessage()]
    assert len(lines) == 1 and "on 2 replicas (global batch 16)" in lines[0].getMessage()
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(0.05)  # as written
