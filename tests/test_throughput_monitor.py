"""`ThroughputMonitor` in real `fit()` calls, on 2 replicas (see conftest) and on 1.

No test bounds wall-clock time: rates are compared with an independent measurement of the
same steps (a second callback that timestamps first-step begins and batch ends), or with each
other. The module's 3-epoch fit is of a new model (its first step traces the train step); the
other tests of the 2-replica model of `build()` each fit one model built for the module
(`trained_model`), whose step counts they take relative to what it did before.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import keras
import numpy as np
import pytest

import keras_mirror_kit as kmk
from keras_mirror_kit.callbacks import ThroughputMonitor
from keras_mirror_kit.throughput.flops import count_training_flops
from keras_mirror_kit.throughput.meter import FIGURE_KEYS, FLOP_KEYS
from keras_mirror_kit.throughput.peaks import cpu_name, store_roof
from keras_mirror_kit.throughput.step_split import SPLIT_KEYS
from tests import models

pytestmark = pytest.mark.filterwarnings("ignore:`shuffle=True` was passed:UserWarning")

PER_REPLICA = 8
GBS = 2 * PER_REPLICA  # 2 replicas in this process
RNG = np.random.default_rng(0)
X = RNG.normal(size=(320, 6)).astype("float32")  # 20 steps of 16
Y = (X[:, 0] > 0).astype("int32") + (X[:, 1] > 0).astype("int32")
FLOPS = {"flops_per_sec", "flops_per_sec_per_replica"}  # the FLOP figures without a peak


@pytest.fixture(scope="module", autouse=True)
def no_stored_roof(tmp_path_factory):
    """The monitor reads a CPU roof from KMK_ROOF_FILE: none here, whatever the machine has."""
    old = os.environ.get("KMK_ROOF_FILE")
    os.environ["KMK_ROOF_FILE"] = str(tmp_path_factory.mktemp("roof") / "absent.json")
    yield
    if old is None:
        os.environ.pop("KMK_ROOF_FILE", None)
    else:
        os.environ["KMK_ROOF_FILE"] = old


def build(steps_per_execution: int = 1, devices: list[str] | None = None) -> keras.Model:
    @kmk.distributed(per_replica_batch_size=PER_REPLICA, devices=devices)
    def factory() -> keras.Model:
        model = models.sequential()
        model.compile(
            optimizer=keras.optimizers.SGD(0.05),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=steps_per_execution,
        )
        return model

    return factory()


@pytest.fixture(scope="module")
def trained_model() -> keras.Model:
    """`build()` once for the module: each test's fit adds to what it has trained."""
    return build()


def _steps(model: keras.Model) -> int:
    return int(model.optimizer.iterations.numpy())


class Timestamps(keras.callbacks.Callback):
    """The independent clock: epoch begins, batch ends, validation, and batch-log keys."""

    def __init__(self) -> None:
        super().__init__()
        self.epoch_begin: list[float] = []
        self.first_batch_begin: list[float | None] = []
        self.batch_ends: list[list[tuple[int, float]]] = []
        self.test_time: list[float] = []
        self.epoch_end: list[float] = []
        self.batch_logs: list[tuple[int, int, dict]] = []
        self._test_began = 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch_begin.append(time.perf_counter())
        self.first_batch_begin.append(None)
        self.batch_ends.append([])
        self.test_time.append(0.0)

    def on_train_batch_begin(self, batch, logs=None):
        if self.first_batch_begin[-1] is None:
            self.first_batch_begin[-1] = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.batch_ends[-1].append((batch, time.perf_counter()))
        picked = {
            k: v
            for k, v in logs.items()
            if k in FIGURE_KEYS or k in FLOP_KEYS or k == "scaling_efficiency"
        }
        self.batch_logs.append((len(self.epoch_begin) - 1, batch, picked))

    def on_test_begin(self, logs=None):
        self._test_began = time.perf_counter()

    def on_test_end(self, logs=None):
        self.test_time[-1] += time.perf_counter() - self._test_began

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_end.append(time.perf_counter())

    def epoch_seconds(self, epoch: int, after_batch: int | None = None) -> float:
        """Training time of an epoch: from its first step (or a batch end) to its last one."""
        ends = self.batch_ends[epoch]
        start = self.first_batch_begin[epoch]
        if after_batch is not None:
            start = next(t for b, t in ends if b == after_batch)
        return ends[-1][1] - start


