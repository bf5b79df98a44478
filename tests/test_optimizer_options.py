"""Optimizer options on 1 and 2 replicas: gradient clipping and EMA train as on one device.

Each configuration trains the same small Dense model for 2 epochs (16 steps of a global
batch of 16 per epoch, the same data order) three times: plain Keras without a strategy,
a kit-built model on 1 replica and one on 2 replicas (this process has 2 logical CPUs,
`tests/conftest.py`). The 2 epochs run as one `fit` epoch over the 16 batches twice: the
same 32 steps on the same batches, the same weights bit for bit, without the cost of an
epoch's end (no optimizer option acts on one). Keras clips each replica's gradient before
the all-reduce (`keras_mirror_kit.workarounds.keras_gradient_clipping`) and its EMA
overwrite fails under any strategy (`keras_mirror_kit.workarounds.keras_ema_overwrite`); the
kit-built models must end where the plain one ends. `docs/distributed.md` lists what these
tests check.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import NamedTuple

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mirror_kit as kmk
from keras_mirror_kit.workarounds import (
    keras_ema_overwrite,
    keras_grad_accumulation,
    keras_gradient_clipping,
)
from tests.ckpt_helpers import max_diff
from tests.processes import run_worker_script

GLOBAL_BATCH, STEPS, EPOCHS = 16, 16, 2
X = np.random.default_rng(0).normal(size=(GLOBAL_BATCH * STEPS, 6)).astype("float32")
Y = (3.0 * X[:, :3].sum(axis=1, keepdims=True) + X[:, 3:4] ** 2).astype("float32")

SGD, Adam, AdamW = keras.optimizers.SGD, keras.optimizers.Adam, keras.optimizers.AdamW


class Config(NamedTuple):
    optimizer: Callable[[], keras.optimizers.Optimizer]
    knobs: dict = {}  # noqa: RUF012  (distributed()'s, never mutated)
    tolerance: float = 1e-6  # float32: 2 partial sums instead of 1 (measured <= 3.6e-7)
    plain: bool = True  # also compared with plain Keras (no strategy)
    y_scale: float = 1.0  # targets scaled (float16: no step may overflow, see below)


EMA_UPSTREAM = keras_ema_overwrite.status() == "fixed-upstream"  # Keras 3.16

CONFIGS = {
    "sgd": Config(lambda: SGD(0.05)),
    "adam": Config(lambda: Adam(0.01)),
    # Clipping: the kit leaves 1 replica alone, so 1 replica is one device (the baselines'
    # plain and 1-replica runs agree exactly) and a plain run would only repeat it.
    "sgd-clipnorm": Config(lambda: SGD(0.05, clipnorm=0.2), plain=False),
    "sgd-global_clipnorm": Config(lambda: SGD(0.05, global_clipnorm=0.2), plain=False),
    "sgd-clipvalue": Config(lambda: SGD(0.05, clipvalue=0.05), plain=False),
    "adam-global_clipnorm": Config(lambda: Adam(0.01, global_clipnorm=0.2), plain=False),
    "adamw-weight_decay-clipnorm": Config(
        lambda: AdamW(0.01, weight_decay=0.1, clipnorm=0.2), plain=False
    ),
    # Keras' own accumulation on one device (plain) against the kit's on 1 and 2 replicas.
    "sgd-global_clipnorm-weight_decay-accumulate2": Config(
        lambda: SGD(0.05, global_clipnorm=0.2, weight_decay=0.01, gradient_accumulation_steps=2),
        {"gradient_accumulation_steps": 2},
    ),
    # float16 forward and backward passes: 2 replicas sum two float16-rounded partial
    # gradients where 1 replica rounds one, a difference of float16's precision (2^-11
    # relative) in each gradient, before the (exact) clipping; measured 1.7e-5, tolerance
    # 1e-4, 1000x below what the unfixed clipping moves (9.5e-2). Targets / 10, so no step
    # overflows at Keras' initial loss scale 2^15 (a replica's float16 gradient is 1/N of
    # one device's, so an overflow, a skipped step, can happen on 1 replica and not on 2).
    "sgd-clipnorm-float16": Config(
        lambda: SGD(0.2, clipnorm=0.05),
        {"mixed_precision": "mixed_float16"},
        tolerance=1e-4,
        plain=False,
        y_scale=0.1,
    ),
    "sgd-ema": Config(lambda: SGD(0.05, use_ema=True)),
    "sgd-ema-overwrite": Config(lambda: SGD(0.05, use_ema=True, ema_overwrite_frequency=2)),
    "adam-ema": Config(lambda: Adam(0.01, use_ema=True, ema_momentum=0.9)),
    "adam-ema-overwrite": Config(
        lambda: Adam(0.01, use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=2)
    ),
}
CHECKED = [name for name in CONFIGS if name not in ("sgd", "adam")]  # baselines: see below


def _model() -> keras.Model:
    keras.utils.set_random_seed(7)
    return keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)]
    )


def _dataset(y_scale: float = 1.0) -> tf.data.Dataset:
    return tf.data.Dataset.from_tensor_slices((X, Y * y_scale)).batch(GLOBAL_BATCH)  # one order


def _train(model: keras.Model, y_scale: float = 1.0) -> None:
    """`EPOCHS` epochs of the 16 batches, as one fit epoch (see the module's docstring)."""
    model.fit(_dataset(y_scale).repeat(EPOCHS), epochs=1, verbose=0)


@functools.cache
def _trained(name: str, where: str) -> keras.Model:
    """The model of configuration `name` after 2 epochs: plain Keras, kit on 1 or 2 replicas."""
    optimizer, knobs, _, _, y_scale = CONFIGS[name]
    if where == "plain":
        model = _model()
        model.compile(optimizer=optimizer(), loss="mse")
    else:
        devices = ["/cpu:0"] if where == "kit-1" else None

        @kmk.distributed(global_batch_size=GLOBAL_BATCH, devices=devices, **knobs)
        def factory():
            model = _model()
            model.compile(optimizer=optimizer(), loss="mse")
            return model

        model = factory()
        assert factory.distribution.num_replicas == (1 if where == "kit-1" else 2)
    _train(model, y_scale)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("name", CHECKED)
def test_one_and_two_replicas_train_as_one_device(name):
    _, _, tolerance, with_plain, _ = CONFIGS[name]
    one, two = _trained(name, "kit-1"), _trained(name, "kit-2")
    for model in (one, two):  # every step applied (float16: none skipped)
        assert int(model.optimizer.iterations.numpy()) == EPOCHS * STEPS // (
            CONFIGS[name].knobs.get("gradient_accumulation_steps", 1)
        )
    moved = max_diff(one.get_weights(), _model().get_weights())
    assert moved > 100 * tolerance  # training really changed the weights
    diff = max_diff(two.get_weights(), one.get_weights())
    assert diff <= tolerance, f"{name}: 2 replicas vs 1: max |w2 - w1| = {diff:.3g}"
    if with_plain:
        plain = _trained(name, "plain").get_weights()
        diff = max_diff(one.get_weights(), plain)
        assert diff <= tolerance, f"{name}: 1 replica vs plain Keras: {diff:.3g}"
    inner = keras_grad_accumulation.accumulating_optimizer(two.optimizer)
    assert keras_gradient_clipping.is_fixed(two.optimizer)  # every optimizer on 2 replicas
    assert not keras_gradient_clipping.is_fixed(one.optimizer)  # 1 replica: nothing to fix
    # Keras 3.16 overwrites in a merge_call itself: the kit's fix retires there.
    assert keras_ema_overwrite.is_fixed(inner) == (bool(inner.use_ema) and not EMA_UPSTREAM)


