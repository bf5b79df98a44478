"""`keras-mirror-kit info`: versions, devices and what `distributed()` would choose."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def register(sub: Any) -> None:
    """Adds the `info` sub-command to the parser."""
    info = sub.add_parser("info", help="versions, devices and what distributed() would choose")
    info.add_argument("--json", action="store_true", help="print JSON instead of a table")
    info.add_argument(
        "--per-replica-batch-size",
        type=int,
        default=None,
        help="show the global and effective batch sizes for this batch",
    )
    info.add_argument(
        "--gradient-accumulation-steps",
        type=int,
        default=1,
        help="micro-batches per optimizer update (for the effective batch)",
    )


def run(args: argparse.Namespace) -> int:
    """Runs `keras-mirror-kit info`."""
    info = collect(
        per_replica_batch_size=getattr(args, "per_replica_batch_size", None),
        gradient_accumulation_steps=getattr(args, "gradient_accumulation_steps", 1),
    )
    if args.json:
        sys.stdout.write(json.dumps(info, indent=2) + "\n")
    else:
        print_table(info)
    return 0


def _installed_version(distribution: str) -> str | None:
    """An installed package's version, read without importing it (None: not installed)."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def collect(
    per_replica_batch_size: int | None = None, gradient_accumulation_steps: int = 1
) -> dict[str, Any]:
    """What `info` shows: versions, the backend's devices, what `distributed()` would choose."""
    import keras

    from keras_mirror_kit import __version__, backends
    from keras_mirror_kit.multi_worker.cluster import parse_tf_config, tf_config_num_workers

    backend = backends.current()  # a RuntimeError names the backends the kit supports
    backends.configure_from_environment()
    tf_config = parse_tf_config()  # validated: a bad TF_CONFIG is a clear error here too
    info: dict[str, Any] = {
        "keras_mirror_kit": __version__,
        "tensorflow": _installed_version("tensorflow"),
        "jax": _installed_version("jax"),
        "keras": keras.__version__,
        "keras_backend": backend.NAME,
        "framework_version": backend.framework_version(),
        **backend.device_report(),
        "tf_config": json.loads(os.environ["TF_CONFIG"]) if tf_config is not None else None,
    }
    workers = tf_config_num_workers()
    if workers > 1:
        info["logical_devices"] = backend.logical_devices()
        info["would_choose"] = backend.multi_worker_choice(workers)
        return info
    import keras_mirror_kit as kmk

    dist = kmk.distributed(
        per_replica_batch_size=per_replica_batch_size or 1,
        gradient_accumulation_steps=gradient_accumulation_steps,
    ).distribution
    info["logical_devices"] = backend.logical_devices()
    info["would_choose"] = {
        "strategy": dist.strategy_name,
        "devices": list(dist.devices),
        "replicas": dist.num_replicas,
        "all_reduce": dist.cross_device_ops,
    }
    info["recipe"] = recipe(backend, dist)
    if per_replica_batch_size is not None or gradient_accumulation_steps > 1:
        info["would_choose"].update(
            per_replica_batch_size=dist.per_replica_batch_size,
            global_batch_size=dist.global_batch_size,
            gradient_accumulation_steps=dist.gradient_accumulation_steps,
            effective_batch_size=dist.effective_batch_size,
        )
    return info


def recipe(backend: Any, dist: Any) -> dict[str, Any]:
    """The recommended knobs (docs/performance.md) on `dist`'s devices, and why."""
    from keras_mirror_kit.distributed import AUTO_STEPS_PER_EXECUTION
    from keras_mirror_kit.precision import choose_policy

    choice = choose_policy(backend.precision_devices(dist.engine))
    return {
        "call": 'distributed(mixed_precision="auto", steps_per_execution="auto")',
        "mixed_precision": choice.label,
        "why": choice.reason,
        "steps_per_execution": AUTO_STEPS_PER_EXECUTION,
    }


def print_table(info: dict[str, Any]) -> None:
    """Prints `collect()`'s fields as the `info` table."""
    chosen = info["would_choose"]
    lines = [
        f"keras-mirror-kit {info['keras_mirror_kit']}",
        f"TensorFlow       {info['tensorflow'] or 'not installed'}",
        f"JAX              {info['jax'] or 'not installed'}",
        f"Keras            {info['keras']} (backend: {info['keras_backend']}, "
        f"{info['framework']} {info['framework_version']})",
        f"GPUs             {len(info['physical_gpus'])}: "
        f"{', '.join(info['physical_gpus']) or '-'}",
        f"CPUs             {len(info['physical_cpus'])}: {', '.join(info['physical_cpus'])}",
        f"Logical devices  {', '.join(info['logical_devices'])}",
        f"NCCL usable      {info['all_reduce_note'] or ('yes' if info['nccl_usable'] else 'no')}",
        f"CUDA build       {_build_line(info['cuda_build'], info['framework'])}",
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
        + f", all-reduce {chosen['all_reduce']}"
        + (f": {chosen['refused']}" if "refused" in chosen else ""),
        *(
            [
                f"Batch            global {chosen['global_batch_size']} = "
                f"{chosen['per_replica_batch_size']} per replica x {chosen['replicas']}; "
                f"effective {chosen['effective_batch_size']} per update = "
                f"{chosen['global_batch_size']} x {chosen['gradient_accumulation_steps']} "
                "accumulation steps"
            ]
            if "effective_batch_size" in chosen
            else []
        ),
        *(
            [
                f"Recipe           {info['recipe']['call']}: "
                f"{info['recipe']['mixed_precision']} ({info['recipe']['why']}), "
                f"{info['recipe']['steps_per_execution']} steps per execution"
            ]
            if "recipe" in info
            else []
        ),
        *(f"WARNING: {warning}" for warning in info["warnings"]),
    ]
    sys.stdout.write("\n".join(lines) + "\n")


def _build_line(build: dict[str, Any], framework: str) -> str:
    if not build.get("is_cuda_build"):
        return f"no (this {framework} cannot use NVIDIA GPUs)"
    kernels = ", ".join(build.get("cuda_compute_capabilities") or []) or "?"
    return (
        f"CUDA {build.get('cuda_version', '?')}, cuDNN {build.get('cudnn_version', '?')}, "
        f"kernels for {kernels}"
    )
