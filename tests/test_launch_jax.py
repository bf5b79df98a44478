"""`keras-mirror-kit launch` and Keras' JAX backend: refused clearly, before or in a worker.

The launcher starts TensorFlow `MultiWorkerMirroredStrategy` workers; multi-process JAX
(`jax.distributed`) is not built. A job with `KERAS_BACKEND=jax` in the launcher's
environment is refused before any worker starts; a script that selects JAX itself is refused
by each worker's `distributed()` (TF_CONFIG has no JAX meaning), and that message reaches
the launcher's output.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

from keras_mirror_kit.multi_worker import launch
from tests.subproc import REPO

STARTED = "import pathlib, sys; pathlib.Path(sys.argv[1]).write_text('started')\n"


@pytest.mark.parametrize(
    ("backend", "expected"),
    [
        ("jax", "multi-process training on Keras' JAX backend (jax.distributed) is not built"),
        ("torch", "TensorFlow and JAX backends only"),
    ],
)
def test_a_job_for_another_backend_is_refused_before_any_worker(
    capsys, monkeypatch, tmp_path, backend, expected
):
    script, marker = tmp_path / "train.py", tmp_path / "started"
    script.write_text(STARTED)
    monkeypatch.setenv("KERAS_BACKEND", backend)
    code = launch.main(["-n", "2", str(script), str(marker)])
    err = capsys.readouterr().err
    assert code == launch.EXIT_USAGE, err
    assert expected in err and f"Received: KERAS_BACKEND={backend!r}" in err
    assert not marker.exists()  # no worker started
    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")
    assert launch.main(["-n", "1", "--startup-timeout", "0", str(script), str(marker)]) == 0
    assert marker.exists()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="jax is not installed")
def test_a_worker_that_selects_jax_itself_is_refused_and_the_launcher_shows_why(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import os
            os.environ["KERAS_BACKEND"] = "jax"  # the script's own choice: launch cannot see it
            import keras_mirror_kit as kmk
            kmk.distributed(global_batch_size=16).distribution
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "TF_CONFIG")}
    env.update(PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(
        [sys.executable, "-m", "keras_mirror_kit.multi_worker.launch", "-n", "2",
         "--startup-timeout", "300", str(script)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 124), output[-6000:]
    assert "Multi-worker training (TF_CONFIG" in output, output[-6000:]
    assert "has no meaning on Keras' JAX backend" in output and "TF_CONFIG=set" in output
