"""The `keras-mirror-kit` command line: `info`, `bench` and `launch`.

```
keras-mirror-kit info                      # versions, devices, what distributed() picks
keras-mirror-kit bench --replicas 1,2 --steps 50 --json bench.json --plot bench.png
keras-mirror-kit launch -n 2 -- train.py --epochs 3
```
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

__all__ = ["main"]


def _info() -> dict[str, Any]:
    import keras
    import tensorflow as tf

    from keras_mirror_kit import __version__
    from keras_mirror_kit.devices import (
        configure_from_environment,
        gpu_report,
        nccl_available,
        warn_if_gpus_unused,
    )
    from keras_mirror_kit.multi_worker import parse_tf_config, tf_config_num_workers

    configure_from_environment()
    tf_config = parse_tf_config()  # validated: a bad TF_CONFIG is a clear error here too
    build, gpus, warnings = gpu_report()
    unused = warn_if_gpus_unused()
    info: dict[str, Any] = {
        "keras_mirror_kit": __version__,
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "keras_backend": keras.backend.backend(),
        "physical_gpus": [d.name for d in tf.config.list_physical_devices("GPU")],
        "physical_cpus": [d.name for d in tf.config.list_physical_devices("CPU")],
        "nccl_usable": nccl_available(),
        "cuda_build": build,
        "gpu_details": gpus,
        "warnings": ([unused] if unused else []) + warnings,
        "tf_config": json.loads(os.environ["TF_CONFIG"]) if tf_config is not None else None,
    }
    workers = tf_config_num_workers()
    if workers > 1:
        info["logical_devices"] = [d.name for d in tf.config.list_logical_devices()]
        info["would_choose"] = {
            "strategy": "MultiWorkerMirroredStrategy",
            "workers": workers,
            "all_reduce": "collective (NCCL on GPUs, ring on CPUs)",
        }
        return info
    import keras_mirror_kit as kmk

    dist = kmk.distributed(per_replica_batch_size=1).distribution
    info["logical_devices"] = [d.name for d in tf.config.list_logical_devices()]
    info["would_choose"] = {
        "strategy": dist.strategy_name,
        "devices": list(dist.devices),
        "replicas": dist.num_replicas,
        "all_reduce": dist.cross_device_ops,
    }
    return info


def _print_info(info: dict[str, Any]) -> None:
    chosen = info["would_choose"]
    lines = [
        f"keras-mirror-kit {info['keras_mirror_kit']}",
        f"TensorFlow       {info['tensorflow']}",
        f"Keras            {info['keras']} (backend: {info['keras_backend']})",
        f"GPUs             {len(info['physical_gpus'])}: "
        f"{', '.join(info['physical_gpus']) or '-'}",
        f"CPUs             {len(info['physical_cpus'])}: {', '.join(info['physical_cpus'])}",
        f"Logical devices  {', '.join(info['logical_devices'])}",
        f"NCCL usable      {'yes' if info['nccl_usable'] else 'no'}",
        f"CUDA build       {_build_line(info['cuda_build'])}",
        *(
            f"  {gpu['name']}: {gpu['device_name']}, compute capability "
            f"{gpu['compute_capability']} (kernels: {gpu['kernels']})"
            for gpu in info["gpu_details"]
        ),
        f"TF_CONFIG        {json.dumps(info['tf_config']) if info['tf_config'] else 'not set'}",
        f"distributed()    {chosen['strategy']}"
        + (f" on {', '.join(chosen['devices'])}" if "devices" in chosen else "")
        + (f", {chosen['replicas']} replica(s)" if "replicas" in chosen else "")
        + (f", {chosen['workers']} workers" if "workers" in chosen else "")
        + f", all-reduce {chosen['all_reduce']}",
        *(f"WARNING: {warning}" for warning in info["warnings"]),
    ]
    sys.stdout.write("\n".join(lines) + "\n")


def _build_line(build: dict[str, Any]) -> str:
    if not build.get("is_cuda_build"):
        return "no (this TensorFlow cannot use NVIDIA GPUs)"
    kernels = ", ".join(build.get("cuda_compute_capabilities") or []) or "?"
    return (
        f"CUDA {build.get('cuda_version', '?')}, cuDNN {build.get('cudnn_version', '?')}, "
        f"kernels for {kernels}"
    )


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
                sys.executable, "-m", "keras_mirror_kit.cli", "_bench-worker",
                "--replicas", str(n), "--per-replica-batch-size",
                str(args.per_replica_batch_size), "--steps", str(args.steps),
                "--result-file", str(result_file),
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
    header = f"{'replicas':>8} {'global batch':>12} {'samples/s':>11} {'per replica':>11} " \
             f"{'efficiency':>10}"
    rows = [header, "-" * len(header)]
    for r in results:
        rows.append(
            f"{r['replicas']:>8} {r['global_batch_size']:>12} {r['samples_per_sec']:>11.1f} "
            f"{r['samples_per_sec_per_replica']:>11.1f} {r['scaling_efficiency']:>10.2f}"
        )
    rows.append(f"(efficiency relative to the {results[0]['replicas']}-replica run, per replica)")
    sys.stdout.write("\n".join(rows) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
        sys.stdout.write(f"wrote {args.json}\n")
    if args.plot:
        _plot(results, args.plot)
        sys.stdout.write(f"wrote {args.plot}\n")
    return 0


def _plot(results: list[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("error: --plot needs matplotlib (pip install matplotlib)") from None
    replicas = [r["replicas"] for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.bar([str(n) for n in replicas], [r["samples_per_sec"] for r in results])
    left.set(xlabel="replicas", ylabel="samples / s", title="Throughput")
    right.plot(replicas, [r["scaling_efficiency"] for r in results], marker="o")
    right.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    right.set(xlabel="replicas", ylabel="efficiency", title="Scaling efficiency", ylim=(0, 1.2))
    fig.suptitle("keras-mirror-kit bench: tutorial CIFAR-10 CNN, synthetic data")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keras-mirror-kit",
        description="Data-parallel Keras 3 training on every replica of a host.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, devices and what distributed() would choose")
    info.add_argument("--json", action="store_true", help="print JSON instead of a table")
    for name, hidden in (("bench", False), ("_bench-worker", True)):
        bench = sub.add_parser(
            name,
            help=None if hidden else "samples/sec of the tutorial CNN per replica count",
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
        bench.add_argument("--replicas", type=_parse_replicas, default=[1, 2],
                           help="comma-separated replica counts, each run in its own process")
        bench.add_argument("--per-replica-batch-size", type=int, default=64)
        bench.add_argument("--steps", type=int, default=50, help="measured steps per run")
        if hidden:
            bench.add_argument("--result-file", required=True)
        else:
            bench.add_argument("--json", help="write the raw figures to this file")
            bench.add_argument("--plot", help="write a chart to this PNG file")
            bench.add_argument("--timeout", type=float, default=1800,
                               help="seconds allowed per run")
    launch = sub.add_parser(
        "launch",
        help="run a script (launch -n 2 train.py) or a command (launch -n 2 -- python3 "
        "train.py) as N local multi-worker processes; launch --help for details",
        add_help=False,
    )
    launch.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the `keras-mirror-kit` command line.

    Args:
        argv: Arguments without the program name (default: `sys.argv[1:]`).

    Returns:
        The process exit code.

    Raises:
        SystemExit: On invalid arguments (argparse's usual behaviour).

    Example:

    ```python
    from keras_mirror_kit.cli import main
    main(["info"])
    ```
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "launch":
        from keras_mirror_kit.launch import main as launch_main

        return launch_main(argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "info":
        info = _info()
        if args.json:
            sys.stdout.write(json.dumps(info, indent=2) + "\n")
        else:
            _print_info(info)
        return 0
    if args.per_replica_batch_size <= 0 or args.steps <= 0:
        _parser().error("--per-replica-batch-size and --steps must be positive")
    if args.command == "_bench-worker":
        return _bench_worker(args)
    return _bench(args)


if __name__ == "__main__":
    sys.exit(main())