@pytest.mark.slow
def test_the_options_change_what_trains():
    """Each option really acts on this model and data (else the tests above prove nothing)."""
    base = {"sgd": _trained("sgd", "plain"), "adam": _trained("adam", "plain")}
    for name in CHECKED:
        if CONFIGS[name].y_scale != 1.0:
            continue  # other targets: no baseline here (2 replicas unfixed: 9.5e-2 away)
        baseline = base["adam" if name.startswith("adam") else "sgd"].get_weights()
        assert max_diff(_trained(name, "kit-1").get_weights(), baseline) > 1e-3, name
    overwrite = _trained("adam-ema-overwrite", "kit-1").get_weights()
    assert max_diff(overwrite, _trained("adam-ema", "kit-1").get_weights()) > 1e-3


@pytest.mark.slow
def test_ema_keeps_its_config_and_fit_ends_on_the_averages():
    for name in ("adam-ema", "adam-ema-overwrite"):
        model = _trained(name, "kit-2")
        config = model.optimizer.get_config()
        assert config["use_ema"] is True and config["ema_momentum"] == 0.9
        assert config["ema_overwrite_frequency"] == (2 if name.endswith("overwrite") else None)
        averages = [v.numpy() for v in model.optimizer._model_variables_moving_average]
        # finalize_variable_values (end of fit, cross-replica context) copied the averages
        assert max_diff(model.get_weights(), averages) == 0.0
        for variable in model.trainable_variables:  # the replicas' copies stayed identical
            copies = [v.numpy() for v in variable.value.values]
            np.testing.assert_array_equal(copies[0], copies[1])


