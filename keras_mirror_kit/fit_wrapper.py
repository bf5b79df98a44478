"""The `fit`, `evaluate` and `predict` of a model the kit built, and the hooks they call.

`prepare_model` (`keras_mirror_kit.model_setup`) gives each model per-instance wrappers
(`install`) that, before any step:

* check the data (`keras_mirror_kit.fit_inputs`) and the step counts
  (`keras_mirror_kit.workarounds.keras_epoch_rounding`);
* batch in-memory arrays with the global batch size when no `batch_size` is given (Keras'
  default of 32 knows nothing of the replicas), and record the batch really used in the
  model's record (`batch_plan`, read by `ThroughputMonitor`);
* run the callbacks that add figures to `logs` first, so loggers listed before them still
  see their figures;
* evaluate every sample of a kit dataset given to `evaluate` or as `validation_data`,
  also of one that drops its last partial batch for training (`DatasetInfo.whole`; not on
  JAX, which refuses a last batch it cannot split over the replicas);
* key the order of a kit dataset's epoch on Keras' epoch number (`EpochOrder`), so epoch
  `e` sees the order of epoch `e` whatever else iterated the dataset before (Keras' own
  first-batch build, a peek, an `evaluate`) and whichever callbacks are listed;
* run the call the backend's way (`keras_mirror_kit.backends`): on TensorFlow, feeding the
  replicas a `make_dataset` dataset in its stored dtype when its `preprocess` runs on the
  replicas (`backends.tensorflow_preprocess`) and refusing XLA over several replicas;
  on JAX, under the model's `DataParallel` distribution.

Callbacks take part through `keras_mirror_kit.fit_hooks.FitHooks`, dispatched here after
the data checks (and before the backend may give Keras the data's replica twin).
"""

from __future__ import annotations

import functools
import inspect
import logging
import types
from typing import TYPE_CHECKING, Any

import keras

from keras_mirror_kit import backends
from keras_mirror_kit.data.info import dataset_info
from keras_mirror_kit.distribution import Distribution
from keras_mirror_kit.fit_arguments import KerasCall
from keras_mirror_kit.fit_hooks import dispatch, listed, order_callbacks
from keras_mirror_kit.fit_inputs import (
    BatchPlan,
    arrays_as_dataset,
    check_even_batches,
    check_input,
    check_training_split,
    dataset_cursor,
    is_array_data,
    plan_batches,
)
from keras_mirror_kit.learning_rate_callbacks import check_learning_rate_callbacks
from keras_mirror_kit.model_record import record_of
from keras_mirror_kit.tensorflow_objects import is_dataset
from keras_mirror_kit.workarounds.keras_epoch_rounding import check_step_arguments

if TYPE_CHECKING:
    from keras_mirror_kit.data.cursor import DatasetCursor

__all__ = ["EpochOrder", "batch_plan", "install"]

logger = logging.getLogger("keras_mirror_kit")


class EpochOrder(keras.callbacks.Callback):
    """Points the training dataset's cursor at Keras' epoch when each epoch begins.

    A kit dataset's cursor otherwise counts iterations, and Keras itself iterates the
    dataset once before the first epoch (to build the model from a batch). Listed first, so
    that `SyncedCheckpoint`, which sets the skip of a resumed epoch, runs after it.
    """

    def __init__(self, cursor: DatasetCursor) -> None:
        super().__init__()
        self.cursor = cursor

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.cursor.set(epoch)


def _orders_itself(x: Any) -> bool:
    """Data whose order Keras does not choose (and warns about when `shuffle=True`)."""
    return is_dataset(x) or isinstance(x, types.GeneratorType)


def _resumes_mid_epoch(callbacks: Any) -> bool:
    """Whether a callback resumes a kit dataset mid-epoch (`FitHooks.resumes_mid_epoch`)."""
    return any(getattr(c, "resumes_mid_epoch", False) is True for c in listed(callbacks))


def _with_epoch_order(callbacks: Any, x: Any) -> Any:
    cursor = dataset_cursor(x)
    if cursor is None or isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks
    return [EpochOrder(cursor), *listed(callbacks)]


