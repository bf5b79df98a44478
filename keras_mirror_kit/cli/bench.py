"""`keras-mirror-kit bench`: samples/s, FLOP/s and MFU of the tutorial CNN per replica count.

Each replica count runs in its own process (the hidden `_bench-worker` sub-command), since
logical devices can only be set up before TensorFlow initialises. `bench --roof` instead
measures this CPU's matmul roof per dtype and stores it where `ThroughputMonitor` (and so
the MFU column of `bench`) finds it (`keras_mirror_kit.throughput.peaks.roof_path()`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from keras_mirror_kit.throughput.step_split import SPLIT_KEYS, SPLIT_NAMES, find_limit


def register(sub: Any) -> None:
    """Adds the `bench` sub-command (and its hidden worker) to the parser."""
    for name, hidden in (("bench", False), ("_bench-worker", True)):
        bench = sub.add_parser(
            name,
            help=None if hidden else "samples/sec of the tutorial CNN per replica count",
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
        bench.add_argument(
            "--replicas",
            type=_parse_replicas,
            default=[1, 2],
            help="comma-separated replica counts, each run in its own process",
        )
        bench.add_argument("--per-replica-batch-size", type=int, default=64)
        bench.add_argument("--steps", type=int, default=50, help="measured steps per run")
        if hidden:
            bench.add_argument("--result-file", required=True)
        else:
            bench.add_argument("--json", help="write the raw figures to this file")
            bench.add_argument("--plot", help="write a chart to this PNG file")
            bench.add_argument(
                "--roof",
                action="store_true",
                help="instead of the benchmark: measure this CPU's matmul FLOP/s per dtype "
                "and store it for ThroughputMonitor's mfu (file: $KMK_ROOF_FILE, else "
                "~/.cache/keras-mirror-kit/roof.json)",
            )
            bench.add_argument(
                "--roof-dtypes",
                default="float32,bfloat16,float16",
                help="dtypes measured by --roof",
            )
            bench.add_argument(
                "--roof-size", type=int, default=1024, help="matrix side used by --roof"
            )
            bench.add_argument(
                "--timeout", type=float, default=1800, help="seconds allowed per run"
            )


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Runs `keras-mirror-kit bench` (or its hidden worker)."""
    if args.per_replica_batch_size <= 0 or args.steps <= 0:
        parser.error("--per-replica-batch-size and --steps must be positive")
    if args.command == "_bench-worker":
        return _bench_worker(args)
    if args.roof:
        return _roof(args, parser)
    return _bench(args)


