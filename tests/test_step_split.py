"""The step split: where each training step's time goes (`ThroughputMonitor`, docs/throughput.md).

The arithmetic (`keras_mirror_kit.throughput.step_split`) is driven with made-up figures
and a fake clock. The measurement runs on real fits of 2 replicas in this process (see
conftest): a `tf.data` pipeline slowed on purpose by a `py_function` that sleeps in every
batch reads as input-bound and is named once; the same data cached in memory by
`kmk.make_dataset` does not. No test bounds wall-clock time: the slow pipeline's wait is
compared with the step it is part of, never with a duration. JAX runs in a child process
(`KERAS_BACKEND=jax`).
"""

from __future__ import annotations

import logging
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mirror_kit as kmk
from keras_mirror_kit.backends.step_clock import _TimedIterator
from keras_mirror_kit.throughput.step_split import (
    LIMITS,
    SPLIT_KEYS,
    StepTimes,
    describe,
    find_limit,
    split,
)
from tests.subproc import last_json, run_python

PER_REPLICA = 16
GBS = 2 * PER_REPLICA
RNG = np.random.default_rng(0)
X = RNG.random((8 * GBS, 24, 24, 3)).astype("float32")  # 8 steps per epoch
Y = RNG.integers(0, 10, len(X)).astype("int32")
SLEEP = 0.15  # seconds the slow pipeline sleeps in every batch (compute: a few ms)


# ---- the arithmetic, with made-up figures -------------------------------------------------


def test_a_tensorflow_split_counts_the_launch_of_each_call_as_host_work():
    # 1.9 s inside the calls: 1.2 reading batches, 0.6 on the replicas, 0.1 launching.
    times = StepTimes(wall=2.0, in_call=1.9, input_wait=1.2, busy=0.6)
    figures = split(times)
    assert figures == pytest.approx(
        {"input_wait_share": 0.6, "compute_share": 0.3, "host_share": 0.1}
    )
    assert list(figures) == list(SPLIT_KEYS)


def test_a_jax_split_takes_the_rest_of_the_call_as_compute():
    figures = split(StepTimes(wall=1.0, in_call=0.8, input_wait=0.2))
    assert figures == pytest.approx(
        {"input_wait_share": 0.2, "compute_share": 0.6, "host_share": 0.2}
    )


@pytest.mark.parametrize(
    "times",
    [
        StepTimes(wall=1.0, in_call=1.2, input_wait=0.7, busy=0.6),
        StepTimes(wall=1.0, in_call=0.5, input_wait=-0.1, busy=0.2),
        StepTimes(wall=1.0, in_call=1.5, input_wait=2.0),
    ],
)
def test_figures_past_their_range_are_clipped_and_the_shares_still_add_up(times):
    figures = split(times)
    assert figures is not None
    assert all(0.0 <= v <= 1.0 for v in figures.values())
    assert sum(figures.values()) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize(
    "times",
    [StepTimes(wall=0.0, in_call=0.0, input_wait=0.0), StepTimes(wall=1.0, in_call=0.5)],
)
def test_nothing_to_split_gives_none(times):
    assert split(times) is None


def test_step_times_add_up_and_an_unmeasured_figure_stays_unmeasured():
    a = StepTimes(1.0, 0.9, input_wait=0.5, busy=0.3)
    b = StepTimes(2.0, 1.0, input_wait=0.1, busy=None)
    total = a + b
    assert (total.wall, total.in_call, total.input_wait) == pytest.approx((3.0, 1.9, 0.6))
    assert total.busy is None


