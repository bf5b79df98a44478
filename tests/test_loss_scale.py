"""float16 loss scaling on 2 replicas: an overflow on any replica skips the step (issue 17.1).

Keras' `LossScaleOptimizer` decides from replica 0's local gradients whether a step
overflowed (`keras_mirror_kit.workarounds.keras_loss_scale`). The input row that overflows
float16 goes to one replica only: a global batch of 2 on 2 replicas gives row 0 to replica 0
and row 1 to replica 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mirror_kit as kmk
from keras_mirror_kit.workarounds import keras_loss_scale
from tests.processes import run_worker_script

REPO = Path(__file__).resolve().parent.parent
INITIAL_SCALE = 2.0**15
BIG = 1000.0  # x * x * loss scale overflows float16 (max 65504) in the backward pass


def _batch(overflow_row: int | None) -> tf.data.Dataset:
    x = np.ones((2, 1), "float32")
    if overflow_row is not None:
        x[overflow_row] = BIG
    return tf.data.Dataset.from_tensor_slices((x, np.zeros((2, 1), "float32"))).batch(2)


def _dense_stack(layers: int) -> keras.Model:
    return keras.Sequential(
        [keras.Input((1,))]
        + [keras.layers.Dense(1, kernel_initializer="ones") for _ in range(layers)]
    )


def _weights(model: keras.Model) -> list[np.ndarray]:
    return [np.array(w) for w in model.get_weights()]


@pytest.fixture
def restore_policy():
    before = keras.config.dtype_policy()
    yield
    keras.config.set_dtype_policy(before)


@pytest.mark.slow
def test_plain_keras_still_trusts_replica_0(restore_policy):
    """The upstream bug, with plain Keras: an upgrade that fixes it fails this test."""
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    outcome = {}
    for row in (0, 1):
        keras.config.set_dtype_policy("mixed_float16")
        with strategy.scope():
            model = _dense_stack(1)  # one float16 layer: its gradient overflows
            model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        keras.config.set_dtype_policy("float32")
        model.fit(_batch(row), epochs=1, verbose=0)
        finite = all(np.isfinite(w).all() for w in _weights(model))
        outcome[row] = (float(model.optimizer.dynamic_scale.numpy()), finite)
    assert outcome[0] == (INITIAL_SCALE / 2, True)  # replica 0 overflowed: step skipped
    # Replica 1 overflowed: the infinite all-reduced gradient was applied, scale unchanged.
    assert outcome[1] == (INITIAL_SCALE, False), (
        "Keras' LossScaleOptimizer now skips a step when replica 1 overflows: the bug of "
        f"{keras_loss_scale.UPSTREAM} is fixed in Keras {keras.__version__}; limit "
        "keras_loss_scale.TESTED_KERAS so the workaround stops applying"
    )


@pytest.mark.slow
def test_kit_model_skips_the_step_when_any_replica_overflows():
    """On one model: replica 0 overflows, a normal step, then replica 1 overflows, a normal
    step. Each overflow halves the loss scale and skips the step on every replica."""

    @kmk.distributed(global_batch_size=2, mixed_precision="mixed_float16")
    def build():
        model = _dense_stack(2)  # float16 hidden layer, float32 output (the kit's rule)
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        return model

    model = build()
    assert build.distribution.num_replicas == 2
    assert keras_loss_scale.is_fixed(model.optimizer)
    scale, steps = INITIAL_SCALE, 0
    for row in (0, 1):
        before = _weights(model)
        model.fit(_batch(row), epochs=1, verbose=0)
        scale /= 2
        assert float(model.optimizer.dynamic_scale.numpy()) == scale, row
        assert int(model.optimizer.iterations.numpy()) == steps, row  # the step was skipped
        for old, new in zip(before, _weights(model)):
            np.testing.assert_array_equal(old, new)  # ... on every replica: weights untouched
        model.fit(_batch(None), epochs=1, verbose=0)  # a normal step still trains
        steps += 1
        assert int(model.optimizer.iterations.numpy()) == steps, row
        after = _weights(model)
        assert all(np.isfinite(w).all() for w in after), row
        assert any(not np.array_equal(old, new) for old, new in zip(before, after)), row
        for variable in model.trainable_variables:  # replicas stayed identical
            values = [v.numpy() for v in variable.value.values]
            np.testing.assert_array_equal(values[0], values[1])


@pytest.mark.slow
def test_fixed_when_compiled_after_the_factory_or_in_a_with_block(restore_policy):
    @kmk.distributed(global_batch_size=2, mixed_precision="mixed_float16")
    def build():
        return _dense_stack(2)

    late = build()
    late.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    with kmk.distributed(global_batch_size=2, mixed_precision="mixed_float16"):
        block = _dense_stack(2)
        block.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    for model in (late, block):
        assert keras_loss_scale.is_fixed(model.optimizer)
        model.fit(_batch(1), epochs=1, verbose=0)
        assert float(model.optimizer.dynamic_scale.numpy()) == INITIAL_SCALE / 2
        assert all(np.isfinite(w).all() for w in _weights(model))


def test_one_replica_and_bfloat16_are_left_alone():
    @kmk.distributed(global_batch_size=2, devices=["/cpu:0"], mixed_precision="mixed_float16")
    def one_replica():
        model = _dense_stack(2)
        model.compile(optimizer="sgd", loss="mse")
        return model

    @kmk.distributed(global_batch_size=2, mixed_precision="mixed_bfloat16")
    def bfloat16():
        model = _dense_stack(2)
        model.compile(optimizer="sgd", loss="mse")
        return model

    model = one_replica()
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert not keras_loss_scale.is_fixed(model.optimizer)
    assert not isinstance(bfloat16().optimizer, keras.optimizers.LossScaleOptimizer)


def test_untested_keras_with_the_bug_refuses_float16_on_two_replicas(monkeypatch):
    assert keras_loss_scale.status() == "tested"
    monkeypatch.setattr(keras_loss_scale, "TESTED_KERAS", ((9, 0, 0), (9, 1, 0)))
    assert keras_loss_scale.status() == "refused"  # Keras 3.15's source still has the bug

    @kmk.distributed(global_batch_size=2, mixed_precision="mixed_float16")
    def build():
        model = _dense_stack(2)
        model.compile(optimizer="sgd", loss="mse")
        return model

    with pytest.raises(ValueError, match="mixed_bfloat16") as info:
        build()
    assert "replicas=2" in str(info.value) and keras.__version__ in str(info.value)


def test_a_keras_whose_check_agrees_is_taken_as_fixed_upstream():
    class AgreeingLossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
        def _tf_apply(self, grads, trainable_variables=None):
            return super()._tf_apply(grads, trainable_variables)

        def check_finite(self, grads):
            finite = super().check_finite(grads)
            context = tf.distribute.get_replica_context()
            return context.all_reduce("SUM", tf.cast(finite, "float32")) > 0

    assert keras_loss_scale._bug_in_source(keras.optimizers.LossScaleOptimizer)
    assert not keras_loss_scale._bug_in_source(AgreeingLossScaleOptimizer)


WORKER = """
import json, os, sys
from tests.mw_child import skip_optional_imports
skip_optional_imports()  # JAX, Matplotlib, pandas: unused here, a third of the start
import numpy as np, tensorflow as tf, keras
import keras_mirror_kit as kmk
from keras_mirror_kit.workarounds import keras_loss_scale

