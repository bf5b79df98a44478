"""`fit_hooks`: every model's `fit()` calls the `FitHooks` of its callbacks, once.

In-process and on one device: what is tested is the dispatch around Keras' own `fit()`,
for models the kit did not build (the class-level wrapper that `install` puts on
`keras.Model.fit`) and for one it built (its per-instance wrapper dispatches; the class
one passes the call through).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

import keras_mirror_kit as kmk
from keras_mirror_kit import fit_hooks
from tests.ckpt_helpers import CountBatches


@pytest.fixture(autouse=True)
def installed() -> None:
    fit_hooks.install()  # what the kit's callbacks do when the first one is created


def plain_model() -> keras.Model:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def arrays() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(16, 4)).astype("float32"), rng.normal(size=(16, 2)).astype("float32")


class Added(keras.callbacks.Callback):
    """A callback that `Records.arrange_callbacks` appends to the list."""

    def __init__(self, events: list[Any]) -> None:
        super().__init__()
        self.events = events

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        self.events.append(("added: train end", self.model is not None))


class Records(keras.callbacks.Callback):
    """Records every hook `fit()` calls on it, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[Any] = []
        self.added = Added(self.events)

    def check_fit_data(self, x: Any) -> None:
        self.events.append(("check", type(x).__name__))

    def arrange_callbacks(self, callbacks: list[Any]) -> list[Any]:
        self.events.append(("arrange", [type(c).__name__ for c in callbacks]))
        return [*callbacks, self.added]

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.events.append(("train begin",))

    def on_fit_exception(self, exception: BaseException) -> None:
        self.events.append(("exception", str(exception)))

    def on_fit_end(self) -> None:
        self.events.append(("end",))


class Raises(keras.callbacks.Callback):
    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        raise RuntimeError("stopped at the first batch")


def test_a_plain_models_fit_calls_each_hook_once_in_order():
    x, y = arrays()
    records, other = Records(), keras.callbacks.History()
    plain_model().fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[other, records])

    assert records.events == [
        ("check", "ndarray"),
        ("arrange", ["History", "Records"]),
        ("train begin",),
        ("added: train end", True),  # Keras' CallbackList gave it the model
        ("end",),
    ]


def test_a_raising_fit_calls_on_fit_exception_then_on_fit_end_and_raises_the_same():
    x, y = arrays()
    records = Records()
    with pytest.raises(RuntimeError, match="first batch"):
        plain_model().fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[records, Raises()])
    assert records.events[-2:] == [("exception", "stopped at the first batch"), ("end",)]
    assert ("added: train end", True) not in records.events  # Keras called no on_train_end


class FailsToClose(keras.callbacks.Callback):
    def on_fit_exception(self, exception: BaseException) -> None:
        raise ValueError("a broken hook")


def test_an_error_in_a_hook_is_logged_and_never_replaces_fits_exception(caplog):
    x, y = arrays()
    records = Records()
    with caplog.at_level(logging.ERROR, logger="keras_mirror_kit"):
        with pytest.raises(RuntimeError, match="first batch"):
            plain_model().fit(
                x, y, epochs=1, verbose=0, callbacks=[FailsToClose(), records, Raises()]
            )
    assert ("exception", "stopped at the first batch") in records.events  # still called
    assert any("on_fit_exception" in r.getMessage() for r in caplog.records)


def test_a_users_callback_list_is_arranged_for_the_fit_and_put_back_after():
    x, y = arrays()
    model = plain_model()
    records = Records()
    given = keras.callbacks.CallbackList([records], add_history=True, model=model)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=given)

    assert ("added: train end", True) in records.events  # set_model by the dispatch
    assert given.callbacks[0] is records and len(given.callbacks) == 2  # and its History


def test_a_kit_built_models_fit_is_dispatched_once():
    x, y = arrays()

    @kmk.distributed(devices=["/cpu:0"], per_replica_batch_size=8)
    def build() -> keras.Model:
        return plain_model()

    records = Records()
    build().fit(x, y, epochs=1, verbose=0, callbacks=[records])
    assert [e[0] for e in records.events].count("arrange") == 1
    assert [e[0] for e in records.events].count("end") == 1


class FitsAgain(keras.callbacks.Callback):
    """At the first epoch end, fits the same model once more (a nested fit)."""

    def __init__(self, inner: Records) -> None:
        super().__init__()
        self.inner = inner

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if epoch == 0:
            x, y = arrays()
            self.model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[self.inner])


