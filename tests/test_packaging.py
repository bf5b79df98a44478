"""Packaging: metadata, the lazy package `__init__` and a command line without TensorFlow."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest

from tests.subproc import REPO, last_json, run_python

# Without TF_CPP_MIN_LOG_LEVEL, TensorFlow's C++ start-up lines would show on stderr.
LOUD = {"TF_CPP_MIN_LOG_LEVEL": "0"}


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


def test_version_is_defined_once_and_installed_metadata_matches() -> None:
    project = _pyproject()["project"]
    assert "version" not in project and "version" in project["dynamic"]
    text = (REPO / "keras_mirror_kit" / "_version.py").read_text(encoding="utf-8")
    version = re.search(r'^__version__ = "([^"]+)"$', text, re.M).group(1)
    assert importlib.metadata.version("keras-mirror-kit") == version
    changelog = (REPO / "CHANGELOG.md").read_text(encoding="utf-8")
    assert f"## [{version}]" in changelog or "## [Unreleased]" in changelog


def test_ci_runs_the_readme_quickstart_literally_in_its_virtual_environment() -> None:
    """`.ci/run` creates and activates the Quickstart's virtual environment, then runs its
    test command verbatim: a test that passes only with a global install fails CI."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    quickstart = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    venv = re.search(r"`(python3 -m venv \.venv && \. \.venv/bin/activate)`", quickstart)
    assert venv, "README's Quickstart must tell users how to create the virtual environment"
    commands = re.findall(r"```bash\n(.*?)\n```", quickstart, flags=re.S)
    assert len(commands) == 2, commands
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert venv.group(1) in ci and commands[1] in ci
    assert ci.index(venv.group(1)) < ci.index(commands[1])
    installs = [line for line in ci if "pip install" in line]
    assert installs and all(ci.index(venv.group(1)) < ci.index(line) for line in installs)