class CountBatches(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def on_train_batch_end(self, batch, logs=None):
        self.count += 1


@pytest.fixture(scope="module")
def two_replica_fit(no_stored_roof):
    """One 3-epoch fit on 2 replicas with batch logs every 5 steps and a baseline."""
    logger = logging.getLogger("keras_mirror_kit")
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    old_level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        model = build()
        monitor = ThroughputMonitor(log_every_n_steps=5, baseline_samples_per_sec=1000.0)
        stamps = Timestamps()
        data = kmk.make_dataset(X, Y, GBS, seed=0)
        history = model.fit(data, epochs=3, verbose=0, callbacks=[monitor, stamps])
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    return {
        "history": history.history,
        "monitor": monitor,
        "stamps": stamps,
        "records": [r for r in records if "ThroughputMonitor" in r.getMessage()],
        "model": model,
    }


@pytest.mark.slow
def test_epoch_figures_are_in_history(two_replica_fit):
    history = two_replica_fit["history"]
    for key in (*FIGURE_KEYS, "scaling_efficiency"):
        assert len(history[key]) == 3, key
        assert all(isinstance(v, float) and v > 0 for v in history[key]), key
    for e in range(3):
        sps = history["samples_per_sec"][e]
        assert sps == pytest.approx(GBS * history["steps_per_sec"][e])
        assert history["samples_per_sec_per_replica"][e] == pytest.approx(sps / 2)
        assert history["step_time_ms"][e] == pytest.approx(1000.0 / history["steps_per_sec"][e])
        assert history["scaling_efficiency"][e] == pytest.approx(sps / (2 * 1000.0))


@pytest.mark.slow  # the module's 3-epoch fit on 2 replicas
def test_rate_agrees_with_an_independent_measurement(two_replica_fit):
    history, stamps = two_replica_fit["history"], two_replica_fit["stamps"]
    monitor = two_replica_fit["monitor"]
    # Epoch 0: the first 2 steps (batch indices 0 and 1) are warm-up.
    seconds = [stamps.epoch_seconds(0, after_batch=1), stamps.epoch_seconds(1)]
    seconds.append(stamps.epoch_seconds(2))
    steps = [18, 20, 20]
    for e in range(3):
        expected = steps[e] * GBS / seconds[e]
        assert history["samples_per_sec"][e] == pytest.approx(expected, rel=0.10), e
    summary = monitor.summary()
    assert summary["measured_steps"] == 58 and summary["warmup_steps"] == 2
    assert summary["samples_per_sec"] == pytest.approx(58 * GBS / sum(seconds), rel=0.10)
    assert summary["global_batch_size"] == GBS and summary["num_replicas"] == 2


@pytest.mark.slow  # the module's 3-epoch fit on 2 replicas
def test_batch_logs_every_n_steps(two_replica_fit):
    batch_logs = two_replica_fit["stamps"].batch_logs
    assert len(batch_logs) == 60
    for epoch, batch, picked in batch_logs:
        if (batch + 1) % 5 == 0:
            assert set(picked) == {*FIGURE_KEYS, "scaling_efficiency", *FLOPS}, (epoch, batch)
            assert picked["samples_per_sec"] == pytest.approx(GBS * picked["steps_per_sec"])
        else:
            assert picked == {}, (epoch, batch)


@pytest.mark.slow  # the module's 3-epoch fit on 2 replicas
def test_last_figures_summary_and_log_line(two_replica_fit):
    history, monitor = two_replica_fit["history"], two_replica_fit["monitor"]
    assert monitor.last == {k: v[-1] for k, v in history.items() if k in monitor.last}
    assert set(monitor.last) == {*FIGURE_KEYS, "scaling_efficiency", *FLOPS, *SPLIT_KEYS}
    records = [r for r in two_replica_fit["records"] if "throughput" in r.getMessage()]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    message = records[0].getMessage()
    assert "samples/s" in message and "2 replicas" in message and "over 58 steps" in message
    assert "input wait" in message and "host" in message
    assert "\n" not in message


@pytest.mark.slow
def test_steps_per_execution_counts_steps_not_calls():
    model = build(steps_per_execution=3)
    assert model.steps_per_execution == 3
    monitor = ThroughputMonitor(log_every_n_steps=4)
    stamps = Timestamps()
    data = kmk.make_dataset(X[:160], Y[:160], GBS, seed=0)  # 10 steps: 3 + 3 + 3 + 1
    history = model.fit(data, epochs=2, verbose=0, callbacks=[monitor, stamps]).history
    calls = [[b for b, _ in ends] for ends in stamps.batch_ends]
    assert calls == [[2, 5, 8, 11], [2, 5, 8, 11]]  # Keras reports the nominal last index
    summary = monitor.summary()
    # Warm-up (2 steps) ends with the first execution (3 steps); the last execution is 1.
    assert summary["warmup_steps"] == 3 and summary["measured_steps"] == 17
    expected = [
        7 * GBS / stamps.epoch_seconds(0, after_batch=2),
        10 * GBS / stamps.epoch_seconds(1),
    ]
    for e in range(2):
        assert history["samples_per_sec"][e] == pytest.approx(expected[e], rel=0.10), e
    # Batch logs when the step count crosses a multiple of 4: after steps 6, 9, then
    # 12 (epoch 1 index 2), 16 (index 5) and 20 (index 9 = the clamped 11).
    reported = [(e, b) for e, b, picked in stamps.batch_logs if picked]
    assert reported == [(0, 5), (0, 8), (1, 2), (1, 5), (1, 11)]


@pytest.mark.slow
def test_validation_time_is_excluded(trained_model):
    class SlowValidation(keras.callbacks.Callback):
        """Makes validation take twice the epoch's training time."""

        def __init__(self, stamps: Timestamps, batches: int) -> None:
            super().__init__()
            self.stamps, self.batches = stamps, batches

        def on_test_batch_end(self, batch, logs=None):
            epoch = len(self.stamps.epoch_begin) - 1
            # Epoch 0 includes tracing: scale on its steps after warm-up instead.
            seconds = self.stamps.epoch_seconds(epoch, after_batch=1 if epoch == 0 else None)
            time.sleep(2 * seconds / self.batches)

    model = trained_model
    monitor = ThroughputMonitor()
    stamps = Timestamps()
    train = kmk.make_dataset(X, Y, GBS, seed=0)
    val = kmk.make_dataset(X[:64], Y[:64], GBS, shuffle=False)  # 4 batches
    history = model.fit(
        train,
        validation_data=val,
        epochs=3,
        verbose=0,
        callbacks=[SlowValidation(stamps, 4), monitor, stamps],
    )
    assert len(history.history["val_loss"]) == 3
    assert len(history.history["samples_per_sec"]) == 3
    for e in (1, 2):
        rate = history.history["samples_per_sec"][e]
        training_only = 20 * GBS / stamps.epoch_seconds(e)
        with_validation = 20 * GBS / (stamps.epoch_end[e] - stamps.epoch_begin[e])
        assert stamps.test_time[e] >= 2 * stamps.epoch_seconds(e)
        assert rate == pytest.approx(training_only, rel=0.10), e
        assert rate > 2 * with_validation, e
    assert monitor.summary()["paused_seconds"] >= sum(stamps.test_time) * 0.9


def test_model_not_built_by_the_kit_needs_the_batch_size_before_training():
    model = models.compile_sgd(models.sequential())
    counter = CountBatches()
    with pytest.raises(ValueError, match=r"not built by kmk.*global_batch_size=\.\.\."):
        model.fit(
            X, Y, batch_size=16, epochs=1, verbose=0, callbacks=[ThroughputMonitor(), counter]
        )
    assert counter.count == 0


def test_model_not_built_by_the_kit_with_arguments():
    model = models.compile_sgd(models.sequential())
    monitor = ThroughputMonitor(global_batch_size=32, warmup_steps=1)
    history = model.fit(X, Y, batch_size=32, epochs=2, verbose=0, callbacks=[monitor])
    figures = history.history
    assert len(figures["samples_per_sec"]) == 2
    # Not under a strategy: 1 replica, so per-replica == global.
    assert figures["samples_per_sec_per_replica"] == pytest.approx(figures["samples_per_sec"])
    assert monitor.summary()["num_replicas"] == 1
    assert monitor.summary()["measured_steps"] == 19  # 2 x 10 steps, 1 of warm-up

    explicit = ThroughputMonitor(global_batch_size=32, num_replicas=4)
    model.fit(X, Y, batch_size=32, epochs=1, verbose=0, callbacks=[explicit])
    assert explicit.summary()["num_replicas"] == 4


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"global_batch_size": 99}, "global_batch_size=99"),
        ({"num_replicas": 1}, "num_replicas=1"),
    ],
)
def test_arguments_contradicting_the_distribution(kwargs, match):
    model = build()
    counter = CountBatches()
    with pytest.raises(ValueError, match=rf"contradicts this fit\(\) of a model built.*{match}"):
        model.fit(
            X,
            Y,
            batch_size=GBS,
            epochs=1,
            verbose=0,
            callbacks=[ThroughputMonitor(**kwargs), counter],
        )
    assert counter.count == 0


