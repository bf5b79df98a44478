"""benchmarks/gpu_selftest_jax.py in its quick (CPU) mode, with TensorFlow hidden as on the
GPU machine: every section runs and its figures are measured, not made up.

Two children on `KERAS_BACKEND=jax` (forked from the tests' JAX zygote, which imported no
TensorFlow), started together: the self-test, and a
reference that builds the same two models through the public API and counts their FLOPs
with `kmk.count_training_flops`. Nothing here depends on how fast the machine is.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import textwrap

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

SCRIPT = REPO / "benchmarks" / "gpu_selftest_jax.py"

# The same models as the quick mode builds (its Sizes.QUICK): the CNN in float32 at batch
# 16, the residual stand-in for ResNet-50 in mixed bfloat16 at batch 8.
REFERENCE = textwrap.dedent(
    """
    import importlib.util, json, sys
    sys.modules["tensorflow"] = None
    import keras_mirror_kit as kmk
    spec = importlib.util.spec_from_file_location("selftest", sys.argv[1])
    selftest = sys.modules["selftest"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(selftest)

    def count(factory, batch, policy):
        @kmk.distributed(global_batch_size=batch, mixed_precision=policy)
        def build():
            model = factory()
            model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
            return model

        return kmk.count_training_flops(build()).flops_per_sample

    print(json.dumps({
        "cnn": count(kmk.models.tutorial_cnn, 16, None),
        "resnet50": count(lambda: selftest.small_resnet(16), 8, "mixed_bfloat16"),
    }))
    """
)


def positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


@pytest.fixture(scope="module")
def selftest(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu-selftest-jax") / "figures.json"
    env = {k: v for k, v in os.environ.items() if k not in ("KMK_SIMULATE_REPLICAS", "XLA_FLAGS")}
    env.update(PYTHONPATH=str(REPO), KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="2")
    # XLA's CPU code generation unoptimized: compiles in half the time; the same FLOP counts
    # (XLA counts them before code generation), and no figure here is judged by its speed.
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"
    command = [sys.executable, str(SCRIPT), "--quick", "--hide-tensorflow", "--json", str(out)]
    # A budget no run reaches (the test's own timeout bounds it): every section must run,
    # however slow the machine (a budget skip is a failure here).
    run = forkserver.popen(
        [*command, "--budget-s", "36000"], cwd=REPO, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        reference = forkserver.run(
            [sys.executable, "-c", REFERENCE, str(SCRIPT)], cwd=REPO, env=env, text=True,
            capture_output=True, timeout=600,
        )  # fmt: skip
        stdout, stderr = run.communicate(timeout=900)
    finally:
        if run.poll() is None:  # the reference or the wait failed: reap it
            run.kill()
            run.communicate()
    assert reference.returncode == 0, reference.stderr[-4000:]
    assert run.returncode == 0, stdout + stderr[-6000:]
    lines = stdout.splitlines()
    result_lines = [line for line in lines if line.startswith("RESULT ")]
    assert len(result_lines) == 1, stdout
    result = json.loads(result_lines[0][len("RESULT ") :])
    assert json.loads(out.read_text()) == result  # --json holds the same figures
    return {
        "result": result,
        "lines": lines,
        "stderr": stderr,
        "flops": json.loads(reference.stdout.strip().splitlines()[-1]),
    }


def test_every_section_ran_on_jax_without_tensorflow(selftest):
    result, lines = selftest["result"], selftest["lines"]
    assert lines[0].startswith("gpu_selftest_jax: 0 GPU(s); JAX ") and "quick mode" in lines[0]
    assert result["mode"] == "quick" and result["tensorflow_imported"] is False
    assert "tensorflow: not imported" in lines
    for section in ("cnn", "resnet50", "monitor", "checkpoint"):
        assert section in result, result
        assert "skipped" not in result[section] and "failed" not in result[section], (
            result[section],
            selftest["stderr"][-4000:],
        )
    for prefix in (
        "peak: ",
        "cnn fp32 (batch 16): ",
        "pipeline cnn fp32: ",
        "resnet50 bf16 (batch 8): ",
        "pipeline resnet50 bf16: ",
        "monitor: ",
        "checkpoint: one save of ",
    ):
        assert sum(line.startswith(prefix) for line in lines) == 1, (prefix, lines)


@pytest.mark.parametrize(("section", "run"), [("cnn", "fp32"), ("resnet50", "bf16")])
def test_the_model_figures_are_measured_and_consistent(selftest, section, run):
    figures = selftest["result"][section]
    peak = selftest["result"]["peak_flops"]
    assert positive(peak)  # this CPU's matmul rate, measured at the start
    # XLA's count of the same model, counted again in another process.
    assert figures["flops_per_sample"] == selftest["flops"][section]
    assert 0 < figures["forward_flops_per_sample"] < figures["flops_per_sample"]
    summary = figures[run]
    for key in ("samples_per_sec", "step_time_ms", "flops_per_sec", "mfu", "measured_seconds"):
        assert positive(summary[key]), (key, summary)
    assert (
        summary["measured_steps"]
        == selftest["result"]["sizes"]["cnn_steps" if section == "cnn" else "resnet_steps"]
        - selftest["result"]["sizes"]["warmup"]
    )
    assert summary["flops_per_sec"] == pytest.approx(
        summary["samples_per_sec"] * figures["flops_per_sample"], rel=1e-6
    )
    assert summary["mfu"] == pytest.approx(summary["flops_per_sec"] / peak, rel=1e-6)
    pipeline = figures["pipeline"]
    produced = pipeline["produced_images_per_sec"]
    consumed = pipeline["consumed_images_per_sec"]
    fed = pipeline["fed_from_pipeline_samples_per_sec"]
    assert positive(produced) and positive(fed) and consumed == summary["samples_per_sec"]
    assert pipeline["keeps_up"] is (produced >= consumed and fed >= 0.9 * consumed)


def test_the_monitor_and_checkpoint_figures_are_measured(selftest):
    monitor = selftest["result"]["monitor"]
    assert positive(monitor["step_ms"])
    for key in ("hooks_us_per_step", "fit_us_per_step", "synchronous_dispatch_us_per_step"):
        assert finite(monitor[key]), (key, monitor)  # differences: noise may make them < 0
    checkpoint = selftest["result"]["checkpoint"]
    assert checkpoint["requested_mb"] == selftest["result"]["sizes"]["ckpt_mb"]
    # What was written to disk, read back from the directory after the save landed.
    assert checkpoint["written_mb"] >= checkpoint["variables_mb"] >= checkpoint["requested_mb"]
    assert positive(checkpoint["loop_s"]) and checkpoint["async_wait_s"] >= 0
    assert finite(checkpoint["sync_s"]) and finite(checkpoint["async_s"])  # both measured
    if checkpoint["sync_s"] > 0:
        ratio = checkpoint["async_s"] / checkpoint["sync_s"]
        assert checkpoint["ratio"] == pytest.approx(ratio)
        assert checkpoint["target_met"] is (ratio <= 0.10)
