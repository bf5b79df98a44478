"""`mid_epoch_skip`: whether a checkpoint written mid-epoch resumes exactly, case by case.

Direct unit tests on a checkpoint's metadata and a stand-in cursor (no training): the
end-to-end resumes are in `test_synced_checkpoint.py` and `test_resume_state.py`.
"""

from __future__ import annotations

import dataclasses

import pytest

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