@pytest.mark.slow
def test_arguments_agreeing_with_the_distribution_are_accepted(trained_model):
    model = trained_model
    monitor = ThroughputMonitor(global_batch_size=GBS, num_replicas=2)
    model.fit(X, Y, batch_size=GBS, epochs=1, verbose=0, callbacks=[monitor])
    assert monitor.summary()["measured_steps"] == 18


@pytest.mark.slow
def test_one_replica_short_epochs_and_evaluate_outside_fit(caplog):
    caplog.set_level(logging.INFO, logger="keras_mirror_kit")
    model = build(devices=["/cpu:0"])
    assert kmk.distribution_of(model).num_replicas == 1
    monitor = ThroughputMonitor(warmup_steps=6)
    data = kmk.make_dataset(X[:32], Y[:32], PER_REPLICA, seed=1)  # 4 steps per epoch
    history = model.fit(data, epochs=3, verbose=0, callbacks=[monitor])
    # Epoch 0 is all warm-up: no figures for it (like val_* with validation_freq).
    assert len(history.history["loss"]) == 3
    assert len(history.history["samples_per_sec"]) == 2
    figures = history.history
    assert figures["samples_per_sec_per_replica"] == pytest.approx(figures["samples_per_sec"])
    summary = monitor.summary()
    assert summary["warmup_steps"] == 6 and summary["measured_steps"] == 6
    assert summary["num_replicas"] == 1 and summary["global_batch_size"] == PER_REPLICA
    # evaluate() outside fit does not disturb the monitor.
    model.evaluate(data, verbose=0, callbacks=[monitor])
    assert monitor.summary() == summary
    lines = [r.getMessage() for r in caplog.records if "ThroughputMonitor: thr" in r.getMessage()]
    assert len(lines) == 1 and "1 replica)" in lines[0]


