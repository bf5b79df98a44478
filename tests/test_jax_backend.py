"""The same `distributed()` on Keras' JAX backend, on 1 and on 2 simulated CPU devices.

Each configuration runs in its own child (`tests/jax_child.py`: `KERAS_BACKEND=jax`, forked
from the tests' JAX zygote as a new interpreter would run it,
XLA's host-platform device count set by `kmk.simulate_replicas`), both from the same
initial weights.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import numpy as np
import pytest

from tests import forkserver
from tests.subproc import REPO

pytestmark = [
    pytest.mark.slow,  # a JAX child (or a module fixture running one) per module
    pytest.mark.skipif(
        importlib.util.find_spec("jax") is None,
        reason="jax is not installed (keras-mirror-kit[dev])",
    ),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, dict]:
    root = tmp_path_factory.mktemp("jax")
    env = {k: v for k, v in os.environ.items() if k not in ("KMK_SIMULATE_REPLICAS", "XLA_FLAGS")}
    env.update(PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="jax")
    results = {}
    for n in (1, 2):  # the 1-device run writes the initial weights both start from
        out = root / f"result-{n}.json"
        proc = forkserver.run(
            [sys.executable, "-m", "tests.jax_child", str(out), str(n), str(root / "w.npz")],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-6000:]
        results[n] = json.loads(out.read_text())
    return results


def _max_difference(a: list, b: list) -> float:
    return max(float(np.max(np.abs(np.array(x) - np.array(y)))) for x, y in zip(a, b))


def test_the_distribution_reports_as_on_tensorflow(runs):
    for n, expected_devices in ((1, ["cpu:0"]), (2, ["cpu:0", "cpu:1"])):
        dist = runs[n]["distribution"]
        assert runs[n]["keras_backend"] == dist["backend"] == "jax"
        assert dist["strategy"] == "DataParallel" and dist["devices"] == expected_devices
        assert (dist["replicas"], dist["global"], dist["per_replica"]) == (n, 16, 16 // n)
        assert f"global batch 16 = {16 // n} per replica x {n}" in dist["describe"]
        assert dist["config"]["num_replicas"] == n
    assert runs[2]["one_device"] == [["cpu:0"], 1]  # devices= takes keras' names
    assert runs[2]["tf_style_devices"] == ["cpu:0", "cpu:1"]  # and TensorFlow's
    assert runs[2]["with_form_replicas"] == 2
    assert runs[2]["warmup"] == pytest.approx(5e-3)


@pytest.mark.parametrize(
    ("case", "tolerance"),
    [("sgd", 1e-6), ("adam", 1e-6), ("accumulate", 1e-6), ("sync_bn", 1e-6), ("bfloat16", 2e-3)],
)
def test_one_and_two_devices_train_to_the_same_weights(runs, case, tolerance):
    assert _max_difference(runs[1]["trained"][case], runs[2]["trained"][case]) <= tolerance


def test_the_with_form_trains_as_the_decorator_does(runs):
    for n in (1, 2):
        assert _max_difference(runs[n]["trained"]["with_form"], runs[n]["trained"]["sgd"]) <= 1e-6
    assert (
        _max_difference(runs[1]["trained"]["with_form"], runs[2]["trained"]["with_form"]) <= 1e-6
    )


def test_an_image_folder_feeds_two_devices_as_one(runs):
    one, two = runs[1]["trained"]["image_folder"], runs[2]["trained"]["image_folder"]
    assert _max_difference(one, two) <= 1e-6
    assert _max_difference(one, runs[1]["trained"]["image_folder_start"]) > 1e-3  # it trained


def test_batch_norm_statistics_are_global_under_spmd(runs):
    """No sync_batch_norm needed: the moving statistics of 2 devices are one device's."""
    one, two = runs[1]["moving_statistics"], runs[2]["moving_statistics"]
    assert set(one) == set(two) and len(one) == 2
    assert _max_difference([one[p] for p in one], [two[p] for p in one]) <= 1e-6
    assert any("sync_batch_norm=True has nothing to do" in line for line in runs[2]["log"])


def test_evaluate_predict_and_throughput(runs):
    assert np.allclose(runs[1]["evaluate"], runs[2]["evaluate"], atol=1e-6, rtol=0)
    assert _max_difference(runs[1]["predict"], runs[2]["predict"]) <= 1e-6
    for n in (1, 2):
        keys = runs[n]["history_keys"]
        assert {"samples_per_sec", "samples_per_sec_per_replica", "step_time_ms"} <= set(keys)
        assert all(v > 0 for v in runs[n]["samples_per_sec"])


def test_what_has_no_jax_meaning_is_refused_before_any_step(runs):
    errors = runs[2]["errors"]
    for case in ("nccl", "multi_worker", "tf_config"):
        kind, message = errors[case]
        assert kind == "ValueError" and "no meaning on Keras' JAX backend" in message, case
    assert "cross_device_ops='nccl'" in errors["nccl"][1]
    assert "TF_CONFIG=set" in errors["tf_config"][1]
    assert errors["unknown_device"][0] == "ValueError" and "'gpu:7'" in errors["unknown_device"][1]
    kind, message = errors["simulate_late"]
    assert kind == "RuntimeError" and "after JAX initialised its devices" in message
    kind, message = errors["tf_strategy"]
    assert kind == "ValueError" and "runs on Keras' TensorFlow backend only" in message
    kind, message = errors["outside"]
    assert kind == "ValueError" and "not replicated over the devices" in message
    kind, message = runs[2]["uneven_evaluate"]
    assert kind == "ValueError" and "holds 13 samples" in message
    assert runs[1]["uneven_evaluate"] is None  # one device takes any batch
