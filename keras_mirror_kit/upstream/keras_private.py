"""Keras' private symbols the kit reads, wraps or patches, resolved for every tested version.

Each function imports lazily and tries the layouts of the Keras releases the kit was tested
on (`keras_mirror_kit.upstream.versions.TESTED_KERAS`), newest first. Where a symbol is on
none of them it raises `ImportError` naming the symbol and the installed Keras, and the
caller's protection refuses its feature (never a silent fallback). The renames known today:

* Keras 3.16 renamed `trainers.trainer.Trainer` to `BaseTrainer` and
  `backend.tensorflow.trainer.TensorFlowTrainer` to `Trainer`;
* Keras 3.12 renamed `utils.image_dataset_utils.load_image` to `_load_image_tf` and
  `utils.text_dataset_utils.path_to_string_content` to `_path_to_string_content_tf`;
* Keras 3.16 takes the epoch in `PyDatasetEnqueuer.start(epoch)` (`start_enqueuer`).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from types import ModuleType
from typing import Any

__all__ = [
    "base_trainer",
    "batch_end_reports_first_step",
    "can_convert_arrays",
    "data_adapter_utils",
    "dataset_utils",
    "distribution_class",
    "draw_seed",
    "first_step_iterator",
    "generator_data_adapter",
    "global_seed_generator",
    "global_state",
    "image_utils",
    "is_remote_path",
    "keras_mask",
    "last_step_of_execution",
    "load_image",
    "loss_module",
    "optimizer_built_for",
    "path_to_string_content",
    "py_dataset_adapter",
    "py_dataset_shuffles_by_epoch",
    "seed_generator_class",
    "squeeze_or_expand_to_same_rank",
    "standardize_data_format",
    "start_enqueuer",
    "tensorflow_backend",
    "tensorflow_random",
    "tensorflow_trainer",
    "tensorflow_trainer_module",
    "tf_optimizer",
]


def _first(*candidates: tuple[str, str | None]) -> Any:
    """The first `(module, attribute)` that imports (attribute None: the module itself)."""
    tried = []
    for module_name, attribute in candidates:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            tried.append(module_name)
            continue
        if attribute is None:
            return module
        if hasattr(module, attribute):
            return getattr(module, attribute)
        tried.append(f"{module_name}.{attribute}")
    import keras

    raise ImportError(
        f"keras-mirror-kit: Keras {keras.__version__} has none of {', '.join(tried)}, which "
        "the kit reads; see docs/support.md for the versions it was tested on"
    )


def base_trainer() -> type:
    """Keras' backend-independent trainer class (`BaseTrainer` from 3.16, `Trainer` before)."""
    return _first(
        ("keras.src.trainers.trainer", "BaseTrainer"), ("keras.src.trainers.trainer", "Trainer")
    )


def tensorflow_trainer_module() -> ModuleType:
    """Keras' `backend.tensorflow.trainer` module."""
    return _first(("keras.src.backend.tensorflow.trainer", None))


def tensorflow_trainer() -> type:
    """Keras' TensorFlow trainer class (`Trainer` from 3.16, `TensorFlowTrainer` before)."""
    module = tensorflow_trainer_module()
    found = getattr(module, "TensorFlowTrainer", None)
    if found is None:
        found = getattr(module, "Trainer", None)
    if not isinstance(found, type) or not issubclass(found, base_trainer()):
        return _first(("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer"))
    return found


def first_step_iterator(epoch_iterator: Any) -> Any:
    """The data iterator of the first step of `fit`'s epoch iterator, as Keras'
    `_maybe_symbolic_build` takes it: the last item of what the epoch iterator yields
    (`(step, iterator)` before Keras 3.11, `(begin, end, iterator)` from 3.11); None when
    it yields no step (Keras then builds without a batch)."""
    for item in epoch_iterator:
        return item[-1]
    return None


@functools.cache
def batch_end_reports_first_step() -> bool:
    """Whether Keras reports an execution's *first* step at `on_*_batch_end` (Keras 3.10),
    not its last (3.11 and later), with `steps_per_execution > 1`."""
    try:
        source = inspect.getsource(_first(("keras.src.trainers.epoch_iterator", None)))
    except (ImportError, OSError, TypeError):
        from keras_mirror_kit.upstream import versions

        return versions.keras_version_in(((3, 0, 0), (3, 11, 0)))
    return "end_step" not in source and "steps_per_execution - 1" not in source


def last_step_of_execution(batch: int, steps_per_execution: Any) -> int:
    """The index of the last step of the execution Keras reports as `batch` at a batch end
    (Keras 3.10 reports its first step: `batch + steps_per_execution - 1` there); a
    `steps_per_execution` that is not a positive int (unset, a mock) counts as 1."""
    if not isinstance(steps_per_execution, int) or steps_per_execution <= 1:
        return int(batch)
    if batch_end_reports_first_step():
        return int(batch) + steps_per_execution - 1
    return int(batch)


def tf_optimizer() -> type:
    """Keras' TensorFlow optimizer base class (`TFOptimizer`)."""
    return _first(("keras.src.backend.tensorflow.optimizer", "TFOptimizer"))


def data_adapter_utils() -> ModuleType:
    """Keras' `trainers.data_adapters.data_adapter_utils` (`unpack_x_y_sample_weight`)."""
    return _first(("keras.src.trainers.data_adapters.data_adapter_utils", None))


