"""`ThroughputMeter`: the arithmetic of training throughput, free of any framework.

The meter is told when training steps finish (`step`), when the clock should stop counting
(`pause`/`resume` around validation, `stop` at the end of an epoch) and turns that into
rates: samples per second over all replicas, per replica, steps per second and the mean
step time. It knows nothing about Keras or TensorFlow, reads time only through the
`clock` it is given (`time.perf_counter` by default), and so is tested with a fake clock.
`keras_mirror_kit.callbacks.ThroughputMonitor` is the thin Keras callback around it.

What is measured. Time counts only while the clock runs: from `start()` or `start_epoch()`
to each `step()`, less any time between `pause()` and `resume()`. Each `step()` closes an
interval and attributes it to the steps it reports. The first `warmup_steps` steps after
`start()` are warm-up: their intervals are dropped (tracing and compilation happen there).
A `step()` reporting several steps at once (one execution of `steps_per_execution` steps)
is never split, so warm-up ends with the first execution that reaches `warmup_steps`.

Three tallies share the measured intervals: the run (since `start()`), the epoch (since
`start_epoch()`) and the interval (since the last `interval_figures()`). A tally with no
measured step, or one whose measured time is zero, has no figures (`None`): rates over
nothing are not reported rather than reported as zero or infinity.

Multi-worker: the rates are global because each synchronous step consumes one global batch
on every worker at once; given `num_workers > 1`, the meter also reports
`samples_per_sec_per_worker`.

FLOP/s and MFU: once told the FLOPs of one training sample (`set_flops`), the figures also
hold `flops_per_sec` (`samples_per_sec x flops_per_sample`) and `flops_per_sec_per_replica`,
and, told the peak FLOP/s of all the devices the replicas run on, `mfu` (model FLOPs
utilisation: `flops_per_sec / peak`, 1.0 being the hardware's peak).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from keras_mirror_kit.validation import non_negative_int, optional_positive_number, positive_int

__all__ = ["BASELINE_MEANING", "FIGURE_KEYS", "FLOP_KEYS", "ThroughputMeter"]

#: Keys of the figures dict, in the order they are reported.
FIGURE_KEYS = (
    "samples_per_sec",
    "samples_per_sec_per_replica",
    "steps_per_sec",
    "step_time_ms",
)

#: Keys added once the FLOPs per sample are known (`mfu` only with a peak), in this order.
FLOP_KEYS = ("flops_per_sec", "flops_per_sec_per_replica", "mfu")
#: What `baseline_samples_per_sec` is, for its type error.
BASELINE_MEANING = "the samples/s of the same training on 1 replica"

_IDLE, _RUNNING, _PAUSED = "idle", "running", "paused"


@dataclass
class _Tally:
    steps: int = 0
    seconds: float = 0.0
    samples: int = 0

    def add(self, steps: int, seconds: float, samples: int) -> None:
        self.steps += steps
        self.seconds += seconds
        self.samples += samples


class ThroughputMeter:
    """Turns step completions and a clock into samples/s, steps/s and step time.

    Call `start()` when a run begins (this restarts warm-up), `start_epoch()` when each
    epoch's first step begins, `step(n_steps)` each time `n_steps` training steps have finished,
    `pause()`/`resume()` around anything that is not training (validation), and `stop()`
    at the end of an epoch. Read the rates with `epoch_figures()`, `run_figures()` or
    `interval_figures()`, and the whole run with `summary()`.

    Each figures dict holds `samples_per_sec` (over all replicas), `samples_per_sec_per_
    replica`, `steps_per_sec` and `step_time_ms` (mean wall time of one step), plus
    `samples_per_sec_per_worker` when `num_workers > 1` (workers step together, so each
    worker's clock gives the global rate), and
    `scaling_efficiency` when `baseline_samples_per_sec` is given: `samples_per_sec /
    (num_replicas * baseline_samples_per_sec)`, 1.0 meaning perfect linear scaling. With
    `flops_per_sample`: `flops_per_sec` and `flops_per_sec_per_replica`; with `peak_flops`
    too: `mfu` (`flops_per_sec / peak_flops`). Every step processes `global_batch_size`
    samples unless `step(samples=...)` says how many (a smaller last batch).

    Args:
        global_batch_size: Samples per step over all replicas.
        num_replicas: Replicas in sync; divides the global rate into the per-replica one.
        warmup_steps: Steps at the start of every run whose time is not measured. A
            `step()` reporting several steps is not split: warm-up ends with the first
            call that reaches `warmup_steps`. 0 measures from `start()`.
        baseline_samples_per_sec: Samples/s of the same training on one replica; enables
            `scaling_efficiency`.
        num_workers: Processes taking part (multi-worker training); adds
            `samples_per_sec_per_worker` when above 1.
        clock: Function returning seconds as a float, monotonic; `time.perf_counter` by
            default (a fake one in tests).
        flops_per_sample: FLOPs of one training sample; enables the FLOP figures (also
            settable later with `set_flops`).
        peak_flops: Peak FLOP/s of all the replicas' devices together; enables `mfu`.

    Raises:
        TypeError: If a count is not an integer, the baseline, FLOPs or peak not a number
            or `clock` not callable.
        ValueError: If a count is not positive (`warmup_steps` may be 0) or the baseline,
            FLOPs or peak is not positive and finite.

    Example:

    ```python
    meter = ThroughputMeter(global_batch_size=256, num_replicas=4, warmup_steps=2)
    meter.start()
    meter.start_epoch()
    for batch in batches:
        train_step(batch)
        meter.step()
    meter.stop()
    meter.epoch_figures()
    # {'samples_per_sec': 10240.0, 'samples_per_sec_per_replica': 2560.0,
    #  'steps_per_sec': 40.0, 'step_time_ms': 25.0}
    ```
    """

    def __init__(
        self,
        global_batch_size: int,
        num_replicas: int = 1,
        warmup_steps: int = 2,
        baseline_samples_per_sec: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
        num_workers: int = 1,
        flops_per_sample: float | None = None,
        peak_flops: float | None = None,
    ) -> None:
        self._global_batch_size = positive_int("global_batch_size", global_batch_size)
        self._num_replicas = positive_int("num_replicas", num_replicas)
        self._num_workers = positive_int("num_workers", num_workers)
        self._warmup_steps = non_negative_int("warmup_steps", warmup_steps)
        self._baseline = optional_positive_number(
            "baseline_samples_per_sec", baseline_samples_per_sec, BASELINE_MEANING
        )
        if not callable(clock):
            raise TypeError(f"`clock` must be callable. Received: clock={clock!r}")
        self._clock = clock
        self._state = _IDLE
        self._started = False
        self._mark = 0.0  # clock value where the current, unattributed interval began
        self._pending = 0.0  # running time before a pause, not yet attributed to a step
        self._run = _Tally()
        self._epoch = _Tally()
        self._interval = _Tally()
        self._warmup = _Tally()
        self._paused_seconds = 0.0
        self._pause_began = 0.0
        self._flops_per_sample: float | None = None
        self._peak_flops: float | None = None
        self.set_flops(flops_per_sample, peak_flops)

    @property
    def global_batch_size(self) -> int:
        """Samples per step over all replicas."""
        return self._global_batch_size

    @property
    def num_replicas(self) -> int:
        """Replicas in sync."""
        return self._num_replicas

    @property
    def warmup_steps(self) -> int:
        """Steps excluded at the start of every run."""
        return self._warmup_steps

    @property
    def baseline_samples_per_sec(self) -> float | None:
        """The 1-replica samples/s that `scaling_efficiency` compares with, or None."""
        return self._baseline

    @property
    def flops_per_sample(self) -> float | None:
        """FLOPs of one training sample (`set_flops`), or None: no FLOP figures."""
        return self._flops_per_sample

    @property
    def peak_flops(self) -> float | None:
        """Peak FLOP/s of all the replicas' devices together (`set_flops`), or None: no MFU."""
        return self._peak_flops

    def set_flops(self, flops_per_sample: float | None, peak_flops: float | None = None) -> None:
        """Adds FLOP/s (and MFU, with a peak) to the figures from now on, for every tally.

        Args:
            flops_per_sample: FLOPs of one training sample (forward and backward); None
                removes the FLOP figures.
            peak_flops: Peak FLOP/s of all the devices the replicas run on together (one
                GPU's peak times the GPUs; a CPU's roof once, however many replicas share
                it); None: no `mfu`.

        Raises:
            TypeError: If a value is not a real number.
            ValueError: If a value is not positive and finite.

        Example:

        ```python
        meter.set_flops(6.0e6, peak_flops=2 * 312e12)   # 2 A100s in bfloat16
        ```
        """
        self._flops_per_sample = optional_positive_number("flops_per_sample", flops_per_sample)
        self._peak_flops = optional_positive_number("peak_flops", peak_flops)

    @property
    def in_warmup(self) -> bool:
        """Whether the next `step()` still belongs to the warm-up."""
        return self._warmup.steps < self._warmup_steps

    @property
    def running(self) -> bool:
        """Whether the clock is counting (started, not paused, not stopped)."""
        return self._state == _RUNNING

    def start(self) -> None:
        """Begins a run: clears every tally, restarts warm-up and starts the clock.

        Example:

        ```python
        meter.start()  # at the beginning of each fit()
        ```
        """
        self._run, self._epoch, self._interval = _Tally(), _Tally(), _Tally()
        self._warmup = _Tally()
        self._paused_seconds = 0.0
        self._started = True
        self._restart_clock()

    def start_epoch(self) -> None:
        """Begins an epoch: clears the epoch tally and (re)starts the clock from now.

        Time between `stop()` and `start_epoch()` is never measured. Warm-up is not
        restarted (it runs once per `start()`, and may span several short epochs). Calls
        `start()` first if the run has not begun.

        Example:

        ```python
        meter.start_epoch()  # on_epoch_begin
        ```
        """
        if not self._started:
            self.start()
        self._epoch = _Tally()
        self._restart_clock()

    def stop(self) -> None:
        """Stops the clock; the time since the last `step()` is discarded.

        Example:

        ```python
        meter.stop()  # on_epoch_end, after the last step and validation
        ```
        """
        if self._state == _PAUSED:
            self._paused_seconds += self._clock() - self._pause_began
        self._state = _IDLE
        self._pending = 0.0

    def pause(self) -> None:
        """Stops counting time until `resume()`; does nothing unless the clock is running.

        The time already run since the last `step()` is kept and added to the next one.

        Example:

        ```python
        meter.pause()     # on_test_begin inside fit
        run_validation()
        meter.resume()    # on_test_end
        ```
        """
        if self._state != _RUNNING:
            return
        now = self._clock()
        self._pending += now - self._mark
        self._pause_began = now
        self._state = _PAUSED

    def resume(self) -> None:
        """Counts time again after `pause()`; does nothing unless paused.

        Example:

        ```python
        meter.resume()
        ```
        """
        if self._state != _PAUSED:
            return
        now = self._clock()
        self._paused_seconds += now - self._pause_began
        self._mark = now
        self._state = _RUNNING

    def step(self, n_steps: int = 1, now: float | None = None, samples: int | None = None) -> bool:
        """Records that `n_steps` training steps have just finished.

        The running time since the previous `step()` (or since the clock started), less
        pauses, is attributed to these steps: dropped during warm-up, otherwise added to the
        run, epoch and interval tallies.

        Args:
            n_steps: Steps finished since the previous call, e.g. `steps_per_execution`.
            now: When they finished (clock value), if earlier than now.
            samples: Samples those steps processed over all replicas; default
                `n_steps * global_batch_size` (pass fewer for a smaller last batch).

        Returns:
            True if the steps were measured, False if they were warm-up.

        Raises:
            TypeError: If `n_steps` or `samples` is not an integer.
            ValueError: If `n_steps` is not positive, or `samples` is not positive or more
                than `n_steps` full batches.
            RuntimeError: If the clock is not running: call `start_epoch()` first (after
                `stop()`), or `resume()` (after `pause()`).

        Example:

        ```python
        meter.step(n_steps=4)  # one execution of steps_per_execution=4
        ```
        """
        n_steps = positive_int("n_steps", n_steps)
        full = n_steps * self._global_batch_size
        if samples is None:
            samples = full
        elif positive_int("samples", samples) > full:
            raise ValueError(
                f"ThroughputMeter.step(): {n_steps} step(s) of at most "
                f"{self._global_batch_size} samples cannot process more than {full}. "
                f"Received: samples={samples}"
            )
        if self._state != _RUNNING:
            raise RuntimeError(
                f"ThroughputMeter.step() was called while the clock is {self._state}. Call "
                "start_epoch() before the first step of an epoch and resume() after "
                f"pause(). Received: n_steps={n_steps}"
            )
        stamp = self._clock() if now is None else min(now, self._clock())
        elapsed = self._pending + (stamp - self._mark)
        self._pending = 0.0
        self._mark = stamp
        return self._attribute(n_steps, elapsed, samples)

    def _attribute(self, n_steps: int, elapsed: float, samples: int) -> bool:
        if self.in_warmup:
            self._warmup.add(n_steps, elapsed, samples)
            return False
        for tally in (self._run, self._epoch, self._interval):
            tally.add(n_steps, elapsed, samples)
        return True

    @property
    def epoch_seconds(self) -> float:
        """Measured seconds of the current (or just stopped) epoch (warm-up, pauses left out)."""
        return self._epoch.seconds

    def epoch_figures(self) -> dict[str, float] | None:
        """Rates over the measured steps of the current (or just stopped) epoch.

        Returns:
            The figures dict, or None when the epoch has no measured step (it was all
            warm-up) or no measured time.

        Example:

        ```python
        figures = meter.epoch_figures()
        if figures is not None:
            logs.update(figures)
        ```
        """
        return self._figures(self._epoch)

    def run_figures(self) -> dict[str, float] | None:
        """Rates over all measured steps since `start()`.

        Returns:
            The figures dict, or None when nothing has been measured.

        Example:

        ```python
        meter.run_figures()["samples_per_sec"]
        ```
        """
        return self._figures(self._run)

    def interval_figures(self, reset: bool = True) -> dict[str, float] | None:
        """Rates over the measured steps since the previous `interval_figures()` call.

        Args:
            reset: Start a new interval afterwards (the default).

        Returns:
            The figures dict, or None when the interval has no measured step; the interval
            is reset in both cases (when `reset`).

        Example:

        ```python
        if step % 100 == 0:
            recent = meter.interval_figures()
        ```
        """
        figures = self._figures(self._interval)
        if reset:
            self._interval = _Tally()
        return figures

    def summary(self) -> dict[str, float]:
        """The run so far: its figures (when any) and what was measured and excluded.

        Returns:
            A dict with the `run_figures()` keys (absent when nothing was measured) and
            `measured_steps`, `measured_seconds`, `warmup_steps` and `warmup_seconds`
            (excluded as warm-up), `paused_seconds` (excluded, e.g. validation),
            `global_batch_size` and `num_replicas`.

        Example:

        ```python
        meter.summary()["measured_steps"]
        ```
        """
        summary: dict[str, float] = dict(self.run_figures() or {})
        summary.update(
            measured_steps=self._run.steps,
            measured_seconds=self._run.seconds,
            warmup_steps=self._warmup.steps,
            warmup_seconds=self._warmup.seconds,
            paused_seconds=self._paused_seconds,
            global_batch_size=self._global_batch_size,
            num_replicas=self._num_replicas,
        )
        return summary

    def describe(self) -> str:
        """A one-line, human-readable summary of the run.

        Returns:
            For example `"throughput 5058.8 samples/s (2529.4 per replica, 2 replicas),
            316.2 steps/s, 3.16 ms/step over 58 steps; excluded: 2 warm-up steps (0.50 s),
            1.54 s paused"`.

        Example:

        ```python
        logger.info(meter.describe())
        ```
        """
        s = self.summary()
        replicas = self._num_replicas
        excluded = (
            f"excluded: {s['warmup_steps']} warm-up step{'s' if s['warmup_steps'] != 1 else ''}"
            f" ({s['warmup_seconds']:.2f} s), {s['paused_seconds']:.2f} s paused"
        )
        if "samples_per_sec" not in s:
            return (
                f"throughput: no step was measured (global batch {self._global_batch_size}, "
                f"{replicas} replica{'s' if replicas != 1 else ''}); {excluded}. Lower "
                "`warmup_steps` or train longer to get figures."
            )
        line = (
            f"throughput {s['samples_per_sec']:.1f} samples/s "
            f"({s['samples_per_sec_per_replica']:.1f} per replica, {replicas} "
            f"replica{'s' if replicas != 1 else ''}"
            + (
                f", {s['samples_per_sec_per_worker']:.1f} per worker over {self._num_workers}"
                if "samples_per_sec_per_worker" in s
                else ""
            )
            + f"), {s['steps_per_sec']:.1f} steps/s, "
            f"{s['step_time_ms']:.2f} ms/step over {s['measured_steps']} steps"
        )
        if "scaling_efficiency" in s:
            line += f", scaling efficiency {s['scaling_efficiency']:.1%}"
        if "flops_per_sec" in s:
            line += f", {s['flops_per_sec'] / 1e9:.3g} GFLOP/s"
            if "mfu" in s:
                line += f" (MFU {s['mfu']:.1%})"
        return f"{line}; {excluded}"

    def _restart_clock(self) -> None:
        self._mark = self._clock()
        self._pending = 0.0
        self._state = _RUNNING

    def _figures(self, tally: _Tally) -> dict[str, float] | None:
        if tally.steps <= 0 or tally.seconds <= 0:
            return None
        steps_per_sec = tally.steps / tally.seconds
        samples_per_sec = tally.samples / tally.seconds
        figures = {
            "samples_per_sec": samples_per_sec,
            "samples_per_sec_per_replica": samples_per_sec / self._num_replicas,
            "steps_per_sec": steps_per_sec,
            "step_time_ms": 1000.0 * tally.seconds / tally.steps,
        }
        if self._num_workers > 1:
            figures["samples_per_sec_per_worker"] = samples_per_sec / self._num_workers
        if self._baseline is not None:
            figures["scaling_efficiency"] = samples_per_sec / (self._num_replicas * self._baseline)
        if self._flops_per_sample is not None:
            flops_per_sec = samples_per_sec * self._flops_per_sample
            figures["flops_per_sec"] = flops_per_sec
            figures["flops_per_sec_per_replica"] = flops_per_sec / self._num_replicas
            if self._peak_flops is not None:
                figures["mfu"] = flops_per_sec / self._peak_flops
        return figures
