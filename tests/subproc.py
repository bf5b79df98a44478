"""Run a Python snippet in a fresh interpreter (a fresh TensorFlow runtime), bounded in time.

The child is forked from a process that has imported TensorFlow (`tests/forkserver.py`)
where that is the same as a new interpreter; `fresh=True` starts a new interpreter always
(a test of what an import loads).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from tests import forkserver

REPO = Path(__file__).resolve().parent.parent


def run_python(
    code: str,
    *,
    replicas: int | None = None,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    check: bool = True,
    cwd: str | Path | None = None,
    fresh: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Runs `code` in a new interpreter; `replicas` sets KMK_SIMULATE_REPLICAS."""
    full_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(REPO)}
    full_env.pop("KMK_SIMULATE_REPLICAS", None)
    full_env.pop("TF_CONFIG", None)
    if replicas is not None:
        full_env["KMK_SIMULATE_REPLICAS"] = str(replicas)
    full_env.update(env or {})
    proc = (subprocess.run if fresh else forkserver.run)(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=cwd,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"subprocess failed (rc={proc.returncode})\n--- stdout\n{proc.stdout[-4000:]}"
            f"\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def last_json(proc: subprocess.CompletedProcess[str]) -> Any:
    """The last stdout line that starts with 'RESULT ' parsed as JSON."""
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise AssertionError(
        f"no RESULT line in output:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )


def python_on_path(path: Path) -> Path:
    """Writes at `path` a `python` that runs this interpreter (a virtual environment's too).

    A symbolic link to `sys.executable` would not do: started through a link outside the
    environment, the interpreter finds no `pyvenv.cfg` and loses the environment's packages.
    The wrapper exports `KMK_TEST_PYTHON_VIA=<path>`, so a child can show it was reached
    through this file.
    """
    path.write_text(f'#!/bin/sh\nexport KMK_TEST_PYTHON_VIA="$0"\nexec "{sys.executable}" "$@"\n')
    path.chmod(0o755)
    return path
