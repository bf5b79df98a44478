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


def collect(
    per_replica_batch_size: int | None = None, gradient_accumulation_steps: int = 1
) -> dict[str, Any]:
    import keras
    import tensorflow as tf

    from keras_mirror_kit import __version__
    from keras_mirror_kit.devices import (
        configure_from_environment,
        gpu_report,
        nccl_available,
        warn_if_gpus_unused,
    )
    from keras_mirror_kit.multi_worker.cluster import parse_tf_config, tf_config_num_workers

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

    dist = kmk.distributed(
        per_replica_batch_size=per_replica_batch_size or 1,
        gradient_accumulation_steps=gradient_accumulation_steps,
    ).distribution
    info["logical_devices"] = [d.name for d in tf.config.list_logical_devices()]
    info["would_choose"] = {
        "strategy": dist.strategy_name,
        "devices": list(dist.devices),
        "replicas": dist.num_replicas,
        "all_reduce": dist.cross_device_ops,
    }
    if per_replica_batch_size is not None or gradient_accumulation_steps > 1:
        info["would_choose"].update(
            per_replica_batch_size=dist.per_replica_batch_size,
            global_batch_size=dist.global_batch_size,
            gradient_accumulation_steps=dist.gradient_accumulation_steps,
            effective_batch_size=dist.effective_batch_size,
        )
    return info


def print_table(info: dict[str, Any]) -> None:
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
