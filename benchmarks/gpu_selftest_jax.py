"""The first GPU figures, on Keras' JAX backend: one script, bounded in time, no TensorFlow.

The project's GPU machine (one H200) has JAX with CUDA but no TensorFlow, so this script
uses nothing of the kit that imports TensorFlow (no `kmk.make_dataset`: batches come from
Python generators of NumPy or device arrays) and runs everything in this one process on
`KERAS_BACKEND=jax`. It prints one line per figure and, at the end, `RESULT {...}` (also
written to `--json`):

1. `cnn`: the CIFAR tutorial CNN (`kmk.models.tutorial_cnn`), float32 and mixed bfloat16:
   samples/s, step time, FLOPs per sample (XLA's count, `kmk.count_training_flops`),
   FLOP/s and MFU from `ThroughputMonitor`, fed with one batch kept on the device;
2. `resnet50`: `keras.applications.ResNet50(weights=None)` at 224x224, mixed bfloat16 and
   float32 (float32 runs as TF32 on the GPU by JAX's default: its MFU is against the TF32
   peak), the same figures;
3. `pipeline`: whether a host input pipeline keeps up: images/s a NumPy generator (one host
   thread: random samples, random flips, uint8 to float32) produces alone, against the
   images/s the model consumes fed from the device, and the model's samples/s fed from that
   generator (the CNN's float32 and ResNet-50's bfloat16 runs);
4. `monitor`: `ThroughputMonitor`'s cost per step on fast steps (a one-layer model): its
   hooks alone (Keras' `CallbackList` dispatch, fastest of 9) and whole `fit()` calls
   with and without it, and with a callback that does nothing at batch ends (the part that
   is Keras dispatching batch ends synchronously on JAX, as it does for any callback with
   `on_train_batch_end`; fastest of alternating rounds);
5. `checkpoint`: one `SyncedCheckpoint` save of a state of at least 500 MB (two 7936 x 7936
   Dense layers, SGD) in the middle of an epoch, synchronous against `async_save=True`: the
   training loop's extra seconds over the same epoch without a checkpoint, timed until the
   save is written (an async write still running at the epoch's end is waited for and
   counted; the epoch-end save is not timed), and the bytes it wrote (target: async <= 10%
   of sync).

Without a GPU it runs in its quick mode (automatically, or `--quick`): the same code on
small sizes (a small residual CNN at 16x16 stands in for ResNet-50, an 8 MB state for the
checkpoint, one precision per model), with the MFU against this CPU's float32 matmul rate
measured at the start. `tests/test_gpu_selftest_jax.py` runs that mode with TensorFlow
hidden (`--hide-tensorflow`), as on the GPU machine. A section that would not fit in what
is left of `--budget-s` is skipped with a line.

Carrying the kit and Keras to the GPU machine as wheels (docs/benchmarks.md, "GPU figures
on JAX", has the commands), then there:

    python3 -m pip install --no-deps --no-index gpu_wheels/*.whl
    python3 benchmarks/gpu_selftest_jax.py --json gpu_figures.json   # under 8 min on an H200

Exit status: 0 when every section ran or was skipped with its reason (a target not met is
a figure, not a failure), 1 when one failed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def say(line: str = "") -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


@dataclass(frozen=True)
class Sizes:
    """What each section trains, in one mode (`FULL` on a GPU, `QUICK` elsewhere)."""

    cnn_batch: int
    cnn_steps: int
    resnet_batch: int
    resnet_steps: int
    resnet_image: int  # the side of the stand-in's images in quick mode
    warmup: int
    pipeline_images: int  # images the pipeline draws from (uint8, in host memory)
    pipeline_batches: int  # batches timed for the pipeline alone
    monitor_steps: int
    monitor_rounds: int
    ckpt_mb: float  # the checkpoint's state at least (MB, 10**6 bytes)
    ckpt_save_at: int  # the save's step; the epoch is 2 x this - 1 steps (one save in it)
    ckpt_rounds: int


FULL = Sizes(512, 300, 256, 40, 224, 5, 512, 40, 2000, 4, 500.0, 600, 2)
QUICK = Sizes(16, 8, 8, 6, 16, 2, 128, 10, 100, 3, 8.0, 12, 1)

# Seconds each section needs at least (FULL, QUICK): skipped when less is left.
ESTIMATES = {
    "cnn": (60, 20),
    "resnet50": (200, 40),
    "monitor": (40, 15),
    "checkpoint": (90, 20),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes even on a GPU")
    parser.add_argument(
        "--budget-s", type=float, default=420.0, help="seconds for all sections together"
    )
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument(
        "--peak-flops", type=float, default=None, help="peak FLOP/s of one device, for MFU"
    )
    parser.add_argument(
        "--only", default=None, help="comma-separated sections: cnn,resnet50,monitor,checkpoint"
    )
    parser.add_argument(
        "--hide-tensorflow",
        action="store_true",
        help="make `import tensorflow` fail, as on the GPU machine (for tests)",
    )
    args = parser.parse_args(argv)
    args.sections = (args.only or ",".join(ESTIMATES)).split(",")
    unknown = [s for s in args.sections if s not in ESTIMATES]
    if unknown:
        parser.error(f"--only: unknown section(s) {unknown}; choose from {list(ESTIMATES)}")
    return args


# -- the pieces every section uses -------------------------------------------------------


def device_batches(x: Any, y: Any) -> Iterator[tuple[Any, Any]]:
    """The same batch for ever, placed on the device once: the model's own speed."""
    import jax

    x, y = jax.device_put(x), jax.device_put(y)
    while True:
        yield x, y


