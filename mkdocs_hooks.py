"""MkDocs hooks (mkdocs.yml `hooks:`): the command-line reference and an API-coverage check.

- `docs/api/cli.md` holds `<!-- cli-help: COMMAND -->` markers; each becomes the output of
  `keras-mirror-kit COMMAND --help` (`<!-- cli-help: -->` for the top level), so the page is
  never out of date. A sub-command without a marker fails the build.
- After the build, every name of `keras_mirror_kit.__all__` must have its entry in the API
  reference (an anchor `keras_mirror_kit.NAME` or `MODULE.NAME`), else the build fails.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

_MARKER = re.compile(r"<!-- cli-help: ?([\w-]*) -->")


def _help(command: str) -> str:
    """The `--help` text of one command (`""`: the top level), 88 columns wide."""
    from keras_mirror_kit.cli import main

    argv = ([command] if command else []) + ["--help"]
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "88"
    try:
        with contextlib.redirect_stdout(io.StringIO()) as out:
            try:
                main(argv)
            except SystemExit:
                pass
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    return out.getvalue().replace("usage: __main__.py", "usage: keras-mirror-kit").rstrip()


def _commands() -> list[str]:
    """The public sub-commands of `keras-mirror-kit`."""
    from keras_mirror_kit.cli import _parser

    sub = next(a for a in _parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    return [name for name in sub.choices if not name.startswith("_")]


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """Replaces the `cli-help` markers with the commands' `--help` output."""
    if page.file.src_uri != "api/cli.md":
        return markdown
    missing = set(_commands()) - set(_MARKER.findall(markdown))
    if missing:
        raise PluginError(f"docs/api/cli.md has no '<!-- cli-help: NAME -->' for {missing}")
    return _MARKER.sub(lambda m: "```text\n" + _help(m.group(1)) + "\n```", markdown)


def on_post_build(config: Any, **kwargs: Any) -> None:
    """Fails the build when a public name has no entry in the API reference."""
    import keras_mirror_kit as kmk

    html = "".join(
        p.read_text(encoding="utf-8") for p in Path(config["site_dir"], "api").rglob("*.html")
    )
    ids = set(re.findall(r'id="([\w.]+)"', html))
    missing = []
    for name in kmk.__all__:
        if name == "__version__":
            continue
        module = kmk._LAZY[name]
        anchors = {f"keras_mirror_kit.{name}", f"{module}.{name}"}
        if name in kmk._SUBMODULES:
            anchors.add(module)
        if not anchors & ids:
            missing.append(name)
    if missing:
        raise PluginError(f"the API reference (docs/api/) has no entry for {missing}")