# The argument of each method that is evaluated (every sample counts, none is trained).
_EVALUATED = {"fit": "validation_data", "evaluate": "x"}


def _whole(data: Any) -> Any:
    """A kit dataset that drops its last partial batch, as one that keeps it (evaluation)."""
    info = dataset_info(data)
    return info.whole() if info is not None and info.whole is not None else data


def batch_plan(model: Any) -> BatchPlan | None:
    """The batch the running `fit` of a model the kit prepared uses; None outside a `fit`."""
    record = record_of(model)
    return record.batch_plan if record is not None else None


_METHODS = (
    ("fit", ("steps_per_epoch", "validation_steps"), ("x", "validation_data")),
    ("evaluate", ("steps",), ("x",)),
    ("predict", (), ("x",)),
)


def install(model: Any, dist: Distribution) -> None:
    """Installs the checking `fit`, `evaluate` and `predict` wrappers on this instance."""
    record = record_of(model)
    assert record is not None, "register_model() runs before install()"
    backend = backends.current()
    for method_name, steps_args, data_args in _METHODS:
        original = getattr(model, method_name)
        signature = inspect.signature(original)

        def wrapper(
            *args: Any,
            _original: Any = original,
            _signature: inspect.Signature = signature,
            _method: str = method_name,
            _steps: tuple[str, ...] = steps_args,
            _data: tuple[str, ...] = data_args,
            **kwargs: Any,
        ) -> Any:
            call = KerasCall.read(_method, _signature, args, kwargs)
            if call is None:  # does not bind: the method's own error
                return _original(*args, **kwargs)
            given = call.arguments  # by Keras' names, whatever the override's signature
            evaluated = _EVALUATED.get(_method)
            if evaluated in given and not backend.SHARDS_EACH_BATCH:  # JAX: as it was given
                given[evaluated] = _whole(given[evaluated])
            for argument in _data:
                check_input(given.get(argument), dist, _method, argument)
            check_step_arguments(model, **{name: given.get(name) for name in _steps})
            if is_array_data(given.get("x")) and not given.get("batch_size"):
                given["batch_size"] = dist.global_batch_size  # not Keras' default of 32
            if "callbacks" in given and _method != "fit":  # fit's: ordered by dispatch
                given["callbacks"] = order_callbacks(given["callbacks"])
            if backend.SHARDS_EACH_BATCH:
                check_even_batches(given, dist, _method)
            elif _method == "fit":
                check_training_split(given, dist, backend.trains_exactly(model))
            if _method == "fit":
                check_learning_rate_callbacks(model, given.get("callbacks"), dist)
            if _method != "fit":
                with backend.call(model, dist.engine, _method, given):  # after the checks
                    call_args, call_kwargs = call.call()
                    return _original(*call_args, **call_kwargs)
            if not backend.SHARDS_EACH_BATCH and _resumes_mid_epoch(given.get("callbacks")):
                arrays_as_dataset(given, dist)  # arrays: the same batches, resumable
            if "shuffle" not in given and _orders_itself(given.get("x")):
                given["shuffle"] = False  # Keras would warn that it ignores shuffle=True
            callbacks = _with_epoch_order(given.get("callbacks"), given.get("x"))
            plan = plan_batches(
                given.get("x"),
                dist,
                batch_size=given.get("batch_size"),
                validation_split=given.get("validation_split") or 0.0,
                steps_per_epoch=given.get("steps_per_epoch"),
            )

            def run(
                callbacks: Any,
                _original: Any = _original,
                _method: str = _method,
                call: KerasCall = call,
            ) -> Any:
                call.arguments["callbacks"] = callbacks
                with backend.call(model, dist.engine, _method, call.arguments):
                    call_args, call_kwargs = call.call()
                    return _original(*call_args, **call_kwargs)

            previous, record.batch_plan = record.batch_plan, plan
            try:
                return dispatch(model, callbacks, given.get("x"), run)
            finally:
                record.batch_plan = previous

        object.__setattr__(model, method_name, functools.wraps(original)(wrapper))
