"""Keras' learning-rate callbacks beside the kit's scaled rates and schedules, checked at `fit`.

`keras.callbacks.ReduceLROnPlateau` and `keras.callbacks.LearningRateScheduler` set the
optimizer's learning rate. On an optimizer that follows a `LearningRateSchedule` (the kit's
`WarmupSchedule`) Keras cannot set it and fails with a `TypeError` after the first epoch's
work; the kit refuses the pair before any step, with what to write instead. A
`LearningRateScheduler` on several replicas sets the rates its function returns, as
written: a function written for one device replaces the rate the kit scaled for the global
batch (`kmk.scale_learning_rate`) with an unscaled one, so the kit says so once, at
WARNING, with how to scale it.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import keras

from keras_mirror_kit.distribution import Distribution
from keras_mirror_kit.fit_hooks import listed
from keras_mirror_kit.workarounds import inner_optimizer

__all__ = ["check_learning_rate_callbacks"]

logger = logging.getLogger("keras_mirror_kit")

_SETTERS = (keras.callbacks.ReduceLROnPlateau, keras.callbacks.LearningRateScheduler)
_warned: weakref.WeakSet[Any] = weakref.WeakSet()  # the schedulers already said


def check_learning_rate_callbacks(model: Any, callbacks: Any, dist: Distribution) -> None:
    """Refuses a learning-rate callback on a scheduled rate; warns once for an unscaled one.

    Raises `ValueError` before any step when a `ReduceLROnPlateau` or
    `LearningRateScheduler` is given to the `fit` of a model whose optimizer follows a
    `LearningRateSchedule`.
    """
    setters = [c for c in listed(callbacks) if isinstance(c, _SETTERS)]
    if not setters:
        return
    optimizer = inner_optimizer(getattr(model, "optimizer", None))
    rate = getattr(optimizer, "_learning_rate", None)
    names = ", ".join(type(c).__name__ for c in setters)
    if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
        raise ValueError(
            f"fit() of {model.name!r} was given {names}, which sets the optimizer's learning "
            f"rate, but the optimizer follows a {type(rate).__name__}, whose rate Keras "
            "cannot set: Keras would fail after the first epoch's work. Either keep the "
            "schedule and drop the callback (a WarmupSchedule's `after=` takes another "
            "schedule, such as keras.optimizers.schedules.ExponentialDecay, for what comes "
            "after the warmup), or compile with a float learning rate (the kit's scaled "
            "rate, kmk.current().scale_learning_rate(...)) and keep the callback. "
            f"Received: callbacks=[{names}], learning_rate={type(rate).__name__}"
        )
    schedulers = [c for c in setters if isinstance(c, keras.callbacks.LearningRateScheduler)]
    if dist.num_replicas > 1 and schedulers and schedulers[0] not in _warned:
        _warned.add(schedulers[0])
        logger.warning(
            "keras-mirror-kit: LearningRateScheduler sets each epoch's learning rate to what "
            "its function returns, as written: on %d replicas (global batch %d) a function "
            "written for one device replaces the rate the kit scaled with an unscaled one. "
            "Scale what it returns: LearningRateScheduler(lambda epoch, lr: "
            "dist.scale_learning_rate(f(epoch), base_batch_size=B)), with dist the "
            "model's kmk.distribution_of(model) and B the batch f was tuned at",
            dist.num_replicas,
            dist.global_batch_size,
        )
