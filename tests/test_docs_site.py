"""The documentation site's build hooks (mkdocs_hooks.py): CLI reference and API coverage.

`mkdocs build --strict` itself runs in `.ci/run`; these tests check that the hooks fail the
build when a public name or a sub-command is missing from the reference.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.subproc import REPO

pytest.importorskip("mkdocs", reason="the docs extra: pip install -e '.[docs]'")
from mkdocs.exceptions import PluginError  # noqa: E402


def _hooks():
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", REPO / "mkdocs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _site(tmp_path: Path, ids: list[str]) -> dict:
    api = tmp_path / "site" / "api"
    api.mkdir(parents=True)
    (api / "index.html").write_text("".join(f'<h3 id="{i}">x</h3>' for i in ids))
    return {"site_dir": str(tmp_path / "site")}


def test_api_coverage_fails_the_build_for_a_missing_public_name(tmp_path: Path) -> None:
    import keras_mirror_kit as kmk

    hooks = _hooks()
    ids = []
    for name in kmk.__all__:
        if name == "__version__":
            continue
        module = kmk._LAZY[name]
        ids.append(module if name in kmk._SUBMODULES else f"{module}.{name}")
    hooks.on_post_build(_site(tmp_path / "all", ids))  # every name: passes
    without = [i for i in ids if not i.endswith(".make_dataset")]
    with pytest.raises(PluginError, match="make_dataset"):
        hooks.on_post_build(_site(tmp_path / "some", without))
    # The module of a function is not an entry for the function.
    with pytest.raises(PluginError, match="make_dataset"):
        hooks.on_post_build(_site(tmp_path / "module", [*without, "keras_mirror_kit.data"]))


def test_cli_reference_is_each_commands_help_and_misses_none() -> None:
    hooks = _hooks()
    page = SimpleNamespace(file=SimpleNamespace(src_uri="api/cli.md"))
    commands = hooks._commands()
    assert {"info", "doctor", "bench", "launch"} <= set(commands)
    markdown = "\n".join(f"<!-- cli-help: {c} -->" for c in ["", *commands])
    out = hooks.on_page_markdown(markdown, page)
    assert "usage: keras-mirror-kit doctor" in out and "--no-self-test" in out
    assert "usage: keras-mirror-kit launch" in out and "<!--" not in out
    with pytest.raises(PluginError, match="doctor"):
        hooks.on_page_markdown(markdown.replace("<!-- cli-help: doctor -->", ""), page)
    other = SimpleNamespace(file=SimpleNamespace(src_uri="cli.md"))
    assert hooks.on_page_markdown("<!-- cli-help: nope -->", other) == "<!-- cli-help: nope -->"


def test_the_real_cli_page_has_a_marker_for_every_command() -> None:
    hooks = _hooks()
    text = (REPO / "docs" / "api" / "cli.md").read_text(encoding="utf-8")
    assert set(hooks._commands()) <= set(hooks._MARKER.findall(text))