def host_pipeline(images: Any, labels: Any, batch: int, seed: int = 0) -> Iterator[Any]:
    """A host input pipeline on one thread: random samples, random flips, uint8 -> float32."""
    import numpy as np

    rng = np.random.default_rng(seed)
    scale = np.float32(1.0 / 255.0)
    while True:
        index = rng.integers(0, len(images), size=batch)
        chosen = images[index]
        flip = rng.random(batch) < 0.5
        chosen[flip] = chosen[flip, :, ::-1]
        yield chosen.astype(np.float32) * scale, labels[index]


def images_per_second(batches: Iterator[Any], count: int, batch: int) -> float:
    next(batches)  # the first batch's set-up is not the pipeline's rate
    start = time.perf_counter()
    for _ in range(count):
        next(batches)
    return count * batch / (time.perf_counter() - start)


def train(
    model: Any, batches: Iterator[Any], steps: int, sizes: Sizes, global_batch: int, **monitor: Any
) -> dict[str, float]:
    """One `fit()` of `steps` steps with `ThroughputMonitor`; its summary."""
    import keras_mirror_kit as kmk

    meter = kmk.ThroughputMonitor(
        global_batch_size=global_batch, warmup_steps=sizes.warmup, **monitor
    )
    model.fit(batches, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=[meter])
    return meter.summary()


def figures_line(label: str, summary: dict[str, float], flops: float, peak: Any) -> str:
    line = (
        f"{label}: {summary.get('samples_per_sec', 0):,.0f} samples/s, "
        f"{summary.get('step_time_ms', 0):.2f} ms/step, {flops / 1e6:,.1f} MFLOP/sample"
    )
    if "flops_per_sec" in summary:
        line += f", {summary['flops_per_sec'] / 1e12:.3f} TFLOP/s"
    if "mfu" in summary:
        line += f", MFU {100 * summary['mfu']:.1f}% of {peak}"
    return line


def peak_text(model: Any, given: float | None) -> str:
    """The peak `ThroughputMonitor` compares with, as words (for the report)."""
    from keras_mirror_kit.model_record import engine_of
    from keras_mirror_kit.throughput.flops import model_compute_dtype
    from keras_mirror_kit.throughput.peaks import resolve_peak

    peak = resolve_peak(engine_of(model).devices, model_compute_dtype(model), peak_flops=given)
    if peak.total is None:
        return f"no known peak ({peak.source})"
    return f"{peak.total / 1e12:.3g} TFLOP/s {peak.dtype} ({peak.device_name})"


