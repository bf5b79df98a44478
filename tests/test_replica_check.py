"""`kmk.check_replicas` and `doctor --model`: a user's own model on 1 replica and on 2.

Each check trains in a real child process (2 replicas simulated on the CPU); the user's
factory and data live in a module written to `tmp_path`, run with that as the current
directory, as a user runs `keras-mirror-kit doctor --model train:build_model` next to
`train.py`. The checks that train run as the user runs them, in a process of their own
(the command, or a script calling `kmk.check_replicas`) forked from the tests' zygote, so
the check's own child is forked too (`tests/forkserver.py`); their output is shown on
failure. The refusals before any training run here, where the check's child's stderr is
logged at DEBUG on the kit's logger (shown on failure).
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

import keras_mirror_kit as kmk
from keras_mirror_kit.cli import main as cli_main
from keras_mirror_kit.replica_check.causes import _workaround_status, model_causes, state_causes
from keras_mirror_kit.replica_check.record import compare_variables
from keras_mirror_kit.replica_check.samples import (
    FactorySettings,
    load_samples,
    save_samples,
    take_samples,
)
from tests import forkserver
from tests.subproc import REPO, last_json

USER_MODULE = """
import keras
import numpy as np

import keras_mirror_kit as kmk


def _compiled(*layers, optimizer=None):
    model = keras.Sequential([keras.Input((8,)), *layers, keras.layers.Dense(1)])
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.05), loss="mse")
    return model


def dense():
    return _compiled(keras.layers.Dense(16, activation="tanh"))


def batch_norm():
    return _compiled(keras.layers.Dense(16), keras.layers.BatchNormalization())


synced_batch_norm = kmk.distributed(global_batch_size=32, sync_batch_norm=True)(batch_norm)


def dropout():
    return _compiled(keras.layers.Dense(16), keras.layers.Dropout(0.5))


def not_compiled():
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype("float32")
    return x, (x @ rng.normal(size=(8, 1))).astype("float32")


