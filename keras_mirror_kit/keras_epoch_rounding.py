"""Workaround for a Keras 3 bug: epochs rounded up to a multiple of `steps_per_execution`.

Keras' `compile()` documents that an execution "is truncated to the size of the epoch", but
the TensorFlow trainer's epoch loop (`EpochIterator._enumerate_iterator`, `range(0,
steps_per_epoch, steps_per_execution)`) runs whole executions: measured with Keras 3.15.1,
`fit(repeated_dataset, steps_per_epoch=10, epochs=2)` with `steps_per_execution=4` runs 12
steps per epoch (24 optimizer steps instead of 20). With a finite dataset and no
`steps_per_epoch` the count is right, because the last execution stops where the data ends.
No upstream report was found (keras-team/keras issues searched on 2026-11-29); the closest
documentation is the `steps_per_execution` entry of `Trainer.compile`.

Mechanism, the least invasive that works: correcting the count would mean replacing Keras'
epoch loop, so instead `fit()` of a model built by `distributed()` rejects the combination
with a clear error before any step (a per-instance wrapper: no Keras class or module is
patched, and models the kit did not build are untouched). Tested on Keras 3.15;
`tests/test_knobs.py::test_keras_still_rounds_epochs_up` reproduces the bug with plain
Keras, so an upgrade that fixes it fails that test and the guard can be limited by version.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import keras

__all__ = ["check_fit_arguments", "install_fit_guard"]


def check_fit_arguments(model: keras.Model, steps_per_epoch: int | None) -> None:
    """Rejects a `steps_per_epoch` that Keras would round up.

    Args:
        model: The model about to be fit.
        steps_per_epoch: The `fit()` argument.

    Returns:
        None.

    Raises:
        ValueError: If `steps_per_epoch` is not a multiple of `model.steps_per_execution`.

    Example:

    ```python
    check_fit_arguments(model, steps_per_epoch=12)
    ```
    """
    per_execution = int(getattr(model, "steps_per_execution", 1) or 1)
    if steps_per_epoch and per_execution > 1 and steps_per_epoch % per_execution:
        lower = max(per_execution, steps_per_epoch - steps_per_epoch % per_execution)
        raise ValueError(
            f"steps_per_epoch={steps_per_epoch} is not a multiple of the model's "
            f"steps_per_execution={per_execution}: Keras 3 would run "
            f"{-(-steps_per_epoch // per_execution) * per_execution} steps per epoch instead "
            f"(see keras_mirror_kit.keras_epoch_rounding). Use a multiple, e.g. "
            f"steps_per_epoch={lower} or {lower + per_execution}. "
            f"Received: steps_per_epoch={steps_per_epoch}"
        )


def install_fit_guard(model: keras.Model) -> None:
    """Wraps `model.fit` (this instance only) with `check_fit_arguments`.

    Args:
        model: A model built by `distributed()`.

    Returns:
        None.

    Example:

    ```python
    install_fit_guard(model)
    ```
    """
    original = model.fit
    if getattr(original, "_kmk_guarded", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def fit(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind_partial(*args, **kwargs)
        check_fit_arguments(model, bound.arguments.get("steps_per_epoch"))
        return original(*args, **kwargs)

    fit._kmk_guarded = True  # type: ignore[attr-defined]
    object.__setattr__(model, "fit", fit)
