"""`SyncedCheckpoint` across a recompile and with learning-rate callbacks, killed and rerun.

keras-io's fine-tuning script (a frozen base trained with Adam, then `base.trainable = True`
and `model.compile(...)` again, and a second `fit` with the same checkpoint) is killed by
SIGKILL after a progress marker of its second `fit` and rerun as the same script: it ends
on the uninterrupted run's weights and optimizer state bit for bit. A rerun whose second
compile differs (another optimizer) or whose trainable flags differ is refused before any
step with `OptimizerMismatchError`, a `ValueError`. `ReduceLROnPlateau` and a
`LearningRateScheduler` that reads the rate, killed after the rate was cut and resumed
mid-epoch, set the uninterrupted run's rate at every batch. Children simulate 2 replicas
(`tests/recompile_child.py`); all of them take about half a minute.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

import keras_mirror_kit as kmk
from keras_mirror_kit.checkpoint.meta import CheckpointMeta
from keras_mirror_kit.checkpoint.optimizer_match import OptimizerMismatchError
from keras_mirror_kit.checkpoint.store import CheckpointError
from tests import forkserver
from tests.subproc import REPO

ENV = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2"}
ENV["KMK_SIMULATE_REPLICAS"] = "2"


def _run(out, specs, kill=False):
    """Runs `tests.recompile_child` on `specs`; with `kill`, SIGKILLs it at its marker."""
    spec = out.with_suffix(".spec.json")
    spec.write_text(json.dumps(specs))
    command = [sys.executable, "-m", "tests.recompile_child", str(out), str(spec)]
    proc = forkserver.popen(
        command, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        if kill:
            marker, deadline = (
                specs[0]["marker"],
                time.monotonic() + 240,
            )  # a bound, not a kill time
            while not os.path.exists(marker):
                assert proc.poll() is None, proc.communicate()[1][-3000:]
                assert time.monotonic() < deadline, "the child never reached its marker"
                time.sleep(0.02)
            proc.kill()  # SIGKILL, after the marker: in training, never after a normal exit
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=60)
    if kill:
        assert proc.returncode == -9, stderr[-3000:]
        return None
    assert proc.returncode == 0, stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted runs, the killed ones, and their reruns (with two altered scripts)."""
    root = tmp_path_factory.mktemp("recompile")
    dirs = {name: root / name / "ckpt" for name in ("ref", "tune", "rates", "sgd", "frozen")}
    for directory in dirs.values():
        directory.parent.mkdir()
    reference = _run(
        root / "ref.json",
        [
            {"script": "finetune", "directory": str(dirs["ref"])},
            {"script": "rates", "directory": str(dirs["ref"]) + "-rates"},
        ],
    )
    # The second fit() saves at its steps 4 and 8 (mid-epoch): killed after step 9.
    tune = {"script": "finetune", "directory": str(dirs["tune"]), "kill_after": 9}
    _run(root / "k1.json", [{**tune, "marker": str(root / "tune" / "m")}], kill=True)
    # The rate is cut at the end of epochs 1 and 2; killed after step 17 (epoch 2, batch 5).
    rates = {"script": "rates", "directory": str(dirs["rates"]), "kill_after": 17}
    _run(root / "k2.json", [{**rates, "marker": str(root / "rates" / "m")}], kill=True)
    for name in ("sgd", "frozen"):
        shutil.rmtree(dirs[name].parent)
        shutil.copytree(dirs["tune"].parent, dirs[name].parent)
    resumed = _run(
        root / "resumed.json",
        [
            {"script": "finetune", "directory": str(dirs["tune"])},
            {"script": "rates", "directory": str(dirs["rates"])},
            {"script": "finetune", "directory": str(dirs["sgd"]), "second": "sgd"},
            {"script": "finetune", "directory": str(dirs["frozen"]), "unfreeze": False},
        ],
    )
    return {
        "reference": reference[str(dirs["ref"])],
        "reference_rates": reference[str(dirs["ref"]) + "-rates"],
        **{name: resumed[str(dirs[name])] for name in ("tune", "rates", "sgd", "frozen")},
    }


def _same_end(reference, resumed):
    """The two runs ended on the same weights and optimizer state, bit for bit."""
    a, b = np.load(reference["weights"]), np.load(resumed["weights"])
    assert len(a.files) == len(b.files)
    for key in a.files:
        np.testing.assert_array_equal(a[key], b[key])
    assert resumed["iterations"] == reference["iterations"]
    saved, restored = list(reference["optimizer"].values()), list(resumed["optimizer"].values())
    assert restored == saved  # iterations, learning rate, every moment


