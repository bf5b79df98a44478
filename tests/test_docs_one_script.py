"""docs/migration.md's "One script on both backends" runs unchanged on TensorFlow and on JAX.

The first `python` block after that heading is written to a file and run as the page says,
in a fresh interpreter per backend (`KERAS_BACKEND=...`, `KMK_SIMULATE_REPLICAS=2`).
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import sys
from pathlib import Path

import pytest

from tests import forkserver
from tests.subproc import REPO

HEADING = "## One script on both backends"
SUMMARY = re.compile(r"^(\w+): (\d+) replicas, (\w+), loss (\S+)$", re.MULTILINE)


def the_script() -> str:
    """The first python block after the heading (and before the next heading)."""
    page = (REPO / "docs" / "migration.md").read_text(encoding="utf-8")
    assert page.count(HEADING) == 1, f"docs/migration.md has no single {HEADING!r}"
    section = page.split(HEADING, 1)[1].split("\n## ", 1)[0]
    block = re.search(r"^```python\n(.*?)^```$", section, re.MULTILINE | re.DOTALL)
    assert block, f"no ```python block under {HEADING!r}"
    return block.group(1)


def test_the_section_shows_both_commands() -> None:
    page = (REPO / "docs" / "migration.md").read_text(encoding="utf-8")
    section = page.split(HEADING, 1)[1].split("\n## ", 1)[0]
    for backend in ("tensorflow", "jax"):
        assert f"KERAS_BACKEND={backend} KMK_SIMULATE_REPLICAS=2 python3 train.py" in section
    assert "keras_backend" not in the_script() and "KERAS_BACKEND" not in the_script()


@pytest.mark.parametrize(
    ("backend", "strategy"), [("tensorflow", "MirroredStrategy"), ("jax", "DataParallel")]
)
@pytest.mark.slow
def test_the_script_runs_unchanged_on_each_backend(
    tmp_path: Path, backend: str, strategy: str
) -> None:
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed (keras-mirror-kit[dev])")
    script = tmp_path / "train.py"
    script.write_text(the_script(), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "XLA_FLAGS")}
    env.update(
        KERAS_BACKEND=backend,
        KMK_SIMULATE_REPLICAS="2",
        PYTHONPATH=str(REPO),
        TF_CPP_MIN_LOG_LEVEL="2",
    )
    proc = forkserver.run(
        [sys.executable, str(script)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-6000:]
    found = SUMMARY.findall(proc.stdout)
    assert len(found) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    (name, replicas, used, loss) = found[0]
    assert (name, int(replicas), used) == (backend, 2, strategy)
    assert math.isfinite(float(loss)), proc.stdout[-3000:]
    assert "samples_per_sec" in proc.stdout, proc.stdout[-3000:]  # ThroughputMonitor's logs
