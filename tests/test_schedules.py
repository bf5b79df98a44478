"""WarmupSchedule: values, hand-over, serialization and resume."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_mirror_kit as kmk


def values(schedule, steps):
    return np.array([float(schedule(s)) for s in steps])


def test_linear_ramp_from_target_over_k_then_constant():
    schedule = kmk.WarmupSchedule(0.4, warmup_steps=10, scale_factor=4)
    got = values(schedule, [0, 5, 10, 11, 1000])
    np.testing.assert_allclose(got, [0.1, 0.25, 0.4, 0.4, 0.4], rtol=1e-6)


def test_explicit_start_and_default_start_zero():
    np.testing.assert_allclose(
        values(kmk.WarmupSchedule(1.0, 4, start_learning_rate=0.5), [0, 2, 4]), [0.5, 0.75, 1.0]
    )
    np.testing.assert_allclose(values(kmk.WarmupSchedule(1.0, 4), [0, 1, 4]), [0.0, 0.25, 1.0])


def test_hands_over_to_wrapped_schedule_counting_from_end_of_warmup():
    after = keras.optimizers.schedules.ExponentialDecay(0.4, decay_steps=10, decay_rate=0.5)
    schedule = kmk.WarmupSchedule(0.4, warmup_steps=10, scale_factor=4, after=after)
    got = values(schedule, [5, 10, 20, 30])
    np.testing.assert_allclose(got, [0.25, 0.4, 0.2, 0.1], rtol=1e-6)


def test_config_round_trip_with_nested_schedule():
    after = keras.optimizers.schedules.CosineDecay(0.2, decay_steps=100)
    schedule = kmk.WarmupSchedule(0.2, 7, scale_factor=2, after=after)
    clone = kmk.WarmupSchedule.from_config(schedule.get_config())
    steps = [0, 3, 7, 50, 200]
    np.testing.assert_allclose(values(clone, steps), values(schedule, steps), rtol=1e-7)


def test_keras_model_reloads_with_schedule_and_resumes_from_iterations(tmp_path):
    schedule = kmk.WarmupSchedule(0.01, warmup_steps=8, scale_factor=4)
    with kmk.distributed(per_replica_batch_size=4):
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(schedule), loss="mse")
    x = np.ones((24, 3), "float32")
    model.fit(x, np.zeros((24, 1), "float32"), batch_size=8, epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 3
    path = tmp_path / "m.keras"
    model.save(path)
    reloaded = keras.saving.load_model(path)
    lr_schedule = (
        reloaded.optimizer.learning_rate_schedule
        if hasattr(reloaded.optimizer, "learning_rate_schedule")
        else reloaded.optimizer._learning_rate
    )  # noqa: SLF001
    assert isinstance(lr_schedule, kmk.WarmupSchedule)
    assert int(reloaded.optimizer.iterations.numpy()) == 3
    # The effective learning rate continues from step 3, not from 0.
    assert float(reloaded.optimizer.learning_rate) == pytest.approx(float(schedule(3)), rel=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "exc", "fragment"),
    [
        ({"target_learning_rate": 0}, ValueError, "target_learning_rate=0"),
        ({"warmup_steps": 0}, ValueError, "warmup_steps=0"),
        ({"warmup_steps": 2.5}, TypeError, "warmup_steps=2.5"),
        ({"scale_factor": -2}, ValueError, "scale_factor=-2"),
        ({"start_learning_rate": -0.1}, ValueError, "start_learning_rate=-0.1"),
        ({"after": 0.1}, TypeError, "after=0.1"),
    ],
)
def test_rejects_bad_input(kwargs, exc, fragment):
    args = {"target_learning_rate": 0.1, "warmup_steps": 10}
    args.update(kwargs)
    with pytest.raises(exc, match="Received") as info:
        kmk.WarmupSchedule(**args)
    assert fragment in str(info.value)
