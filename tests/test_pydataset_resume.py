"""A `PyDataset` killed part-way through an epoch resumes at its batch
(`data.py_dataset_cursor`): the epoch's remaining batches in the saved order, later epochs
shuffled as the uninterrupted run's, plain Keras' weights and losses on 2 replicas; with
`steps_per_epoch` (Keras reads it itself) at the epoch's start.
"""

from __future__ import annotations

import pytest

import keras_mirror_kit as kmk
from tests.ckpt_helpers import StopAt
from tests.test_ecosystem_inputs import (
    BATCHES,
    TOLERANCE,
    TWO,
    Batches,
    _close,
    _kit_model,
    _model,
)

pytestmark = pytest.mark.slow  # kills and resumes fits on 2 replicas


@pytest.mark.parametrize("workers", [0, 2])
def test_a_killed_pydataset_fit_resumes_mid_epoch_on_plain_keras_batches(
    workers: int, tmp_path
) -> None:
    """A `PyDataset` (shuffled by `fit`, Keras' default) killed part-way through epoch 1 of 3
    on 2 replicas resumes at its batch: the epoch's remaining batches in the saved order,
    then epoch 2 shuffled as the uninterrupted run shuffled it (Python's `random` state is
    saved): weights and losses of plain Keras without a strategy."""

    def fit(model, directory=None, *extra):
        callbacks = [] if directory is None else [kmk.SyncedCheckpoint(directory, save_freq=1)]
        data = Batches(workers=workers)
        history = model.fit(data, epochs=3, verbose=0, callbacks=[*callbacks, *extra]).history
        return model, history["loss"]

    plain, plain_losses = fit(_model())
    with pytest.raises(KeyboardInterrupt):
        fit(_kit_model(TWO), tmp_path, StopAt(1, 1))  # after 2 of epoch 1's 4 batches
    checkpoint = kmk.SyncedCheckpoint(tmp_path, save_freq=1)
    resumed = _kit_model(TWO)
    history = resumed.fit(Batches(workers=workers), epochs=3, verbose=0,
                          callbacks=[checkpoint]).history  # fmt: skip
    assert (checkpoint.last_restored.meta.epoch, checkpoint.last_restored.meta.step) == (1, 2)
    assert int(resumed.optimizer.iterations.numpy()) == 3 * BATCHES  # no batch twice
    assert _close((plain.get_weights(), plain_losses[1:]), (resumed.get_weights(),
                  history["loss"])) <= TOLERANCE  # fmt: skip


def test_a_pydataset_fit_reads_itself_with_steps_per_epoch_resumes_at_the_epoch_start(
    tmp_path,
) -> None:
    """With `steps_per_epoch` Keras reads the `PyDataset` itself (its iterator runs across
    epochs): the kit does not order it, and a resume starts at the newest epoch boundary."""

    def fit(model, *extra):
        checkpoint = kmk.SyncedCheckpoint(tmp_path, save_freq=1)
        model.fit(Batches(), steps_per_epoch=BATCHES, epochs=3, verbose=0,
                  callbacks=[checkpoint, *extra])  # fmt: skip
        return checkpoint

    with pytest.raises(KeyboardInterrupt):
        fit(_kit_model(TWO), StopAt(1, 1))
    resumed = _kit_model(TWO)
    checkpoint = fit(resumed)
    assert checkpoint.last_restored.meta.epoch_end and checkpoint.last_restored.meta.epoch == 1
    assert int(resumed.optimizer.iterations.numpy()) == 3 * BATCHES
