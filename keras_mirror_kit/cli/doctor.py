"""`keras-mirror-kit doctor`: can this machine run the kit, and does it train right here?

The checks, each `ok`, `warn`, `FAIL` or `skip`: Python, Keras and its backend's framework
(TensorFlow, or JAX, where TensorFlow is optional) against the supported versions; whether
`launch` can isolate its workers in a network namespace of their own (a namespace made and
dropped, no TensorFlow); the Keras backend (TensorFlow or JAX; any other fails); the
backend's GPUs (names, memory), its CUDA build and GPUs it cannot use; NCCL and the
all-reduce `distributed()` would pick; the environment variables that change what the kit
does; known-bad combinations; and a self-test of about 20 s in a fresh process on the same
backend: one tiny model trained on 1 replica and on every replica (2 simulated ones when
there are fewer than 2 GPUs) must end with the same weights (within 1e-6), and an
all-reduce bandwidth figure (the backend's own: tf.distribute's, or XLA's collectives on
JAX). Exit status 1 when a check failed.

`doctor --model module:factory --data module:function` checks the user's own model
instead (`kmk.check_replicas`, TensorFlow backend only: on JAX it refuses and says why): a
few steps on 1 replica and on N from the same weights, the largest difference per variable
and the known causes found; exit status 0 within the tolerance, 1 above it (or when a run
fails), 2 for a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from keras_mirror_kit.workarounds import version_in

#: Supported ranges, `low <= version < high`: the same as pyproject.toml's requirements.
SUPPORTED_PYTHON = ((3, 11), (3, 14))
SUPPORTED_TENSORFLOW = ((2, 19), (3, 0))
SUPPORTED_KERAS = ((3, 10), (4, 0))
#: Largest weight difference allowed between the 1-replica and the all-replica run.
SELF_TEST_ATOL = 1e-6
#: The size of the tensor the bandwidth figure all-reduces.
ALL_REDUCE_MIB = 16
#: Environment variables that change what the kit or TensorFlow does (and any `NCCL_*`).
ENV_VARS = (
    "KERAS_BACKEND",
    "CUDA_VISIBLE_DEVICES",
    "TF_CONFIG",
    "KMK_SIMULATE_REPLICAS",
    "TF_FORCE_GPU_ALLOW_GROWTH",
    "TF_GPU_ALLOCATOR",
    "TF_XLA_FLAGS",
    "XLA_FLAGS",
    "TF_CPP_MIN_LOG_LEVEL",
)
_RESULT = "KMK_DOCTOR_RESULT "


def register(sub: Any) -> None:
    """Adds the `doctor` sub-command to the parser."""
    doctor = sub.add_parser(
        "doctor",
        help="check this machine for the kit (versions, backend, GPUs, NCCL, environment) "
        "and run a short self-test, or with --model and --data your own model on 1 and N "
        "replicas; exit status 1 when a check fails",
    )
    doctor.add_argument("--json", action="store_true", help="print JSON instead of a table")
    doctor.add_argument(
        "--no-self-test", action="store_true", help="skip the training and all-reduce self-test"
    )
    doctor.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds the self-test (default: 300) or the --model check (default: 600) may "
        "take before it counts as failed",
    )
    model = doctor.add_argument_group(
        "your own model",
        "--model and --data check your model instead of the machine: trained a few steps "
        "on 1 replica and on N from the same weights, the largest difference per variable "
        "and the known causes found; exit status 0 within --tolerance, 1 above it, 2 for a "
        "usage error",
    )
    model.add_argument(
        "--model",
        metavar="MODULE:FACTORY",
        help="a function returning a compiled keras.Model, or a @kmk.distributed factory, "
        "importable from the current directory (e.g. train:build_model)",
    )
    model.add_argument(
        "--data",
        metavar="MODULE:FUNCTION",
        help="what fit gets: a function returning (x, y) arrays, a tf.data.Dataset of "
        "batches or a PyDataset (or the data itself, by name)",
    )
    model.add_argument(
        "--replicas",
        type=int,
        metavar="N",
        help="replicas compared with one (default: the GPUs when there are 2 or more, else "
        "2, simulated)",
    )
    model.add_argument(
        "--steps", type=int, metavar="K", help="optimizer updates in each run (default: 3)"
    )
    model.add_argument(
        "--tolerance",
        type=float,
        metavar="T",
        help="largest absolute difference counted as equal (default: 1e-05; about 1e-2 "
        "for float16 or bfloat16)",
    )
    model.add_argument(
        "--batch-size",
        type=int,
        metavar="B",
        help="global batch of both runs (default: the factory's, else the data's first "
        "batch, else 32)",
    )


_MODEL_OPTIONS = ("replicas", "steps", "tolerance", "batch_size")


def _usage_error(message: str) -> int:
    sys.stderr.write(f"keras-mirror-kit doctor: error: {message}\n")
    return 2


def run(args: argparse.Namespace) -> int:
    """Runs `keras-mirror-kit doctor`."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up chatter
    if args.model is not None or args.data is not None:
        return _check_model(args)
    given = [f"--{n.replace('_', '-')}" for n in _MODEL_OPTIONS if getattr(args, n) is not None]
    if given:
        return _usage_error(
            f"{', '.join(given)}: option(s) of the --model check; give --model and --data too"
        )
    timeout = 300.0 if args.timeout is None else args.timeout
    report = diagnose(self_test=not args.no_self_test, timeout=timeout)
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2, default=str) + "\n")
    else:
        print_report(report)
    return 0 if report["ok"] else 1


