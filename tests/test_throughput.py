"""`ThroughputMeter` arithmetic, driven by a fake clock (no TensorFlow, no real time)."""

from __future__ import annotations

import math

import pytest

from keras_mirror_kit.throughput.meter import FIGURE_KEYS, ThroughputMeter
from keras_mirror_kit.validation import optional_positive_number


class FakeClock:
    """A clock that only moves when told to."""

    def __init__(self, start: float = 100.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make(clock: FakeClock, **kwargs) -> ThroughputMeter:
    kwargs.setdefault("global_batch_size", 32)
    kwargs.setdefault("num_replicas", 4)
    kwargs.setdefault("warmup_steps", 0)
    return ThroughputMeter(clock=clock, **kwargs)


def run_steps(meter: ThroughputMeter, clock: FakeClock, seconds: list[float], n: int = 1):
    for s in seconds:
        clock.advance(s)
        meter.step(n)


def test_rates_from_steps_and_time():
    clock = FakeClock()
    meter = make(clock)
    meter.start()
    run_steps(meter, clock, [0.5, 0.5, 0.5, 0.5])  # 4 steps in 2 s
    figures = meter.run_figures()
    assert list(figures) == list(FIGURE_KEYS)
    assert figures["steps_per_sec"] == pytest.approx(2.0)
    assert figures["samples_per_sec"] == pytest.approx(64.0)  # 2 steps/s x 32
    assert figures["samples_per_sec_per_replica"] == pytest.approx(16.0)  # / 4 replicas
    assert figures["step_time_ms"] == pytest.approx(500.0)
    assert "scaling_efficiency" not in figures


def test_warmup_steps_are_excluded():
    clock = FakeClock()
    meter = make(clock, warmup_steps=2)
    meter.start()
    assert meter.in_warmup
    clock.advance(30.0)  # tracing
    assert meter.step() is False
    clock.advance(2.0)
    assert meter.step() is False
    assert not meter.in_warmup
    assert meter.run_figures() is None  # nothing measured yet
    clock.advance(0.25)
    assert meter.step() is True
    run_steps(meter, clock, [0.25, 0.25])
    figures = meter.run_figures()
    assert figures["steps_per_sec"] == pytest.approx(4.0)
    summary = meter.summary()
    assert summary["measured_steps"] == 3
    assert summary["measured_seconds"] == pytest.approx(0.75)
    assert summary["warmup_steps"] == 2
    assert summary["warmup_seconds"] == pytest.approx(32.0)


def test_warmup_zero_measures_from_start():
    clock = FakeClock()
    meter = make(clock, warmup_steps=0)
    meter.start()
    assert not meter.in_warmup
    clock.advance(1.0)
    assert meter.step() is True
    assert meter.run_figures()["step_time_ms"] == pytest.approx(1000.0)


def test_start_restarts_warmup_and_clears_tallies():
    clock = FakeClock()
    meter = make(clock, warmup_steps=1)
    meter.start()
    run_steps(meter, clock, [5.0, 1.0, 1.0])
    assert meter.summary()["measured_steps"] == 2
    meter.stop()
    clock.advance(1000.0)  # between two fit() calls
    meter.start()  # the next fit(): warm-up again
    assert meter.in_warmup
    assert meter.run_figures() is None
    run_steps(meter, clock, [7.0, 0.5])
    summary = meter.summary()
    assert summary["measured_steps"] == 1
    assert summary["step_time_ms"] == pytest.approx(500.0)
    assert summary["warmup_seconds"] == pytest.approx(7.0)


def test_steps_per_execution_jumps_and_warmup_rounds_up_to_an_execution():
    clock = FakeClock()
    meter = make(clock, global_batch_size=10, num_replicas=2, warmup_steps=2)
    meter.start()
    clock.advance(9.0)
    assert meter.step(3) is False  # one execution of 3 steps reaches warm-up (2): all out
    assert not meter.in_warmup
    run_steps(meter, clock, [0.3, 0.3], n=3)  # 6 steps in 0.6 s
    clock.advance(0.1)
    meter.step(1)  # a short last execution (e.g. 10 steps with steps_per_execution=3)
    figures = meter.run_figures()
    assert meter.summary()["measured_steps"] == 7
    assert meter.summary()["warmup_steps"] == 3
    assert figures["steps_per_sec"] == pytest.approx(7 / 0.7)
    assert figures["samples_per_sec"] == pytest.approx(100.0)
    assert figures["samples_per_sec_per_replica"] == pytest.approx(50.0)
    assert figures["step_time_ms"] == pytest.approx(100.0)


def test_warmup_that_needs_two_executions():
    clock = FakeClock()
    meter = make(clock, warmup_steps=5)
    meter.start()
    run_steps(meter, clock, [9.0, 1.0], n=3)  # 3 then 6 steps: warm-up ends at 6
    assert not meter.in_warmup
    assert meter.summary()["warmup_steps"] == 6
    run_steps(meter, clock, [0.3], n=3)
    assert meter.run_figures()["step_time_ms"] == pytest.approx(100.0)


def test_pause_excludes_validation_time_but_keeps_time_before_it():
    clock = FakeClock()
    meter = make(clock)
    meter.start()
    clock.advance(0.2)
    meter.pause()
    clock.advance(50.0)  # validation
    meter.resume()
    clock.advance(0.3)
    meter.step()  # 0.2 + 0.3 s, not 50.5 s
    figures = meter.run_figures()
    assert figures["step_time_ms"] == pytest.approx(500.0)
    assert meter.summary()["paused_seconds"] == pytest.approx(50.0)


def test_pause_and_resume_are_idempotent_and_ignored_when_idle():
    clock = FakeClock()
    meter = make(clock)
    meter.pause()  # before start: nothing happens
    meter.resume()
    meter.start()
    clock.advance(1.0)
    meter.pause()
    clock.advance(10.0)
    meter.pause()  # second pause: no effect
    clock.advance(10.0)
    meter.resume()
    meter.resume()  # second resume: no effect
    clock.advance(1.0)
    meter.step()
    assert meter.run_figures()["step_time_ms"] == pytest.approx(2000.0)
    assert meter.summary()["paused_seconds"] == pytest.approx(20.0)
    meter.stop()
    meter.pause()  # stopped: nothing happens
    assert not meter.running


def test_validation_after_last_step_then_stop_discards_the_tail():
    """The Keras order: last batch, validation (paused), epoch end (stop)."""
    clock = FakeClock()
    meter = make(clock)
    meter.start()
    meter.start_epoch()
    run_steps(meter, clock, [1.0, 1.0])
    clock.advance(0.01)
    meter.pause()
    clock.advance(30.0)
    meter.resume()
    clock.advance(0.01)
    meter.stop()
    assert meter.epoch_figures()["step_time_ms"] == pytest.approx(1000.0)
    assert meter.summary()["paused_seconds"] == pytest.approx(30.0)


def test_stop_while_paused_counts_the_pause():
    clock = FakeClock()
    meter = make(clock)
    meter.start()
    meter.pause()
    clock.advance(4.0)
    meter.stop()
    assert meter.summary()["paused_seconds"] == pytest.approx(4.0)
    assert not meter.running


def test_epoch_reset_and_gaps_between_epochs_are_not_measured():
    clock = FakeClock()
    meter = make(clock, global_batch_size=8, num_replicas=1)
    meter.start()
    meter.start_epoch()
    run_steps(meter, clock, [1.0, 1.0])
    meter.stop()
    first = meter.epoch_figures()
    assert first["steps_per_sec"] == pytest.approx(1.0)
    clock.advance(60.0)  # checkpoints and other epoch-end callbacks
    meter.start_epoch()
    assert meter.epoch_figures() is None  # new epoch, nothing yet
    run_steps(meter, clock, [0.5, 0.5])
    meter.stop()
    assert meter.epoch_figures()["steps_per_sec"] == pytest.approx(2.0)
    run = meter.run_figures()  # 4 steps in 3 s; the 60 s gap is not there
    assert run["steps_per_sec"] == pytest.approx(4 / 3)
    assert run["samples_per_sec"] == pytest.approx(32 / 3)


def test_epoch_shorter_than_warmup_has_no_figures_and_warmup_carries_over():
    clock = FakeClock()
    meter = make(clock, warmup_steps=3)
    meter.start()
    meter.start_epoch()
    run_steps(meter, clock, [10.0, 1.0])  # a 2-step epoch: all warm-up
    meter.stop()
    assert meter.epoch_figures() is None
    assert meter.run_figures() is None
    assert "samples_per_sec" not in meter.summary()
    assert "no step was measured" in meter.describe()
    meter.start_epoch()
    run_steps(meter, clock, [1.0, 0.25])  # 3rd step ends warm-up; the 4th is measured
    meter.stop()
    assert meter.epoch_figures()["step_time_ms"] == pytest.approx(250.0)
    assert meter.summary()["warmup_steps"] == 3


def test_start_epoch_starts_the_run_when_needed():
    clock = FakeClock()
    meter = make(clock, warmup_steps=1)
    meter.start_epoch()
    assert meter.running and meter.in_warmup
    run_steps(meter, clock, [3.0, 1.0])
    assert meter.run_figures()["step_time_ms"] == pytest.approx(1000.0)


def test_zero_elapsed_time_gives_no_figures():
    clock = FakeClock()
    meter = make(clock)
    meter.start()
    meter.step()  # the clock did not move: no rate rather than infinity
    assert meter.run_figures() is None
    assert meter.epoch_figures() is None
    assert meter.summary()["measured_steps"] == 1


def test_interval_figures_cover_the_steps_since_the_previous_call():
    clock = FakeClock()
    meter = make(clock, warmup_steps=1)
    meter.start()
    run_steps(meter, clock, [5.0])  # warm-up
    assert meter.interval_figures() is None  # only warm-up so far
    run_steps(meter, clock, [1.0, 1.0])
    assert meter.interval_figures(reset=False)["step_time_ms"] == pytest.approx(1000.0)
    assert meter.interval_figures()["step_time_ms"] == pytest.approx(1000.0)
    run_steps(meter, clock, [0.1, 0.1, 0.1])
    assert meter.interval_figures()["step_time_ms"] == pytest.approx(100.0)
    assert meter.interval_figures() is None  # empty after the reset
    assert meter.run_figures()["step_time_ms"] == pytest.approx(2300.0 / 5)


def test_scaling_efficiency():
    clock = FakeClock()
    meter = make(clock, global_batch_size=64, num_replicas=4, baseline_samples_per_sec=100.0)
    meter.start()
    run_steps(meter, clock, [0.2, 0.2])  # 5 steps/s x 64 = 320 samples/s
    figures = meter.run_figures()
    assert figures["samples_per_sec"] == pytest.approx(320.0)
    assert figures["scaling_efficiency"] == pytest.approx(320.0 / (4 * 100.0))
    assert meter.baseline_samples_per_sec == 100.0
    assert "scaling efficiency 80.0%" in meter.describe()


def test_summary_and_describe():
    clock = FakeClock()
    meter = make(clock, global_batch_size=16, num_replicas=2, warmup_steps=1)
    meter.start()
    run_steps(meter, clock, [2.0, 0.5, 0.5])
    summary = meter.summary()
    assert summary["global_batch_size"] == 16 and summary["num_replicas"] == 2
    assert summary["samples_per_sec"] == pytest.approx(32.0)
    line = meter.describe()
    assert line.startswith("throughput 32.0 samples/s (16.0 per replica, 2 replicas)")
    assert "2.0 steps/s, 500.00 ms/step over 2 steps" in line
    assert "1 warm-up step (2.00 s)" in line
    assert "\n" not in line


def test_properties():
    meter = ThroughputMeter(48, num_replicas=3, warmup_steps=4)
    assert meter.global_batch_size == 48
    assert meter.num_replicas == 3
    assert meter.warmup_steps == 4
    assert meter.baseline_samples_per_sec is None
    assert not meter.running


def test_step_requires_a_running_clock():
    clock = FakeClock()
    meter = make(clock)
    with pytest.raises(RuntimeError, match="start_epoch"):
        meter.step()
    meter.start()
    meter.pause()
    with pytest.raises(RuntimeError, match="paused"):
        meter.step()
    meter.resume()
    meter.stop()
    with pytest.raises(RuntimeError, match="idle"):
        meter.step()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"global_batch_size": 0}, ValueError, "global_batch_size=0"),
        ({"global_batch_size": 8.0}, TypeError, "global_batch_size=8.0"),
        ({"global_batch_size": 8, "num_replicas": -2}, ValueError, "num_replicas=-2"),
        ({"global_batch_size": 8, "num_replicas": True}, TypeError, "num_replicas=True"),
        ({"global_batch_size": 8, "warmup_steps": -1}, ValueError, "warmup_steps=-1"),
        ({"global_batch_size": 8, "warmup_steps": "2"}, TypeError, "warmup_steps='2'"),
        (
            {"global_batch_size": 8, "baseline_samples_per_sec": 0},
            ValueError,
            "baseline_samples_per_sec=0",
        ),
        (
            {"global_batch_size": 8, "baseline_samples_per_sec": math.inf},
            ValueError,
            "baseline_samples_per_sec=inf",
        ),
        (
            {"global_batch_size": 8, "baseline_samples_per_sec": "fast"},
            TypeError,
            "baseline_samples_per_sec='fast'",
        ),
        ({"global_batch_size": 8, "clock": 3.0}, TypeError, "clock=3.0"),
    ],
)
def test_invalid_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        ThroughputMeter(**kwargs)


