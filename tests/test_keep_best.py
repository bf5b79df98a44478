"""Keep the best checkpoints by a logged metric beside the newest (issue 12, item 5).

The tests that rank by a value `LogScore` puts into the logs share one model (`model`):
what they check is the callback's retention and its refusals, not the weights.
"""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest

from keras_mirror_kit.callbacks.synced_checkpoint import SyncedCheckpoint
from keras_mirror_kit.checkpoint.restore import load_checkpoint
from tests.ckpt_helpers import build, data, dataset


class LogScore(keras.callbacks.Callback):
    """Puts a given value per epoch into the epoch's logs as `val_score`."""

    def __init__(self, scores: list[float]) -> None:
        super().__init__()
        self.scores = scores

    def on_epoch_end(self, epoch, logs=None):
        logs["val_score"] = self.scores[epoch]


@pytest.fixture(scope="module")
def model():
    """One kit-built SGD model for the tests that rank by `LogScore`'s values (one trace)."""
    return build("sgd")


def _kept(directory) -> list[dict]:
    return json.loads((directory / "manifest.json").read_text())["checkpoints"]


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "best"), [("min", [2, 4]), ("max", [1, 3])])
def test_the_best_k_are_kept_beside_the_newest(tmp_path, mode, best, model):
    scores = [9.0, 1.0, 8.0, 2.0, 3.0, 4.0, 5.0]  # min: epochs 2, 4; max: epochs 1, 3
    ds = dataset()
    checkpoint = SyncedCheckpoint(
        tmp_path, keep=1, keep_best=2, monitor="val_score", mode=mode, dataset=ds
    )
    model.fit(ds, epochs=7, verbose=0, callbacks=[LogScore(scores), checkpoint])
    kept = _kept(tmp_path)
    # The newest (and the two usable resume points before it), plus the best two.
    assert [e["epoch"] for e in kept] == sorted({*best, 5, 6, 7})
    assert all(e["monitor"] == "val_score" and e["mode"] == mode for e in kept)
    assert [e["score"] for e in kept] == [scores[e["epoch"] - 1] for e in kept]
    assert load_checkpoint(tmp_path, "best").meta["epoch"] == best[0]
    assert len(list(tmp_path.glob("ckpt-*.npz"))) == len(kept)  # the others were deleted


@pytest.mark.slow
def test_val_loss_in_auto_mode_keeps_the_lowest(tmp_path):
    model, ds = build("adam"), dataset()
    x, y = data(32)
    history = model.fit(
        ds,
        epochs=5,
        verbose=0,
        validation_data=(x[::-1].copy(), y[::-1].copy()),
        callbacks=[SyncedCheckpoint(tmp_path, keep=1, keep_best=1, dataset=ds)],
    )
    losses = history.history["val_loss"]
    kept = _kept(tmp_path)
    assert all(e["mode"] == "min" for e in kept)
    np.testing.assert_allclose([e["score"] for e in kept], [losses[e["epoch"] - 1] for e in kept])
    best = int(np.argmin(losses)) + 1
    assert best in [e["epoch"] for e in kept]


@pytest.mark.slow
def test_a_metric_missing_from_the_logs_warns_and_saves_anyway(tmp_path, model):
    ds = dataset()
    with pytest.warns(UserWarning, match="can rank checkpoints only with 'val_loss'") as info:
        model.fit(ds, epochs=2, verbose=0, callbacks=[SyncedCheckpoint(tmp_path, keep_best=2)])
    assert "Logged values: loss" in str([w.message for w in info if "rank" in str(w.message)][0])
    kept = _kept(tmp_path)
    assert [e["epoch"] for e in kept] == [1, 2] and all(e["score"] is None for e in kept)


@pytest.mark.slow
def test_auto_mode_for_a_metric_of_unknown_direction_asks_for_a_mode(tmp_path, model):
    ds = dataset()
    checkpoint = SyncedCheckpoint(tmp_path, keep_best=1, monitor="val_score")
    with pytest.raises(ValueError, match="Pass mode='max'"):
        model.fit(ds, epochs=2, verbose=0, callbacks=[LogScore([1.0, 2.0]), checkpoint])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"mode": "best"}, ValueError, "`mode` must be 'auto', 'min' or 'max'"),
        ({"keep_best": -1}, ValueError, "`keep_best` must be a non-negative integer"),
        ({"keep_best": 1, "monitor": ""}, ValueError, "`monitor` must be the non-empty"),
        ({"keep_best": 1, "monitor": 3}, TypeError, "`monitor` must be the non-empty"),
        ({"keep_best": 1.5}, TypeError, "`keep_best` must be a non-negative integer"),
    ],
)
def test_bad_keep_best_arguments_are_refused(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        SyncedCheckpoint(tmp_path, **kwargs)