def _check_model(args: argparse.Namespace) -> int:
    """`doctor --model ... --data ...`: the replica check of the user's model."""
    if args.model is None or args.data is None:
        return _usage_error("--model and --data go together: give both")
    if args.no_self_test:
        return _usage_error("--no-self-test is for the machine checks, not --model")
    from keras_mirror_kit.named_objects import resolve
    from keras_mirror_kit.replica_check import DEFAULT_TOLERANCE, check_replicas

    try:
        resolve(args.model, "--model")  # errors that name the options
        resolve(args.data, "--data")
        result = check_replicas(
            args.model,
            args.data,
            3 if args.steps is None else args.steps,
            replicas=args.replicas,
            tolerance=DEFAULT_TOLERANCE if args.tolerance is None else args.tolerance,
            batch_size=args.batch_size,
            timeout=600.0 if args.timeout is None else args.timeout,
        )
    except (TypeError, ValueError) as err:
        return _usage_error(str(err))
    except RuntimeError as err:
        sys.stderr.write(f"keras-mirror-kit doctor: {err}\n")
        return 1
    if args.json:
        sys.stdout.write(json.dumps(result.as_dict(), indent=2, allow_nan=False) + "\n")
    else:
        sys.stdout.write(result.describe() + "\n")
    return 0 if result.passed else 1