@pytest.mark.parametrize(("n", "error"), [(0, ValueError), (-3, ValueError), (1.5, TypeError)])
def test_invalid_n_steps(n, error):
    clock = FakeClock()
    meter = make(clock)
    meter.start()
    with pytest.raises(error, match="n_steps"):
        meter.step(n)


def test_validate_baseline():
    assert optional_positive_number("baseline_samples_per_sec", None) is None
    assert optional_positive_number("baseline_samples_per_sec", 12) == 12.0
    with pytest.raises(ValueError, match="nan"):
        optional_positive_number("baseline_samples_per_sec", float("nan"))
    with pytest.raises(TypeError):
        optional_positive_number("baseline_samples_per_sec", False)


def test_module_does_not_import_a_framework():
    import ast
    import inspect

    import keras_mirror_kit.throughput.meter as module

    tree = ast.parse(inspect.getsource(module))
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        node.module.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module
    }
    assert not imported & {"tensorflow", "keras", "jax", "torch", "numpy"}


def test_per_worker_figure_only_in_multi_worker_runs():
    from keras_mirror_kit.throughput.meter import ThroughputMeter

    now = [0.0]
    for workers, expected in ((1, None), (4, 256.0)):
        meter = ThroughputMeter(
            64, num_replicas=8, warmup_steps=0, num_workers=workers, clock=lambda: now[0]
        )
        meter.start()
        meter.start_epoch()
        now[0] += 1.0
        meter.step(16)  # 16 steps x 64 samples in 1 s = 1024 samples/s
        meter.stop()
        figures = meter.epoch_figures()
        assert figures["samples_per_sec"] == 1024.0
        assert figures.get("samples_per_sec_per_worker") == expected
        assert ("per worker over 4" in meter.describe()) == (workers == 4)


