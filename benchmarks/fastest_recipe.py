"""The fastest correct recipe: the whole CIFAR-10 job, the tutorial's code against the kit's knobs.

One process, 2 simulated CPU replicas (`--replicas`), CIFAR-10-shaped learnable synthetic data
(`keras_mirror_kit.datasets.make_synthetic_cifar10`: 50,000 training and 10,000 test
images by default), the tutorial's CNN and Adam, per-replica batch 64. Every condition
starts from the same initial weights and trains one epoch per round, `--epochs` rounds (3),
in an order that rotates from round to round; then each is evaluated on the same test set.

* `tutorial`: the tutorial's code as written (`benchmarks/overhead_vs_tutorial.py`'s
  `tutorial_job`: `x / 255.0`, `shuffle(10000).batch(128)`, `experimental_distribute_dataset`,
  model compiled in `strategy.scope()`).
* `kit`: `kmk.distributed(per_replica_batch_size=64)`, `kmk.make_dataset(...,
  preprocess=kmk.rescale())`, `kmk.ThroughputMonitor()`: the kit's defaults.
* `kit + mixed_bfloat16`: only where the hardware has bfloat16 (a GPU of compute capability
  8.0 or newer; a CPU with AVX512-BF16 or AMX).
* `recipe (auto)`: the kit's recommended recipe, `mixed_precision="auto"` and
  `steps_per_execution="auto"` (docs/performance.md): bfloat16 where the devices compute it
  natively, else float32; the line after the table says which "auto" chose and why.
* `recipe (auto), no bf16 (emulated)`: on a CPU with bfloat16 instructions, the same recipe
  as "auto" decides it on a CPU without them: the kit is shown this CPU with its bfloat16
  flags (`avx512_bf16`, `amx_bf16`) removed while the condition's strategy is created, so
  "auto" picks float32 through its own code path. Only the decision is emulated: it runs
  on this CPU, whose float32 speed is not that of a CPU without the instructions.
* `kit + jit_compile=True`: only if XLA is correct under `MirroredStrategy` here, checked
  first: the same 4 SGD steps from the same weights on 1 replica and on 2 replicas (and
  without XLA) must give the same weights (relative difference below 1e-4).

Reported per condition: training samples/s (median over rounds; from the end of the
`--warmup`-th step to the epoch's end, counted in steps so that `steps_per_execution` is
timed alike; no validation), its ratio to the tutorial (median of the per-round ratios),
FLOP/s (samples/s x the kit's count of FLOPs per training sample,
`keras_mirror_kit.throughput.flops`),
MFU (FLOP/s over this CPU's matmul roof in the condition's compute dtype: the roof stored by
`keras-mirror-kit bench --roof`, else measured here first), and test accuracy after the
epochs. Targets for the recommended recipe (`recipe (auto)`), its accuracy within 1 point
of the float32 kit's: >= 1.3x the tutorial's samples/s where "auto" chose bfloat16, >= 1.1x
where it chose float32 (also judged for the emulated row). The fastest condition within 1
point is also named.

    python benchmarks/fastest_recipe.py                       # the whole job, 3 epochs
    python benchmarks/fastest_recipe.py --replicas 1          # the default devices (1 CPU)
    python benchmarks/fastest_recipe.py --train-samples 12800 --test-samples 2000  # smoke

This is a script, not a test: it prints its figures and asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _report import say  # benchmarks/_report.py (scripts run from benchmarks/)
from overhead_vs_tutorial import PER_REPLICA_BATCH, tutorial_job

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["CUDA_VISIBLE_DEVICES"] = "-1"  # the simulated replicas are CPU replicas
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

TARGETS = {"bfloat16": 1.3, "float32": 1.1}  # the recipe's, by what "auto" chose
ACCURACY_POINTS = 1.0
RECIPE = {"mixed_precision": "auto", "steps_per_execution": "auto"}


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark and prints its figures.

    Args:
        argv: Command-line arguments (default: `sys.argv[1:]`).

    Returns:
        The exit status, 0.

    Example:

    ```python
    main(["--train-samples", "12800", "--test-samples", "2000"])
    ```
    """
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--epochs", type=int, default=3, help="rounds of one epoch each")
    parser.add_argument("--train-samples", type=int, default=50_000)
    parser.add_argument("--test-samples", type=int, default=10_000)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=10, help="steps per fit not timed")
    args = parser.parse_args(argv)
    global_batch = PER_REPLICA_BATCH * args.replicas
    if args.epochs <= 0 or args.train_samples < (args.warmup + 16) * global_batch:
        parser.error("--epochs must be positive and --train-samples hold warm-up + 16 steps")

    import keras_mirror_kit as kmk

    kmk.simulate_replicas(args.replicas, device_type="CPU")

    import keras
    import tensorflow as tf

    from keras_mirror_kit.datasets import make_synthetic_cifar10
    from keras_mirror_kit.throughput import peaks
    from keras_mirror_kit.throughput.flops import count_training_flops

    say(f"command: python benchmarks/fastest_recipe.py {' '.join(sys.argv[1:])}".rstrip())
    say(
        f"TensorFlow {tf.__version__}, Keras {keras.__version__}, {peaks.cpu_name()}, load "
        f"average {os.getloadavg()[0]:.2f}; {args.replicas} simulated replicas, global batch "
        f"{global_batch}; {args.train_samples} training / {args.test_samples} test images; "
        f"{args.epochs} epochs"
    )
    (x_train, y_train), (x_test, y_test) = make_synthetic_cifar10(
        num_train=args.train_samples, num_test=args.test_samples, seed=0
    )

    bf16 = peaks.cpu_has_bfloat16()
    say(f"bfloat16 instructions on this CPU: {'yes' if bf16 else 'no'}")
    jit_ok, jit_detail = jit_equivalent(x_train, y_train, args.replicas)
    say(f"XLA under MirroredStrategy, 1 vs {args.replicas} replicas: {jit_detail}")

    knobs: dict[str, dict[str, Any]] = {"kit": {}}
    if bf16:
        knobs["kit + mixed_bfloat16"] = {"mixed_precision": "mixed_bfloat16"}
    if jit_ok:
        knobs["kit + jit_compile=True"] = {"jit_compile": True}
    knobs["recipe (auto)"] = dict(RECIPE)
    if bf16:
        knobs[EMULATED] = dict(RECIPE)

    # The tutorial's job, and one kit model per recipe, all from the same initial weights.
    tutorial_model, tutorial_data = tutorial_job(x_train, y_train)
    initial = tutorial_model.get_weights()
    conditions: dict[str, dict[str, Any]] = {
        "tutorial": {
            "model": tutorial_model,
            "data": tutorial_data,
            "epoch_samples": args.train_samples,  # the tutorial keeps the last, smaller batch
            "dtype": "float32",
        }
    }
    kit_data = kmk.make_dataset(x_train, y_train, global_batch, seed=0, preprocess=kmk.rescale())
    chosen: dict[str, str] = {}  # what "auto" chose, and why, per recipe condition
    for name, settings in knobs.items():
        settings = dict(settings)
        jit = settings.pop("jit_compile", False)

        @kmk.distributed(per_replica_batch_size=PER_REPLICA_BATCH, **settings)
        def build(jit: bool = jit) -> keras.Model:
            model = kmk.models.tutorial_cnn()
            model.compile(
                optimizer="adam",
                loss="sparse_categorical_crossentropy",
                metrics=["accuracy"],
                jit_compile=jit,
            )
            return model

        with without_cpu_bfloat16(name == EMULATED):
            model = build()
        model.set_weights(initial)
        if settings.get("mixed_precision") == "auto":
            chosen[name] = describe_auto(build.distribution, emulated=name == EMULATED)
        conditions[name] = {
            "model": model,
            "data": kit_data,
            "epoch_samples": (args.train_samples // global_batch) * global_batch,
            "dtype": model.layers[0].compute_dtype,  # what the policy (or "auto") gave
        }
    flops = count_training_flops(tutorial_model).flops_per_sample
    say(f"FLOPs per training sample (kit's count, forward + backward): {flops / 1e6:.3f} M")
    roof = roof_by_dtype()

    names = list(conditions)
    rates: dict[str, list[float]] = {name: [] for name in names}
    monitor_flops: dict[str, list[float]] = {name: [] for name in names}
    started = time.perf_counter()
    for r in range(args.epochs):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            condition = conditions[name]
            timer = StepTimer(args.warmup, global_batch, condition["epoch_samples"])
            callbacks: list[Any] = [timer]
            if name != "tutorial":
                callbacks.insert(0, kmk.ThroughputMonitor(warmup_steps=args.warmup))
            condition["model"].fit(condition["data"], epochs=1, verbose=0, callbacks=callbacks)
            rates[name].append(timer.rate())
            if name != "tutorial" and "flops_per_sec" in callbacks[0].last:
                monitor_flops[name].append(callbacks[0].last["flops_per_sec"])
        say(f"epoch {r + 1}: " + ", ".join(f"{n}: {rates[n][-1]:.0f}" for n in names))
    say(
        f"{time.perf_counter() - started:.0f} s for the epochs; load average at the end "
        f"{os.getloadavg()[0]:.2f}"
    )

    x_eval = (x_test / 255.0).astype("float32")
    accuracy = {}
    for name in names:
        result = conditions[name]["model"].evaluate(
            x_eval, y_test, batch_size=global_batch, verbose=0, return_dict=True
        )
        accuracy[name] = 100.0 * float(result["accuracy"])

    say()
    say(f"training samples/s (median over {args.epochs} epochs) and test accuracy after them")
    say(
        f"  {'condition':<36} {'samples/s':>9} {'ratio':>6} {'range':>10} {'GFLOP/s':>8} "
        f"{'MFU':>6} {'accuracy':>8} {'vs fp32':>7}"
    )
    base = rates["tutorial"]
    reference = accuracy["kit"]
    rows = {}
    for name in names:
        median = statistics.median(rates[name])
        per_round = [v / b for v, b in zip(rates[name], base, strict=True)]
        paired = statistics.median(per_round)
        spread = f"{min(per_round):.2f}-{max(per_round):.2f}"
        achieved = median * flops
        peak = roof.get(peaks.compute_dtype_key(conditions[name]["dtype"]))
        mfu = f"{achieved / peak:.3f}" if peak else "-"
        delta = accuracy[name] - reference
        rows[name] = (paired, delta)
        say(
            f"  {name:<36} {median:>9.0f} {paired:>6.2f} {spread:>10} {achieved / 1e9:>8.2f} "
            f"{mfu:>6} "
            f"{accuracy[name]:>7.1f}% {delta:>+7.1f}"
        )
    say(
        "  ratio: median over epochs of samples/s / the tutorial's in the same epoch (range: "
        "its min-max); MFU over the CPU roof in the condition's dtype; vs fp32: accuracy "
        "points against `kit`."
    )
    for name, values in monitor_flops.items():
        if values:
            say(
                f"  cross-check, ThroughputMonitor's flops_per_sec for {name}: median "
                f"{statistics.median(values) / 1e9:.2f} GFLOP/s (its own timing)"
            )
    for name, line in chosen.items():
        say(f"  {name}: {line}")
    for name in chosen:
        ratio, delta = rows[name]
        dtype = conditions[name]["dtype"]
        target = TARGETS.get(dtype, TARGETS["float32"])
        met = ratio >= target and abs(delta) <= ACCURACY_POINTS
        say(
            f"verdict, {name} ({dtype}): {ratio:.2f}x the tutorial, accuracy {delta:+.1f} "
            f"points vs float32; target >= {target}x within {ACCURACY_POINTS:g} point: "
            f"{'MET' if met else 'NOT MET'}"
        )
    correct = {n: v for n, v in rows.items() if n != "tutorial" and abs(v[1]) <= ACCURACY_POINTS}
    best = max(correct, key=lambda n: correct[n][0])
    say(
        f"fastest within {ACCURACY_POINTS:g} point of float32: {best} ({correct[best][0]:.2f}x "
        f"the tutorial, accuracy {correct[best][1]:+.1f} points)"
    )
    return 0


EMULATED = "recipe (auto), no bf16 (emulated)"


@contextlib.contextmanager
def without_cpu_bfloat16(active: bool) -> Iterator[None]:
    """While active, the kit sees this CPU without its bfloat16 flags (`precision.this_cpu`)."""
    from keras_mirror_kit import precision

    if not active:
        yield
        return
    real = precision.this_cpu
    cpu = real()
    flags = (cpu.cpu_flags or frozenset()) - precision.CPU_BFLOAT16_FLAGS
    precision.this_cpu = lambda: dataclasses.replace(cpu, cpu_flags=flags)  # type: ignore[assignment]
    try:
        yield
    finally:
        precision.this_cpu = real  # type: ignore[assignment]


def describe_auto(dist: Any, emulated: bool) -> str:
    """What `mixed_precision="auto"` chose on `dist`'s devices, and why (as the kit logs it)."""
    from keras_mirror_kit import backends, precision

    with without_cpu_bfloat16(emulated):
        choice = precision.choose_policy(backends.current().precision_devices(dist.engine))
    return choice.describe() + (" (bfloat16 flags hidden from the kit)" if emulated else "")


def roof_by_dtype() -> dict[str, float]:
    """This CPU's matmul roof per dtype key: the stored one, else measured now."""
    from keras_mirror_kit.throughput import peaks

    stored = {key: entry["flops_per_sec"] for key, entry in peaks.load_roof().items()}
    if {"fp32", "bf16"} <= set(stored):
        say(f"CPU roof: stored in {peaks.roof_path()}: " + describe_roof(stored))
        return stored
    measured = {
        peaks.compute_dtype_key(dtype): peaks.measure_matmul_roof(dtype)["flops_per_sec"]
        for dtype in ("float32", "bfloat16")
    }
    say("CPU roof: measured now (none stored; `keras-mirror-kit bench --roof` stores one): "
        + describe_roof(measured))  # fmt: skip
    return measured


def describe_roof(roof: dict[str, float]) -> str:
    return ", ".join(f"{key} {value / 1e9:.0f} GFLOP/s" for key, value in sorted(roof.items()))


def StepTimer(warmup: int, global_batch: int, epoch_samples: int) -> Any:  # noqa: N802
    """A callback: samples/s from the end of the `warmup`-th step to the epoch's end.

    Keras reports the last step index of each execution (`steps_per_execution`), so the
    timing starts at the first batch end whose index reaches `warmup - 1`; the samples
    measured are the epoch's less the steps done by then.
    """
    import keras

    class _StepTimer(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.start = self.end = 0.0
            self.steps_before: int | None = None

        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            if self.steps_before is None and batch + 1 >= warmup:
                self.steps_before = batch + 1
                self.start = time.perf_counter()

        def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
            self.end = time.perf_counter()

        def rate(self) -> float:
            samples = epoch_samples - (self.steps_before or 0) * global_batch
            return samples / (self.end - self.start)

    return _StepTimer()


def jit_equivalent(x: Any, y: Any, replicas: int, steps: int = 4) -> tuple[bool, str]:
    """Whether XLA gives the same weights on 1 and on `replicas` replicas (and without XLA)."""
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_mirror_kit as kmk

    global_batch = PER_REPLICA_BATCH * replicas
    n = steps * global_batch
    first = [d.name for d in tf.config.list_logical_devices("CPU")][:1]
    initial = None
    results = {}
    for label, devices, jit in (
        ("1 replica, XLA", first, True),
        (f"{replicas} replicas, XLA", None, True),
        (f"{replicas} replicas, no XLA", None, False),
    ):

        @kmk.distributed(global_batch_size=global_batch, devices=devices)
        def build(jit: bool = jit) -> keras.Model:
            model = kmk.models.tutorial_cnn()
            model.compile(
                optimizer=keras.optimizers.SGD(0.05),
                loss="sparse_categorical_crossentropy",
                jit_compile=jit,
            )
            return model

        data = kmk.make_dataset(
            x[:n], y[:n], global_batch, shuffle=False, preprocess=kmk.rescale()
        )
        try:  # the kit refuses XLA on 2+ replicas when the model is built (keras_jit_replicas)
            model = build()
            if initial is None:
                initial = model.get_weights()
            model.set_weights(initial)
            model.fit(data, epochs=1, verbose=0)
        except Exception as error:  # noqa: BLE001 - reported, and XLA is left out
            lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
            lines = [ln for ln in lines if not ln.startswith(("File ", "[[", "Detected at"))]
            return False, f"{label} failed: {type(error).__name__}: {' '.join(lines[-2:])}"
        results[label] = model.get_weights()
    reference = results["1 replica, XLA"]
    scale = max(float(np.abs(w).max()) for w in reference)
    worst = {
        label: max(float(np.abs(a - b).max()) for a, b in zip(ws, reference, strict=True)) / scale
        for label, ws in results.items()
        if label != "1 replica, XLA"
    }
    ok = all(value < 1e-4 for value in worst.values())
    detail = ", ".join(f"{label}: {value:.1e}" for label, value in worst.items())
    verdict = "equivalent" if ok else "NOT equivalent"
    return ok, (
        f"{verdict} (max relative weight difference after {steps} SGD steps vs 1 replica "
        f"with XLA: {detail})"
    )


if __name__ == "__main__":
    sys.exit(main())