def diagnose(*, self_test: bool = True, timeout: float = 300.0) -> dict[str, Any]:
    """Checks this machine for keras-mirror-kit, as `keras-mirror-kit doctor` does; never raises.

    Returns `{"ok", "checks": [{"name", "status", "detail"}], "environment", "isolation"
    ({"available", "kind", "detail"}: can `launch` isolate its workers here), "info" (the
    fields of `keras-mirror-kit info`, or None), "self_test" (figures, or None)}`; `ok` is
    False when a check has the status `"fail"`, which is how anything that goes wrong shows.
    `self_test` also trains a tiny model on 1 and on every replica in a fresh process and
    measures the all-reduce bandwidth, within `timeout` seconds.
    """
    checks: list[dict[str, str]] = []

    def check(name: str, status: str, detail: str) -> None:
        checks.append({"name": name, "status": status, "detail": detail})

    environment = _environment()
    report: dict[str, Any] = {"environment": environment, "info": None, "self_test": None}
    python = sys.version_info[:2]
    check(
        "python",
        "ok" if version_in(python, SUPPORTED_PYTHON) else "fail",
        f"{sys.version.split()[0]} (supported: {_range_text(SUPPORTED_PYTHON)})",
    )
    report["isolation"] = _check_isolation(check)
    keras, backend = _import_frameworks(check)
    if keras is None:
        report.update(checks=checks, ok=False)
        return report
    _check_workaround_range(keras.__version__, check)
    info = _collect_info(check) if backend is not None else None
    report["info"] = info
    if info is not None:
        _check_devices(info, check)
    _check_combinations(environment, info, check)
    check(
        "environment",
        "ok",
        ", ".join(f"{k}={v}" for k, v in environment.items()) or "none of the variables is set",
    )
    if not self_test:
        check("self-test", "skip", "--no-self-test")
    elif info is None:
        check("self-test", "skip", "skipped: fix the failed checks above first")
    else:
        gpus = len(info["physical_gpus"])
        report["self_test"] = _self_test(gpus, timeout, check)
    report.update(checks=checks, ok=all(c["status"] != "fail" for c in checks))
    return report


def _range_text(bounds: tuple[tuple[int, int], tuple[int, int]]) -> str:
    (a, b), (c, d) = bounds
    return f">={a}.{b},<{c}.{d}"


def _environment() -> dict[str, str]:
    names = [n for n in ENV_VARS if n in os.environ]
    names += sorted(n for n in os.environ if n.startswith("NCCL_"))
    return {n: os.environ[n] for n in names}


def _check_isolation(check: Any) -> dict[str, Any]:
    """Whether `launch` can put its workers in a network namespace of their own, here."""
    from keras_mirror_kit.multi_worker import SECURITY_DOCS_URL
    from keras_mirror_kit.multi_worker.launch.isolation import probe

    result = probe()  # a holder process makes and drops one namespace, as launch does
    if result.available:
        check(
            "isolation",
            "ok",
            f"launch runs its workers in {result.detail}: their TensorFlow "
            "servers are reachable from nowhere else",
        )
    else:
        check(
            "isolation",
            "warn",
            f"launch cannot isolate its workers here ({result.detail}): they run on this "
            "host's network, where their TensorFlow servers listen on all interfaces, with "
            f"a WARNING; see {SECURITY_DOCS_URL}",
        )
    return {"available": result.available, "kind": result.kind, "detail": result.detail}


def _import_frameworks(check: Any) -> tuple[Any, Any]:
    """Imports Keras and its backend's framework, checking versions and the backend.

    `(keras, backend module)`: Keras None when it cannot be imported, the backend None when
    the kit does not run on it or its framework fails to import.
    """
    from keras_mirror_kit import backends

    try:
        import keras
    except Exception as err:  # ImportError, or a broken CUDA install raising at import
        _check_tensorflow(check, required=True)
        check("keras", "fail", f"cannot import Keras: {type(err).__name__}: {err}")
        return None, None
    name = backends.name()
    # Another supported backend uses TensorFlow for tf.data only; elsewhere it is required.
    _check_tensorflow(check, required=name == "tensorflow" or name not in backends.SUPPORTED)
    ok = version_in(keras.__version__, SUPPORTED_KERAS)
    check(
        "keras",
        "ok" if ok else "fail",
        f"{keras.__version__} (supported: {_range_text(SUPPORTED_KERAS)})",
    )
    try:
        backend = backends.current()
    except RuntimeError as err:
        check("backend", "fail", str(err).split(" Received:")[0])
        return keras, None
    try:
        version = backend.framework_version()
    except Exception as err:
        check(backend.FRAMEWORK, "fail", f"cannot import it: {type(err).__name__}: {err}")
        return keras, None
    if backend.FRAMEWORK != "tensorflow":
        check(backend.FRAMEWORK, "ok", version)
    check("backend", "ok", f"{name}: {backend.SUMMARY}")
    return keras, backend


