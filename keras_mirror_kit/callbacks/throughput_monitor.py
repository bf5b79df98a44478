"""`ThroughputMonitor`: samples/s, per-replica samples/s, steps/s, step time, FLOP/s and MFU.

A thin Keras callback over `keras_mirror_kit.throughput.meter.ThroughputMeter`, which does the
arithmetic. The callback only reads `time.perf_counter()` and Python attributes: it never
reads a tensor, so it adds no device synchronisation to the training loop.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import keras

from keras_mirror_kit import fit_hooks
from keras_mirror_kit.backends.step_clock import StepClock, Totals, remove_step_timing
from keras_mirror_kit.callbacks.keras_loop import steps_done
from keras_mirror_kit.fit_wrapper import batch_plan
from keras_mirror_kit.model_record import engine_of, is_chief
from keras_mirror_kit.throughput.flops import count_training_flops, model_compute_dtype
from keras_mirror_kit.throughput.meter import (
    BASELINE_MEANING,
    ThroughputMeter,
)
from keras_mirror_kit.throughput.peaks import resolve_peak
from keras_mirror_kit.throughput.step_split import StepTimes, describe, find_limit, split
from keras_mirror_kit.validation import (
    check_bool,
    non_negative_int,
    optional_positive_number,
    positive_int,
)
from keras_mirror_kit.with_block import check_callback_model

__all__ = ["ThroughputMonitor"]

logger = logging.getLogger("keras_mirror_kit")

_NEVER = sys.maxsize


def _replica_devices(model: Any) -> tuple[str, ...]:
    """This process's replica devices (the backend's default device outside any strategy)."""
    return engine_of(model).devices


class ThroughputMonitor(keras.callbacks.Callback):
    """Adds training throughput to the logs of every epoch (and, optionally, of batches).

    At the end of every epoch, this callback adds to `logs` the throughput of that epoch,
    so that `History`, `TensorBoard`, W&B and any other callback placed after it see them:

    - `samples_per_sec`: samples per second over all replicas (the global rate);
    - `samples_per_sec_per_replica`: `samples_per_sec / num_replicas`;
    - `steps_per_sec`: training steps per second (one step = one global batch);
    - `step_time_ms`: mean wall time of one step, in milliseconds;
    - `updates_per_sec` (with gradient accumulation only): optimizer updates per second,
      `steps_per_sec` divided by the optimizer's `gradient_accumulation_steps` (a step is
      one micro-batch of `global_batch_size` samples);
    - `samples_per_sec_per_worker` (multi-worker runs only): `samples_per_sec / num_workers`;
    - `scaling_efficiency` (only with `baseline_samples_per_sec`): `samples_per_sec /
      (num_replicas * baseline_samples_per_sec)`; 1.0 is perfect linear scaling;
    - `flops_per_sec`: `samples_per_sec x` the FLOPs of one training sample (forward and
      backward, a multiply-add as 2), which the kit counts once per model from its traced
      computation (`keras_mirror_kit.throughput.flops`) before the first step, or at the
      first epoch's end for a model not built yet; `flops_per_sample=` gives it instead;
    - `flops_per_sec_per_replica`: `flops_per_sec / num_replicas`;
    - `mfu` (model FLOPs utilisation, when the peak is known): `flops_per_sec` over the
      peak FLOP/s of the devices the replicas run on, from the GPU table for the model's
      compute dtype (`keras_mirror_kit.throughput.peaks`), the CPU roof stored by
      `keras-mirror-kit bench --roof`, or `peak_flops=`. Unknown: no `mfu` and one INFO
      line saying how to give the peak.

    - the step split (`step_split=True`, the default): where each step's wall time went,
      as shares that add up to 1 (`keras_mirror_kit.throughput.step_split`; docs/throughput.md
      explains each with an example epoch): `input_wait_share` (the replicas waiting for
      their batch), `compute_share` (forward, backward, all-reduce and update) and
      `host_share` (Keras' loop, the callbacks, and launching each compiled call). Measured
      on the real run: a host timer around each compiled call and, inside it, timestamps
      around the batch reads and the replicas' steps (TensorFlow) or a timer on the loop's
      `next()` (JAX). When one share dominates (input wait at half the step or more, the
      host at 30% or more), one WARNING per `fit()` names it, with its figure and what
      usually helps. On TensorFlow, a model compiled with `jit_compile=True` or
      `run_eagerly=True`, or under `tf.config.experimental.enable_op_determinism()`, gets
      no split (one INFO line says why). Several workers: each worker's own split in its
      `logs`.

    With `log_every_n_steps=N` the same keys are also added to the batch `logs` every `N`
    training steps, computed over the steps since the previous such report.

    The batch size and the replica count come from a model built by `kmk.distributed()`:
    the batch its `fit` really uses (the global batch size, or the `batch_size` given with
    NumPy arrays), and a smaller last batch counted exactly where its size is known (arrays,
    or a kit dataset, which keeps it unless `drop_remainder=True`). For any other model pass
    `global_batch_size` (Keras does not tell callbacks the batch size); `num_replicas` then
    defaults to the replicas of the model's `tf.distribute` strategy (1 without one), and
    every step is counted as one full global batch.

    What is measured: the wall time from the start of each epoch's first training step
    (`on_train_batch_begin`) to the end of its last one, less the following. Keras creates
    the epoch's input iterator before that first step; that set-up, and epoch-end work
    (checkpoints, other callbacks), are outside the measured time.

    - warm-up: the first `warmup_steps` steps of every `fit()` call (tracing and
      compilation happen in the first one). With `steps_per_execution=N` Keras reports
      batches once per execution, so warm-up ends with the first execution that reaches
      `warmup_steps` steps; steps are counted from the batch indices, not the calls.
    - validation: everything between `on_test_begin` and `on_test_end` inside `fit()`.

    An epoch with no measured step (a short epoch entirely within warm-up) gets no
    throughput keys, like `val_*` keys on epochs that `validation_freq` skips. At the end
    of training one INFO line with the figures of the whole `fit()` is logged on the
    `keras_mirror_kit` logger; `summary()` returns them and `last` the latest figures.

    Keras calls callbacks in list order, so a logger listed before the monitor would write
    its row before the figures exist. `fit` of a model built by `kmk.distributed()` (either
    form) therefore runs the monitor first wherever it is listed, and `TensorBoard`,
    `CSVLogger`, `WandbLogger` and `History` all see the figures. For a model the kit did not
    build, list the monitor before the callbacks that read `logs`.

    Args:
        global_batch_size: Samples per step over all replicas. Needed when the model was
            not built by `kmk.distributed()`; otherwise optional and checked against it.
        num_replicas: Replicas in sync. Optional; checked against the `Distribution`, or
            defaults to the model's strategy's replicas.
        warmup_steps: Training steps at the start of each `fit()` left out of the rates;
            0 keeps them all (tracing included).
        log_every_n_steps: Also add the figures to the batch logs every this many steps;
            None (the default) reports at epoch ends only.
        baseline_samples_per_sec: Samples/s of the same training on a single replica;
            enables `scaling_efficiency`.
        flops_per_sample: FLOPs of one training sample (forward and backward); replaces
            the kit's count.
        peak_flops: Peak FLOP/s of one device (one GPU, or the whole CPU); replaces the
            table or the stored roof for `mfu`.
        step_split: Measure the step split (above). False removes the timing from the
            model's compiled step (it is traced again) and, on JAX, lets the loop dispatch
            the next step before the previous one finished.

    Raises:
        TypeError: If a count is not an integer, the baseline, FLOPs or peak not a number,
            or `step_split` not a bool.
        ValueError: If a count is not positive (`warmup_steps` may be 0) or the baseline,
            FLOPs or peak not positive and finite. At the start of `fit()` (before any
            step): if the global batch size is unknown, or an explicit argument contradicts
            the model's `Distribution`.

    Example:

    ```python
    import keras_mirror_kit as kmk
    from keras_mirror_kit.callbacks import ThroughputMonitor

    @kmk.distributed(per_replica_batch_size=64)
    def build_model(): ...

    model = build_model()
    history = model.fit(train_ds, epochs=5, callbacks=[ThroughputMonitor()])
    history.history["samples_per_sec"]   # one figure per epoch

    # A model not built by the kit: say what a step is.
    model.fit(x, y, batch_size=256, callbacks=[ThroughputMonitor(global_batch_size=256)])
    ```
    """

    produces_logs = True  # fit_hooks.FitHooks: fit() runs it before the other callbacks

    def __init__(
        self,
        *,
        global_batch_size: int | None = None,
        num_replicas: int | None = None,
        warmup_steps: int = 2,
        log_every_n_steps: int | None = None,
        baseline_samples_per_sec: float | None = None,
        flops_per_sample: float | None = None,
        peak_flops: float | None = None,
        step_split: bool = True,
    ) -> None:
        super().__init__()
        fit_hooks.install()  # any model's fit() then runs it first (produces_logs)
        if global_batch_size is not None:
            positive_int("global_batch_size", global_batch_size)
        if num_replicas is not None:
            positive_int("num_replicas", num_replicas)
        if log_every_n_steps is not None:
            positive_int("log_every_n_steps", log_every_n_steps)
        non_negative_int("warmup_steps", warmup_steps)
        self._global_batch_size = global_batch_size
        self._num_replicas = num_replicas
        self._warmup_steps = warmup_steps
        self._log_every_n_steps = log_every_n_steps
        self._baseline = optional_positive_number(
            "baseline_samples_per_sec", baseline_samples_per_sec, BASELINE_MEANING
        )
        self._flops_per_sample = optional_positive_number(
            "flops_per_sample", flops_per_sample, "FLOPs of one training sample"
        )
        self._peak_flops = optional_positive_number(
            "peak_flops", peak_flops, "the peak FLOP/s of one device"
        )
        self._step_split = check_bool("step_split", step_split)
        self._step_clock: StepClock | None = None
        self._split_mark: Totals | None = None  # the clock's totals at the last read
        self._split_fit: StepTimes | None = None  # the measured split of this fit() so far
        self._limit_told = False
        self._flops_pending = False  # the FLOPs are still to be counted (model not built)
        self._workers = 1
        self._flops_told: set[str] = set()  # the one-line notices already logged
        self._meter: ThroughputMeter | None = None
        self._last: dict[str, float] = {}
        self._training = False
        self._epoch_pending = False  # the clock starts at the epoch's first batch
        self._steps_per_execution = 1
        self._accumulation = 1  # steps per optimizer update (gradient accumulation)
        # Steps are counted at batch ends (Keras calls them on the main thread right after
        # each execution, whatever the callbacks). During warm-up every end is counted; past
        # it, an end only notes its index and time (`_fast`), and the steps are given to the
        # meter in one go when a batch report is due or at the epoch's end: the same time
        # is attributed to them, and Keras' hot loop costs a few attribute stores.
        self._steps_in_fit = 0  # steps of this fit() given to the meter
        self._last_batch = -1  # index of the last step of this epoch given to the meter
        self._seen_batch = -1  # index of the last step of this epoch seen at a batch end
        self._seen_at = 0.0  # when that batch end was seen
        self._fast = False
        self._next_report = _NEVER  # _steps_in_fit at which the next batch report is due
        self._epoch_length = _NEVER  # params["steps"], or _NEVER when unknown
        self._short_last_batch = 0  # samples of a smaller last batch of each epoch, or 0

    @property
    def last(self) -> dict[str, float]:
        """The figures most recently added to `logs` (epoch or batch); `{}` before any."""
        return dict(self._last)

    @property
    def meter(self) -> ThroughputMeter | None:
        """The `ThroughputMeter` of the current (or last) `fit()`; None before the first."""
        return self._meter

    @property
    def step_times(self) -> StepTimes | None:
        """The seconds behind the step split of the current (or last) `fit()`, summed over
        its ended epochs (`keras_mirror_kit.throughput.step_split.StepTimes`); None where
        no split was measured."""
        return self._split_fit

    def summary(self) -> dict[str, float]:
        """The throughput of the whole current (or last) `fit()`, warm-up and validation excluded.

        Called during `fit()` (from a callback: the thread that runs `fit()`), it first
        counts the steps done so far in the current epoch.

        Returns:
            `ThroughputMeter.summary()`: the figures keys (absent when no step was
            measured) plus `measured_steps`, `measured_seconds`, `warmup_steps`,
            `warmup_seconds`, `paused_seconds`, `global_batch_size` and `num_replicas`,
            and the step split over the epochs ended so far (where measured). An empty
            dict before the first `fit()`.

        Example:

        ```python
        monitor = ThroughputMonitor()
        model.fit(train_ds, epochs=3, callbacks=[monitor])
        monitor.summary()["samples_per_sec"]
        ```
        """
        if self._meter is None:
            return {}
        self._count_seen()  # mid-epoch: the steps done so far (the epoch end would, later)
        return {**self._meter.summary(), **self._fit_split()}

    def _fit_split(self) -> dict[str, float]:
        """The step split of the epochs measured so far in this fit(), or {}."""
        return (split(self._split_fit) or {}) if self._split_fit is not None else {}

    def _resolve(self) -> tuple[int, int, int]:
        """Global batch size, replicas and workers, from the Distribution or the arguments."""
        model = self.model
        name = getattr(model, "name", type(model).__name__)
        dist = check_callback_model(model, "ThroughputMonitor")
        if dist is not None:
            plan = batch_plan(model)  # the batch this fit() really uses
            batch = plan.batch_size if plan is not None else dist.global_batch_size
            for arg, given, actual in (
                ("global_batch_size", self._global_batch_size, batch),
                ("num_replicas", self._num_replicas, dist.num_replicas),
            ):
                if given is not None and given != actual:
                    raise ValueError(
                        f"ThroughputMonitor: `{arg}` contradicts this fit() of a model built "
                        f"by kmk.distributed() ({dist!r}), which uses {arg}={actual}. Drop "
                        f"the argument (the kit knows it) or fix it. Received: {arg}={given}"
                    )
            return batch, dist.num_replicas, dist.num_workers
        if self._global_batch_size is None:
            raise ValueError(
                "ThroughputMonitor needs the global batch size (samples per training step "
                "over all replicas) and Keras does not tell callbacks the batch size. The "
                f"model {name!r} was not built by kmk.distributed(), so pass it: "
                "ThroughputMonitor(global_batch_size=...), and num_replicas=... if the model "
                "is not under its tf.distribute strategy. Received: global_batch_size=None"
            )
        replicas = self._num_replicas
        if replicas is None:
            replicas = engine_of(model).num_replicas
        return self._global_batch_size, replicas, 1

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Resolves batch size and replicas (or raises `ValueError`) and restarts warm-up."""
        global_batch_size, replicas, workers = self._resolve()
        optimizer = getattr(self.model, "optimizer", None)
        optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's
        self._accumulation = int(getattr(optimizer, "gradient_accumulation_steps", None) or 1)
        plan = batch_plan(self.model)
        steps = (self.params or {}).get("steps")
        self._short_last_batch = (plan.last_batch_size(steps) if plan else None) or 0
        if plan is not None and not plan.known and self._global_batch_size is None:
            logger.warning(
                "ThroughputMonitor: the batch size of this fit's data cannot be read (a "
                "generator, a PyDataset or a tf.data pipeline that unbatches or rebatches), "
                "so the figures assume the global batch size, %d samples per step. Batch "
                "with kmk.make_dataset or Dataset.batch(global_batch_size) for exact figures.",
                global_batch_size,
            )
        self._is_chief = is_chief(self.model)
        self._meter = ThroughputMeter(
            global_batch_size,
            num_replicas=replicas,
            warmup_steps=self._warmup_steps,
            baseline_samples_per_sec=self._baseline,
            num_workers=workers,
        )
        self._flops_pending = True
        self._workers = workers
        self._set_flops()
        self._meter.start()
        self._start_step_clock()
        self._training = True
        self._steps_in_fit = 0
        self._next_report = self._log_every_n_steps or _NEVER
        spe = getattr(self.model, "steps_per_execution", 1)
        self._steps_per_execution = spe if isinstance(spe, int) and spe > 0 else 1
        self._start_epoch_counts()

    def _start_step_clock(self) -> None:
        """Instruments this fit() for the step split (or removes the timing: `step_split`)."""
        self._step_clock, self._split_mark, self._split_fit = None, None, None
        self._limit_told = False
        if not self._step_split:
            remove_step_timing(self.model)
            return
        clock = StepClock(self.model)
        if not clock.start():
            self._tell(
                "split", "ThroughputMonitor: no step split in this fit(): %s.", clock.why_not
            )
            return
        self._step_clock = clock
        self._measure_split()

    def _measure_split(self) -> None:
        """Starts counting the training calls once warm-up is over (their totals from now)."""
        clock, meter = self._step_clock, self._meter
        if clock is not None and not clock.measuring and meter is not None and not meter.in_warmup:
            clock.measuring = True
            running = meter.running
            if running:
                meter.pause()  # the read is not training time
            self._split_mark = clock.totals()
            if running:
                meter.resume()

    def _epoch_split(self, epoch: int) -> dict[str, float] | None:
        """The step split of the epoch's measured steps; names a dominating share once."""
        clock, meter, mark = self._step_clock, self._meter, self._split_mark
        if clock is None or meter is None or mark is None:
            return None
        now = clock.totals()
        self._split_mark, epoch_totals = now, now.minus(mark)
        if not epoch_totals.calls or not epoch_totals.timed_steps:
            return None  # no call of Keras' train function, or none timed inside (a trace
            # made before the clock): nothing measured, so no split rather than a wrong one
        times = StepTimes(
            meter.epoch_seconds, epoch_totals.in_call, epoch_totals.busy, epoch_totals.input_wait
        )
        figures = split(times)
        if figures is None:
            return None
        self._split_fit = times if self._split_fit is None else self._split_fit + times
        limit = find_limit(figures)
        if limit is not None and not self._limit_told:
            self._limit_told = True
            who = "" if self._workers == 1 else " (chief)" if self._is_chief else " (a worker)"
            logger.warning(
                "keras-mirror-kit ThroughputMonitor%s: epoch %d: %s",
                who,
                epoch + 1,
                limit.describe(),
            )
        return figures

    def _set_flops(self) -> None:
        """Gives the meter the FLOPs per sample and the peak (outside the measured time)."""
        meter, model = self._meter, self.model
        if meter is None or not self._flops_pending:
            return
        flops = self._flops_per_sample
        if flops is None:
            if not getattr(model, "built", False):
                return  # counted at the first epoch's end, once the model is built
            try:
                flops = count_training_flops(model).flops_per_sample
            except Exception as error:  # noqa: BLE001 - a count never stops training
                self._tell(
                    "flops",
                    "ThroughputMonitor: the FLOPs per sample of this model were not counted "
                    "(%s), so no flops_per_sec or mfu is reported. Give them: "
                    "ThroughputMonitor(flops_per_sample=...).",
                    error,
                )
                self._flops_pending = False
                return
        self._flops_pending = False
        dtype = model_compute_dtype(model)
        try:
            peak = resolve_peak(
                _replica_devices(model),
                dtype,
                num_workers=self._workers,
                peak_flops=self._peak_flops,
            )
            total, device, why = peak.total, peak.device_name, peak.source
        except (ValueError, RuntimeError) as error:  # e.g. a float64 model: no table entry
            total, device, why = None, "this device", str(error)
        if total is None:
            self._tell(
                "peak",
                "ThroughputMonitor: no peak FLOP/s known for %s in %s (%s), so mfu is not "
                "reported. Give the peak of one device: ThroughputMonitor(peak_flops=...) in "
                "FLOP/s; on a CPU, `keras-mirror-kit bench --roof` measures this machine's "
                "matmul roof once and stores it for the monitor.",
                device,
                dtype,
                why,
            )
        meter.set_flops(flops, total)

    def _tell(self, what: str, message: str, *args: Any) -> None:
        if what not in self._flops_told:
            self._flops_told.add(what)
            logger.info(message, *args)

    def _start_epoch_counts(self) -> None:
        self._last_batch = -1
        self._seen_batch = -1
        self._fast = False
        self._epoch_length = (self.params or {}).get("steps") or _NEVER

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """Arms the epoch: its clock starts with its first training step."""
        self._count_seen()  # a loop that did not call on_epoch_end for the previous epoch
        self._start_epoch_counts()
        self._epoch_pending = self._meter is not None

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Starts the epoch's clock at its first training step."""
        if self._epoch_pending:
            self._epoch_pending = False
            meter = self._meter
            assert meter is not None
            meter.start_epoch()
            self._fast = not meter.in_warmup

    def _with_updates(self, figures: dict[str, float] | None) -> dict[str, float] | None:
        """Adds `updates_per_sec` under gradient accumulation (N micro-batches per update)."""
        if figures is not None and self._accumulation > 1:
            figures["updates_per_sec"] = figures["steps_per_sec"] / self._accumulation
        return figures

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Counts the steps done; every `log_every_n_steps` steps adds figures to `logs`."""
        if self._fast:
            # With steps_per_execution=N Keras reports the last index of each execution,
            # even past the end of the epoch when its last execution runs fewer steps.
            index = batch if batch < self._epoch_length else self._epoch_length - 1
            if (
                index > self._seen_batch  # not indices restarting (a hand-driven loop)
                and self._steps_in_fit + index - self._last_batch < self._next_report
            ):
                self._seen_batch = index
                self._seen_at = time.perf_counter()
                return
        self._count_batch_end(batch, logs)

    def _count_batch_end(self, batch: int, logs: dict[str, Any] | None) -> None:
        meter = self._meter
        if meter is None:
            return
        if not meter.running:  # a custom loop without on_train_batch_begin: time from here
            self._epoch_pending = False
            self._last_batch = self._seen_batch = batch
            meter.start_epoch()
            return
        steps = (self.params or {}).get("steps")
        index = steps_done(batch, steps, 0, self._steps_per_execution) - 1
        if index <= self._seen_batch:  # indices restarted without on_epoch_begin
            self._count_seen()
            n_steps = max(1, min(index + 1, self._steps_per_execution))
        else:
            n_steps = index - self._last_batch
        self._last_batch = self._seen_batch = index
        self._give(n_steps, logs)

    def _give(self, n_steps: int, logs: dict[str, Any] | None, now: float | None = None) -> None:
        """Gives steps to the meter; adds batch figures to `logs` when a report is due."""
        meter = self._meter
        assert meter is not None
        samples = None
        if self._short_last_batch and self._last_batch == self._epoch_length - 1:
            # These steps end the epoch, whose last batch is smaller: count it exactly.
            samples = n_steps * meter.global_batch_size - (
                meter.global_batch_size - self._short_last_batch
            )
        meter.step(n_steps, now=now, samples=samples)
        if self._step_clock is not None and not self._step_clock.measuring:
            self._measure_split()  # warm-up ended with these steps
        before, self._steps_in_fit = self._steps_in_fit, self._steps_in_fit + n_steps
        every = self._log_every_n_steps
        if every is not None:
            if logs is not None and self._steps_in_fit // every > before // every:
                figures = self._with_updates(meter.interval_figures())
                if figures is not None:
                    logs.update(figures)
                    self._last = figures
            self._next_report = (self._steps_in_fit // every + 1) * every
        self._fast = meter.running and not meter.in_warmup

    def _count_seen(self) -> None:
        """Gives the meter the steps seen at batch ends but not counted yet, timed then."""
        meter = self._meter
        if meter is not None and meter.running and self._seen_batch > self._last_batch:
            n_steps = self._seen_batch - self._last_batch
            self._last_batch = self._seen_batch
            self._give(n_steps, None, now=self._seen_at)

    def on_test_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Pauses the clock for validation inside `fit()`."""
        if self._training and self._meter is not None:
            self._count_seen()
            self._meter.pause()

    def on_test_end(self, logs: dict[str, Any] | None = None) -> None:
        """Resumes the clock after validation inside `fit()`."""
        if self._training and self._meter is not None:
            self._meter.resume()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """Adds the epoch's figures to `logs` (none if the epoch was all warm-up)."""
        if self._meter is None:
            return
        self._count_seen()
        self._fast = False
        self._meter.stop()
        if self._flops_pending:
            self._set_flops()
        figures = None if self._epoch_pending else self._with_updates(self._meter.epoch_figures())
        if figures is not None:
            figures.update(self._epoch_split(epoch) or {})
        self._epoch_pending = False
        if figures is None:
            logger.debug(
                "ThroughputMonitor: epoch %d had no measured step (warm-up: %d steps); no "
                "throughput figures for it.",
                epoch,
                self._warmup_steps,
            )
            return
        if logs is not None:
            logs.update(figures)
        self._last = figures

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        """Logs the one-line summary of the whole `fit()` at INFO level."""
        self._training = False
        self._epoch_pending = False
        if self._meter is None:
            return
        self._count_seen()  # a loop that ends without on_epoch_end
        self._fast = False
        self._meter.stop()
        self._stop_step_clock()

    def on_fit_exception(self, exception: BaseException) -> None:
        """A `fit()` that raised (Keras calls no `on_train_end`): the model gets its own
        train function back (`fit_hooks.FitHooks`)."""
        self._stop_step_clock()

    def _stop_step_clock(self) -> None:
        if self._step_clock is not None:
            self._step_clock.stop()
        if getattr(self, "_is_chief", True):  # one summary per cluster, from the chief
            line = self._meter.describe()
            if self._fit_split():
                line += f"; each step: {describe(self._fit_split())}"
            logger.info("keras-mirror-kit ThroughputMonitor: %s", line)
