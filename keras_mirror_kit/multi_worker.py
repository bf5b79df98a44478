"""MultiWorkerMirroredStrategy support (placeholder; being implemented)."""

from __future__ import annotations

import json
import os
from typing import Any

import tensorflow as tf

__all__ = ["create_strategy", "tf_config_num_workers"]


def tf_config_num_workers() -> int:
    """Number of worker-type tasks (chief + worker) that TF_CONFIG describes; 0 if unset."""
    raw = os.environ.get("TF_CONFIG", "").strip()
    if not raw:
        return 0
    cluster = json.loads(raw).get("cluster", {})
    return len(cluster.get("chief", [])) + len(cluster.get("worker", []))


def create_strategy(
    cluster_resolver: Any = None, cross_device_ops: Any = "auto"
) -> tuple[tf.distribute.Strategy, str]:
    """Creates a MultiWorkerMirroredStrategy; returns it and the all-reduce name."""
    raise NotImplementedError("multi-worker support is being implemented")
