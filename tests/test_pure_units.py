"""Unit tests of Keras-free pieces, run without TensorFlow: keep_best's ranking and scores,
the preemption signals' parsing, and the split arithmetic tf.distribute follows.

The module asserts at the end that importing what it tests loaded no TensorFlow, so these
stay fast (`python3 -m pytest tests/test_pure_units.py` alone takes about a second).
"""

from __future__ import annotations

import math
import signal
import subprocess
import sys

import pytest

from keras_mirror_kit.checkpoint.best import BestKeeper, best_entries, check_best_args
from keras_mirror_kit.checkpoint.meta import ManifestEntry, Score
from keras_mirror_kit.checkpoint.preemption import parse_signals


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


@pytest.mark.slow  # a child interpreter
def test_nothing_here_loads_tensorflow():
    code = (
        "import sys\n"
        "import keras_mirror_kit.checkpoint.best, keras_mirror_kit.checkpoint.meta\n"
        "import keras_mirror_kit.checkpoint.preemption\n"
        "print('tensorflow' in sys.modules, 'keras' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"], out.stdout
