"""FLOPs on Keras' JAX backend (XLA's cost analysis) against the TensorFlow count.

The JAX side runs in a child (`tests/jax_tools_child.py`, forked from the tests' JAX zygote,
2 simulated CPU devices); the TensorFlow counts of the same models (`tests/flop_models.py`)
are made here.
Both count a multiply-add as 2 FLOPs and leave out the first layer's input gradient; XLA
also counts elementwise operations TensorFlow's statistics leave at 0 (ReLU and its
gradient), and only the multiply-adds inside the image of a 'same'-padded convolution.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

from keras_mirror_kit.throughput.flops import count_training_flops
from tests import forkserver
from tests.flop_models import flop_models
from tests.subproc import REPO

pytestmark = [
    pytest.mark.slow,  # a JAX child (or a module fixture running one) per module
    pytest.mark.skipif(
        importlib.util.find_spec("jax") is None,
        reason="jax is not installed (keras-mirror-kit[dev])",
    ),
]


@pytest.fixture(scope="module")
def jax_run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("jax-flops") / "result.json"
    env = {k: v for k, v in os.environ.items() if k not in ("KMK_SIMULATE_REPLICAS", "XLA_FLAGS")}
    env.update(PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="jax")
    proc = forkserver.run(
        [sys.executable, "-m", "tests.jax_tools_child", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def tf_counts() -> dict:
    return {name: count_training_flops(model) for name, model in flop_models().items()}


@pytest.mark.parametrize(
    ("name", "tolerance"),
    [("dense", 0.01), ("conv_valid", 0.02), ("tutorial_cnn", 0.02)],
)
def test_xla_counts_agree_with_the_tensorflow_count(jax_run, tf_counts, name, tolerance):
    jax_count, tf_count = jax_run["counts"][name], tf_counts[name]
    assert jax_run["keras_backend"] == "jax" and jax_count["counter"] == "xla"
    assert tf_count.counter == "tensorflow"
    assert jax_count["loss"] == tf_count.loss == "compiled"
    assert jax_count["flops"] == pytest.approx(tf_count.flops_per_sample, rel=tolerance)
    assert jax_count["forward"] == pytest.approx(tf_count.forward_flops_per_sample, rel=tolerance)


def test_a_multiply_add_is_two_flops_on_xla_too(jax_run):
    """Dense 64->32 (ReLU) -> 8: the matmuls are 2 FLOPs per multiply-add (forward, weight
    gradients, the second layer's input gradient); XLA adds its elementwise operations."""
    matmuls = 2 * (2 * 64 * 32) + 3 * (2 * 32 * 8)
    bias = 2 * (32 + 8)  # the adds and their gradients
    assert matmuls + bias < jax_run["counts"]["dense"]["flops"] < (matmuls + bias) * 1.03


def test_same_padding_counts_only_the_multiply_adds_inside_the_image(jax_run, tf_counts):
    # 3x3 'same' on 4x4: per axis the outputs see 2, 3, 3, 2 input positions (10 of 12).
    inside = 2 * (10 * 10) * 8 * 8  # forward multiply-adds x 2, 8 -> 8 channels
    assert jax_run["counts"]["conv_same"]["forward"] == inside
    assert tf_counts["conv_same"].forward_flops_per_sample == 2 * 16 * 9 * 8 * 8


def test_the_count_does_not_depend_on_the_distribution_or_dtype_policy(jax_run):
    bf16 = jax_run["distributed_bf16"]
    assert bf16["dtype"] == "bfloat16" and bf16["cached"]
    assert bf16["flops"] == pytest.approx(jax_run["counts"]["tutorial_cnn"]["flops"], rel=1e-3)


def test_throughput_monitor_reports_flops_and_mfu_on_jax(jax_run):
    history, flops = jax_run["history"], jax_run["dense_flops"]
    assert len(history["mfu"]) == 2
    for epoch, samples_per_sec in enumerate(history["samples_per_sec"]):
        assert history["flops_per_sec"][epoch] == pytest.approx(samples_per_sec * flops)
        assert history["flops_per_sec_per_replica"][epoch] == pytest.approx(
            samples_per_sec * flops / 2
        )
        # 2 simulated devices share one CPU: its peak counts once.
        assert history["mfu"][epoch] == pytest.approx(samples_per_sec * flops / 1.0e12)
    assert "flops_per_sec" in jax_run["history_without_peak"]
    assert "mfu" not in jax_run["history_without_peak"]
    assert any("no peak FLOP/s known" in line and "float32" in line for line in jax_run["log"])


def test_errors_on_jax_name_the_fix(jax_run):
    errors = jax_run["errors"]
    assert errors["lazy"][0] == "ValueError" and "not built yet" in errors["lazy"][1]
    kind, message = errors["unknown_shape"]
    assert kind == "ValueError" and "input_specs=[keras.KerasTensor" in message
    # Given as a KerasTensor: the Dense applies to each of 5 vectors.
    assert jax_run["given_specs"] == pytest.approx(5 * (2 * 2 * 64 * 8 + 2 * 8), rel=0.05)
