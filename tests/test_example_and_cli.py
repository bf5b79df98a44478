"""The CIFAR-10 example and the `keras-mirror-kit` command line, run as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.subproc import REPO

EXAMPLE = str(REPO / "examples" / "cifar10_cnn.py")


def run(args, cwd, timeout=400, env=None):
    full_env = {k: v for k, v in os.environ.items() if k not in ("KMK_SIMULATE_REPLICAS",)}
    full_env.update(PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="2",
                    KERAS_HOME=str(cwd / "keras_home"), **(env or {}))
    return subprocess.run([sys.executable, *args], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


def test_example_help_lists_the_flags(tmp_path):
    proc = run([EXAMPLE, "--help"], tmp_path)
    assert proc.returncode == 0
    for flag in ("--epochs", "--per-replica-batch-size", "--learning-rate", "--lr-rule",
                 "--warmup-epochs", "--data", "--data-dir", "--checkpoint-dir",
                 "--simulate-replicas", "--wandb", "--output"):
        assert flag in proc.stdout


def test_example_offline_trains_on_synthetic_data_loudly_and_saves(tmp_path):
    proc = run([EXAMPLE, "--epochs", "2", "--simulate-replicas", "2", "--train-samples", "4096",
                "--warmup-epochs", "0.5", "--output", "out/model.keras"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    loud = [line for line in proc.stderr.splitlines() if "SYNTHETIC" in line]
    assert len(loud) == 1 and "real data unavailable" in loud[0]
    assert "2 replicas" in proc.stderr and "global batch 128 = 64 per replica x 2" in proc.stderr
    accuracy = float(proc.stdout.split("Test accuracy: ")[1].split("%")[0])
    assert accuracy > 25.0  # chance is 10%
    assert (tmp_path / "out" / "model.keras").exists()
    assert (tmp_path / "cifar10_checkpoints" / "manifest.json").exists()
    assert "samples_per_sec" in proc.stdout  # Keras' progress line shows the monitor's logs
    import keras

    import keras_mirror_kit  # noqa: F401  (registers WarmupSchedule for loading)

    model = keras.saving.load_model(tmp_path / "out" / "model.keras")
    assert [type(layer).__name__ for layer in model.layers] == [
        "Conv2D", "MaxPooling2D", "Flatten", "Dense", "Dense"]
    # A rerun resumes from the checkpoint: nothing left to train, same accuracy.
    again = run([EXAMPLE, "--epochs", "2", "--simulate-replicas", "2", "--train-samples", "4096",
                 "--warmup-epochs", "0.5", "--output", "out/model.keras"], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stderr and "(epoch 2, batch 0" in again.stderr
    assert float(again.stdout.split("Test accuracy: ")[1].split("%")[0]) == pytest.approx(
        accuracy, abs=0.01)


def test_example_refuses_to_stand_in_synthetic_for_real_data(tmp_path):
    proc = run([EXAMPLE, "--data", "cifar10", "--data-dir", str(tmp_path / "nothing")], tmp_path)
    assert proc.returncode != 0
    assert "--data cifar10, but CIFAR-10 cannot be had" in proc.stderr
    assert "SYNTHETIC" not in proc.stderr


def test_example_reads_real_format_cifar10_from_data_dir(tmp_path):
    import numpy as np

    from tests.test_datasets_cifar10 import make_cifar, write_folder  # the real format

    folder = write_folder(tmp_path / "data", make_cifar().files)  # 20 train, 3 test images
    proc = run([EXAMPLE, "--data", "cifar10", "--data-dir", str(folder), "--epochs", "1",
                "--no-checkpoint", "--per-replica-batch-size", "16"], tmp_path,
               env={"KMK_SIMULATE_REPLICAS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SYNTHETIC" not in proc.stderr and "Test accuracy:" in proc.stdout
    assert np.isfinite(float(proc.stdout.split("(loss ")[1].split(")")[0]))


def test_cli_info_reports_versions_devices_and_choice(tmp_path):
    proc = run(["-m", "keras_mirror_kit.cli", "info", "--json"], tmp_path,
               env={"KMK_SIMULATE_REPLICAS": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads(proc.stdout)
    import keras
    import tensorflow as tf

    assert info["tensorflow"] == tf.__version__ and info["keras"] == keras.__version__
    assert info["physical_gpus"] == [] and info["nccl_usable"] is False
    assert info["would_choose"]["strategy"] == "MirroredStrategy"
    assert info["would_choose"]["replicas"] == 2
    assert info["would_choose"]["all_reduce"] == "reduction_to_one_device"
    assert info["tf_config"] is None
    text = run(["-m", "keras_mirror_kit.cli", "info"], tmp_path)
    assert text.returncode == 0 and "NCCL usable      no" in text.stdout
    assert "MirroredStrategy" in text.stdout


def test_cli_bench_prints_a_table_and_writes_json_and_plot(tmp_path):
    proc = run(["-m", "keras_mirror_kit.cli", "bench", "--replicas", "1,2",
                "--per-replica-batch-size", "32", "--steps", "12", "--json", "b.json",
                "--plot", "b.png"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[1/2] 1 replica(s)" in proc.stdout and "[2/2] 2 replica(s)" in proc.stdout
    assert "samples/s" in proc.stdout and "efficiency" in proc.stdout
    results = json.loads((tmp_path / "b.json").read_text())
    assert [r["replicas"] for r in results] == [1, 2]
    assert [r["global_batch_size"] for r in results] == [32, 64]
    for r in results:
        assert r["samples_per_sec"] > 0
        assert r["samples_per_sec_per_replica"] == pytest.approx(
            r["samples_per_sec"] / r["replicas"])
    assert results[0]["scaling_efficiency"] == pytest.approx(1.0)
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("replicas", ["0", "one", "1,,-2"])
def test_cli_bench_rejects_bad_replica_lists(tmp_path, replicas):
    proc = run(["-m", "keras_mirror_kit.cli", "bench", "--replicas", replicas], tmp_path)
    assert proc.returncode == 2 and "--replicas takes a comma-separated list" in proc.stderr