def _one_weight(devices, **clip) -> float:
    """One weight w = 1, SGD(learning_rate=1), one step whose global gradient is 200."""

    @kmk.distributed(global_batch_size=2, devices=devices)
    def factory():
        model = keras.Sequential(
            [keras.Input((1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")]
        )
        model.compile(optimizer=SGD(1.0, **clip), loss="mse")
        return model

    model = factory()
    x, y = np.ones((2, 1), "float32"), np.full((2, 1), -99.0, "float32")  # d/dw = 2(w - y)
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(2), epochs=1, verbose=0)
    return float(model.get_weights()[0][0, 0])


@pytest.mark.slow
@pytest.mark.parametrize("clip", ["clipnorm", "global_clipnorm", "clipvalue"])
def test_one_weight_is_clipped_to_the_threshold_on_any_replica_count(clip):
    """1 replica: 1 - 1 = 0. Keras on 2 replicas clips each half (100) to 1: 1 - 2 = -1."""
    assert _one_weight(["/cpu:0"], **{clip: 1.0}) == 0.0
    assert _one_weight(None, **{clip: 1.0}) == 0.0


def test_plain_keras_still_clips_each_replica():
    """The upstream behaviour with plain Keras: an upgrade that fixes it fails this test."""
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")]
        )
        model.compile(optimizer=SGD(1.0, clipnorm=1.0), loss="mse")
    x, y = np.ones((2, 1), "float32"), np.full((2, 1), -99.0, "float32")
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(2), epochs=1, verbose=0)
    assert float(model.get_weights()[0][0, 0]) == -1.0, (
        "Keras now clips the all-reduced gradient: the bug of "
        f"{keras_gradient_clipping.UPSTREAM} is fixed in Keras {keras.__version__}; limit "
        "keras_gradient_clipping.TESTED_KERAS so the workaround stops applying"
    )
    assert keras_gradient_clipping._bug_in_source()


def test_plain_keras_ema_overwrite_still_fails_under_a_strategy():
    """The upstream bug with plain Keras (one device is enough): a fix fails this test, on
    a Keras where the kit still applies the workaround (Keras 3.16 fixed it: there the
    kit must see it fixed, and plain Keras trains)."""
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        model = _model()
        model.compile(optimizer=SGD(0.05, use_ema=True, ema_overwrite_frequency=2), loss="mse")
    if keras_ema_overwrite.status() == "fixed-upstream":
        model.fit(_dataset().take(2), epochs=1, verbose=0)  # trains: the bug is gone
        assert not keras_ema_overwrite._bug_in_source()
        return
    assert keras_ema_overwrite.status() == "tested"
    with pytest.raises(RuntimeError, match="merge_call"):
        model.fit(_dataset().take(2), epochs=1, verbose=0)
    assert keras_ema_overwrite._bug_in_source()


def test_a_keras_that_clips_after_the_sum_or_overwrites_without_merge_is_taken_as_fixed():
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    class ClipsAfterTheSum(TFOptimizer):
        def _all_reduce_sum_gradients(self, grads_and_vars):
            reduced = super()._all_reduce_sum_gradients(grads_and_vars)
            grads = self._clip_gradients([g for g, _ in reduced])
            return list(zip(grads, [v for _, v in reduced]))

    class OverwritesLocally(TFOptimizer):
        def _overwrite_model_variables_with_average_value(self, trainable_variables):
            for var, average in zip(trainable_variables, self._model_variables_moving_average):
                var.assign(average)

    assert not keras_gradient_clipping._bug_in_source(ClipsAfterTheSum)
    assert not keras_ema_overwrite._bug_in_source(OverwritesLocally)


def test_untested_keras_with_the_bugs_refuses_before_any_step(monkeypatch):
    assert keras_gradient_clipping.status() == "tested"
    ema_fixed = keras_ema_overwrite.status() == "fixed-upstream"  # Keras 3.16
    assert ema_fixed or keras_ema_overwrite.status() == "tested"
    monkeypatch.setattr(keras_gradient_clipping, "TESTED_KERAS", ((9, 0, 0), (9, 1, 0)))
    monkeypatch.setattr(keras_ema_overwrite, "TESTED_KERAS", ((9, 0, 0), (9, 1, 0)))
    assert keras_gradient_clipping.status() == "refused"
    assert keras_ema_overwrite.status() == ("fixed-upstream" if ema_fixed else "refused")

    def factory_for(optimizer):
        @kmk.distributed(global_batch_size=2)
        def factory():
            model = _model()
            model.compile(optimizer=optimizer(), loss="mse")
            return model

        return factory

    with pytest.raises(ValueError, match=r"clipnorm=0\.5.*replicas=2") as info:
        factory_for(lambda: SGD(0.1, clipnorm=0.5))()
    assert keras.__version__ in str(info.value)
    if not ema_fixed:
        with pytest.raises(ValueError, match="ema_overwrite_frequency=2"):
            factory_for(lambda: SGD(0.1, use_ema=True, ema_overwrite_frequency=2))()
    plain = factory_for(lambda: SGD(0.1, use_ema=True))()  # nothing to refuse
    assert not keras_gradient_clipping.is_fixed(plain.optimizer)
    assert not keras_ema_overwrite.is_fixed(plain.optimizer)