def _check_tensorflow(check: Any, *, required: bool) -> None:
    """TensorFlow's version; on another backend it is optional (the tf.data pipeline)."""

    try:
        import tensorflow as tf
    except Exception as err:  # ImportError, or a broken CUDA install raising at import
        if required:
            check("tensorflow", "fail", f"cannot import TensorFlow: {type(err).__name__}: {err}")
        else:
            check(
                "tensorflow",
                "ok",
                "not installed: not needed on this backend, except by what uses tf.data "
                "(kmk.make_dataset); feed NumPy arrays or a generator instead",
            )
        return
    ok = version_in(tf.__version__, SUPPORTED_TENSORFLOW)
    use = "" if required else "; on this backend only for tf.data (kmk.make_dataset)"
    check(
        "tensorflow",
        "ok" if ok else ("fail" if required else "warn"),
        f"{tf.__version__} (supported: {_range_text(SUPPORTED_TENSORFLOW)}){use}",
    )


def _check_workaround_range(keras_version: str, check: Any) -> None:
    """Warns when Keras is outside the range the kit and its workarounds were tested on."""
    from keras_mirror_kit.upstream import versions

    if not versions.keras_version_in(versions.TESTED_KERAS, keras_version):
        check(
            "workarounds",
            "warn",
            f"Keras {keras_version} is outside the versions the kit was tested on "
            f"({versions.TESTED_KERAS_TEXT}): each workaround checks itself first and "
            "refuses the feature it cannot make exact, before any step (docs/support.md).",
        )


def _collect_info(check: Any) -> dict[str, Any] | None:
    """`keras-mirror-kit info`'s fields, or None with a failed check."""
    from keras_mirror_kit.cli import info

    try:
        return info.collect()
    except ValueError as err:  # a bad TF_CONFIG or KMK_SIMULATE_REPLICAS
        check("configuration", "fail", str(err))
    except Exception as err:
        check("devices", "fail", f"{type(err).__name__}: {err}")
    return None


def _gpu_memory() -> dict[str, str]:
    """Total memory per GPU from nvidia-smi, by index, when it is there."""
    import shutil

    if not shutil.which("nvidia-smi"):
        return {}
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    rows = (line.split(",", 1) for line in out.splitlines() if "," in line)
    return {index.strip(): memory.strip() for index, memory in rows}


def _check_devices(info: dict[str, Any], check: Any) -> None:
    gpus = info["gpu_details"]
    memory = _gpu_memory() if gpus else {}
    if gpus:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [s.strip() for s in visible.split(",")] if visible else None
        rows = []
        for i, gpu in enumerate(gpus):
            index = ids[i] if ids and i < len(ids) else str(i)
            rows.append(
                f"{gpu['name']}: {gpu['device_name']}, {memory.get(index, 'memory ?')}, "
                f"compute capability {gpu['compute_capability']} (kernels: {gpu['kernels']})"
            )
        check("gpus", "ok", f"{len(gpus)}: " + "; ".join(rows))
    else:
        check("gpus", "ok", "none visible: the kit trains on the CPU")
    for warning in info["warnings"]:
        # A GPU TensorFlow cannot use trains on the CPU in silence: a failure.
        check("gpus", "fail" if "training runs on the CPU" in warning else "warn", warning)
    build, framework = info["cuda_build"], info["framework"]
    if build.get("is_cuda_build"):
        check(
            "cuda",
            "ok",
            f"{framework} built with CUDA {build.get('cuda_version', '?')}, cuDNN "
            f"{build.get('cudnn_version', '?')}, kernels for "
            f"{', '.join(build.get('cuda_compute_capabilities') or []) or '?'}",
        )
    else:
        check("cuda", "ok" if not gpus else "fail", f"not a CUDA build of {framework}")
    chosen = info["would_choose"]
    if "refused" in chosen:
        check("distributed()", "fail", chosen["refused"])
    elif "replicas" in chosen:
        detail = (
            f"{chosen['strategy']} on {chosen['replicas']} replica(s) "
            f"({', '.join(chosen['devices'])}), all-reduce {chosen['all_reduce']}"
        )
    else:
        detail = f"{chosen['strategy']}, {chosen['workers']} workers, {chosen['all_reduce']}"
    if "refused" not in chosen:
        check("distributed()", "ok", detail)
    physical = len(info["physical_gpus"])
    if info["all_reduce_note"]:
        check("nccl", "ok", info["all_reduce_note"])
    elif physical >= 2 and not info["nccl_usable"]:
        check("nccl", "warn", f"{physical} GPUs but NCCL is not usable: all-reduce is slower")
    else:
        check("nccl", "ok", "usable" if info["nccl_usable"] else "not needed (fewer than 2 GPUs)")