def py_dataset_adapter() -> type:
    """Keras' `PyDatasetAdapter`."""
    return _first(("keras.src.trainers.data_adapters.py_dataset_adapter", "PyDatasetAdapter"))


def generator_data_adapter() -> type:
    """Keras' `GeneratorDataAdapter`."""
    return _first(
        ("keras.src.trainers.data_adapters.generator_data_adapter", "GeneratorDataAdapter")
    )


@functools.cache
def py_dataset_shuffles_by_epoch() -> bool:
    """Whether Keras shuffles a `PyDataset`'s batches with `random.Random(epoch)` (Keras
    3.16), not with Python's global `random.shuffle` (3.15 and older)."""
    source = inspect.getsource(py_dataset_adapter()._finite_generator)  # noqa: SLF001
    return "random.Random(" in source


def start_enqueuer(enqueuer: Any, epoch: int) -> None:
    """`enqueuer.start(epoch)` where Keras takes the epoch (3.16), else `enqueuer.start()`."""
    try:
        takes_epoch = "epoch" in inspect.signature(enqueuer.start).parameters
    except (TypeError, ValueError):
        takes_epoch = False
    if takes_epoch:
        enqueuer.start(epoch)
    else:
        enqueuer.start()


def can_convert_arrays() -> Any:
    """Keras' test for the data its `ArrayDataAdapter` batches, or None where it is not."""
    try:
        return _first(
            ("keras.src.trainers.data_adapters.array_data_adapter", "can_convert_arrays")
        )
    except ImportError:
        return None


def keras_mask(tensor: Any) -> Any:
    """The Keras mask attached to `tensor` (`backend.common.masking.get_keras_mask`), or None."""
    try:
        get = _first(
            ("keras.src.backend.common.masking", "get_keras_mask"),
            ("keras.src.backend", "get_keras_mask"),
        )
    except ImportError:
        return getattr(tensor, "_keras_mask", None)
    return get(tensor)


def squeeze_or_expand_to_same_rank(x1: Any, x2: Any) -> tuple[Any, Any]:
    """Keras' rank alignment of a mask and sample weights (`losses.loss`)."""
    return _first(("keras.src.losses.loss", "squeeze_or_expand_to_same_rank"))(x1, x2)


def loss_module() -> ModuleType:
    """Keras' `losses.loss` module (`scale_loss_for_distribution`, ...)."""
    return _first(("keras.src.losses.loss", None))


def tensorflow_random() -> ModuleType:
    """Keras' TensorFlow random module (`backend.tensorflow.random`)."""
    return _first(("keras.src.backend.tensorflow.random", None))


def tensorflow_backend() -> ModuleType:
    """Keras' TensorFlow backend package (`backend.tensorflow`)."""
    return _first(("keras.src.backend.tensorflow", None))


def draw_seed(seed: Any) -> Any:
    """Keras' `random.seed_generator.draw_seed`."""
    return _first(("keras.src.random.seed_generator", "draw_seed"))(seed)


def seed_generator_class() -> type:
    """Keras' `SeedGenerator` class (the one `keras.random.SeedGenerator` names)."""
    return _first(("keras.src.random.seed_generator", "SeedGenerator"))


def global_seed_generator() -> Any:
    """Keras' global seed generator (created on first use)."""
    return _first(("keras.src.random.seed_generator", "global_seed_generator"))()


def global_state() -> ModuleType:
    """Keras' `backend.common.global_state` module."""
    return _first(("keras.src.backend.common.global_state", None))


def optimizer_built_for(optimizer: Any) -> list[Any] | None:
    """The variables a built Keras optimizer was built to train (`build(variables)` keeps
    them as `_trainable_variables`, in every tested release), or None when it is not built
    or keeps no such list."""
    if not getattr(optimizer, "built", False):
        return None
    variables = getattr(optimizer, "_trainable_variables", None)
    return list(variables) if isinstance(variables, (list, tuple)) else None


def is_remote_path(path: str) -> bool:
    """Keras' test of a remote path (gs://, hdfs://, ...)."""
    return bool(_first(("keras.src.utils.file_utils", "is_remote_path"))(path))


def dataset_utils() -> ModuleType:
    """Keras' `utils.dataset_utils` (folder indexing and splits)."""
    return _first(("keras.src.utils.dataset_utils", None))


def image_utils() -> ModuleType:
    """Keras' `utils.image_utils` (`smart_resize`)."""
    return _first(("keras.src.utils.image_utils", None))


def standardize_data_format(data_format: str | None) -> str:
    """Keras' `backend.config.standardize_data_format`."""
    return _first(("keras.src.backend.config", "standardize_data_format"))(data_format)


def load_image() -> Any:
    """Keras' image loader of `image_dataset_from_directory` (`_load_image_tf` from 3.12,
    `load_image` before; the same arguments)."""
    return _first(
        ("keras.src.utils.image_dataset_utils", "_load_image_tf"),
        ("keras.src.utils.image_dataset_utils", "load_image"),
    )


def path_to_string_content() -> Any:
    """Keras' text reader of `text_dataset_from_directory` (`_path_to_string_content_tf`
    from 3.12, `path_to_string_content` before; the same arguments)."""
    return _first(
        ("keras.src.utils.text_dataset_utils", "_path_to_string_content_tf"),
        ("keras.src.utils.text_dataset_utils", "path_to_string_content"),
    )


def distribution_class() -> type:
    """Keras' `Distribution` base class (`distribution.distribution_lib`)."""
    return _first(("keras.src.distribution.distribution_lib", "Distribution"))
