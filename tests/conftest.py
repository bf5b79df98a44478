"""Test bed: this pytest process has 2 logical CPU devices, configured once, and no GPU.

Logical devices must be configured before TensorFlow initialises, so it happens here, at
import, before any test module imports TensorFlow's runtime. Tests that need another layout
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

import tensorflow as tf  # noqa: E402

tf.config.set_visible_devices([], "GPU")
_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