def test_license_and_classifiers() -> None:
    project = _pyproject()["project"]
    assert project["license"] == "Apache-2.0"  # SPDX expression, not the deprecated table
    assert project["license-files"] == ["LICENSE"]
    license_text = (REPO / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text
    classifiers = project["classifiers"]
    assert any(c.startswith("Operating System ::") for c in classifiers)
    pythons = sorted(c.rsplit(" ", 1)[1] for c in classifiers if re.search(r":: 3\.\d+$", c))
    assert pythons, classifiers
    metadata = importlib.metadata.metadata("keras-mirror-kit")
    assert metadata["License-Expression"] == "Apache-2.0"


def test_requires_python_excludes_pythons_without_tensorflow_and_keras() -> None:
    project = _pyproject()["project"]
    spec = project["requires-python"]
    assert spec == ">=3.11,<3.14", spec  # Keras 3.15: 3.11+; TensorFlow 2.21: up to 3.13
    for classifier in project["classifiers"]:
        match = re.search(r":: 3\.(\d+)$", classifier)
        if match:
            assert 11 <= int(match.group(1)) <= 13, classifier
    running = sys.version_info[:2]
    assert (3, 11) <= running <= (3, 13)


def test_extras_and_urls() -> None:
    pyproject = _pyproject()
    extras = pyproject["project"]["optional-dependencies"]
    assert any(r.startswith("tensorflow[and-cuda]") for r in extras["gpu"])
    assert any(r.startswith("matplotlib") for r in extras["plot"])
    assert {r.split("[")[0].split(">")[0] for r in extras["docs"]} == {
        "mkdocs",
        "mkdocs-material",
        "mkdocstrings",
    }
    urls = pyproject["project"]["urls"]
    for key in ("Documentation", "Repository", "Changelog"):
        assert urls[key].startswith("https://"), key


def test_readme_links_work_on_the_package_index() -> None:
    """README links are absolute (relative ones break on the package index page) and each
    link into the documentation site names an existing docs/ page and heading."""
    urls = _pyproject()["project"]["urls"]
    site, repo = urls["Documentation"], urls["Repository"]
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert links
    for link in links:
        assert link.startswith("https://"), f"relative link in README.md: {link}"
        if link.startswith(site):
            page, _, anchor = link[len(site) :].partition("#")
            page = page.strip("/") or "index"
            doc = REPO / "docs" / f"{page}.md"
            assert doc.exists(), link
            if anchor:
                assert anchor in _anchors(doc), link
        elif link.startswith(repo + "/blob/main/"):
            assert (REPO / link[len(repo + "/blob/main/") :]).exists(), link


def _anchors(doc: Path) -> set[str]:
    """The MkDocs (Python-Markdown toc) slugs of a page's headings."""
    slugs = set()
    for line in doc.read_text(encoding="utf-8").splitlines():
        match = re.match(r"#{1,6} (.+)", line)
        if match:
            explicit = re.search(r"\{ *#([\w-]+) *\}\s*$", match.group(1))
            if explicit:  # attr_list's `{ #id }`: the heading's id, as the site builds it
                slugs.add(explicit.group(1))
                continue
            text = re.sub(r"[`*]", "", match.group(1)).strip().lower()
            text = re.sub(r"[^\w\s-]", "", text)
            slugs.add(re.sub(r"[-\s]+", "-", text).strip("-"))
    return slugs


def test_all_names_exactly_the_static_imports_the_lazy_table_is_read_from() -> None:
    import keras_mirror_kit as kmk

    assert set(kmk._LAZY) == set(kmk.__all__) - {"__version__"}
    assert len(kmk.__all__) == len(set(kmk.__all__))
    assert kmk._LAZY["distributed"] == "keras_mirror_kit.distributed"
    assert kmk._LAZY["models"] == "keras_mirror_kit.models"  # a sub-module maps to itself
    # The table reads only `from module import name` lines: nothing else may stand there.
    tree = ast.parse((REPO / "keras_mirror_kit" / "__init__.py").read_text(encoding="utf-8"))
    (block,) = [
        n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"
    ]
    for statement in block.body:
        assert isinstance(statement, ast.ImportFrom), ast.unparse(statement)
        assert all(alias.asname is None for alias in statement.names), ast.unparse(statement)


def test_help_and_launch_start_without_tensorflow() -> None:
    proc = run_python(
        """
        import contextlib, io, json, sys, time
        start = time.perf_counter()
        from keras_mirror_kit.cli import main
        seconds = {}
        for argv in (["--help"], ["launch", "--help"]):
            t0 = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()) as out:
                try:
                    main(argv)
                except SystemExit as exit:
                    assert exit.code in (0, None), exit.code
            assert "usage" in out.getvalue().lower(), out.getvalue()
            seconds[" ".join(argv)] = time.perf_counter() - t0
        rc = main(["launch", "-n", "1", "--", sys.executable, "-c", "print('worker ran')"])
        modules = [m for m in ("tensorflow", "keras", "numpy") if m in sys.modules]
        print("RESULT " + json.dumps({"rc": rc, "modules": modules, "seconds": seconds,
                                      "total": time.perf_counter() - start}))
        """,
        env=LOUD,
        timeout=120,
        fresh=True,
    )
    result = last_json(proc)
    assert result["rc"] == 0
    assert "worker ran" in proc.stdout
    assert result["modules"] == [], result  # before the lazy __init__: tensorflow, keras
    # No TensorFlow log noise (its C++ start-up lines go to stderr). The launcher's own
    # lines may name TensorFlow (its WARNING where the host refuses network namespaces).
    launcher = "keras-mirror-kit launch:"
    noise = [line for line in proc.stderr.splitlines() if not line.startswith(launcher)]
    assert "tensorflow" not in "\n".join(noise).lower() and "I0000" not in proc.stderr
    print(f"start-up: {result}")  # measured, not asserted (the wall clock varies)


@pytest.mark.slow
def test_every_public_name_resolves_and_distributed_stays_the_decorator() -> None:
    proc = run_python(
        """
        import json, types
        import keras_mirror_kit as kmk
        import keras_mirror_kit.distributed  # sets the module as an attribute: still the API
        from keras_mirror_kit.distributed import distributed
        assert kmk.distributed is distributed, kmk.distributed
        missing = [n for n in kmk.__all__ if getattr(kmk, n, None) is None]
        kinds = {n: isinstance(getattr(kmk, n), types.ModuleType) for n in kmk.__all__}
        from keras_mirror_kit import SyncedCheckpoint, datasets
        assert set(kmk.__all__) <= set(dir(kmk))
        try:
            kmk.no_such_name
        except AttributeError as err:
            message = str(err)
        # Sub-modules are attributes too, as they were when the package imported eagerly.
        subs = {n: getattr(kmk, n).__name__ for n in ("devices", "callbacks", "integrations")}
        print("RESULT " + json.dumps({"missing": missing, "kinds": kinds, "msg": message,
                                      "subs": subs}))
        """,
        timeout=300,
    )
    result = last_json(proc)
    assert result["missing"] == []
    assert {n for n, is_module in result["kinds"].items() if is_module} == {"datasets", "models"}
    assert "no_such_name" in result["msg"]
    assert result["subs"] == {n: f"keras_mirror_kit.{n}" for n in result["subs"]}


@pytest.fixture(scope="module")
def warmup_model_file(tmp_path_factory) -> Path:
    """A `.keras` file whose optimizer uses `WarmupSchedule` (written in this process)."""
    import keras

    from keras_mirror_kit.schedules import WarmupSchedule

    path = tmp_path_factory.mktemp("warmup") / "model.keras"
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(WarmupSchedule(0.1, warmup_steps=5)), loss="mse")
    model.save(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("keras_first", [False, True])
def test_warmup_schedule_loads_from_a_keras_file_after_a_plain_import(
    warmup_model_file: Path, keras_first: bool
) -> None:
    # Loaded in a fresh interpreter: only there is the import order the user's own.
    path = warmup_model_file
    imports = (
        "import keras\nimport keras_mirror_kit"
        if keras_first
        else ("import keras_mirror_kit\nimport keras")
    )
    proc = run_python(
        imports
        + f"""
import json, sys
assert "keras_mirror_kit.schedules" in sys.modules  # registered when Keras came in
model = keras.saving.load_model({str(path)!r})
schedule = model.optimizer._learning_rate
print("RESULT " + json.dumps([type(schedule).__module__, type(schedule).__name__,
                              schedule.get_config()["warmup_steps"]]))
""",
        timeout=300,
        fresh=True,  # the import order is the user's only in a new interpreter
    )
    assert last_json(proc) == ["keras_mirror_kit.schedules", "WarmupSchedule", 5]


def test_datasets_import_without_tensorflow() -> None:
    proc = run_python(
        """
        import json, sys
        import keras_mirror_kit as kmk
        from keras_mirror_kit.datasets import make_synthetic_cifar10
        (x, y), _ = make_synthetic_cifar10(num_train=20, num_test=10, seed=0)
        modules = [m for m in ("tensorflow", "keras") if m in sys.modules]
        print("RESULT " + json.dumps({"modules": modules, "shape": list(x.shape),
                                      "same": kmk.datasets.make_synthetic_cifar10
                                      is make_synthetic_cifar10}))
        """,
        timeout=120,
        fresh=True,
    )
    assert last_json(proc) == {"modules": [], "shape": [20, 32, 32, 3], "same": True}


def test_bench_plot_without_matplotlib_names_the_extra(tmp_path: Path) -> None:
    proc = run_python(
        f"""
        import sys
        sys.modules["matplotlib"] = None  # as if it were not installed: import fails
        from keras_mirror_kit.cli.bench import _plot
        _plot([{{"replicas": 1, "samples_per_sec": 1.0, "scaling_efficiency": 1.0}}],
              {str(tmp_path / "x.png")!r})
        """,
        check=False,
        timeout=120,
    )
    assert proc.returncode == 1
    assert 'pip install "keras-mirror-kit[plot]"' in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "x.png").exists()


def test_every_module_registering_with_keras_is_imported_with_keras() -> None:
    """A module that registers objects with Keras' serialization is listed in
    `_KERAS_REGISTRATIONS`, so a `.keras` file using them loads after `import keras_mirror_kit`."""
    import keras_mirror_kit as kmk

    registering = set()
    for path in (REPO / "keras_mirror_kit").rglob("*.py"):
        source = path.read_text(encoding="utf-8")
        if re.search(r"^\s*@?[\w.]*register_keras_serializable\(", source, re.M):  # used
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            registering.add(module.removesuffix(".__init__"))
    assert "keras_mirror_kit.schedules" in registering
    assert registering == set(kmk._KERAS_REGISTRATIONS)
