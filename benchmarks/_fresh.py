"""Shared by the benchmark scripts: running one measurement in a fresh Python process."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent  # the checkout: children import the kit from it


def child_env(gpu: bool = False) -> dict[str, str]:
    """This environment for a child: no cluster, no simulated replicas, CPU or GPU 0 only."""
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "KMK_SIMULATE_REPLICAS")}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["CUDA_VISIBLE_DEVICES"] = "0" if gpu else "-1"
    return env


def run_fresh(
    command: list[str],
    result_file: Path,
    *,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
) -> tuple[Any, str | None, float]:
    """Runs `command` from the checkout and reads the JSON it wrote to `result_file`.

    Returns:
        `(result, None, seconds)`, or `(None, error, seconds)` when the process failed or
        wrote nothing: its exit status and the last lines of its output.
    """
    start = time.perf_counter()
    proc = subprocess.run(
        command,
        env=child_env() if env is None else env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    seconds = time.perf_counter() - start
    if proc.returncode != 0 or not result_file.exists():
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
        return None, f"exit {proc.returncode}: {tail}", seconds
    return json.loads(result_file.read_text()), None, seconds