def _check_combinations(env: dict[str, str], info: dict[str, Any] | None, check: Any) -> None:
    """Known-bad combinations that the environment shows."""
    found = False
    gpus = len(info["physical_gpus"]) if info else 0
    if "auto_jit" in env.get("TF_XLA_FLAGS", "") and "auto_jit=0" not in env["TF_XLA_FLAGS"]:
        found = True
        check(
            "combinations",
            "warn",
            "TF_XLA_FLAGS turns XLA auto-clustering on for every function: Keras turns XLA "
            "off under tf.distribute for a reason (as with compile(jit_compile=True) on 2+ "
            "replicas); unset it unless you measured it.",
        )
    if env.get("KMK_SIMULATE_REPLICAS") and gpus >= 2:
        found = True
        check(
            "combinations",
            "warn",
            f"KMK_SIMULATE_REPLICAS={env['KMK_SIMULATE_REPLICAS']} on a host with {gpus} "
            "GPUs: distributed() trains on simulated devices instead (TensorFlow: the first "
            "GPU split, the others hidden; JAX: CPU devices), which is meant for tests.",
        )
    for name in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE"):
        if env.get(name) == "1":
            found = True
            check("combinations", "warn", f"{name}=1: NCCL all-reduce takes a slower path.")
    if env.get("TF_CONFIG") and env.get("KMK_SIMULATE_REPLICAS"):
        found = True
        check(
            "combinations",
            "warn",
            "TF_CONFIG and KMK_SIMULATE_REPLICAS are both set: every worker splits its CPU "
            "or first GPU (for tests only).",
        )
    if not found:
        check(
            "combinations",
            "ok",
            "none found in the environment (not seen from here: compile(jit_compile=True) "
            "on 2+ replicas, which Keras' default 'auto' avoids)",
        )


