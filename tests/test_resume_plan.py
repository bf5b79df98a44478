"""`mid_epoch_skip` and `fit_record`: whether a checkpoint resumes exactly, and whose it is.

Direct unit tests on a checkpoint's metadata and a stand-in cursor (no training): the
end-to-end resumes are in `test_synced_checkpoint.py` and `test_resume_state.py`.
"""

from __future__ import annotations

import dataclasses

import pytest

from keras_mirror_kit.checkpoint.fit_record import FitLedger, FitRecord, Placement, place
from keras_mirror_kit.checkpoint.meta import CheckpointMeta, DataDescription
from keras_mirror_kit.checkpoint.resume import mid_epoch_skip


@dataclasses.dataclass
class Cursor:
    """What `mid_epoch_skip` reads of a kit dataset's cursor."""

    num_batches: int = 6
    num_samples: int | None = 96
    seed: int = 11
    seed_given: bool = True


class Model:
    """A model the kit did not build: no global batch size to compare."""

    def __init__(self, steps_per_execution: int = 1) -> None:
        self.steps_per_execution = steps_per_execution


def _meta(step: int = 2, **data) -> CheckpointMeta:
    saved = {"epoch_length": 6, "seed": 11, "samples": 96, **data}
    return CheckpointMeta(epoch=1, step=step, data=DataDescription(**saved))


def test_the_same_data_resumes_after_the_batches_already_trained():
    assert mid_epoch_skip(_meta(step=2), Cursor(), Model()).skip == 2
    assert mid_epoch_skip(_meta(step=4), Cursor(), Model(steps_per_execution=2)).skip == 4


@pytest.mark.parametrize(
    ("meta", "cursor", "model", "reason", "changed"),
    [
        (_meta(), None, Model(), "SyncedCheckpoint was given no dataset=", False),
        (_meta(), Cursor(num_batches=5), Model(2), "5 batches per epoch is not a multiple", False),
        (_meta(), Cursor(num_samples=97), Model(), "holds 97 samples now but held 96", True),
        (_meta(), Cursor(num_batches=7), Model(), "holds 7 batches now but held 6", True),
        (_meta(), Cursor(seed=12), Model(), "seed 12 differs from the checkpoint's 11", True),
        (_meta(step=3), Cursor(), Model(2), "do not end on a steps_per_execution=2", False),
    ],
    ids=["no-dataset", "epoch-not-whole-executions", "samples", "epoch-length", "seed", "spe"],
)
def test_what_cannot_resume_exactly_says_why(meta, cursor, model, reason, changed):
    found = mid_epoch_skip(meta, cursor, model)
    assert found.skip is None
    assert reason in found.reason
    assert found.data_changed is changed


def test_a_seed_not_given_now_does_not_count_as_another_order():
    assert mid_epoch_skip(_meta(), Cursor(seed=12, seed_given=False), Model()).skip == 2


# -- fit_record: which fit() of a script a checkpoint belongs to ----------------------------


def test_a_process_numbers_its_fits_per_model_and_directory(tmp_path):
    ledger, model, other = FitLedger(), Model(), Model()
    first = ledger.starting(model, tmp_path, epochs=2)
    assert first == FitRecord(0, 2)
    assert ledger.starting(model, tmp_path, epochs=2) == first  # not completed: the same fit
    ledger.completed(model, tmp_path, first)
    assert ledger.starting(model, tmp_path, epochs=4) == FitRecord(1, 4, (2,))
    assert ledger.starting(model, tmp_path / "other", epochs=4) == FitRecord(0, 4)
    assert ledger.starting(other, tmp_path, epochs=4) == FitRecord(0, 4)
    # A fit that took a later stage's number goes on from it.
    ledger.completed(model, tmp_path, FitRecord(3, 4, (2, 2, 6)))
    assert ledger.starting(model, str(tmp_path), epochs=1) == FitRecord(4, 1, (2, 2, 6, 4))


STAGE_TWO = FitRecord(1, 4, (2,))  # stage 2 of fit(epochs=2); fit(epochs=4)


@pytest.mark.parametrize(
    ("saved", "starting", "epoch", "stopped", "placement"),
    [
        (None, FitRecord(0, 3), 1, False, Placement.OWN),  # a file from before records
        (None, FitRecord(2, 3), 1, True, Placement.OWN),
        (FitRecord(0, 3), FitRecord(0, 3), 1, False, Placement.OWN),
        (FitRecord(0, 3), FitRecord(0, 3), 1, True, Placement.STOPPED),
        (FitRecord(0, 3), FitRecord(0, 5), 1, True, Placement.OWN),  # other epochs now
        (FitRecord(0, 3), FitRecord(0, None), 1, True, Placement.OWN),
        (FitRecord(0, 2), STAGE_TWO, 2, False, Placement.EARLIER),
        # A full rerun: stage 1 finds stage 2's checkpoint and trains nothing...
        (STAGE_TWO, FitRecord(0, 2), 3, False, Placement.LATER),
        # ...and stage 2 rerun alone (it is fit 0 of the process now) takes it as its own.
        (STAGE_TWO, FitRecord(0, 4), 3, False, Placement.STAGE_ALONE),
        (STAGE_TWO, FitRecord(0, 5), 3, False, Placement.LATER),  # other epochs
        (STAGE_TWO, FitRecord(0, 4), 4, False, Placement.LATER),  # it had finished
        (STAGE_TWO, FitRecord(0, 4), 3, True, Placement.LATER),  # it had been stopped
        # Both stages fit(epochs=2): the script's fit 0 had these epochs, a full rerun.
        (FitRecord(1, 2, (2,)), FitRecord(0, 2), 1, False, Placement.LATER),
        # A checkpoint that records no script history: only the epochs tell.
        (FitRecord(1, 4), FitRecord(0, 4), 3, False, Placement.STAGE_ALONE),
    ],
)
def test_what_a_starting_fit_does_with_another_fits_checkpoint(
    saved, starting, epoch, stopped, placement
):
    assert place(saved, starting, epoch=epoch, stopped=stopped) is placement


def test_a_stage_rerun_alone_takes_the_stage_number_and_the_script_history():
    assert FitRecord(0, 4).as_stage_of(STAGE_TWO) == STAGE_TWO
    assert FitRecord(0, 4).as_stage_of(FitRecord(2, 4)) == FitRecord(2, 4, (None, None))


def test_the_record_reads_and_writes_the_keys_of_every_version():
    meta = CheckpointMeta(epoch=3, step=0, epoch_end=True, fit=STAGE_TWO)
    data = meta.to_json()
    assert (data["fit_index"], data["fit_epochs"], data["script_fit_epochs"]) == (1, 4, [2, 4])
    assert CheckpointMeta.from_json(data).fit == STAGE_TWO
    older = {**data, "fit_index": None, "fit_epochs": None, "script_fit_epochs": None}
    assert CheckpointMeta.from_json(older).fit is None  # read as the reading fit()'s own
    no_history = {**data, "script_fit_epochs": None}
    assert CheckpointMeta.from_json(no_history).fit == FitRecord(1, 4)
    with pytest.raises(ValueError, match="script_fit_epochs"):
        CheckpointMeta.from_json({**data, "script_fit_epochs": [2, 2.5]})
