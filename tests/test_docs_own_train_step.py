"""docs/own-train-step.md's GAN runs as the page says, and trains on 2 replicas as on 1.

The first `python` block after its heading is run here, in this process (2 logical CPU
devices), once on both (as `KMK_SIMULATE_REPLICAS=2` gives them) and once on one, each in
a directory of its own (it writes its checkpoints to `gan_checkpoints/`).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import tensorflow  # noqa: F401 (imported at collection: the test bed's 2 logical CPUs)

from tests.subproc import REPO

pytestmark = pytest.mark.slow  # it trains the page's GAN on 1 and 2 replicas

PAGE = REPO / "docs" / "own-train-step.md"
HEADING = "## A GAN written for one device"
DECORATOR = "@kmk.distributed(global_batch_size=32)"
DEVICES = (("two", ["/cpu:0", "/cpu:1"]), ("one", ["/cpu:0"]))


def the_script() -> str:
    """The first python block after the heading (and before the next heading)."""
    page = PAGE.read_text(encoding="utf-8")
    assert page.count(HEADING) == 1, f"{PAGE.name} has no single {HEADING!r}"
    section = page.split(HEADING, 1)[1].split("\n## ", 1)[0]
    block = re.search(r"^```python\n(.*?)^```$", section, re.MULTILINE | re.DOTALL)
    assert block, f"no ```python block under {HEADING!r}"
    return block.group(1)


def _run(script: str, directory: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> dict:
    directory.mkdir()
    monkeypatch.chdir(directory)
    namespace: dict = {"__name__": "__main__"}
    exec(compile(script, str(PAGE), "exec"), namespace)  # noqa: S102 (the page's script)
    namespace["printed"] = capsys.readouterr().out
    return namespace


def test_the_pages_gan_trains_on_two_replicas_as_on_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    script = the_script()
    assert script.count(DECORATOR) == 1 and "replica" not in script.split("print(")[0]
    on = {n: script.replace(DECORATOR, f"{DECORATOR[:-1]}, devices={d})") for n, d in DEVICES}
    two = _run(on["two"], tmp_path / "two", monkeypatch, capsys)
    one = _run(on["one"], tmp_path / "one", monkeypatch, capsys)
    assert two["printed"].startswith("2 replicas: d_loss"), two["printed"]
    assert one["printed"].startswith("1 replicas: d_loss"), one["printed"]
    assert "16 discriminator steps" in two["printed"]  # 256 images / 32, 2 epochs
    for a, b in zip(one["gan"].get_weights(), two["gan"].get_weights(), strict=True):
        assert np.max(np.abs(a - b)) <= 1e-6
    for key in ("d_loss", "g_loss"):
        assert np.allclose(one["history"].history[key], two["history"].history[key], atol=1e-6)
    assert list((tmp_path / "two" / "gan_checkpoints").glob("ckpt-*"))
