"""TensorFlow's private modules and symbols the kit reads or patches, resolved in one place.

Each function imports lazily. Where a symbol is missing it raises `ImportError` naming it
and the installed TensorFlow, and the caller refuses its feature or, for an optional
speed-up (the two `tf.data` workarounds), leaves TensorFlow as it is and says so.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

__all__ = [
    "MULTI_DEVICE_ITERATOR_MODULE",
    "STRUCTURED_FUNCTION_MODULE",
    "eager_context",
    "flop_statistics",
    "import_module",
    "multi_worker_util",
    "op_determinism_enabled",
    "per_replica_spec",
    "silenced_deprecations",
    "slurm_cluster_resolver",
    "strategy_supports_no_merge_call",
]

#: `tf.data`'s wrapper of a dataset's functions (`tf_data_function_instantiation` patches it).
STRUCTURED_FUNCTION_MODULE = "tensorflow.python.data.ops.structured_function"
#: `tf.data`'s multi-device iterator (`tf_data_iterator_stall` patches it).
MULTI_DEVICE_ITERATOR_MODULE = "tensorflow.python.data.ops.multi_device_iterator_ops"


def import_module(name: str) -> ModuleType:
    """A TensorFlow private module by name, with an error that names the TensorFlow."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        import tensorflow as tf

        raise ImportError(
            f"keras-mirror-kit: TensorFlow {tf.__version__} has no {name}, which the kit "
            "reads; see docs/support.md for the versions it was tested on"
        ) from err


def _attribute(module: str, name: str) -> Any:
    found = getattr(import_module(module), name, None)
    if found is None:
        import tensorflow as tf

        raise ImportError(
            f"keras-mirror-kit: TensorFlow {tf.__version__} has no {module}.{name}, which "
            "the kit reads; see docs/support.md for the versions it was tested on"
        )
    return found


def per_replica_spec() -> type:
    """`tf.distribute`'s `PerReplicaSpec` (the element spec of a distributed dataset)."""
    return _attribute("tensorflow.python.distribute.values", "PerReplicaSpec")


def multi_worker_util() -> ModuleType:
    """`tensorflow.python.distribute.multi_worker_util` (`id_in_cluster`, `worker_count`)."""
    return import_module("tensorflow.python.distribute.multi_worker_util")


def eager_context() -> Any:
    """The eager context (its coordination-service key-value store)."""
    return _attribute("tensorflow.python.eager.context", "context")()


def flop_statistics() -> ModuleType:
    """TensorFlow's op registry with the FLOP statistics registered (`ops`), whose shape
    helper's deprecation warning is silenced."""
    ops = import_module("tensorflow.python.framework.ops")
    import_module("tensorflow.python.profiler.internal.flops_registry")  # registers them
    return ops


def silenced_deprecations() -> Any:
    """TensorFlow's context manager that silences its deprecation warnings."""
    return _attribute("tensorflow.python.util.deprecation", "silence")()


def op_determinism_enabled() -> bool:
    """Whether `tf.config.experimental.enable_op_determinism()` was called (TensorFlow then
    refuses `tf.timestamp()`), read from TensorFlow's config module (no public reader)."""
    return bool(_attribute("tensorflow.python.framework.config", "is_op_determinism_enabled")())


def slurm_cluster_resolver() -> ModuleType:
    """TensorFlow's Slurm cluster resolver module (`SlurmClusterResolver`,
    `expand_tasks_per_node`)."""
    return import_module("tensorflow.python.distribute.cluster_resolver.slurm_cluster_resolver")


def strategy_supports_no_merge_call() -> bool:
    """Whether the current strategy runs without `merge_call` (XLA on several devices)."""
    import tensorflow as tf

    return bool(tf.__internal__.distribute.strategy_supports_no_merge_call())
