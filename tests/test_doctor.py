"""`keras-mirror-kit doctor`, run as a user runs it: a subprocess, passing and failing."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib

import pytest

from keras_mirror_kit.cli import doctor
from tests import forkserver
from tests import network_modes as modes
from tests.subproc import REPO


def _doctor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return forkserver.run(
        [sys.executable, "-m", "keras_mirror_kit.cli", "doctor", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=600,
        check=False,
    )


def _by_name(report: dict) -> dict[str, list[dict]]:
    checks: dict[str, list[dict]] = {}
    for check in report["checks"]:
        checks.setdefault(check["name"], []).append(check)
    return checks


@pytest.mark.slow
def test_doctor_passes_here_with_its_self_test() -> None:
    proc = _doctor("--json", env={"NCCL_DEBUG": "WARN"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["ok"] is True
    checks = _by_name(report)
    for name in ("python", "tensorflow", "keras", "backend", "gpus", "cuda", "nccl"):
        assert checks[name][0]["status"] == "ok", checks[name]
    assert "NCCL_DEBUG=WARN" in checks["environment"][0]["detail"]
    assert report["environment"]["CUDA_VISIBLE_DEVICES"] == "-1"  # tests hide GPUs
    assert report["info"]["keras_backend"] == "tensorflow"
    result = report["self_test"]
    assert result["replicas"] == 2 and "simulated" in result["layout"]
    assert result["finite"] and result["steps"] == 32
    assert 0 <= result["max_abs_diff"] <= doctor.SELF_TEST_ATOL
    assert result["all_reduce_correct"] and result["busbw_gbps"] > 0
    assert checks["self-test"][0]["status"] == "ok"
    assert checks["all-reduce"][0]["status"] == "ok"
    # Whether launch can isolate its workers here: what making a namespace shows.
    probe = modes.PROBES["isolated"]
    assert report["isolation"] == {
        "available": probe.available,
        "kind": probe.kind,
        "detail": probe.detail,
    }
    (isolation,) = checks["isolation"]
    assert isolation["status"] == ("ok" if probe.available else "warn"), isolation


@pytest.mark.slow
def test_doctor_passes_on_jax_with_its_self_test_there() -> None:
    """JAX's devices, what distributed() picks there, and the self-test run on JAX."""
    proc = _doctor("--json", env={"KERAS_BACKEND": "jax"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    checks = _by_name(report)
    for name in ("python", "tensorflow", "keras", "jax", "backend", "gpus", "cuda", "nccl"):
        assert checks[name][0]["status"] == "ok", checks[name]
    assert checks["backend"][0]["detail"].startswith("jax: keras.distribution.DataParallel")
    assert "only for tf.data" in checks["tensorflow"][0]["detail"]
    assert "XLA runs the SPMD program's collectives" in checks["nccl"][0]["detail"]
    assert "DataParallel on 1 replica(s) (cpu:0)" in checks["distributed()"][0]["detail"]
    info = report["info"]
    assert info["keras_backend"] == "jax" and info["framework"] == "JAX"
    assert info["logical_devices"] == ["cpu:0"] and info["physical_gpus"] == []
    result = report["self_test"]
    assert result["backend"] == "jax" and result["devices"] == ["cpu:0", "cpu:1"]
    assert result["layout"] == "2 replicas simulated on the CPU" and result["steps"] == 32
    assert 0 <= result["max_abs_diff"] <= doctor.SELF_TEST_ATOL and result["finite"]
    assert result["cross_device_ops"] == "xla-spmd" and result["all_reduce_correct"]
    assert checks["self-test"][0]["status"] == checks["all-reduce"][0]["status"] == "ok"


@pytest.mark.slow
def test_doctor_fails_on_a_backend_the_kit_does_not_distribute_on() -> None:
    proc = _doctor("--no-self-test", env={"KERAS_BACKEND": "numpy"})  # the table
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert re.search(r"FAIL\s+backend\s+keras-mirror-kit distributes training on", proc.stdout)
    assert "no data-parallel API for the 'numpy' backend" in proc.stdout
    assert "KERAS_BACKEND=tensorflow (or jax)" in proc.stdout
    assert "check(s) failed: backend" in proc.stdout


def test_doctor_fails_on_a_bad_tf_config(monkeypatch, capsys) -> None:
    """Also, on a host that refuses namespaces (simulated), isolation is a warning.

    In this process (`keras_mirror_kit.cli.main`, what the command calls): no self-test runs.
    """
    from keras_mirror_kit.cli import main

    monkeypatch.setenv("TF_CONFIG", '{"cluster": ')
    monkeypatch.setenv("KMK_LAUNCH_TEST_NAMESPACES", "refuse")
    assert main(["doctor", "--json", "--no-self-test"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    failed = [c for c in report["checks"] if c["status"] == "fail"]
    assert [c["name"] for c in failed] == ["configuration"]
    assert "TF_CONFIG" in failed[0]["detail"]
    (isolation,) = _by_name(report)["isolation"]
    assert isolation["status"] == "warn" and report["isolation"]["available"] is False
    detail = isolation["detail"]
    assert "launch cannot isolate its workers here (unshare: refused for a test" in detail
    assert "listen on all interfaces" in detail


def test_supported_versions_are_the_package_requirements() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]

    def bounds(spec: str) -> tuple[tuple[int, int], tuple[int, int]]:
        low = re.search(r">=(\d+)\.(\d+)", spec)
        high = re.search(r"<(\d+)(?:\.(\d+))?", spec)
        return (int(low[1]), int(low[2])), (int(high[1]), int(high[2] or 0))

    requirements = {re.split(r"[<>=\[]", r)[0]: r for r in project["dependencies"]}
    assert bounds(project["requires-python"]) == doctor.SUPPORTED_PYTHON
    assert bounds(requirements["tensorflow"]) == doctor.SUPPORTED_TENSORFLOW
    assert bounds(requirements["keras"]) == doctor.SUPPORTED_KERAS


@pytest.mark.slow
def test_doctor_model_refuses_clearly_on_jax(tmp_path) -> None:
    """kmk.check_replicas simulates TensorFlow replicas: on JAX it says so, before any run."""
    (tmp_path / "train.py").write_text(
        "import keras\n"
        "import numpy as np\n"
        "def dense():\n"
        "    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])\n"
        "    model.compile('sgd', 'mse')\n"
        "    return model\n"
        "def data():\n"
        "    return np.zeros((64, 4), 'float32'), np.zeros((64, 1), 'float32')\n",
        encoding="utf-8",
    )
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}", "KERAS_BACKEND": "jax"}
    proc = forkserver.run(
        [sys.executable, "-m", "keras_mirror_kit.cli", "doctor", "--model", "train:dense",
         "--data", "train:data"],
        cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert "runs on Keras' TensorFlow backend only" in proc.stderr
    assert "KERAS_BACKEND=tensorflow" in proc.stderr
    assert "Received: keras.backend.backend()='jax'" in proc.stderr
