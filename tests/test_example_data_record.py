"""The example's checkpoint directory resumes only on the data it was trained on."""

from __future__ import annotations

import json

import pytest

from tests.test_datasets_cifar10 import make_cifar, write_folder
from tests.test_example_and_cli import EXAMPLE, run

pytestmark = pytest.mark.slow  # every test here starts children or trains for long

SMALL = ["--epochs", "1", "--per-replica-batch-size", "16", "--output", "model.keras"]


def test_a_rerun_on_other_data_is_refused_before_training(tmp_path) -> None:
    folder = write_folder(tmp_path / "data", make_cifar().files)  # real format, 20 images
    ckpt = tmp_path / "ckpts"
    env = {"KMK_SIMULATE_REPLICAS": "1"}
    real = [EXAMPLE, "--data", "cifar10", "--data-dir", str(folder), *SMALL]
    first = run([*real, "--checkpoint-dir", str(ckpt)], tmp_path, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads((ckpt / "data_source.json").read_text()) == {"data": "cifar10"}
    trained = sorted(p.name for p in ckpt.iterdir())

    # What `--data auto` does offline: synthetic data, into the same directory.
    synthetic = [EXAMPLE, "--data", "synthetic", "--train-samples", "64", *SMALL]
    second = run([*synthetic, "--checkpoint-dir", str(ckpt)], tmp_path, env=env)
    assert second.returncode != 0
    assert (
        f"error: --checkpoint-dir {ckpt} holds checkpoints trained on real CIFAR-10, but this "
        "run uses synthetic CIFAR-shaped data (--seed 0)" in second.stderr
    ), second.stderr[-3000:]
    assert "Epoch 1/1" not in second.stdout + second.stderr  # refused before training
    assert sorted(p.name for p in ckpt.iterdir()) == trained  # nothing of the user's changed

    # The same data again resumes (the run had finished: nothing left to train).
    third = run([*real, "--checkpoint-dir", str(ckpt)], tmp_path, env=env)
    assert third.returncode == 0, third.stderr[-3000:]
    assert "Test accuracy:" in third.stdout