def cpu_matmul_peak() -> float:
    """This CPU's float32 matmul FLOP/s through XLA (quick mode's stand-in for a GPU peak)."""
    import jax
    import jax.numpy as jnp

    size = 1024
    a = jnp.ones((size, size), jnp.float32) / size
    chain = jax.jit(lambda x: x @ a @ a @ a @ a)
    chain(a).block_until_ready()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        chain(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 4 * 2.0 * size**3 / best


def release(*models: Any) -> None:
    import keras

    del models
    keras.backend.clear_session()
    gc.collect()


# -- the sections ---------------------------------------------------------------------------


def section_model(
    name: str, factory: Callable[[], Any], shape: tuple[int, ...], classes: int, batch: int,
    steps: int, sizes: Sizes, peak: float | None, pipeline_precision: str, quick: bool,
) -> dict[str, Any]:  # fmt: skip
    """Float32 and mixed bfloat16 runs of one model, and the pipeline check on one of them
    (quick mode: that one only, the code is the same)."""
    import numpy as np

    import keras_mirror_kit as kmk

    rng = np.random.default_rng(0)
    x = rng.random((batch, *shape), dtype=np.float32)
    y = rng.integers(0, classes, size=(batch,)).astype("int32")
    out: dict[str, Any] = {}
    flops = None
    precisions = [pipeline_precision] if quick else ["mixed_bfloat16", "float32"]
    for precision in precisions:
        key = "bf16" if precision == "mixed_bfloat16" else "fp32"
        policy = None if precision == "float32" else precision

        @kmk.distributed(global_batch_size=batch, mixed_precision=policy)
        def build() -> Any:
            model = factory()
            model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
            return model

        model = build()
        if flops is None:
            start = time.perf_counter()
            count = kmk.count_training_flops(model)
            flops = count.flops_per_sample
            out["flops_per_sample"] = flops
            out["forward_flops_per_sample"] = count.forward_flops_per_sample
            out["count_seconds"] = round(time.perf_counter() - start, 2)
            say(
                f"{name}: {flops / 1e9:.3f} GFLOP per training sample "
                f"({count.forward_flops_per_sample / 1e9:.3f} forward; XLA's count, "
                f"{out['count_seconds']:.1f} s)"
            )
        start = time.perf_counter()
        summary = train(
            model, device_batches(x, y), steps, sizes, batch, flops_per_sample=flops,
            peak_flops=peak,
        )  # fmt: skip
        summary["wall_seconds"] = round(time.perf_counter() - start, 1)
        out[key] = summary
        say(figures_line(f"{name} {key} (batch {batch})", summary, flops, peak_text(model, peak)))
        if precision == pipeline_precision:
            out["pipeline"] = section_pipeline(f"{name} {key}", model, shape, classes, batch,
                                               steps, sizes, summary)  # fmt: skip
        release(model)
    return out


def section_pipeline(
    label: str, model: Any, shape: tuple[int, ...], classes: int, batch: int, steps: int,
    sizes: Sizes, fed_from_device: dict[str, float],
) -> dict[str, Any]:  # fmt: skip
    import numpy as np

    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, size=(sizes.pipeline_images, *shape), dtype=np.uint8)
    labels = rng.integers(0, classes, size=(sizes.pipeline_images,)).astype("int32")
    produced = images_per_second(
        host_pipeline(images, labels, batch), sizes.pipeline_batches, batch
    )
    consumed = fed_from_device.get("samples_per_sec", 0.0)
    fed = train(model, host_pipeline(images, labels, batch), steps, sizes, batch)
    end_to_end = fed.get("samples_per_sec", 0.0)
    keeps_up = produced >= consumed and end_to_end >= 0.9 * consumed
    say(
        f"pipeline {label}: produced {produced:,.0f} images/s (one host thread) vs consumed "
        f"{consumed:,.0f} images/s (fed from the device); fed from the pipeline "
        f"{end_to_end:,.0f} samples/s ({end_to_end / max(consumed, 1e-9):.2f}x): "
        f"{'keeps up' if keeps_up else 'does NOT keep up'}"
    )
    return {
        "produced_images_per_sec": produced,
        "consumed_images_per_sec": consumed,
        "fed_from_pipeline_samples_per_sec": end_to_end,
        "keeps_up": keeps_up,
        "fed_warmup_seconds": fed.get("warmup_seconds"),
    }


def section_cnn(sizes: Sizes, peak: float | None, quick: bool) -> dict[str, Any]:
    import keras_mirror_kit as kmk

    return section_model(
        "cnn", kmk.models.tutorial_cnn, (32, 32, 3), 10, sizes.cnn_batch, sizes.cnn_steps,
        sizes, peak, pipeline_precision="float32", quick=quick,
    )  # fmt: skip


