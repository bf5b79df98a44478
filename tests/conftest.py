"""Test bed: this pytest process has 2 logical CPU devices, configured once.

Logical devices must be configured before TensorFlow initialises, so it happens here, at
import, before any test module imports TensorFlow's runtime. Tests that need another layout
(1 device, or a fresh runtime) run in a subprocess through `tests/subproc.py`.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.pop("KMK_SIMULATE_REPLICAS", None)
os.environ.pop("TF_CONFIG", None)

import tensorflow as tf  # noqa: E402

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
