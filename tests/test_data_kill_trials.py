"""SIGKILLed file-source jobs resume exactly (image folder and TFRecords, both save modes).

Three seeded trials here (seed 20261202): the image-folder job killed with synchronous and
with asynchronous saves, the TFRecord job with asynchronous ones; `python
benchmarks/data_sigkill_trials.py` runs ten per job and save mode. Two uninterrupted runs
of the augmented image job must be equal (deterministic augmentation), and every resumed
run must equal the uninterrupted one.
"""

from __future__ import annotations

import pytest

from tests.data_kill_trials import check_trial, kill_points, run_trials

pytestmark = pytest.mark.slow  # every test here starts children or trains for long

SEED = 20261202


@pytest.mark.timeout(900)
def test_sigkilled_file_jobs_resume_to_the_uninterrupted_weights(tmp_path):
    steps = kill_points(3, SEED)
    plans = {
        "images": {"trials": [(steps[0], False), (steps[1], True)], "twice": True},
        "records": {"trials": [(steps[2], True)]},
    }
    result = run_trials(tmp_path, plans)
    assert result["images"]["uninterrupted_diff"] == 0.0  # augmentation identical run to run
    for job, plan in plans.items():
        assert len(result[job]["resumed"]) == len(plan["trials"])
        for resumed in result[job]["resumed"]:
            check_trial(resumed)
