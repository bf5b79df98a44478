"""Test bed: this pytest process has 2 logical CPU devices, configured once, and no GPU.

Logical devices must be configured before TensorFlow initialises, so the session fixture
`tensorflow_test_bed` does it before the first test, when a collected module imported
TensorFlow (no test module may create a variable or run an op at import); this file itself
imports no TensorFlow. Tests that need another layout
(1 device, or a fresh runtime) run in a subprocess through `tests/subproc.py`.

GPUs are hidden (`CUDA_VISIBLE_DEVICES=-1`, inherited by every subprocess, and
`set_visible_devices` here), so the suite asserts the same device layouts on a GPU host as
on a laptop; what the kit does with GPUs is tested with fake device tables.
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["WANDB_MODE"] = "offline"  # also for users who export WANDB_MODE=online
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.pop("KMK_SIMULATE_REPLICAS", None)
os.environ.pop("TF_CONFIG", None)
for _name in [n for n in os.environ if n.startswith("SLURM_")]:  # the suite under srun too
    del os.environ[_name]
# A CPU roof a developer stored with `bench --roof` would add `mfu` to every monitor's logs.
os.environ["KMK_ROOF_FILE"] = os.path.join(tempfile.mkdtemp(prefix="kmk-roof-"), "roof.json")
os.environ["CUDA_VISIBLE_DEVICES"] = "-1"  # before TensorFlow loads CUDA; children inherit it
os.environ["HIP_VISIBLE_DEVICES"] = "-1"

import sys  # noqa: E402

import pytest  # noqa: E402

LOGICAL_CPUS = 2


def configure_tensorflow() -> None:
    """Hides the GPUs and splits the CPU into `LOGICAL_CPUS` logical devices (once)."""
    import tensorflow as tf

    if len(tf.config.get_logical_device_configuration(_cpu(tf)) or []) == LOGICAL_CPUS:
        return
    try:
        tf.config.set_visible_devices([], "GPU")
        tf.config.set_logical_device_configuration(
            _cpu(tf), [tf.config.LogicalDeviceConfiguration()] * LOGICAL_CPUS
        )
    except RuntimeError as err:
        raise RuntimeError(
            "TensorFlow was initialised before the test bed could split the CPU: a test "
            "module creates a variable or runs an op at import (make it in a fixture)"
        ) from err


def _cpu(tf):
    return tf.config.list_physical_devices("CPU")[0]


@pytest.fixture(scope="session", autouse=True)
def tensorflow_test_bed():
    """The 2 logical CPU devices, before the first test, when a collected test module
    imported TensorFlow (session scope: before any module- or class-scoped fixture).

    Tests that import no TensorFlow (the pure modules: validation, checkpoint metadata,
    launch options) never load it, so they run in seconds alone.
    """
    if "tensorflow" in sys.modules:
        configure_tensorflow()