@pytest.mark.slow
def test_fixed_when_compiled_after_the_factory_or_in_a_with_block():
    @kmk.distributed(global_batch_size=GLOBAL_BATCH)
    def build():
        return _model()

    late = build()
    config = {"learning_rate": 0.01, "use_ema": True, "ema_momentum": 0.9}
    config["ema_overwrite_frequency"] = 2
    # Made inside compile() (inside the scope), as a later compile's optimizer must be.
    late.compile(optimizer={"class_name": "Adam", "config": config}, loss="mse")
    with kmk.distributed(global_batch_size=GLOBAL_BATCH, mixed_precision="mixed_float16"):
        block = _model()
        block.compile(optimizer=SGD(0.05, use_ema=True, clipnorm=0.2), loss="mse")
    assert isinstance(block.optimizer, keras.optimizers.LossScaleOptimizer)
    for model in (late, block):
        assert keras_gradient_clipping.is_fixed(model.optimizer)
        assert keras_ema_overwrite.is_fixed(model.optimizer) is not EMA_UPSTREAM
    _train(late)  # the overwrite traces and runs
    expected = _trained("adam-ema-overwrite", "plain").get_weights()
    assert max_diff(late.get_weights(), expected) <= 1e-6


WORKER = """
import json, os, sys
import numpy as np, tensorflow as tf, keras
import keras_mirror_kit as kmk
from keras_mirror_kit.workarounds import keras_ema_overwrite, keras_gradient_clipping

out, rank = sys.argv[1], json.loads(os.environ["TF_CONFIG"])["task"]["index"]

@kmk.distributed(global_batch_size=2)  # one strategy per process
def one_weight(**options):
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(
        1, use_bias=False, kernel_initializer="ones")])
    model.compile(optimizer=keras.optimizers.SGD(**options), loss="mse")
    return model

def train(model, y, samples):
    x, y = np.ones((samples, 1), "float32"), np.full((samples, 1), y, "float32")
    model.fit(kmk.make_dataset(x, y, 2, seed=1), epochs=1, verbose=0)
    return float(model.get_weights()[0][0, 0])

result = {}
model = one_weight(learning_rate=1.0, clipnorm=1.0)
result["clipnorm"] = [train(model, -99.0, 2), keras_gradient_clipping.is_fixed(model.optimizer)]
model = one_weight(learning_rate=0.1, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=2)
upstream = keras_ema_overwrite.status() == "fixed-upstream"  # Keras 3.16: its own merge_call
result["ema"] = [train(model, 3.0, 8), keras_ema_overwrite.is_fixed(model.optimizer) or upstream]
with open(os.path.join(out, f"result-{rank}.json"), "w") as f:
    json.dump(result, f)
"""


@pytest.mark.slow
def test_two_workers_clip_the_reduced_gradient_and_overwrite_with_ema(tmp_path):
    """MultiWorkerMirroredStrategy (1 replica per worker) takes the same all-reduce path.

    The 2 workers get a TF_CONFIG each (as `launch` makes it) and are forked from the
    tests' zygote (the check is on training, not on the launcher): each must end by itself
    (a stalled collective fails after 120 s)."""
    run_worker_script(WORKER, tmp_path)
    # One device: w = 1, every step the gradient 2 (w - 3) over the same rows; the average
    # (momentum 0.5) overwrites the weight after steps 2 and 4, and fit ends on the average.
    w, average = 1.0, None
    for step in range(4):
        w -= 0.1 * 2 * (w - 3.0)
        average = w if average is None else 0.5 * average + 0.5 * w
        if (step + 1) % 2 == 0:
            w = average
    for rank in (0, 1):
        result = json.loads((tmp_path / f"result-{rank}.json").read_text())
        assert result["clipnorm"] == [0.0, True], (rank, result)
        assert result["ema"][1] is True and result["ema"][0] == pytest.approx(average, abs=1e-6)