def small_resnet(side: int) -> Any:
    """Quick mode's stand-in for ResNet-50: two residual blocks at `side` x `side`."""
    import keras

    inputs = keras.Input((side, side, 3))
    x = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
    for _ in range(2):
        y = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(x)
        y = keras.layers.BatchNormalization()(keras.layers.Conv2D(16, 3, padding="same")(y))
        x = keras.layers.ReLU()(keras.layers.Add()([x, y]))
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(x))


def section_resnet50(sizes: Sizes, peak: float | None, quick: bool) -> dict[str, Any]:
    import keras

    side = sizes.resnet_image
    if quick:
        say(f"resnet50: quick mode: a 2-block residual CNN at {side}x{side} stands in")
        factory, classes = (lambda: small_resnet(side)), 10
    else:
        factory, classes = (
            (lambda: keras.applications.ResNet50(weights=None, input_shape=(side, side, 3))),
            1000,
        )
    return section_model(
        "resnet50", factory, (side, side, 3), classes, sizes.resnet_batch, sizes.resnet_steps,
        sizes, peak, pipeline_precision="mixed_bfloat16", quick=quick,
    )  # fmt: skip


def section_monitor(sizes: Sizes) -> dict[str, Any]:
    import keras
    import numpy as np

    import keras_mirror_kit as kmk

    batch = 32

    @kmk.distributed(global_batch_size=batch)
    def build() -> Any:
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(10)])
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        return model

    model = build()
    rng = np.random.default_rng(0)
    x = rng.random((batch, 16), dtype=np.float32)
    y = rng.integers(0, 10, size=(batch,)).astype("int32")

    def monitor() -> Any:
        return kmk.ThroughputMonitor(global_batch_size=batch, warmup_steps=0)

    kmk.count_training_flops(model)  # counted once per model (cached): not in the timing

    class Bare(keras.callbacks.Callback):
        """Does nothing at batch ends: Keras then dispatches them synchronously."""

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            pass

    conditions = {"none": list, "bare": lambda: [Bare()], "monitor": lambda: [monitor()]}

    def fit_seconds(condition: str) -> float:
        callbacks = conditions[condition]()
        start = time.perf_counter()
        model.fit(device_batches(x, y), steps_per_epoch=sizes.monitor_steps, epochs=1,
                  verbose=0, callbacks=callbacks)  # fmt: skip
        return time.perf_counter() - start

    fit_seconds("none")  # compiles
    times: dict[str, list[float]] = {name: [] for name in conditions}
    for round_ in range(sizes.monitor_rounds):
        for name in list(conditions)[:: -1 if round_ % 2 else 1]:
            times[name].append(fit_seconds(name))
    per_step = {k: 1e6 * min(v) / sizes.monitor_steps for k, v in times.items()}
    step_ms = per_step["none"] / 1e3
    fit_cost_us = per_step["monitor"] - per_step["none"]
    sync_us = per_step["bare"] - per_step["none"]
    hooks_us = hook_cost(model, lambda: [monitor()], 2000, Bare())
    say(
        f"monitor: {hooks_us:.1f} us per step in its hooks (CallbackList dispatch, fastest of "
        f"9); whole fit(): {fit_cost_us:+.1f} us per step on {step_ms:.3f} ms steps "
        f"({100 * fit_cost_us / 1e3 / step_ms:+.1f}%), of which {sync_us:+.1f} us is Keras "
        "dispatching batch ends synchronously, as for any callback with on_train_batch_end "
        f"(fastest of {sizes.monitor_rounds} alternating rounds)"
    )
    release(model)
    return {
        "hooks_us_per_step": hooks_us,
        "fit_us_per_step": fit_cost_us,
        "synchronous_dispatch_us_per_step": sync_us,
        "step_ms": step_ms,
    }


def hook_cost(model: Any, make_callbacks: Callable[[], list], calls: int, bare: Any) -> float:
    """Microseconds per step the callbacks add to Keras' `CallbackList` dispatch.

    Against a list with `bare` (a callback that does nothing at batch ends), so that both
    lists dispatch synchronously: without it, Keras on JAX hands every batch end to a
    thread pool, which costs more host time than the monitor itself.
    """
    import keras

    lists = {
        label: keras.callbacks.CallbackList(
            callbacks, add_history=True, model=model, epochs=9, steps=calls, verbose=0
        )
        for label, callbacks in (("with", make_callbacks()), ("without", [bare]))
    }
    best = dict.fromkeys(lists, float("inf"))
    for cbl in lists.values():
        cbl.on_train_begin()
    for repeat in range(9):
        for label in ("with", "without") if repeat % 2 else ("without", "with"):
            cbl = lists[label]
            cbl.on_epoch_begin(repeat)
            start = time.perf_counter()
            for step in range(calls):
                cbl.on_train_batch_begin(step)
                cbl.on_train_batch_end(step, {"loss": 0.5})
            best[label] = min(best[label], time.perf_counter() - start)
            cbl.on_epoch_end(repeat, {"loss": 0.5})
    for cbl in lists.values():
        cbl.on_train_end()
    return 1e6 * (best["with"] - best["without"]) / calls