def test_the_limit_is_named_at_its_threshold_and_input_comes_first():
    assert find_limit({"input_wait_share": 0.49, "compute_share": 0.51, "host_share": 0}) is None
    limit = find_limit({"input_wait_share": 0.5, "compute_share": 0.1, "host_share": 0.4})
    assert limit is not None and limit.key == "input_wait_share"
    assert "50%" in limit.describe() and "cache()" in limit.describe()
    host = find_limit({"input_wait_share": 0.1, "compute_share": 0.5, "host_share": 0.4})
    assert host is not None and "steps_per_execution" in host.advice
    assert find_limit({"input_wait_share": 0.1, "compute_share": 0.9, "host_share": 0.0}) is None
    assert [key for key, *_ in LIMITS] == ["input_wait_share", "host_share"]


def test_describe_names_each_share_in_words():
    words = describe({"input_wait_share": 0.61, "compute_share": 0.27, "host_share": 0.12})
    assert words == "input wait 61%, compute 27%, host 12%"


def test_the_jax_loops_reads_are_timed_with_a_fake_clock():
    now = [0.0]

    class Clock:
        input_wait = 0.0

        @staticmethod
        def now() -> float:
            return now[0]

    def batches():
        for batch in range(3):
            now[0] += 0.25 * (batch + 1)  # the pipeline takes 0.25, 0.5, 0.75 s
            yield batch

    clock = Clock()
    timed = _TimedIterator(batches(), clock)  # type: ignore[arg-type]
    assert next(timed) == 0 and clock.input_wait == pytest.approx(0.25)
    now[0] += 10.0  # the step: not a read
    assert list(timed) == [1, 2]
    assert clock.input_wait == pytest.approx(1.5)


# ---- real fits on 2 replicas -------------------------------------------------------------


