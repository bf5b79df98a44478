"""What the kit keeps about each model it built: one `ModelRecord`, held weakly.

Nothing is stamped on Keras objects. `distributed()` registers every model it builds here
(`register_model`); the fit wrapper, the `with` form and the callbacks read the record
through `record_of` and `distribution_of`. The map holds models weakly, so a model the user
drops is freed as before.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from keras_mirror_kit import backends
from keras_mirror_kit.distribution import Distribution, distributions_alive
from keras_mirror_kit.fit_inputs import BatchPlan

__all__ = [
    "ModelRecord",
    "distribution_of",
    "engine_of",
    "is_chief",
    "record_of",
    "register_model",
]


@dataclass(eq=False)
class ModelRecord:
    """A model the kit built: its distribution, whether it was prepared, the running batch."""

    distribution: Distribution
    prepared: bool = False  # checked and wrapped by `model_setup.prepare_model`
    batch_plan: BatchPlan | None = None  # the batch of the fit() in progress


_RECORDS: weakref.WeakKeyDictionary[Any, ModelRecord] = weakref.WeakKeyDictionary()


def register_model(model: Any, distribution: Distribution) -> ModelRecord:
    """The record of `model` (created on first registration), now naming `distribution`."""
    record = _RECORDS.get(model)
    if record is None:
        record = _RECORDS[model] = ModelRecord(distribution)
    record.distribution = distribution
    return record


def record_of(model: Any) -> ModelRecord | None:
    """The record `register_model` made for `model`, or None."""
    try:
        return _RECORDS.get(model)
    except TypeError:  # unhashable or not weak-referenceable
        return None


def distribution_of(model: Any) -> Distribution | None:
    """Returns the `Distribution` that built `model`, or None for a model the kit did not build.

    Args:
        model: A `keras.Model`.

    Returns:
        The `Distribution` registered by `distributed()` (a decorated factory, or a model
        built inside its `with` block), or None.

    Example:

    ```python
    dist = kmk.distribution_of(model)
    if dist is not None:
        batch = dist.global_batch_size
    ```
    """
    record = record_of(model)
    if record is not None:
        return record.distribution
    # Built inside `with kmk.distributed(...)` but not compiled there: the strategy Keras
    # captured names the distribution.
    strategy = getattr(model, "_distribute_strategy", None)
    if strategy is None:
        return None
    return next((d for d in distributions_alive() if d.strategy is strategy), None)


def engine_of(model: Any) -> backends.Engine:
    """The engine `model` trains under: its `Distribution`'s, else the backend's default."""
    dist = distribution_of(model)
    if dist is not None:
        return dist.engine
    return backends.current().engine_of_model(model)


def is_chief(model: Any) -> bool:
    """Whether this process writes checkpoints and logs for `model` (True on one process).

    The `Distribution` that built the model decides; for another model, its strategy's
    `extended.should_checkpoint`.
    """
    return engine_of(model).is_chief