NOT_CALLABLE = 3
"""


@pytest.fixture
def user_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> Path:
    """`tmp_path/train.py` holds the user's factories; the current directory, importable."""
    (tmp_path / "train.py").write_text(USER_MODULE, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.modules.pop("train", None)
    caplog.set_level(logging.DEBUG, logger="keras_mirror_kit")  # the child's stderr
    yield tmp_path
    sys.modules.pop("train", None)


def _doctor(capsys: Any, *args: str) -> tuple[int, str, str]:
    code = cli_main(["doctor", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def _user_process(user_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`python ARGS` in `user_dir`, as the user runs it (forked from the tests' zygote)."""
    return forkserver.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        cwd=user_dir,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=600,
        check=False,
    )


def _doctor_command(user_dir: Path, *args: str) -> tuple[int, str, str]:
    """`keras-mirror-kit doctor ARGS` in `user_dir`: exit status, stdout, stderr."""
    proc = _user_process(user_dir, "-m", "keras_mirror_kit.cli", "doctor", *args)
    return proc.returncode, proc.stdout, proc.stderr[-6000:]


@pytest.mark.slow
def test_cli_passes_a_plain_model_with_sgd(user_dir: Path) -> None:
    code, out, err = _doctor_command(
        user_dir, "--model", "train:dense", "--data", "train:data", "--json"
    )
    assert code == 0, out + err
    report = json.loads(out)
    assert report["passed"] is True and report["error"] is None
    assert report["replicas"] == 2 and report["layout"] == "2 replicas simulated on the CPU"
    assert report["steps"] == 3 and report["global_batch_size"] == 32  # Keras' 32
    assert 0 <= report["max_difference"] <= 1e-6
    assert report["first_divergent"] is None and report["causes"] == []
    paths = [d["path"] for d in report["differences"]]
    assert {"sequential/dense/kernel", "sgd/iteration"} <= set(paths), paths
    one, two = report["losses"]["1"], report["losses"]["2"]
    assert len(one) == len(two) == 3 and np.allclose(one, two, atol=1e-5)
    assert one[2] < one[0]  # it trained


@pytest.mark.slow
def test_cli_reports_unsynchronized_batch_norm_and_exits_1(user_dir: Path) -> None:
    code, out, err = _doctor_command(
        user_dir, "--model", "train:batch_norm", "--data", "train:data"
    )
    assert code == 1, out + err
    assert "FAILED: largest difference" in out
    assert "first variable to diverge: sequential/" in out
    assert (
        "batch_norm_unsynchronized: 1 BatchNormalization layer(s) ('batch_normalization')" in out
    )
    assert "fix: distributed(sync_batch_norm=True)" in out
    # Its per-replica moving statistics are part of that cause, not reported twice.
    assert "replica_copies_differ" not in out


_SYNCED_CHECK = """
import json
import keras_mirror_kit as kmk
import train

x, y = train.data()
result = kmk.check_replicas(train.synced_batch_norm, (x, y), steps=2)
print("RESULT " + json.dumps({
    "is_replica_check": isinstance(result, kmk.ReplicaCheck),
    "passed": bool(result.passed),
    "global_batch_size": result.global_batch_size,
    "steps": result.steps,
    "max_difference": float(result.max_difference),
    "causes": [cause.code for cause in result.causes],
    "paths": [d.path for d in result.differences],
    "describe": result.describe(),
}))
"""


@pytest.mark.slow
def test_synchronized_batch_norm_of_a_distributed_factory_passes(user_dir: Path) -> None:
    proc = _user_process(user_dir, "-c", _SYNCED_CHECK)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = last_json(proc)
    assert result["is_replica_check"]
    assert result["passed"], result["describe"]
    assert result["global_batch_size"] == 32 and result["steps"] == 2  # the factory's batch
    assert result["max_difference"] <= 1e-6 and result["causes"] == []
    assert "sequential/batch_normalization/moving_variance" in result["paths"]
    assert "passed: largest difference" in result["describe"]


@pytest.mark.slow
def test_random_layers_are_named_and_the_tolerance_flag_decides(user_dir: Path) -> None:
    code, out, err = _doctor_command(
        user_dir, "--model", "train:dropout", "--data", "train:data", "--tolerance", "10", "--json"
    )
    report = json.loads(out)
    assert code == 0, out + err
    # Far above the default tolerance, below the one given: the flag gave the verdict.
    assert 1e-3 < report["max_difference"] <= 10 and report["tolerance"] == 10
    assert report["passed"] is True
    (cause,) = report["causes"]
    assert cause["code"] == "random_layers" and "'dropout'" in cause["explanation"]
    assert "expected" in cause["explanation"]


def test_bad_specs_and_data_give_clear_errors_before_training(user_dir: Path, capsys: Any) -> None:
    train = importlib.import_module("train")
    with pytest.raises(ValueError, match=r"must be 'module:name'.*Received: factory='train'"):
        kmk.check_replicas("train", train.data)
    with pytest.raises(ValueError, match=r"Cannot import the module 'no_such_module'"):
        kmk.check_replicas("no_such_module:build", train.data)
    with pytest.raises(ValueError, match=r"'train' has no attribute 'nope'"):
        kmk.check_replicas("train:nope", train.data)
    with pytest.raises(TypeError, match=r"zero-argument function.*Received: factory=3"):
        kmk.check_replicas("train:NOT_CALLABLE", train.data)
    with pytest.raises(ValueError, match=r"no importable name"):
        kmk.check_replicas(lambda: train.dense(), train.data)
    with pytest.raises(TypeError, match=r"`data` must be arrays \(x, y\).*Received: data=\{"):
        kmk.check_replicas(train.dense, {"x": train.data()[0]})
    with pytest.raises(ValueError, match=r"holds 20 samples.*3 step\(s\) of 32 samples"):
        kmk.check_replicas(train.dense, (np.zeros((20, 8)), np.zeros((20, 1))))
    with pytest.raises(ValueError, match=r"divide evenly by the 2 replicas"):
        kmk.check_replicas(train.dense, train.data, batch_size=31)  # refused before the child
    with pytest.raises(ValueError, match=r"at least 2.*Received: replicas=1"):
        kmk.check_replicas(train.dense, train.data, replicas=1)
    code, out, err = _doctor(capsys, "--model", "train", "--data", "train:data")
    assert code == 2 and "Received: --model='train'" in err, out + err
    code, out, err = _doctor(capsys, "--model", "train:dense")
    assert code == 2 and "--model and --data go together" in err, out + err
    code, out, err = _doctor(capsys, "--steps", "2")
    assert code == 2 and "--steps: option(s) of the --model check" in err, out + err


@pytest.mark.slow
def test_a_factory_in_a_script_is_found_and_must_return_a_compiled_model(
    user_dir: Path,
) -> None:
    """The factory lives in the script being run (`__main__`): the child loads the script
    under another name, so its `if __name__ == "__main__":` block runs once, here."""
    script = user_dir / "check.py"
    script.write_text(
        textwrap.dedent(
            """
            import keras, sys
            import keras_mirror_kit as kmk
            from train import data

            def build():
                return keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])

            if __name__ == "__main__":
                try:
                    kmk.check_replicas(build, data)
                except ValueError as err:
                    print("RAISED", err)
            """
        ),
        encoding="utf-8",
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = forkserver.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        cwd=user_dir,
        env=env,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("RAISED") == 1, proc.stdout + proc.stderr[-3000:]
    assert "must return a compiled keras.Model" in proc.stdout, proc.stdout


def _model(*layers: Any, **compile_args: Any) -> keras.Model:
    model = keras.Sequential([keras.Input((4,)), *layers, keras.layers.Dense(1)])
    compile_args.setdefault("optimizer", "sgd")
    compile_args.setdefault("loss", "mse")
    model.compile(**compile_args)
    return model


def test_model_causes_are_found_only_where_present() -> None:
    def codes(model: keras.Model) -> list[str]:
        return [cause.code for cause in model_causes(model, 2)]

    assert codes(_model(keras.layers.Dense(3))) == []
    assert codes(_model(keras.layers.Dropout(0.0))) == []  # draws nothing
    assert codes(_model(keras.layers.GaussianNoise(0.1))) == ["random_layers"]
    assert codes(_model(keras.layers.BatchNormalization(synchronized=True))) == []
    assert codes(_model(keras.layers.BatchNormalization())) == ["batch_norm_unsynchronized"]
    assert codes(_model(jit_compile=True)) == ["jit_compile"]
    weighted = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
    assert codes(_model(loss=weighted)) == ["loss_reduction"]
    assert codes(_model(loss=keras.losses.MeanSquaredError(reduction="sum"))) == []
    ema = keras.optimizers.Adam(use_ema=True, ema_overwrite_frequency=2)
    fixed = _workaround_status("keras_ema_overwrite") in ("tested", "fixed-upstream")
    assert codes(_model(optimizer=ema)) == ([] if fixed else ["ema_overwrite"])
    clipping = keras.optimizers.SGD(clipnorm=1.0)
    fixed = _workaround_status("keras_gradient_clipping") in ("tested", "fixed-upstream")
    assert codes(_model(optimizer=clipping)) == ([] if fixed else ["gradient_clipping"])
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        low = _model(keras.layers.Dense(3))
    finally:
        keras.config.set_dtype_policy("float32")
    assert codes(low) == ["low_precision"]


def test_state_causes_from_the_n_replica_run() -> None:
    def variable(path: str, **fields: Any) -> dict[str, Any]:
        base = {"path": path, "kind": "model", "trainable": False, "aggregation": "none"}
        base |= {"role": None, "changed": True, "copies_differ": False, "difference": 1.0}
        return base | fields

    variables = [
        variable("m/counter"),  # updated per replica: the cause
        variable("m/steady", changed=False),
        variable("m/close", difference=1e-9),
        variable("m/kernel", trainable=True),
        variable("m/bn/moving_mean", role="batch_norm", copies_differ=True),
        variable("seed_generator_state", role="seed"),
    ]
    state, copies = state_causes(variables, 1e-5)
    assert state.code == "per_replica_state" and "'m/counter'" in state.explanation
    assert "1 non-trainable" in state.explanation
    assert copies.code == "replica_copies_differ" and "'m/bn/moving_mean'" in copies.explanation
    known = model_causes(_model(keras.layers.BatchNormalization()), 2)
    assert [c.code for c in state_causes(variables, 1e-5, known)] == ["per_replica_state"]


def test_differences_count_nan_only_where_one_run_has_it() -> None:
    one = [np.array([1.0, np.nan]), np.array([0.0, 1.0]), np.array([2.0]), np.zeros((2, 3))]
    many = [np.array([1.0, np.nan]), np.array([0.0, np.nan]), np.array([2.5]), np.zeros((2, 3))]
    paths = ["a", "b", "c", "d"]
    differences, first, largest = compare_variables(paths, one, many, tolerance=0.1)
    assert [(d.path, d.difference) for d in differences] == [
        ("b", math.inf),
        ("c", 0.5),
        ("a", 0.0),
        ("d", 0.0),
    ]
    assert first == "b" and largest == math.inf and differences[-1].shape == (2, 3)


def test_samples_are_the_first_batches_of_the_data_in_order(tmp_path: Path) -> None:
    import tensorflow as tf

    x = np.arange(200, dtype="float32").reshape(100, 2)
    y = np.arange(100, dtype="int64")
    plain = FactorySettings(inner=lambda: None)

    class Batches(keras.utils.PyDataset):
        def __len__(self) -> int:
            return 10

        def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
            return x[10 * i : 10 * i + 10], y[10 * i : 10 * i + 10]

    dataset = tf.data.Dataset.from_tensor_slices(({"a": x, "b": y}, y)).batch(7)
    batch, (features, labels) = take_samples(dataset, plain, 2, 3, None)
    assert batch == 6 and labels.tolist() == list(range(18))  # 7 rounded down to 2 x 3
    assert features["a"].tolist() == x[:18].tolist() and features["b"].dtype == np.int64
    batch, (xs, ys) = take_samples(Batches(), plain, 2, 2, None)
    assert batch == 10 and ys.tolist() == list(range(20))
    batch, (xs,) = take_samples(lambda: iter([(x[:64],)]), plain, 2, 2, 16)
    assert batch == 16 and xs.shape == (32, 2)
    accumulating = FactorySettings(inner=plain.inner, options={"gradient_accumulation_steps": 2})
    batch, (xs, ys) = take_samples((x, y, None), accumulating, 4, 1, None)
    assert batch == 32 and len(xs) == 64  # 1 update of 2 micro-batches of Keras' 32
    save_samples(str(tmp_path / "s.npz"), ({"a": x[:4], "b": y[:4]}, np.array(["u", "v"])))
    loaded = load_samples(str(tmp_path / "s.npz"))
    assert loaded[0]["a"].tolist() == x[:4].tolist() and loaded[1].tolist() == ["u", "v"]
    with pytest.raises(TypeError, match=r"Arrays must come as a tuple"):
        take_samples((x, None, y), plain, 2, 1, None)
    with pytest.raises(ValueError, match=r"same number of samples.*\[50, 100\]"):
        take_samples((x[:50], y), plain, 2, 1, None)
