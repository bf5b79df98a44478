"""`kmk.check_replicas`: the user's own model, trained on one replica and on N, compared.

* `runner`: `check_replicas`, run in the calling process: it finds the factory and data,
  chooses the replica layout and starts the child process.
* `child`: the child process, where both runs train (`python -m
  keras_mirror_kit.replica_check.child JOB_DIR`).
* `samples`: the samples both runs train on, and the global batch size.
* `causes`: the known causes of a difference found in the model and in the N-replica run.
* `record`: `ReplicaCheck`, what the check found, and the comparison behind it.
* `specs`: finding a factory or data again by name in the child.
"""

from __future__ import annotations

from keras_mirror_kit.replica_check.record import ReplicaCause, ReplicaCheck, VariableDifference
from keras_mirror_kit.replica_check.runner import DEFAULT_TOLERANCE, check_replicas

__all__ = [
    "DEFAULT_TOLERANCE",
    "ReplicaCause",
    "ReplicaCheck",
    "VariableDifference",
    "check_replicas",
]