def _build(steps_per_execution: int = 1, **kwargs) -> keras.Model:
    keras.utils.set_random_seed(7)

    @kmk.distributed(per_replica_batch_size=PER_REPLICA, **kwargs)
    def factory() -> keras.Model:
        model = keras.Sequential(
            [
                keras.Input((24, 24, 3)),
                keras.layers.Conv2D(32, 3, activation="relu"),
                keras.layers.Conv2D(32, 3, activation="relu"),
                keras.layers.GlobalAveragePooling2D(),
                keras.layers.Dense(10),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.SGD(0.05),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=steps_per_execution,
        )
        return model

    return factory()


def _slow_dataset() -> tf.data.Dataset:
    def decode(images, labels):
        def sleep(batch):
            time.sleep(SLEEP)  # a slow decode, in every batch
            return batch

        images = tf.py_function(sleep, [images], tf.float32)
        images.set_shape((None, 24, 24, 3))
        return images, labels

    return tf.data.Dataset.from_tensor_slices((X, Y)).batch(GBS).map(decode)


def _fit(model, data, epochs=2, **monitor_kwargs):
    logger = logging.getLogger("keras_mirror_kit")
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    old_level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    monitor = kmk.ThroughputMonitor(**monitor_kwargs)
    try:
        history = model.fit(data, epochs=epochs, verbose=0, callbacks=[monitor])
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    named = [r for r in records if "of each training step" in r.getMessage()]
    return history.history, monitor, named


@pytest.fixture(scope="module")
def slow_fit():
    return _fit(_build(), _slow_dataset())


@pytest.fixture(scope="module")
def cached_fit():
    return _fit(_build(steps_per_execution=4), kmk.make_dataset(X, Y, GBS, seed=0))


def test_a_slow_pipeline_reads_as_input_bound_and_the_kit_names_it_once(slow_fit):
    history, _, named = slow_fit
    assert min(history["input_wait_share"]) >= 0.5, history["input_wait_share"]
    assert len(named) == 1 and named[0].levelno == logging.WARNING
    message = named[0].getMessage()
    assert "input pipeline" in message and "num_parallel_calls" in message


def test_a_pipeline_cached_in_memory_is_not_input_bound_and_nothing_is_named(cached_fit):
    history, monitor, named = cached_fit
    assert max(history["input_wait_share"]) <= 0.3, (history, monitor.step_times)
    assert not [r for r in named if "input pipeline" in r.getMessage()]


@pytest.mark.parametrize("which", ["slow_fit", "cached_fit"])
def test_every_epoch_has_the_split_and_its_figures_add_up_to_the_step(which, request):
    history, monitor, _ = request.getfixturevalue(which)
    for epoch in range(2):
        shares = [history[key][epoch] for key in SPLIT_KEYS]
        assert all(0.0 <= share <= 1.0 for share in shares)
        assert sum(shares) == pytest.approx(1.0, abs=1e-9)
    # Before any clipping: what was timed inside the calls fits in the measured time (the
    # host's clock and the graph's timestamps agree within 2% of the step).
    times = monitor.step_times
    assert times is not None and times.busy is not None and times.input_wait is not None
    assert times.input_wait + times.busy <= 1.02 * times.in_call
    assert times.in_call <= 1.02 * times.wall
    summary = monitor.summary()
    assert all(key in summary for key in SPLIT_KEYS)


def test_the_slow_pipelines_wait_is_its_sleep(slow_fit):
    # Each batch sleeps SLEEP in the pipeline; the step waits for it, so the wait per step
    # is at least most of the sleep (the rest overlaps the previous step: the reads run
    # ahead by at most one batch, as the map is not prefetched).
    history, monitor, _ = slow_fit
    times = monitor.step_times
    steps = 8 * 2 - 2  # two epochs, two warm-up steps
    assert times.input_wait / steps >= 0.5 * SLEEP


def test_the_split_changes_no_weight():
    data = kmk.make_dataset(X, Y, GBS, seed=0)
    weights = []
    for step_split in (True, False, True):
        model = _build(steps_per_execution=2)
        _fit(model, data, epochs=1, step_split=step_split)
        weights.append([w.numpy() for w in model.weights])
    for a, b in zip(weights[0], weights[1]):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(weights[0], weights[2]):
        np.testing.assert_array_equal(a, b)


def test_step_split_false_reports_no_split_and_takes_the_timing_out_of_the_step():
    model = _build()
    data = kmk.make_dataset(X, Y, GBS, seed=0)
    history, _, _ = _fit(model, data, epochs=1)
    assert "input_wait_share" in history
    traced_with = model.train_function
    history, monitor, _ = _fit(model, data, epochs=1, step_split=False)
    assert not set(SPLIT_KEYS) & set(history) and monitor.step_times is None
    assert "samples_per_sec" in history
    assert model.train_function is not traced_with  # made again, without the timestamps
    history, _, _ = _fit(model, data, epochs=1)  # and on again
    assert "input_wait_share" in history


def test_a_jit_compiled_model_gets_no_split_and_the_monitor_says_why(caplog):
    keras.utils.set_random_seed(7)

    @kmk.distributed(per_replica_batch_size=GBS, devices=["/cpu:0"])
    def factory() -> keras.Model:
        model = keras.Sequential([keras.Input((24, 24, 3)), keras.layers.Flatten()])
        model.add(keras.layers.Dense(10))
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)
        return model

    model = factory()
    y = np.zeros((len(X), 10), "float32")
    with caplog.at_level(logging.INFO, logger="keras_mirror_kit"):
        history = model.fit(X, y, epochs=1, verbose=0, callbacks=[kmk.ThroughputMonitor()])
    assert "samples_per_sec" in history.history
    assert not set(SPLIT_KEYS) & set(history.history)
    assert any("no step split" in r.getMessage() for r in caplog.records)


DETERMINISM = """
import json, logging
import keras_mirror_kit as kmk
import keras, numpy as np, tensorflow as tf
tf.config.experimental.enable_op_determinism()  # TensorFlow then refuses tf.timestamp()
records = []
handler = logging.Handler(logging.INFO)
handler.emit = records.append
logging.getLogger("keras_mirror_kit").addHandler(handler)
logging.getLogger("keras_mirror_kit").setLevel(logging.INFO)
keras.utils.set_random_seed(0)

@kmk.distributed(per_replica_batch_size=8)
def factory():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    return model

x = np.ones((64, 4), "float32")
history = factory().fit(x, x[:, :2], epochs=2, verbose=0, callbacks=[kmk.ThroughputMonitor()])
said = [r.getMessage() for r in records if "no step split" in r.getMessage()]
print("RESULT " + json.dumps({"keys": sorted(history.history), "said": said}))
"""