out, rank = sys.argv[1], json.loads(os.environ["TF_CONFIG"])["task"]["index"]

@kmk.distributed(global_batch_size=2, mixed_precision="mixed_float16")
def build():
    model = keras.Sequential([keras.Input((1,))] + [
        keras.layers.Dense(1, kernel_initializer="ones") for _ in range(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model

model = build()
x = np.full((2, 1), 1000.0 if rank == 1 else 1.0, "float32")  # worker 1 overflows
data = tf.data.Dataset.from_tensor_slices((x, np.zeros((2, 1), "float32"))).batch(2)
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
model.fit(data.with_options(options), epochs=1, verbose=0)
result = {"fixed": keras_loss_scale.is_fixed(model.optimizer),
          "scale": float(model.optimizer.dynamic_scale.numpy()),
          "iterations": int(model.optimizer.iterations.numpy()),
          "finite": all(bool(np.isfinite(w).all()) for w in model.get_weights())}
with open(os.path.join(out, f"result-{rank}.json"), "w") as f:
    json.dump(result, f)
"""


@pytest.mark.slow
def test_two_workers_agree_when_one_overflows(tmp_path):
    """Without the fix worker 0 waits in the gradient all-reduce that worker 1 skipped.

    The 2 workers get a TF_CONFIG each (as `launch` makes it) and are forked from the
    tests' zygote: each must end by itself (a stalled collective fails after 120 s)."""
    run_worker_script(WORKER, tmp_path)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"result-{rank}.json").read_text())
        assert result == {
            "fixed": True,
            "scale": INITIAL_SCALE / 2,
            "iterations": 0,
            "finite": True,
        }, (rank, result)