def test_no_measured_step_logs_a_hint(caplog):
    caplog.set_level(logging.INFO, logger="keras_mirror_kit")
    model = build(devices=["/cpu:0"])
    monitor = ThroughputMonitor(warmup_steps=100)
    data = kmk.make_dataset(X[:32], Y[:32], PER_REPLICA, seed=1)
    history = model.fit(data, epochs=1, verbose=0, callbacks=[monitor])
    assert "samples_per_sec" not in history.history
    assert monitor.last == {}
    assert "samples_per_sec" not in monitor.summary()
    assert any("no step was measured" in r.getMessage() for r in caplog.records)


def test_state_before_fit():
    monitor = ThroughputMonitor(global_batch_size=8)
    assert monitor.last == {}
    assert monitor.summary() == {}
    assert monitor.meter is None


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"global_batch_size": 0}, ValueError, "global_batch_size=0"),
        ({"global_batch_size": 16.0}, TypeError, "global_batch_size=16.0"),
        ({"num_replicas": -1}, ValueError, "num_replicas=-1"),
        ({"num_replicas": "2"}, TypeError, "num_replicas='2'"),
        ({"warmup_steps": -1}, ValueError, "warmup_steps=-1"),
        ({"warmup_steps": None}, TypeError, "warmup_steps=None"),
        ({"log_every_n_steps": 0}, ValueError, "log_every_n_steps=0"),
        ({"log_every_n_steps": True}, TypeError, "log_every_n_steps=True"),
        ({"baseline_samples_per_sec": -5.0}, ValueError, "baseline_samples_per_sec=-5.0"),
        ({"baseline_samples_per_sec": "x"}, TypeError, "baseline_samples_per_sec='x'"),
    ],
)
def test_invalid_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        ThroughputMonitor(**kwargs)


