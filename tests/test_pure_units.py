"""Unit tests of Keras-free pieces, run without TensorFlow: keep_best's ranking and scores,
the preemption signals' parsing, the cluster's worker counts, the one "module:name" reader,
and the split arithmetic tf.distribute follows.

The module asserts at the end that importing what it tests loaded no TensorFlow, so these
stay fast (`python3 -m pytest tests/test_pure_units.py` alone takes about a second).
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import types

import pytest

from keras_mirror_kit.callbacks.keras_loop import steps_done
from keras_mirror_kit.checkpoint.best import BestKeeper, best_entries, check_best_args
from keras_mirror_kit.checkpoint.meta import ManifestEntry, Score
from keras_mirror_kit.checkpoint.preemption import parse_signals
from keras_mirror_kit.multi_worker import cluster
from keras_mirror_kit.named_objects import resolve
from keras_mirror_kit.workarounds import parse_version, version_in


def _entry(index: int, value: float | None, mode: str | None = "min", finite: bool = True):
    return ManifestEntry(
        file=f"ckpt-{index:08d}.npz",
        index=index,
        finite=finite,
        score=Score("val_loss", mode, value),
    )


def test_best_entries_rank_best_first_and_the_earliest_of_equal_scores_first():
    entries = [_entry(1, 0.5), _entry(2, 0.2), _entry(3, 0.2), _entry(4, 0.9)]
    assert [e.index for e in best_entries(entries, "val_loss")] == [2, 3, 1, 4]
    maximized = [_entry(i, v, mode="max") for i, v in ((1, 0.5), (2, 0.7), (3, 0.1))]
    assert [e.index for e in best_entries(maximized, "val_loss")] == [2, 1, 3]


def test_best_entries_leave_out_unscored_non_finite_and_other_metrics():
    entries = [
        _entry(1, None),  # not scored
        _entry(2, math.nan),  # not finite
        _entry(3, 0.4, finite=False),  # a state with NaN
        _entry(4, 0.3, mode=None),  # direction unknown
        ManifestEntry(file="ckpt-00000005.npz", index=5, score=Score("val_acc", "max", 0.9)),
        _entry(6, 0.8),
    ]
    assert [e.index for e in best_entries(entries, "val_loss")] == [6]


def test_best_keeper_scores_with_the_direction_it_resolves():
    keeper = BestKeeper("val_accuracy", "auto", keep_best=2)
    keeper.begin(lambda name: "max" if name == "accuracy" else None)
    assert keeper.score({"val_accuracy": 0.75}, epoch_end=True, epoch=0) == Score(
        "val_accuracy", "max", 0.75
    )
    losses = BestKeeper("val_loss", "auto", keep_best=1)
    losses.begin(lambda name: None)  # the losses are minimized without asking the model
    assert losses.score({"val_loss": 1.5}, epoch_end=True, epoch=0) == Score(
        "val_loss", "min", 1.5
    )
    assert BestKeeper("val_loss", "auto", keep_best=0).score({"val_loss": 1.0}, True, 0) is None


def test_best_keeper_warns_once_per_fit_for_a_missing_metric_and_refuses_an_unknown_direction():
    keeper = BestKeeper("val_auc", "auto", keep_best=1)
    keeper.begin(lambda name: None)
    with pytest.warns(UserWarning, match="can rank checkpoints only with 'val_auc'"):
        assert keeper.score({"loss": 1.0}, epoch_end=True, epoch=0) == Score("val_auc", None)
    with pytest.raises(ValueError, match="mode='max'"):
        keeper.score({"val_auc": 0.5}, epoch_end=True, epoch=1)


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (("", "auto", 1), ValueError),
        (("val_loss", "up", 1), ValueError),
        (("val_loss", "auto", -1), ValueError),
        (("val_loss", "auto", 1.5), TypeError),
    ],
)
def test_check_best_args_refuses_bad_arguments(args, error):
    with pytest.raises(error):
        check_best_args(*args)


def test_parse_signals_takes_numbers_and_names_in_order_without_repeats():
    parsed = parse_signals([signal.SIGTERM, "usr1", "SIGUSR2", int(signal.SIGTERM)])
    assert parsed == (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
    assert parse_signals(()) == ()


@pytest.mark.parametrize(
    ("signals", "error", "message"),
    [
        ("SIGTERM", TypeError, "list or tuple"),
        (15, TypeError, "list or tuple"),
        (["SIGNOPE"], ValueError, "unknown signal"),
        ([signal.SIGKILL], ValueError, "SIGKILL"),
        ([True], TypeError, "preemption_signals"),
    ],
)
def test_parse_signals_refuses_what_cannot_be_caught_or_named(signals, error, message):
    with pytest.raises(error, match=message):
        parse_signals(signals)


_SLURM = {
    "SLURM_PROCID": "1",
    "SLURM_STEP_NUM_TASKS": "3",
    "SLURM_STEP_NODELIST": "node[1-3]",
    "SLURM_STEP_TASKS_PER_NODE": "1(x3)",
}


def _tf_config(workers: int, index: int, chief: bool = False) -> str:
    jobs = {"worker": [f"127.0.0.1:{2000 + i}" for i in range(workers)]}
    if chief:
        jobs["chief"] = ["127.0.0.1:1999"]
    return json.dumps({"cluster": jobs, "task": {"type": "worker", "index": index}})


def test_cluster_place_reads_tf_config_first_then_the_slurm_step(monkeypatch):
    for name in (*_SLURM, "TF_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    assert cluster.cluster_place() == (0, None)
    assert cluster.tf_config_num_workers() == 0
    for name, value in _SLURM.items():
        monkeypatch.setenv(name, value)
    assert cluster.cluster_place() == (3, 1)
    monkeypatch.setenv("TF_CONFIG", _tf_config(2, 1, chief=True))
    assert cluster.cluster_place() == (3, 2)  # the chief is rank 0, worker 1 is rank 2
    assert cluster.tf_config_num_workers() == 3


def test_a_slurm_step_counts_only_with_every_variable_the_resolver_reads():
    assert cluster.slurm_num_tasks(_SLURM) == 3
    assert cluster.slurm_num_tasks({**_SLURM, "SLURM_STEP_NODELIST": " "}) == 0
    assert cluster.slurm_num_tasks({**_SLURM, "SLURM_STEP_NUM_TASKS": "three"}) == 0


def test_workers_of_a_strategy_count_only_a_multi_worker_one():
    multi = types.SimpleNamespace(extended=types.SimpleNamespace(_num_workers=4))
    single = types.SimpleNamespace(extended=types.SimpleNamespace())
    assert [cluster.strategy_workers(s) for s in (multi, single, None)] == [4, 1, 1]


def test_local_replicas_follow_the_live_setups_only():
    class Owner:
        pass

    owner = Owner()
    assert cluster.local_replicas(7) is None
    cluster.note_local_replicas(owner, 7, 3)
    assert cluster.local_replicas(7) == 3
    assert cluster.local_replicas(2) is None
    del owner  # a weak reference: a setup that is gone says nothing
    assert cluster.local_replicas(7) is None


def test_resolve_finds_module_and_file_names_and_says_what_was_wrong(tmp_path, monkeypatch):
    assert resolve("json:dumps", "model") is json.dumps
    assert resolve("os.path:join", "model", callable_only=True) is __import__("os").path.join
    script = tmp_path / "train.py"
    script.write_text(
        "RAN_AS_MAIN = []\n"
        "def build():\n    return 'model'\n"
        "class Zoo:\n    def make():\n        return 1\n"
        "if __name__ == '__main__':\n    RAN_AS_MAIN.append(1)\n    raise SystemExit(9)\n"
    )
    assert resolve(f"{script}:build", "model")() == "model"
    monkeypatch.chdir(tmp_path)
    assert resolve("train.py:Zoo.make", "model")() == 1
    assert resolve("train.py:build", "model") is resolve(f"{script}:build", "model")  # run once
    monkeypatch.setitem(sys.modules, "train", None)  # put back (removed) after the test
    del sys.modules["train"]
    assert resolve("train:RAN_AS_MAIN", "model") == []  # imported, its main block not run
    cases = [
        ("train", ValueError, r"must be 'module:name'.*Received: model='train'"),
        (":build", ValueError, "must be 'module:name'"),
        ("no_such_module_x:f", ValueError, "Cannot import the module 'no_such_module_x'"),
        ("missing.py:f", ValueError, "Cannot import.*FileNotFoundError"),
        ("train:nope", ValueError, "'train' has no attribute 'nope'"),
        ("train:RAN_AS_MAIN", ValueError, "not callable"),
        (3, TypeError, "must be a string"),
    ]
    for spec, error, message in cases:
        with pytest.raises(error, match=message):
            resolve(spec, "model", callable_only=True)


def test_version_ranges_compare_zero_filled_numbers_low_inclusive_high_exclusive():
    assert parse_version("2.21.0rc1") == (2, 21, 0)
    assert parse_version("3") == (3, 0, 0)
    supported = ((3, 15), (4, 0))  # doctor's two-number ranges
    assert version_in("3.15.0", supported) and version_in("3.99.1.dev2", supported)
    assert not version_in("3.14.9", supported) and not version_in("4.0.0", supported)
    assert version_in((3, 11, 7), ((3, 11), (3, 14)))
    assert not version_in((3, 14), ((3, 11), (3, 14)))
    tested = ((3, 15, 0), (3, 16, 0))  # a workaround's three-number TESTED_KERAS
    assert version_in("3.15.2", tested) and not version_in("3.16.0", tested)


def test_steps_done_counts_from_the_reported_batch_and_stops_at_the_epochs_end():
    assert steps_done(0, 6) == 1 and steps_done(5, 6) == 6
    assert steps_done(2, 6, offset=3) == 6  # a resumed epoch: 3 batches were skipped
    # steps_per_execution=4 over 6 batches: Keras reports batch 7 for the second execution.
    assert steps_done(7, 6) == 6
    assert steps_done(41, None) == 42  # an epoch of unknown length is never capped


@pytest.mark.slow  # a child interpreter
def test_nothing_here_loads_tensorflow():
    code = (
        "import sys\n"
        "import keras_mirror_kit.checkpoint.best, keras_mirror_kit.checkpoint.meta\n"
        "import keras_mirror_kit.checkpoint.preemption, keras_mirror_kit.named_objects\n"
        "import keras_mirror_kit.multi_worker.cluster, keras_mirror_kit.workarounds\n"
        "import keras_mirror_kit.callbacks.keras_loop\n"
        "print('tensorflow' in sys.modules, 'keras' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"], out.stdout