def units_for(megabytes: float) -> int:
    """The width of the checkpoint model (two Dense(units) layers on `units` features, a
    multiple of 128) whose weights hold at least `megabytes` MB in float32."""
    import math

    return 128 * math.ceil(math.sqrt(megabytes * 1e6 / 8) / 128)


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def step_clock(checkpoint: Any, directory: Path) -> Any:
    """Records when each training step ended; at the epoch's end (placed before the
    checkpoint, so before its epoch-end save) waits for the mid-epoch save to be written,
    then records the time and the bytes the checkpoint directory holds."""
    import keras

    class StepClock(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.ends: list[float] = []
            self.written_at = 0.0
            self.wait_seconds = 0.0
            self.written_bytes = 0

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self.ends.append(time.perf_counter())

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            start = time.perf_counter()
            if checkpoint is not None:
                checkpoint.wait_for_pending_save()
                self.written_bytes = directory_bytes(directory)
            self.written_at = time.perf_counter()
            self.wait_seconds = self.written_at - start

    return StepClock()


def section_checkpoint(sizes: Sizes) -> dict[str, Any]:
    import keras
    import numpy as np

    import keras_mirror_kit as kmk

    units, batch = units_for(sizes.ckpt_mb), 8

    @kmk.distributed(global_batch_size=batch)
    def build() -> Any:
        model = keras.Sequential(
            [keras.Input((units,)), keras.layers.Dense(units), keras.layers.Dense(units)]
        )
        model.compile(optimizer=keras.optimizers.SGD(1e-6), loss="mse")
        return model

    model = build()
    variables_mb = (
        sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in model.variables) / 1e6
    )
    rng = np.random.default_rng(0)
    x = rng.random((batch, units), dtype=np.float32)
    steps = 2 * sizes.ckpt_save_at - 1  # one save inside the measured loop
    root = Path(tempfile.mkdtemp(prefix="kmk-gpu-ckpt-"))
    written: list[int] = []

    def loop_seconds(mode: str, run: int) -> tuple[float, float]:
        """Seconds from the end of the second step (compiled) until the mid-epoch save is
        written (the epoch-end save is not timed), and the part spent waiting for it."""
        directory = root / f"{mode}-{run}"
        checkpoint = None
        if mode != "none":
            checkpoint = kmk.SyncedCheckpoint(
                directory, save_freq=sizes.ckpt_save_at, keep=1, restore=False,
                verify_replicas=False,  # one SPMD program: the replicas cannot differ
                async_save=mode == "async",
            )  # fmt: skip
        clock = step_clock(checkpoint, directory)
        callbacks = [clock] if checkpoint is None else [clock, checkpoint]
        model.fit(device_batches(x, x), steps_per_epoch=steps, epochs=1, verbose=0,
                  callbacks=callbacks)  # fmt: skip
        if checkpoint is not None and run >= 0:
            written.append(clock.written_bytes)
        shutil.rmtree(directory, ignore_errors=True)
        return clock.written_at - clock.ends[1], clock.wait_seconds

    try:
        loop_seconds("none", -1)  # compiles
        times: dict[str, list[float]] = {"none": [], "sync": [], "async": []}
        waits: list[float] = []
        for run in range(sizes.ckpt_rounds):
            for mode in ("none", "sync", "async") if run % 2 == 0 else ("async", "sync", "none"):
                seconds, wait = loop_seconds(mode, run)
                times[mode].append(seconds)
                if mode == "async":
                    waits.append(wait)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        release(model)
    base = statistics.median(times["none"])
    sync = statistics.median(times["sync"]) - base
    async_ = statistics.median(times["async"]) - base
    wait = statistics.median(waits)
    ratio = async_ / sync if sync > 0 else float("nan")
    verdict = "met" if ratio <= 0.10 else "NOT met"
    written_mb = min(written) / 1e6
    say(
        f"checkpoint: one save of {written_mb:,.1f} MB written ({variables_mb:,.1f} MB of "
        f"variables; asked for >= {sizes.ckpt_mb:g}) costs the loop {sync:.3f} s synchronous, "
        f"{async_:.3f} s with async_save=True, of which {wait:.3f} s waiting at the epoch's "
        f"end for the write to land ({ratio:.2f}x; target <= 0.10x: {verdict}); "
        f"{steps} steps of {1e3 * base / (steps - 2):.2f} ms, median of {sizes.ckpt_rounds}"
    )
    return {
        "requested_mb": sizes.ckpt_mb,
        "units": units,
        "variables_mb": variables_mb,
        "written_mb": written_mb,
        "steps": steps,
        "loop_s": base,
        "sync_s": sync,
        "async_s": async_,
        "async_wait_s": wait,
        "ratio": ratio,
        "target_met": bool(ratio <= 0.10),
    }