@pytest.mark.slow  # a child process (op determinism is process-wide)
def test_op_determinism_gives_no_split_and_the_fit_trains():
    out = last_json(run_python(DETERMINISM, replicas=2))
    assert "samples_per_sec" in out["keys"]
    assert not set(SPLIT_KEYS) & set(out["keys"])
    assert len(out["said"]) == 1 and "enable_op_determinism" in out["said"][0]


def test_a_fit_that_raises_gives_the_model_its_own_train_function_back():
    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 4:
                raise RuntimeError("boom")

    model = _build()
    with pytest.raises(RuntimeError, match="boom"):
        model.fit(
            kmk.make_dataset(X, Y, GBS, seed=0),
            epochs=1,
            verbose=0,
            callbacks=[kmk.ThroughputMonitor(), Boom()],
        )
    assert not getattr(model.train_function, "kmk_step_clock_wrapper", False)


def test_step_split_must_be_a_bool():
    with pytest.raises(TypeError, match="step_split"):
        kmk.ThroughputMonitor(step_split="yes")  # type: ignore[arg-type]


JAX_SPLIT = """
import json, os, time
os.environ["KERAS_BACKEND"] = "jax"
import keras_mirror_kit as kmk
kmk.simulate_replicas(2)
import keras, numpy as np, tensorflow as tf
rng = np.random.default_rng(0)
x = rng.random((256, 24, 24, 3)).astype("float32")
y = rng.integers(0, 10, 256).astype("int32")

def build():
    keras.utils.set_random_seed(7)

    @kmk.distributed(per_replica_batch_size=16, steps_per_execution=1)
    def factory():
        model = keras.Sequential([keras.Input((24, 24, 3)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])
        model.compile(optimizer="sgd",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model
    return factory()

def slow(images, labels):
    def sleep(batch):
        time.sleep(0.15)
        return batch
    images = tf.py_function(sleep, [images], tf.float32)
    images.set_shape((None, 24, 24, 3))
    return images, labels

out = {}
for name, data in [
    ("slow", tf.data.Dataset.from_tensor_slices((x, y)).batch(32).map(slow)),
    ("cached", kmk.make_dataset(x, y, 32, seed=0)),
]:
    model = build()
    monitor = kmk.ThroughputMonitor()
    history = model.fit(data, epochs=2, verbose=0, callbacks=[monitor])
    out[name] = {k: v for k, v in history.history.items() if k.endswith("_share")}
weights = []
for step_split in (True, False):
    model = build()
    model.fit(kmk.make_dataset(x, y, 32, seed=0), epochs=1, verbose=0,
              callbacks=[kmk.ThroughputMonitor(step_split=step_split)])
    weights.append([np.asarray(w) for w in model.get_weights()])
out["equal"] = all(np.array_equal(a, b) for a, b in zip(*weights))
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow  # a JAX child
def test_jax_splits_the_step_as_tensorflow_does():
    out = last_json(run_python(JAX_SPLIT, env={"KERAS_BACKEND": "jax"}, fresh=True, timeout=600))
    slow, cached = out["slow"], out["cached"]
    assert set(slow) == {"input_wait_share", "compute_share", "host_share"}
    assert min(slow["input_wait_share"]) >= 0.5, slow
    assert max(cached["input_wait_share"]) <= 0.3, cached
    for figures in (slow, cached):
        for epoch in range(2):
            assert sum(figures[k][epoch] for k in figures) == pytest.approx(1.0, abs=1e-9)
    assert out["equal"] is True
