"""benchmarks/gpu_selftest.py runs to completion without a GPU: CPU checks pass, GPU ones skip.

The script runs as a child forked from the tests' zygote (`tests/forkserver.py`), so each
check's fresh process, which the script starts with `subprocess.run`, is forked from the
zygote too: the same script and checks, without a TensorFlow import per check.
"""

from __future__ import annotations

import sys

import pytest

from tests import forkserver
from tests.subproc import REPO

pytestmark = pytest.mark.slow  # every test here starts children or trains for long


def test_the_gpu_selftest_runs_on_a_cpu_and_says_what_it_skipped():
    proc = forkserver.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_selftest.py"), "--timeout", "400"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )  # the suite hides GPUs (tests/conftest.py), so this is the no-GPU mode everywhere
    lines = {line.split()[0]: line for line in proc.stdout.splitlines() if line.strip()}
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    out = proc.stdout.splitlines()
    assert out[0] == "gpu_selftest: 0 GPU(s) visible" and out[-1].endswith("all checks passed")
    for name in ("strategy", "simulated", "launch", "scaling"):
        assert "skipped: no GPU" in lines[name], lines
    assert "PASS" in lines["fit"], lines["fit"]  # resumed within 1e-5 of the reference
    assert "PASS" in lines["float16"] and "loss scale 16384" in lines["float16"]
    # uint8 instead of float32 crosses to the replicas: a quarter of the bytes (+ labels).
    assert "PASS" in lines["preprocess"] and "(0.25x)" in lines["preprocess"], lines["preprocess"]