def test_flop_figures_and_mfu_once_flops_and_peak_are_known():
    """Issue 14: flops_per_sec = samples/s x FLOPs per sample; mfu over the peak given."""
    from keras_mirror_kit.throughput.meter import FLOP_KEYS

    clock = FakeClock()
    meter = make(clock)  # 32 samples per step, 4 replicas
    meter.start()
    run_steps(meter, clock, [0.5, 0.5])
    assert meter.flops_per_sample is None
    assert not set(FLOP_KEYS) & set(meter.run_figures())  # no count: no FLOP figures
    meter.set_flops(6.0e6)
    figures = meter.run_figures()
    assert figures["flops_per_sec"] == pytest.approx(64.0 * 6.0e6)
    assert figures["flops_per_sec_per_replica"] == pytest.approx(16.0 * 6.0e6)
    assert "mfu" not in figures  # the peak is unknown
    meter.set_flops(6.0e6, peak_flops=1.0e9)
    figures = meter.run_figures()
    assert list(figures) == [*FIGURE_KEYS, *FLOP_KEYS]
    assert figures["mfu"] == pytest.approx(64.0 * 6.0e6 / 1.0e9)
    assert "GFLOP/s (MFU 38.4%)" in meter.describe()
    meter.pause()  # validation time stays out of the FLOP figures as out of the others
    clock.advance(100.0)
    meter.resume()
    run_steps(meter, clock, [0.5])
    assert meter.run_figures()["mfu"] == pytest.approx(64.0 * 6.0e6 / 1.0e9)
    meter.set_flops(None)
    assert not set(FLOP_KEYS) & set(meter.run_figures())


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [({"flops_per_sample": 0}, ValueError), ({"flops_per_sample": "6e6"}, TypeError),
     ({"flops_per_sample": 1.0, "peak_flops": math.inf}, ValueError),
     ({"flops_per_sample": 1.0, "peak_flops": True}, TypeError)],
)  # fmt: skip
def test_invalid_flops_and_peak(kwargs, error):
    with pytest.raises(error, match="flops_per_sample|peak_flops"):
        ThroughputMeter(32, **kwargs)