# -- main -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.hide_tensorflow:
        sys.modules["tensorflow"] = None  # type: ignore[assignment]  # import fails, as there
    chosen = os.environ.get("KERAS_BACKEND", "jax")
    if chosen != "jax":
        say(f"gpu_selftest_jax: runs on Keras' JAX backend; unset KERAS_BACKEND={chosen!r}")
        return 1
    os.environ["KERAS_BACKEND"] = "jax"
    try:
        import keras_mirror_kit as kmk
    except ImportError:  # run from a checkout without the wheel installed
        sys.path.insert(0, str(REPO))
        import keras_mirror_kit as kmk
    import jax
    import keras

    start = time.perf_counter()
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    quick = args.quick or not gpus
    sizes = QUICK if quick else FULL
    kinds = f" ({', '.join(sorted({d.device_kind for d in gpus}))})" if gpus else ""
    say(
        f"gpu_selftest_jax: {len(gpus)} GPU(s){kinds}; "
        f"JAX {jax.__version__} on {jax.default_backend()}, Keras {keras.__version__}, "
        f"keras-mirror-kit {kmk.__version__}; "
        + ("quick mode (small sizes, not GPU figures)" if quick else "full sizes")
    )
    peak = args.peak_flops
    if peak is None and not gpus:
        peak = cpu_matmul_peak()
        say(f"peak: {peak / 1e9:.1f} GFLOP/s (this CPU's float32 matmul through XLA)")
    results: dict[str, Any] = {"mode": "quick" if quick else "full", "sizes": asdict(sizes)}
    results["peak_flops"] = peak  # None on a GPU without --peak-flops: the kit's table
    failed = False
    runs = {
        "cnn": lambda: section_cnn(sizes, peak, quick),
        "resnet50": lambda: section_resnet50(sizes, peak, quick),
        "monitor": lambda: section_monitor(sizes),
        "checkpoint": lambda: section_checkpoint(sizes),
    }
    for name in args.sections:
        left = args.budget_s - (time.perf_counter() - start)
        needed = ESTIMATES[name][1 if quick else 0]
        if left < needed:
            say(f"{name}: skipped: {left:.0f} s of --budget-s left, it needs about {needed} s")
            results[name] = {"skipped": "budget"}
            continue
        section_start = time.perf_counter()
        try:
            results[name] = runs[name]()
        except Exception as err:  # noqa: BLE001 - reported; the other sections still run
            failed = True
            say(f"{name}: FAILED: {type(err).__name__}: {err}")
            traceback.print_exc()
            results[name] = {"failed": f"{type(err).__name__}: {err}"}
        results[name]["section_seconds"] = round(time.perf_counter() - section_start, 1)
    tf_imported = isinstance(sys.modules.get("tensorflow"), type(sys))
    results["tensorflow_imported"] = tf_imported
    results["seconds"] = round(time.perf_counter() - start, 1)
    say(f"tensorflow: {'imported' if tf_imported else 'not imported'}")
    say(f"done in {results['seconds']:.0f} s" + ("; a section FAILED" if failed else ""))
    text = json.dumps(results, default=float)
    if args.json:
        Path(args.json).write_text(text + "\n", encoding="utf-8")
    say("RESULT " + text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