@pytest.mark.slow
def test_a_fine_tuning_script_killed_after_its_recompile_resumes_bit_for_bit(runs):
    reference, resumed = runs["reference"], runs["tune"]
    assert resumed["restored"] == [3, 2]  # the second fit()'s checkpoint of its step 8
    _same_end(reference, resumed)
    assert resumed["iterations"] == 12  # the second compile's optimizer: 2 epochs of 6
    assert any("_momentum" in path and "base" in path for path in resumed["optimizer"])
    assert resumed["rates"] and all(
        reference["rates"][k] == v for k, v in resumed["rates"].items()
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, pattern",
    [
        ("sgd", r"another optimizer than this fit\(\)'s, adam in the checkpoint, sgd \(SGD\)"),
        ("frozen", r"trained in the checkpoint, frozen here: base/dense\w*/kernel"),
    ],
    ids=["another optimizer compiled", "other trainable flags"],
)
def test_a_rerun_whose_recompile_differs_is_refused_before_any_step(runs, name, pattern):
    import re

    kind, message = runs[name]["error"]
    assert kind == "OptimizerMismatchError"
    assert {"ValueError", "CheckpointError"} <= set(runs[name]["error_mro"])
    assert re.search(pattern, message), message
    assert "does not match this model's optimizer" in message  # as CheckpointError's words
    assert "nothing was restored or trained" in message and "Received: " in message
    assert "kmk.restore(model, directory, optimizer=False)" in message
    assert runs[name]["iterations"] == 0  # refused before the first step


@pytest.mark.slow
def test_learning_rate_callbacks_resume_exactly_after_the_rate_was_cut(runs):
    reference, resumed = runs["reference_rates"], runs["rates"]
    assert resumed["restored"] == [2, 4]  # mid-epoch 2, after the cut at the end of epoch 1
    first, cut = reference["rates"]["0/0"], reference["rates"]["2/16"]
    assert cut < 0.9 * first  # the scheduler's 0.9 and the plateau's 0.5 both applied
    assert sorted(resumed["rates"]) == sorted(k for k in reference["rates"] if int(k[2:]) >= 16)
    assert {k: reference["rates"][k] for k in resumed["rates"]} == resumed["rates"]
    assert resumed["plateau"] == reference["plateau"]  # wait, best, cooldown_counter
    _same_end(reference, resumed)


def _tuned(unfreeze: bool) -> keras.Model:
    """A frozen base and a head, compiled again with plain SGD (no per-variable state)."""

    @kmk.distributed(global_batch_size=16, devices=["/cpu:0", "/cpu:1"])
    def build():
        base = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4)], name="base")
        base.trainable = False
        inputs = keras.Input((6,))
        model = keras.Model(inputs, keras.layers.Dense(2)(base(inputs)))
        model.compile(optimizer="sgd", loss="mse")
        return model

    model = build()
    model.get_layer("base").trainable = unfreeze
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


def test_other_trainable_flags_are_refused_without_per_variable_optimizer_state(tmp_path):
    x = np.random.default_rng(0).normal(size=(32, 6)).astype("float32")
    y = np.zeros((32, 2), "float32")
    written = _tuned(unfreeze=True)
    written.fit(x, y, epochs=1, verbose=0, callbacks=[kmk.SyncedCheckpoint(tmp_path)])
    rerun = _tuned(unfreeze=False)  # the same optimizer variables: SGD's two
    with pytest.raises(OptimizerMismatchError, match=r"frozen here: base/dense\w*/kernel"):
        rerun.fit(x, y, epochs=2, verbose=0, callbacks=[kmk.SyncedCheckpoint(tmp_path)])
    assert int(rerun.optimizer.iterations.numpy()) == 0
    assert issubclass(OptimizerMismatchError, ValueError)
    assert issubclass(OptimizerMismatchError, CheckpointError)


def test_the_trained_variables_round_trip_in_the_metadata():
    meta = CheckpointMeta(epoch=1, step=0, variables=("model:a", "model:b"), trained=((1,), ()))
    assert CheckpointMeta.from_json(meta.to_json()).trained == ((1,), ())
    assert CheckpointMeta.from_json({**meta.to_json(), "trained": None}).trained is None
    with pytest.raises(ValueError, match="'trained'"):
        CheckpointMeta.from_json({**meta.to_json(), "trained": [["0"]]})
