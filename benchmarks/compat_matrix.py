"""The compatibility matrix: the kit on each tested TensorFlow / Keras pair, in a venv of its own.

For each pair it creates (or reuses) a virtual environment, installs that TensorFlow and
that Keras (`keras-nightly` replaces the `keras` TensorFlow pulls in), the kit without its
own pins (`pip install -e . --no-deps`, as a user with an existing project would) and the
test tools, then runs README's example (1 epoch, synthetic data, 2 simulated replicas) and
the fast tier (`pytest -m "not slow"`), and prints one table. `--slow FILE ...` adds test
files of the slow tier (the own-step models, the uneven splits, ...). `.ci/run`'s
compatibility stage runs the oldest pair and the next Keras with `--strict` (a non-zero exit
on any failure); the figures of a whole run are in docs/support.md.

    python3 benchmarks/compat_matrix.py                       # every pair, fast tier
    python3 benchmarks/compat_matrix.py --pairs oldest,next --strict
    python3 benchmarks/compat_matrix.py --pairs 2.20 --slow tests/test_own_train_steps.py
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Pair:
    """One TensorFlow / Keras pair: pip requirements and a short name."""

    name: str
    tensorflow: str  # a pip requirement: "tensorflow==2.19.1", "tf-nightly==2.23.0.dev..."
    keras: str  # "keras==3.10.0" or "keras-nightly==3.16.0.dev..."
    aliases: tuple[str, ...] = ()


PAIRS = (
    Pair("tf2.19-keras3.10", "tensorflow==2.19.1", "keras==3.10.0", ("oldest", "2.19")),
    Pair("tf2.20-keras3.12", "tensorflow==2.20.0", "keras==3.12.1", ("2.20",)),
    Pair("tf2.21-keras3.15", "tensorflow==2.21.0", "keras==3.15.1", ("pins", "2.21")),
    Pair(
        "tf2.21-keras3.16",
        "tensorflow==2.21.0",
        "keras-nightly==3.16.0.dev2026102704",
        ("next", "3.16"),
    ),
    Pair(
        "tf2.23-keras3.16",
        "tf-nightly==2.23.0.dev20261026",
        "keras-nightly==3.16.0.dev2026102704",
        ("next-tf", "2.23"),
    ),
)
# What the fast tier needs besides TensorFlow and Keras (the dev extra without KerasHub and
# KerasTuner, which pin TensorFlow themselves; their tests skip where they are missing).
TEST_TOOLS = (
    "pytest>=8",
    "pytest-timeout>=2.3",
    "pytest-xdist>=3.5",
    "psutil>=5.9",
    "pandas>=2.0",
    "matplotlib>=3.8",
    "wandb>=0.31",
    "tensorboard",
    "jax>=0.4",
)


@dataclass
class Result:
    """What one pair gave."""

    pair: Pair
    versions: str = ""
    install: str = ""
    example: str = ""
    fast: str = ""
    slow: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    ok: bool = True


def _run(
    command: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: Path = REPO,
    timeout: float = 3600,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, cwd=cwd, env=env, text=True, capture_output=True, timeout=timeout, check=False
    )


def _pip(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return _run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args])


def _versions(python: Path) -> str:
    probe = _run(
        [
            str(python),
            "-c",
            "import tensorflow as tf, keras, sys; "
            "print(sys.version.split()[0], tf.__version__, keras.__version__)",
        ],
    )
    return probe.stdout.strip() if probe.returncode == 0 else ""


def _normal(version: str) -> str:
    """`2.23.0-dev20261026` (tf-nightly's `__version__`) as pip spells it, `2.23.0.dev...`."""
    return version.replace("-", ".")


def _wanted(pair: Pair) -> list[str]:
    return [pair.tensorflow.split("==")[1], pair.keras.split("==")[1]]


def _holds(versions: str, pair: Pair) -> bool:
    """Whether a `_versions` line shows the pair's TensorFlow and Keras."""
    return [_normal(v) for v in versions.split()[1:]] == _wanted(pair)


def install(pair: Pair, root: Path, python: str) -> tuple[Path, str]:
    """The pair's venv (made or reused) with the kit and the test tools; its versions line."""
    venv = root / pair.name
    bin_python = venv / "bin" / "python3"
    have = _versions(bin_python) if bin_python.exists() else ""
    if have and _holds(have, pair):
        _pip(bin_python, "--no-deps", "-e", str(REPO))
        return bin_python, have
    if venv.is_symlink():  # a venv of one's own, linked in: never replaced
        raise RuntimeError(f"{venv} links to a venv that holds {have!r}, not {_wanted(pair)}")
    shutil.rmtree(venv, ignore_errors=True)
    made = _run([python, "-m", "venv", str(venv)])
    if made.returncode:
        raise RuntimeError(f"venv: {made.stderr[-2000:]}")
    nightly = pair.keras.startswith("keras-nightly")
    first = _pip(bin_python, pair.tensorflow, *(() if nightly else (pair.keras,)), *TEST_TOOLS)
    if first.returncode:
        raise RuntimeError(f"pip: {first.stderr[-2000:]}")
    if nightly:  # TensorFlow pulled `keras` in: both install the `keras` module
        _run([str(bin_python), "-m", "pip", "uninstall", "-y", "-q", "keras"])
        again = _pip(bin_python, "--no-deps", "--force-reinstall", pair.keras)
        if again.returncode:
            raise RuntimeError(f"pip: {again.stderr[-2000:]}")
    kit = _pip(bin_python, "--no-deps", "-e", str(REPO))
    if kit.returncode:
        raise RuntimeError(f"pip: {kit.stderr[-2000:]}")
    have = _versions(bin_python)
    if not _holds(have, pair):
        raise RuntimeError(f"the venv holds {have!r}, not {_wanted(pair)}")
    return bin_python, have


def run_example(python: Path) -> tuple[bool, str]:
    """README's example: 1 epoch on 2 simulated replicas, synthetic data."""
    with tempfile.TemporaryDirectory(prefix="kmk-compat-") as tmp:
        done = _run(
            [
                str(python),
                str(REPO / "examples" / "cifar10_cnn.py"),
                "--epochs",
                "1",
                "--simulate-replicas",
                "2",
                "--data",
                "synthetic",
                "--no-checkpoint",
                "--output",
                str(Path(tmp) / "model.keras"),
                "--verbose",
                "0",
            ],
            cwd=Path(tmp),
            timeout=1800,
        )
    found = re.findall(r"test accuracy[^\d]*([\d.]+%?)", done.stdout + done.stderr, re.I)
    if done.returncode:
        return False, "failed: " + (done.stderr.strip().splitlines() or ["?"])[-1][:160]
    return True, f"ok (test accuracy {found[-1]})" if found else "ok"


def run_pytest(python: Path, args: list[str], workers: int) -> tuple[bool, str]:
    """A pytest run in the pair's venv: `N passed, M failed` (and the failures' names)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = _run(
        [
            str(python),
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            "-n",
            str(workers),
            "--timeout",
            "1200",
            *args,
        ],
        env=env,
        timeout=5400,
    )
    text = done.stdout + done.stderr
    counts = re.findall(
        r"(\d+) (passed|failed|skipped|error|errors)\b",
        text.splitlines()[-1] if text.strip() else "",
    )
    summary = ", ".join(f"{n} {what}" for n, what in counts) or "no summary"
    failed = [line.split(" ")[1] for line in text.splitlines() if line.startswith("FAILED ")]
    if failed:
        summary += " (" + "; ".join(failed[:10]) + ")"
    return done.returncode == 0, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--pairs", default="all", help="comma-separated names or aliases (oldest, next, 2.20, ...)"
    )
    parser.add_argument(
        "--root",
        default=str(REPO / ".venvs-compat"),
        help="where the venvs are made (kept for the next run)",
    )
    parser.add_argument("--python", default=sys.executable, help="the interpreter of the venvs")
    parser.add_argument("--slow", nargs="*", default=[], help="slow-tier test files to add")
    parser.add_argument("--no-fast", action="store_true", help="skip the fast tier")
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers")
    parser.add_argument("--strict", action="store_true", help="exit 1 on any failure")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    wanted = set(args.pairs.split(","))
    pairs = [p for p in PAIRS if "all" in wanted or wanted & {p.name, *p.aliases}]
    if not pairs:
        parser.error(f"no pair matches {args.pairs!r}")
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    results = []
    for pair in pairs:
        result = Result(pair)
        start = time.monotonic()
        print(f"== {pair.name}: {pair.tensorflow} {pair.keras}", flush=True)
        try:
            python, result.versions = install(pair, root, args.python)
            result.install = "ok"
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            result.install, result.ok = f"failed: {err}"[:300], False
            results.append(result)
            print(result.install, flush=True)
            continue
        ok, result.example = run_example(python)
        result.ok &= ok
        print(f"   example: {result.example}", flush=True)
        if not args.no_fast:
            ok, result.fast = run_pytest(python, ["-m", "not slow"], args.workers)
            result.ok &= ok
            print(f"   fast tier: {result.fast}", flush=True)
        for path in args.slow:
            ok, result.slow[path] = run_pytest(python, [path], args.workers)
            result.ok &= ok
            print(f"   {path}: {result.slow[path]}", flush=True)
        result.seconds = time.monotonic() - start
        results.append(result)
    print("\n| pair | Python, TensorFlow, Keras | example | fast tier | slow files | s |")
    print("|---|---|---|---|---|---|")
    for r in results:
        slow = "; ".join(f"{Path(k).name}: {v}" for k, v in r.slow.items()) or "-"
        example = r.example or r.install
        print(
            f"| {r.pair.name} | {r.versions} | {example} | {r.fast or '-'} | {slow} | "
            f"{r.seconds:.0f} |"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps([r.__dict__ | {"pair": r.pair.name} for r in results], indent=1)
        )
    return 1 if args.strict and not all(r.ok for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