def test_exported_from_callbacks_package():
    import keras_mirror_kit.callbacks as callbacks

    assert "ThroughputMonitor" in callbacks.__all__
    assert issubclass(callbacks.ThroughputMonitor, keras.callbacks.Callback)


def test_hooks_driven_by_hand_without_epoch_and_batch_begin():
    """A custom loop that only calls on_train_begin and on_train_batch_end still counts."""
    model = models.compile_sgd(models.sequential())
    monitor = ThroughputMonitor(global_batch_size=4, warmup_steps=1)
    callbacks = keras.callbacks.CallbackList([monitor], model=model, epochs=1, steps=None)
    callbacks.on_train_begin()  # the clock runs from here
    for batch in range(6):
        callbacks.on_train_batch_end(batch, {"loss": 1.0})  # batch 0 is the warm-up
    for batch in range(3):  # indices restart (a new epoch) without on_epoch_begin
        callbacks.on_train_batch_end(batch, {"loss": 1.0})
    callbacks.on_epoch_end(0, {"loss": 1.0})
    assert set(monitor.last) == {*FIGURE_KEYS, *FLOPS}
    callbacks.on_epoch_begin(1)
    for batch in range(4):  # no on_train_batch_begin: batch 0 only starts the clock
        callbacks.on_train_batch_end(batch, {"loss": 1.0})
    callbacks.on_train_end()
    summary = monitor.summary()
    assert summary["warmup_steps"] == 1
    assert summary["measured_steps"] == 5 + 3 + 3


class _Probe(keras.callbacks.Callback):
    """Placed after the monitor: reads its summary at one batch begin, spies on its meter."""

    def __init__(self, monitor: ThroughputMonitor, at_batch: int) -> None:
        super().__init__()
        self.monitor = monitor
        self.at_batch = at_batch
        self.seen: dict[str, float] = {}
        self.meter_steps = 0
        self.epoch = -1

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_begin(self, logs=None):
        meter = self.monitor.meter
        original = meter.step

        def counting_step(*args, **kwargs):
            self.meter_steps += 1
            return original(*args, **kwargs)

        meter.step = counting_step

    def on_train_batch_begin(self, batch, logs=None):
        if self.epoch == 0 and batch == self.at_batch:
            self.seen = self.monitor.summary()