def _self_test(gpus: int, timeout: float, check: Any) -> dict[str, Any] | None:
    """Runs the self-test in a fresh process (the replica layout is fixed at TF start)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG",)}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    simulated = gpus < 2
    if simulated:
        env["KMK_SIMULATE_REPLICAS"] = "2"
    else:
        env.pop("KMK_SIMULATE_REPLICAS", None)
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "keras_mirror_kit.cli.doctor"],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        check("self-test", "fail", f"did not finish within --timeout {timeout:g} s")
        return None
    seconds = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_RESULT)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        check("self-test", "fail", f"exit {proc.returncode}: " + " | ".join(tail))
        return None
    result = json.loads(lines[-1][len(_RESULT) :])
    on_gpu = any("gpu" in device.lower() for device in result["devices"])
    layout = (
        f"{result['replicas']} replicas simulated on the {'GPU' if on_gpu else 'CPU'}"
        if simulated
        else f"{result['replicas']} GPUs"
    )
    result.update(layout=layout, seconds=round(seconds, 1))
    agree = result["max_abs_diff"] <= SELF_TEST_ATOL and result["finite"]
    check(
        "self-test",
        "ok" if agree else "fail",
        f"1 replica vs {result['replicas']} ({layout}): weights differ by at most "
        f"{result['max_abs_diff']:.1e} (limit {SELF_TEST_ATOL:g}) after {result['steps']} "
        f"steps; {seconds:.0f} s",
    )
    check(
        "all-reduce",
        "ok" if result["all_reduce_correct"] else "fail",
        f"{result['all_reduce_mib']} MiB over {result['replicas']} replicas with "
        f"{result['cross_device_ops']}: {result['all_reduce_ms']:.2f} ms, "
        f"{result['algbw_gbps']:.2f} GB/s algorithm bandwidth, "
        f"{result['busbw_gbps']:.2f} GB/s bus bandwidth"
        + ("" if result["all_reduce_correct"] else "; WRONG SUM"),
    )
    return result


def _self_test_worker() -> dict[str, Any]:
    """The self-test's own process: 1 vs all replicas, then the all-reduce figure."""
    import keras
    import numpy as np

    import keras_mirror_kit as kmk
    from keras_mirror_kit import backends

    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(512, 1))).astype("float32")
    epochs, global_batch = 2, 32
    keras.utils.set_random_seed(0)
    initial = None

    def train(devices: list[str] | None) -> tuple[list[Any], Any]:
        nonlocal initial

        @kmk.distributed(global_batch_size=global_batch, devices=devices)
        def build() -> Any:
            model = keras.Sequential(
                [
                    keras.Input((8,)),
                    keras.layers.Dense(16, activation="tanh"),
                    keras.layers.Dense(1),
                ]
            )
            model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
            return model

        model = build()
        if initial is None:
            initial = model.get_weights()
        model.set_weights(initial)
        # NumPy arrays, in order: runs on every backend (no tf.data on a JAX-only machine).
        model.fit(x, y, batch_size=global_batch, epochs=epochs, shuffle=False, verbose=0)
        return model.get_weights(), build.distribution

    every, dist = train(None)
    one, _ = train([dist.devices[0]])
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(one, every))
    finite = all(bool(np.all(np.isfinite(w))) for w in every + one)

    n, floats = dist.num_replicas, ALL_REDUCE_MIB * 2**20 // 4
    seconds, correct = backends.current().time_all_reduce(dist.engine, floats, repeats=10)
    algbw = floats * 4 / seconds / 1e9
    return {
        "backend": dist.backend,
        "replicas": n,
        "devices": list(dist.devices),
        "cross_device_ops": dist.cross_device_ops,
        "steps": epochs * (len(x) // global_batch),
        "max_abs_diff": diff,
        "finite": finite,
        "all_reduce_mib": ALL_REDUCE_MIB,
        "all_reduce_ms": seconds * 1e3,
        "all_reduce_correct": bool(correct),
        "algbw_gbps": algbw,
        "busbw_gbps": algbw * 2 * (n - 1) / n,
    }


def print_report(report: dict[str, Any]) -> None:
    """Prints the report as a table (what `doctor` without `--json` shows)."""
    marks = {"ok": "ok", "warn": "warn", "fail": "FAIL", "skip": "skip"}
    lines = ["keras-mirror-kit doctor"]
    for c in report["checks"]:
        lines.append(f"  {marks[c['status']]:<4}  {c['name']:<14} {c['detail']}")
    failed = [c["name"] for c in report["checks"] if c["status"] == "fail"]
    warned = [c["name"] for c in report["checks"] if c["status"] == "warn"]
    if failed:
        lines.append(f"{len(failed)} check(s) failed: {', '.join(failed)}")
    else:
        lines.append("all checks passed" + (f" ({len(warned)} warning(s))" if warned else ""))
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.stdout.write(_RESULT + json.dumps(_self_test_worker()) + "\n")
