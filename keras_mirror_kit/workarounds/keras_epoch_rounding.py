"""Workaround for a Keras 3 bug: epochs rounded up to a multiple of `steps_per_execution`.

Keras' `compile()` documents that an execution "is truncated to the size of the epoch", but
the TensorFlow trainer's epoch loop (`EpochIterator._enumerate_iterator`, `range(0,
steps_per_epoch, steps_per_execution)`) runs whole executions: measured with Keras 3.15.1,
`fit(repeated_dataset, steps_per_epoch=10, epochs=2)` with `steps_per_execution=4` runs 12
steps per epoch (24 optimizer steps instead of 20). The same loop serves evaluation, so
`evaluate(steps=10)` and `fit(validation_steps=10)` evaluate 12 batches. With a finite
dataset and no step count the count is right, because the last execution stops where the
data ends. No upstream report was found (keras-team/keras issues searched on 2026-11-29);
the closest documentation is the `steps_per_execution` entry of `Trainer.compile`.

Mechanism, the least invasive that works: correcting the count would mean replacing Keras'
epoch loop, so instead `fit()` and `evaluate()` of a model built by `distributed()` reject
the combination with a clear error before any step (`check_step_arguments`, called from the
per-instance method wrappers of `keras_mirror_kit.model_setup`: no Keras class or module is
patched for this, and models the kit did not build are untouched). Tested on Keras 3.15;
`tests/test_knobs.py::test_keras_still_rounds_epochs_up` reproduces the bug with plain
Keras, so an upgrade that fixes it fails that test and the guard can be limited by version.
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_step_arguments"]


def check_step_arguments(model: Any, **steps: int | None) -> None:
    """Rejects, with a `ValueError`, step counts Keras would round up (see the module docstring).

    `steps` are `steps_per_epoch=`, `validation_steps=` or `steps=` as given (None or 0: not
    given); each must be a multiple of `model.steps_per_execution`.
    """
    per_execution = int(getattr(model, "steps_per_execution", 1) or 1)
    if per_execution == 1:
        return
    for name, count in steps.items():
        if not count or count % per_execution == 0:
            continue
        lower = max(per_execution, count - count % per_execution)
        runs = "steps per epoch" if name == "steps_per_epoch" else "batches"
        raise ValueError(
            f"{name}={count} is not a multiple of the model's steps_per_execution="
            f"{per_execution}: Keras 3 would run {-(-count // per_execution) * per_execution} "
            f"{runs} instead (see keras_mirror_kit.workarounds.keras_epoch_rounding). Use a "
            f"multiple, e.g. {name}={lower} or {lower + per_execution}. Received: {name}={count}"
        )