@pytest.mark.slow
def test_hot_path_leaves_the_meter_alone_until_the_epoch_ends(trained_model):
    """Past warm-up a batch end only notes its index: the meter sees one call per epoch.

    The steps are counted at the epoch end (same time attributed), and a mid-epoch
    `summary()` still counts the steps done so far.
    """
    model, before = trained_model, _steps(trained_model)
    monitor = ThroughputMonitor(warmup_steps=2)
    probe = _Probe(monitor, at_batch=10)
    data = kmk.make_dataset(X, Y, GBS, seed=1)  # 20 steps per epoch
    model.fit(data, epochs=2, verbose=0, callbacks=[monitor, probe])
    assert _steps(model) == before + 40
    assert probe.seen["warmup_steps"] == 2
    assert probe.seen["measured_steps"] == 8  # steps 2-9 of epoch 0 are done at begin 10
    summary = monitor.summary()
    assert summary["measured_steps"] == 18 + 20
    # Warm-up: 2 calls; epoch 0: the mid-epoch summary and the epoch end; epoch 1: its
    # end. Counting every step would make it 40.
    assert probe.meter_steps == 2 + 2 + 1


@pytest.mark.slow
def test_batch_reports_give_the_meter_only_the_due_steps(trained_model):
    """With log_every_n_steps, past warm-up the meter is called once per report."""
    model = trained_model
    monitor = ThroughputMonitor(warmup_steps=2, log_every_n_steps=5)
    probe = _Probe(monitor, at_batch=-1)
    stamps = Timestamps()
    data = kmk.make_dataset(X, Y, GBS, seed=1)  # 20 steps
    model.fit(data, epochs=1, verbose=0, callbacks=[monitor, probe, stamps])
    reported = [batch for _, batch, picked in stamps.batch_logs if picked]
    assert reported == [4, 9, 14, 19]
    assert probe.meter_steps == 2 + 4  # each warm-up step, then one call per report
    assert monitor.summary()["measured_steps"] == 18


@pytest.mark.slow
def test_keras_runs_batch_ends_on_the_main_thread_with_tensorflow(trained_model):
    """What docs/throughput.md ("No extra synchronisation") and CHANGELOG.md state.

    With the TensorFlow backend Keras 3 dispatches `on_train_batch_end` on the main thread
    right after each execution, even when every callback is `async_safe` (its
    `IS_THREAD_SAFE` is False, tensorflow/tensorflow#78338); other backends use a thread
    pool when every callback allows it. If a release changes this, revise those texts.
    """

    class Threads(keras.callbacks.Callback):
        async_safe = True  # would allow Keras' thread pool on a thread-safe backend

        def __init__(self) -> None:
            super().__init__()
            self.on_main: list[bool] = []

        def on_train_batch_end(self, batch, logs=None):
            self.on_main.append(threading.current_thread() is threading.main_thread())

    model = trained_model
    threads = Threads()
    data = kmk.make_dataset(X, Y, GBS, seed=1)
    model.fit(data, epochs=1, verbose=0, callbacks=[threads])  # the only callback
    assert threads.on_main == [True] * 20


class _FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _hand_driven(monitor: ThroughputMonitor, monkeypatch, steps: int | None = None):
    """A CallbackList with the monitor on a fake clock (the meter's and the callback's)."""
    clock = _FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    model = models.compile_sgd(models.sequential())
    callbacks = keras.callbacks.CallbackList([monitor], model=model, epochs=2, steps=steps)
    callbacks.on_train_begin()
    monitor.meter._clock = clock  # the meter is created at on_train_begin
    return callbacks, clock


