"""keras-mirror-kit: data-parallel Keras 3 training on every replica with one decorator.

```python
import keras_mirror_kit as kmk

@kmk.distributed(per_replica_batch_size=64)
def build_model(): ...
```

Importing the package is cheap: each public name is imported from its module on first use
(PEP 562), so the command line (`keras-mirror-kit --help`, `launch`) starts without
TensorFlow. `WarmupSchedule` is registered with Keras' serialization as soon as Keras is
imported, so a `.keras` file that uses it loads after a plain `import keras_mirror_kit`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.util
import logging
import sys
import types
from typing import TYPE_CHECKING, Any

from keras_mirror_kit._version import __version__

# The public names and their modules, listed once: static tools (type checkers, the API
# reference) read these imports, and `_LAZY` is read from them. `__all__` names the same
# (tests/test_packaging.py checks).
if TYPE_CHECKING:
    from keras_mirror_kit import datasets, models
    from keras_mirror_kit.backends import simulate_replicas
    from keras_mirror_kit.batch_norm import synchronize_batch_norm
    from keras_mirror_kit.callbacks import (
        ReplicaDivergenceError,
        SyncedCheckpoint,
        ThroughputMonitor,
    )
    from keras_mirror_kit.checkpoint.lock import CheckpointLockedError, StaleLockWarning
    from keras_mirror_kit.checkpoint.preemption import Preempted
    from keras_mirror_kit.checkpoint.restore import restore
    from keras_mirror_kit.checkpoint.store import (
        CheckpointError,
        CheckpointWriteError,
        CorruptCheckpointWarning,
    )
    from keras_mirror_kit.data.augment import random_crop_flip
    from keras_mirror_kit.data.cursor import DatasetCursor
    from keras_mirror_kit.data.folders import (
        image_dataset_from_directory,
        text_dataset_from_directory,
    )
    from keras_mirror_kit.data.info import cursor_of
    from keras_mirror_kit.data.pipeline import make_dataset
    from keras_mirror_kit.data.preprocess import preprocess_placement, rescale
    from keras_mirror_kit.data.records import tfrecord_dataset
    from keras_mirror_kit.devices import nccl_available
    from keras_mirror_kit.distributed import DistributedFactory, distributed
    from keras_mirror_kit.distribution import Distribution, current
    from keras_mirror_kit.model_record import distribution_of
    from keras_mirror_kit.multi_worker import PREEMPTED_EXIT_CODE
    from keras_mirror_kit.replica_check.record import ReplicaCheck
    from keras_mirror_kit.replica_check.runner import check_replicas
    from keras_mirror_kit.scaling import (
        global_batch_size,
        per_replica_batch_size,
        scale_learning_rate,
    )
    from keras_mirror_kit.schedules import WarmupSchedule
    from keras_mirror_kit.throughput.flops import count_training_flops
    from keras_mirror_kit.throughput.meter import ThroughputMeter

__all__ = [
    "CheckpointError",
    "CheckpointLockedError",
    "CheckpointWriteError",
    "CorruptCheckpointWarning",
    "DatasetCursor",
    "DistributedFactory",
    "Distribution",
    "PREEMPTED_EXIT_CODE",
    "Preempted",
    "ReplicaCheck",
    "ReplicaDivergenceError",
    "StaleLockWarning",
    "SyncedCheckpoint",
    "ThroughputMeter",
    "ThroughputMonitor",
    "WarmupSchedule",
    "check_replicas",
    "count_training_flops",
    "current",
    "cursor_of",
    "datasets",
    "distributed",
    "distribution_of",
    "global_batch_size",
    "image_dataset_from_directory",
    "make_dataset",
    "models",
    "nccl_available",
    "per_replica_batch_size",
    "preprocess_placement",
    "random_crop_flip",
    "rescale",
    "restore",
    "scale_learning_rate",
    "simulate_replicas",
    "synchronize_batch_norm",
    "text_dataset_from_directory",
    "tfrecord_dataset",
    "__version__",
]

# Modules that register objects with Keras' serialization when imported.
_KERAS_REGISTRATIONS = ("keras_mirror_kit.schedules",)


# Public names that are sub-packages or modules themselves (the others live in a module).
_SUBMODULES = frozenset({"datasets", "models"})


def _lazy_table() -> dict[str, str]:
    """Public name -> its module, read from the `TYPE_CHECKING` imports (the one list)."""
    import ast

    source = None
    with contextlib.suppress(Exception):  # no loader, or one without the source
        source = __loader__.get_source(__name__)  # type: ignore[name-defined]
    if source is None:
        raise ImportError(
            "keras_mirror_kit reads its public names from the source of its __init__.py, "
            "which this installation does not have (a bytecode-only or frozen copy). "
            "Reinstall it from the wheel or sdist (pip install keras-mirror-kit). "
            f"Received: __file__={globals().get('__file__')!r}"
        )
    tree = ast.parse(source)
    return {
        alias.name: f"{node.module}.{alias.name}"
        if alias.name in _SUBMODULES
        else str(node.module)
        for block in tree.body
        if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


_LAZY = _lazy_table()


def __getattr__(name: str) -> Any:
    """Imports a public name from its module on first use (PEP 562)."""
    module_name = _LAZY.get(name)
    if module_name is None:
        # A sub-module (`kmk.devices`, `kmk.callbacks`, ...), as an eager package would have.
        if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}"):
            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = module if name in _SUBMODULES else getattr(module, name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    """The module's names, the lazy ones included."""
    return sorted(set(globals()) | set(__all__))


def _register_with_keras() -> None:
    """Imports the modules that register objects with Keras (Keras is imported by now)."""
    for module_name in _KERAS_REGISTRATIONS:
        try:
            importlib.import_module(module_name)
        except Exception as err:  # never break the user's `import keras`
            logging.getLogger("keras_mirror_kit").debug(
                "keras-mirror-kit: could not register %s with Keras: %r", module_name, err
            )
    try:  # a Keras or TensorFlow outside the tested ranges is named once, here
        from keras_mirror_kit.upstream import versions

        versions.notice_untested("import")
    except Exception as err:  # never break the user's `import keras`
        logging.getLogger("keras_mirror_kit").debug("keras-mirror-kit: %r", err)


class _RegisterAfterKerasImport(importlib.abc.MetaPathFinder):
    """Runs `_register_with_keras` right after `keras` itself is first imported."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "keras":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # one shot; the look-up below must not find us
        spec = importlib.util.find_spec("keras")
        loader = getattr(spec, "loader", None)
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_then_register(module: Any) -> None:
            exec_module(module)
            _register_with_keras()

        loader.exec_module = exec_then_register  # type: ignore[union-attr]
        return spec


class _Package(types.ModuleType):
    """Keeps `kmk.distributed` the decorator when Python sets its module as an attribute."""

    def __setattr__(self, name: str, value: Any) -> None:
        if (
            isinstance(value, types.ModuleType)
            and name not in _SUBMODULES
            and _LAZY.get(name) == value.__name__
        ):
            value = getattr(value, name, value)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

if "keras" in sys.modules:
    _register_with_keras()
elif not any(isinstance(f, _RegisterAfterKerasImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterAfterKerasImport())