def test_a_nested_fit_of_the_same_model_is_dispatched_too():
    x, y = arrays()
    outer, inner = Records(), Records()
    plain_model().fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[outer, FitsAgain(inner)])
    assert [e[0] for e in inner.events] == [
        "check",
        "arrange",
        "train begin",
        "added: train end",
        "end",
    ]
    assert [e[0] for e in outer.events].count("arrange") == 1


def test_a_fit_whose_callbacks_define_no_hook_is_keras_own():
    x, y = arrays()
    history = plain_model().fit(x, y, batch_size=8, epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2


def _newest_meta(directory: Path) -> dict[str, Any]:
    newest = max(directory.glob("ckpt-*.npz"), key=lambda p: p.stat().st_mtime_ns)
    with np.load(newest, allow_pickle=False) as npz:
        return json.loads(npz["__meta__"].tobytes())


def test_synced_checkpoint_on_a_plain_model_saves_the_state_of_callbacks_listed_after_it(
    tmp_path,
):
    x, y = arrays()
    stopping = keras.callbacks.EarlyStopping(monitor="loss", patience=10)
    checkpoint = kmk.SyncedCheckpoint(tmp_path / "ckpt")
    plain_model().fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[checkpoint, stopping])

    saved = _newest_meta(tmp_path / "ckpt")["callbacks"]
    assert set(saved) == {"EarlyStopping#0"}
    assert saved["EarlyStopping#0"]["wait"] == stopping.wait


class SeesLogs(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.keys: set[str] = set()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.keys |= set(logs or {})


def test_a_throughput_monitor_listed_last_runs_first_for_a_plain_model():
    x, y = arrays()
    logger = SeesLogs()
    plain_model().fit(
        x,
        y,
        batch_size=8,
        epochs=1,
        verbose=0,
        callbacks=[logger, kmk.ThroughputMonitor(global_batch_size=8, warmup_steps=0)],
    )
    assert "samples_per_sec" in logger.keys


class Refuses(keras.callbacks.Callback):
    def check_fit_data(self, x: Any) -> None:
        raise ValueError("refused before any step")


def test_a_refusing_check_still_ends_the_hooks_of_the_fit():
    x, y = arrays()
    records = Records()
    with pytest.raises(ValueError, match="refused before any step"):
        plain_model().fit(x, y, epochs=1, verbose=0, callbacks=[records, Refuses()])
    assert [e[0] for e in records.events] == ["check", "exception", "end"]


# -- overrides of fit with a signature of their own (KerasHub's tasks, wrappers) -----------


class KwargsFit(keras.Sequential):
    """KerasHub's `PipelineModel.fit`: callbacks, epochs and shuffle come in `**kwargs`."""

    def fit(self, x=None, y=None, batch_size=None, sample_weight=None, **kwargs):
        return super().fit(x=x, y=y, batch_size=batch_size, sample_weight=sample_weight, **kwargs)


class ArgsFit(keras.Sequential):
    """A wrapper that passes everything through."""

    def fit(self, *args, **kwargs):
        return super().fit(*args, **kwargs)


def kit_built(cls: type[keras.Sequential]) -> keras.Model:
    @kmk.distributed(devices=["/cpu:0"], per_replica_batch_size=8)
    def build() -> keras.Model:
        model = cls([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse")
        return model

    return build()


@pytest.mark.parametrize("cls", [KwargsFit, ArgsFit], ids=["kwargs", "args"])
def test_a_kit_built_models_own_fit_signature_still_hands_over_its_callbacks(cls):
    x, y = arrays()  # 16 samples: 2 steps at the kit's global batch of 8, 1 at Keras' 32
    records, logger, counter = Records(), SeesLogs(), CountBatches()
    monitor = kmk.ThroughputMonitor(warmup_steps=0)
    callbacks = [records, logger, counter, monitor]
    if cls is ArgsFit:  # x, y, batch_size, epochs, verbose, callbacks: all positional
        kit_built(cls).fit(x, y, None, 1, 0, callbacks)
    else:
        kit_built(cls).fit(x, y, epochs=1, verbose=0, callbacks=callbacks)
    assert [e[0] for e in records.events] == [
        "check",
        "arrange",
        "train begin",
        "added: train end",
        "end",
    ]
    assert "samples_per_sec" in logger.keys
    assert counter.batches == 2


def test_a_plain_models_own_fit_signature_hands_over_its_callbacks_too():
    x, y = arrays()
    records = Records()
    model = ArgsFit([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, 8, 1, 0, [records])
    assert [e[0] for e in records.events].count("arrange") == 1