@pytest.mark.parametrize("every", [None, 3])
def test_lazy_counting_attributes_exactly_the_step_times(monkeypatch, every):
    """Past warm-up steps reach the meter late, but timed as if counted one by one: the
    time after the last step (Keras' epoch-end work) and validation are not measured."""
    monitor = ThroughputMonitor(global_batch_size=4, warmup_steps=1, log_every_n_steps=every)
    callbacks, clock = _hand_driven(monitor, monkeypatch, steps=6)
    durations = [5.0, 1.0, 2.0, 1.5, 0.5, 3.0]  # step 0 is warm-up
    callbacks.on_epoch_begin(0)
    for batch, seconds in enumerate(durations):
        callbacks.on_train_batch_begin(batch)
        clock.now += seconds
        callbacks.on_train_batch_end(batch, {"loss": 1.0})
    clock.now += 7.0  # metrics, then validation set-up
    callbacks.on_test_begin()
    clock.now += 50.0
    callbacks.on_test_end()
    clock.now += 0.25  # other callbacks' epoch-end work
    callbacks.on_epoch_end(0, {"loss": 1.0})
    assert monitor.last["step_time_ms"] == pytest.approx(1000 * sum(durations[1:]) / 5)
    summary = monitor.summary()
    assert summary["measured_steps"] == 5
    assert summary["measured_seconds"] == pytest.approx(sum(durations[1:]))
    assert summary["warmup_seconds"] == pytest.approx(5.0)


def test_hand_driven_loops_lose_no_step(monkeypatch):
    """Indices restarting without on_epoch_begin, and on_epoch_begin without on_epoch_end."""
    monitor = ThroughputMonitor(global_batch_size=4, warmup_steps=0)
    callbacks, clock = _hand_driven(monitor, monkeypatch)
    callbacks.on_epoch_begin(0)
    for _ in range(2):  # two passes of 0..9 in one "epoch"
        for batch in range(10):
            callbacks.on_train_batch_begin(batch)
            clock.now += 1.0
            callbacks.on_train_batch_end(batch, {"loss": 1.0})
    callbacks.on_epoch_begin(1)  # no on_epoch_end for epoch 0
    for batch in range(4):
        callbacks.on_train_batch_begin(batch)
        clock.now += 2.0
        callbacks.on_train_batch_end(batch, {"loss": 1.0})
    callbacks.on_train_end()
    summary = monitor.summary()
    assert summary["measured_steps"] == 24
    assert summary["measured_seconds"] == pytest.approx(20 * 1.0 + 4 * 2.0)


# -- FLOP/s and MFU (issue 14) -------------------------------------------------------------


class Records:
    """Collects the kit logger's records at INFO and above inside a `with` block."""

    def __enter__(self) -> list[logging.LogRecord]:
        self.logger = logging.getLogger("keras_mirror_kit")
        self.records: list[logging.LogRecord] = []
        self.handler = logging.Handler(logging.INFO)
        self.handler.emit = self.records.append  # type: ignore[method-assign]
        self.old_level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self.handler)
        return self.records

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.old_level)


def peak_notices(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage() for r in records if "no peak FLOP/s known" in r.getMessage()]


@pytest.mark.slow  # the module's 3-epoch fit on 2 replicas
def test_flop_figures_are_samples_times_the_kits_count(two_replica_fit):
    history, model = two_replica_fit["history"], two_replica_fit["model"]
    flops = count_training_flops(model).flops_per_sample
    for e in range(3):
        sps = history["samples_per_sec"][e]
        assert history["flops_per_sec"][e] == pytest.approx(sps * flops)
        assert history["flops_per_sec_per_replica"][e] == pytest.approx(sps * flops / 2)
    assert "mfu" not in history  # this CPU has no stored roof here
    # One line (for the whole fit, not per epoch) says how to give the peak.
    notices = peak_notices(two_replica_fit["records"])
    assert len(notices) == 1
    assert "peak_flops=" in notices[0] and "keras-mirror-kit bench --roof" in notices[0]