def _roof(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Measures and stores this CPU's matmul roof (`bench --roof`)."""
    dtypes = [d.strip() for d in args.roof_dtypes.split(",") if d.strip()]
    if not dtypes or any(d not in ("float32", "bfloat16", "float16") for d in dtypes):
        parser.error(
            "--roof-dtypes takes a comma-separated list of float32, bfloat16, float16. "
            f"Received: {args.roof_dtypes!r}"
        )
    if args.roof_size <= 0:
        parser.error(f"--roof-size must be positive. Received: {args.roof_size}")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ["CUDA_VISIBLE_DEVICES"] = "-1"  # the CPU's roof, whatever GPUs there are
    from keras_mirror_kit.throughput import peaks

    measured = {}
    rows = [f"{'dtype':<10} {'GFLOP/s':>10}   ({peaks.cpu_name()}, {args.roof_size}^2 matmuls)"]
    for dtype in dtypes:
        result = peaks.measure_matmul_roof(dtype, size=args.roof_size)
        measured[peaks.compute_dtype_key(dtype)] = result
        rows.append(f"{dtype:<10} {result['flops_per_sec'] / 1e9:>10.1f}")
    try:
        path = peaks.store_roof(measured)
    except (OSError, ValueError) as error:
        sys.stderr.write(f"error: the roof was measured but not stored: {error}\n")
        return 1
    sys.stdout.write("\n".join(rows) + f"\nstored in {path}\n")
    return 0


def _parse_replicas(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--replicas takes a comma-separated list of positive integers. Received: {text!r}"
        ) from None
    if not counts or any(n <= 0 for n in counts):
        raise argparse.ArgumentTypeError(
            f"--replicas takes a comma-separated list of positive integers. Received: {text!r}"
        )
    return counts


def _bench_worker(args: argparse.Namespace) -> int:
    """One benchmark run, in its own process: the tutorial CNN on synthetic data."""
    import tensorflow as tf

    import keras_mirror_kit as kmk

    n = args.replicas[0]
    gpus = tf.config.list_physical_devices("GPU")
    devices = [f"/gpu:{i}" for i in range(n)] if len(gpus) >= n else None
    if devices is None:
        kmk.simulate_replicas(n)
    import keras

    from keras_mirror_kit.datasets import make_synthetic_cifar10

    @kmk.distributed(per_replica_batch_size=args.per_replica_batch_size, devices=devices)
    def build() -> keras.Model:
        model = kmk.models.tutorial_cnn()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        return model

    model = build()
    dist = build.distribution
    warmup = 3
    samples = (args.steps + warmup) * dist.global_batch_size
    (x, y), _ = make_synthetic_cifar10(num_train=samples, num_test=10, seed=0)
    dataset = kmk.make_dataset(x, y, dist.global_batch_size, seed=0, preprocess=kmk.rescale())
    monitor = kmk.ThroughputMonitor(warmup_steps=warmup)
    started = time.perf_counter()
    model.fit(dataset, epochs=1, callbacks=[monitor], verbose=1)
    fit_seconds = time.perf_counter() - started
    measured = monitor.summary()
    meter = monitor.meter
    result = {
        "replicas": dist.num_replicas,
        "devices": list(dist.devices),
        "global_batch_size": dist.global_batch_size,
        "dataset_batch_size": int(next(iter(dataset))[0].shape[0]),  # samples per step
        "steps": args.steps,
        "samples_per_sec": monitor.last["samples_per_sec"],
        "samples_per_sec_per_replica": monitor.last["samples_per_sec_per_replica"],
        "steps_per_sec": monitor.last["steps_per_sec"],
        "measured_steps": measured["measured_steps"],
        "measured_seconds": measured["measured_seconds"],
        "warmup_steps": measured["warmup_steps"],
        "fit_seconds": fit_seconds,
        "flops_per_sample": meter.flops_per_sample if meter else None,
        "flops_per_sec": monitor.last.get("flops_per_sec"),
        "peak_flops": meter.peak_flops if meter else None,
        "mfu": monitor.last.get("mfu"),
        "split": {k: monitor.last[k] for k in SPLIT_KEYS if k in monitor.last},
    }
    Path(args.result_file).write_text(json.dumps(result))
    return 0


def _bench(args: argparse.Namespace) -> int:
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, n in enumerate(args.replicas, 1):
            sys.stdout.write(f"[{i}/{len(args.replicas)}] {n} replica(s), {args.steps} steps\n")
            sys.stdout.flush()
            result_file = Path(tmp) / f"r{n}.json"
            env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG",)}
            env.pop("KMK_SIMULATE_REPLICAS", None)
            env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
            command = [
                sys.executable,
                "-m",
                "keras_mirror_kit.cli",
                "_bench-worker",
                "--replicas",
                str(n),
                "--per-replica-batch-size",
                str(args.per_replica_batch_size),
                "--steps",
                str(args.steps),
                "--result-file",
                str(result_file),
            ]
            try:
                proc = subprocess.run(command, env=env, check=False, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                sys.stderr.write(
                    f"error: the {n}-replica run did not finish within --timeout "
                    f"{args.timeout:g} s; it was stopped\n"
                )
                return 1
            if proc.returncode != 0 or not result_file.exists():
                sys.stderr.write(f"error: the {n}-replica run failed (exit {proc.returncode})\n")
                return 1
            results.append(json.loads(result_file.read_text()))
    base = results[0]["samples_per_sec"] / results[0]["replicas"]
    for result in results:
        result["scaling_efficiency"] = result["samples_per_sec"] / (result["replicas"] * base)
    header = (
        f"{'replicas':>8} {'global batch':>12} {'samples/s':>11} {'per replica':>11} "
        f"{'efficiency':>10} {'GFLOP/s':>9} {'MFU':>6}"
    )
    rows = [header, "-" * len(header)]
    for r in results:
        gflops = "-" if r.get("flops_per_sec") is None else f"{r['flops_per_sec'] / 1e9:.2f}"
        mfu = "-" if r.get("mfu") is None else f"{r['mfu']:.3f}"
        rows.append(
            f"{r['replicas']:>8} {r['global_batch_size']:>12} {r['samples_per_sec']:>11.1f} "
            f"{r['samples_per_sec_per_replica']:>11.1f} {r['scaling_efficiency']:>10.2f} "
            f"{gflops:>9} {mfu:>6}"
        )
    rows.append(f"(efficiency relative to the {results[0]['replicas']}-replica run, per replica)")
    flops = results[0].get("flops_per_sample")
    if flops:
        rows.append(f"(GFLOP/s: samples/s x {flops / 1e6:.2f} MFLOPs per training sample)")
    if any(r.get("mfu") is None for r in results):
        rows.append(
            "(MFU: - where the peak is unknown; on a CPU, `keras-mirror-kit bench --roof` "
            "measures and stores it)"
        )
    rows.extend(_split_rows(results))
    sys.stdout.write("\n".join(rows) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
        sys.stdout.write(f"wrote {args.json}\n")
    if args.plot:
        _plot(results, args.plot)
        sys.stdout.write(f"wrote {args.plot}\n")
    return 0


def _split_rows(results: list[dict[str, Any]]) -> list[str]:
    """The step split of each run (ThroughputMonitor's), and the limit where one dominates."""
    if not any(r.get("split") for r in results):
        return []
    keys = [k for k in SPLIT_KEYS if any(k in r.get("split", {}) for r in results)]
    header = f"{'replicas':>8} " + " ".join(f"{SPLIT_NAMES[k]:>11}" for k in keys)
    rows = ["", "where each step goes (share of the step time):", header, "-" * len(header)]
    for r in results:
        split = r.get("split", {})
        cells = ["-" if k not in split else f"{split[k]:.0%}" for k in keys]
        rows.append(f"{r['replicas']:>8} " + " ".join(f"{c:>11}" for c in cells))
    for r in results:
        limit = find_limit(r.get("split", {}))
        if limit is not None:
            rows.append(f"{r['replicas']} replica(s): {limit.describe()}")
    return rows


def _plot(results: list[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "error: --plot needs matplotlib, which is not installed: "
            'pip install "keras-mirror-kit[plot]" (or leave out --plot)'
        ) from None
    replicas = [r["replicas"] for r in results]
    fig, (left, right, flops) = plt.subplots(1, 3, figsize=(13, 3.5))
    left.bar([str(n) for n in replicas], [r["samples_per_sec"] for r in results])
    left.set(xlabel="replicas", ylabel="samples / s", title="Throughput")
    right.plot(replicas, [r["scaling_efficiency"] for r in results], marker="o")
    right.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    right.set(xlabel="replicas", ylabel="efficiency", title="Scaling efficiency", ylim=(0, 1.2))
    gflops = [(r.get("flops_per_sec") or 0.0) / 1e9 for r in results]
    bars = flops.bar([str(n) for n in replicas], gflops, color="tab:green")
    for bar, r in zip(bars, results, strict=True):
        label = "MFU n/a" if r.get("mfu") is None else f"MFU {r['mfu']:.1%}"
        flops.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                       ha="center", va="bottom", fontsize=8)  # fmt: skip
    flops.set(xlabel="replicas", ylabel="GFLOP / s", title="Achieved FLOP/s and MFU")
    flops.set_ylim(0, max([*gflops, 1e-9]) * 1.25)
    fig.suptitle("keras-mirror-kit bench: tutorial CIFAR-10 CNN, synthetic data")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
