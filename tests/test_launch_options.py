"""The launcher's command line (`multi_worker/launch/options.py`), without starting anything.

Pure Python, no TensorFlow: `parse` splits the launcher's options from the script's and
refuses what it cannot read; `validate` refuses bad values before any worker starts. The
launch itself (workers, restarts, isolation) is tested in `test_launch_*.py`.
"""

from __future__ import annotations

import sys

import pytest

from keras_mirror_kit.multi_worker.launch.errors import LaunchError
from keras_mirror_kit.multi_worker.launch.options import parse, validate


def test_the_launchers_options_end_at_the_script_or_at_a_double_dash():
    args = parse(["-n", "2", "--timeout", "5", "train.py", "--epochs", "3", "-n", "9"])
    assert (args.nproc, args.timeout, args.target) == (2, 5.0, "train.py")
    assert args.args == ["--epochs", "3", "-n", "9"]  # the script's own, -n included
    args = parse(["-n", "3", "--", "python3", "-u", "train.py"])
    assert (args.nproc, args.target, args.args) == (3, "python3", ["-u", "train.py"])
    args = parse(["-n", "2", "-m", "pkg.train", "--lr", "0.1"])
    assert args.module and (args.target, args.args) == ("pkg.train", ["--lr", "0.1"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-n", "2"], "the script or command to run is missing"),
        (["-n", "2", "--time", "5", "x.py"], "unknown option --time (did you mean --timeout"),
        (["-n", "2", "--grase", "1", "x.py"], "did you mean --grace"),
        (["-n", "two", "x.py"], "invalid int value: 'two'"),
    ],
)
def test_what_the_parser_cannot_read_is_refused_with_a_hint(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        parse(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["-n", "0"], "-n must be a positive number of workers. Received: -n 0"),
        (["-n", "2", "--max-restarts", "-1"], "--max-restarts must be >= 0"),
        (["-n", "2", "--timeout", "-1"], "--timeout must be >= 0 seconds. Received: --timeout"),
        (["-n", "2", "--grace", "-0.5"], "--grace must be >= 0 seconds"),
        (["-n", "2", "--gpus-per-worker", "-2"], "--gpus-per-worker must be >= 0"),
    ],
)
def test_bad_values_are_refused_before_any_worker_starts(tmp_path, options, message):
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    with pytest.raises(LaunchError, match=message.replace("(", r"\(")):
        validate(parse([*options, str(script)]))


def test_a_good_command_line_gets_its_kind_command_and_gpus(tmp_path, monkeypatch):
    monkeypatch.delenv("KERAS_BACKEND", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    args = parse(["-n", "2", str(script), "--epochs", "1"])
    validate(args)
    assert args.kind == "script"
    assert args.command[-3:] == [str(script), "--epochs", "1"]
    assert args.command[0] == sys.executable
    assert args.gpus is None  # no GPU visible: the workers' environment is left alone
    args = parse(["-n", "2", "--gpus-per-worker", "0", str(script)])
    validate(args)
    assert args.gpus == [[], []]  # asked for none: each worker is told it has no GPU
    with pytest.raises(LaunchError, match="no such script: .*missing.py"):
        validate(parse(["-n", "2", str(tmp_path / "missing.py")]))


@pytest.mark.parametrize(
    ("backend", "message"),
    [("jax", "multi-process training on Keras' JAX backend"), ("torch", "TensorFlow and JAX")],
)
def test_another_keras_backend_is_refused_for_launch(tmp_path, monkeypatch, backend, message):
    monkeypatch.setenv("KERAS_BACKEND", backend)
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    with pytest.raises(LaunchError, match=message) as info:
        validate(parse(["-n", "2", str(script)]))
    assert f"Received: KERAS_BACKEND={backend!r}" in str(info.value)