@pytest.mark.slow
def test_given_flops_and_peak_make_mfu_with_the_cpu_counted_once(trained_model):
    model = trained_model
    data = kmk.make_dataset(X, Y, GBS, seed=0)
    monitor = ThroughputMonitor(flops_per_sample=1.0e6, peak_flops=1.0e10)
    with Records() as records:
        history = model.fit(data, epochs=2, verbose=0, callbacks=[monitor]).history
    for e in range(2):
        flops_per_sec = history["samples_per_sec"][e] * 1.0e6
        assert history["flops_per_sec"][e] == pytest.approx(flops_per_sec)
        # 2 replicas share this one CPU: the peak counts once, not twice.
        assert history["mfu"][e] == pytest.approx(flops_per_sec / 1.0e10)
    assert peak_notices(records) == []
    assert "MFU" in monitor.meter.describe()


@pytest.mark.slow
def test_a_stored_cpu_roof_gives_mfu(tmp_path, monkeypatch, trained_model):
    """What `keras-mirror-kit bench --roof` stores is what the monitor divides by."""
    monkeypatch.setenv("KMK_ROOF_FILE", str(tmp_path / "roof.json"))
    store_roof({"fp32": {"flops_per_sec": 2.0e11}}, cpu=cpu_name())
    model = trained_model
    monitor = ThroughputMonitor()
    with Records() as records:
        history = model.fit(
            kmk.make_dataset(X, Y, GBS, seed=0), epochs=1, verbose=0, callbacks=[monitor]
        ).history
    assert history["mfu"][0] == pytest.approx(history["flops_per_sec"][0] / 2.0e11)
    assert peak_notices(records) == []


@pytest.mark.slow
def test_a_model_built_inside_fit_is_counted_at_its_first_epochs_end():
    @kmk.distributed(per_replica_batch_size=PER_REPLICA)
    def factory() -> keras.Model:
        return models.compile_sgd(models.subclassed_lazy())

    model = factory()
    assert not model.built
    history = model.fit(
        kmk.make_dataset(X, Y, GBS, seed=0), epochs=2, verbose=0,
        callbacks=[ThroughputMonitor()],
    ).history  # fmt: skip
    flops = count_training_flops(model).flops_per_sample
    assert len(history["flops_per_sec"]) == 2
    assert history["flops_per_sec"][0] == pytest.approx(history["samples_per_sec"][0] * flops)


def test_a_model_whose_flops_cannot_be_counted_trains_and_says_so_once():
    model = keras.Sequential(
        [keras.Input((None, 6)), keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)]
    )
    models.compile_sgd(model)
    monitor = ThroughputMonitor(global_batch_size=16)
    with Records() as records:
        history = model.fit(
            X.reshape(-1, 1, 6), Y, batch_size=16, epochs=2, verbose=0, callbacks=[monitor]
        ).history
    assert len(history["samples_per_sec"]) == 2 and "flops_per_sec" not in history
    notices = [r.getMessage() for r in records if "were not counted" in r.getMessage()]
    assert len(notices) == 1 and "flops_per_sample=" in notices[0]
    # Giving the count is enough for the FLOP figures.
    given = ThroughputMonitor(global_batch_size=16, flops_per_sample=100.0)
    model.fit(X.reshape(-1, 1, 6), Y, batch_size=16, epochs=1, verbose=0, callbacks=[given])
    assert given.last["flops_per_sec"] == pytest.approx(given.last["samples_per_sec"] * 100.0)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [({"flops_per_sample": 0}, ValueError), ({"peak_flops": -1.0}, ValueError),
     ({"peak_flops": "312e12"}, TypeError)],
)  # fmt: skip
def test_invalid_flops_or_peak_are_refused_at_construction(kwargs, error):
    with pytest.raises(error, match="flops_per_sample|peak_flops"):
        ThroughputMonitor(**kwargs)
