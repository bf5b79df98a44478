"""`keras-mirror-kit doctor`, run as a user runs it: a subprocess, passing and failing."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib

from keras_mirror_kit.cli import doctor
from tests import network_modes as modes
from tests.subproc import REPO


def _doctor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(
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


def test_doctor_fails_on_another_keras_backend() -> None:
    proc = _doctor(env={"KERAS_BACKEND": "jax"})  # the table, as a user reads it
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert re.search(r"FAIL\s+backend\s+Keras runs on the 'jax' backend", proc.stdout)
    assert "KERAS_BACKEND=tensorflow" in proc.stdout
    assert re.search(r"skip\s+self-test", proc.stdout)
    assert "check(s) failed: backend" in proc.stdout


def test_doctor_fails_on_a_bad_tf_config() -> None:
    """Also, on a host that refuses namespaces (simulated), isolation is a warning."""
    env = {"TF_CONFIG": '{"cluster": ', "KMK_LAUNCH_TEST_NAMESPACES": "refuse"}
    proc = _doctor("--json", "--no-self-test", env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
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
