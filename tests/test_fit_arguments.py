"""`KerasCall`: a call of an override of `fit`/`evaluate`/`predict` read by Keras' names and
given back in the override's form (no model is built: only signatures)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from keras_mirror_kit.fit_arguments import KerasCall


def read(function: Any, *args: Any, method: str = "fit", **kwargs: Any) -> KerasCall:
    call = KerasCall.read(method, inspect.signature(function), args, kwargs)
    assert call is not None
    return call


def hub_fit(x=None, y=None, batch_size=None, sample_weight=None, validation_split=None, **kw):
    """KerasHub's `PipelineModel.fit`."""


def wrapper_fit(*args, **kwargs):
    """A subclass's `fit(self, *args, **kwargs)` that passes everything through."""


def test_keywords_in_the_overrides_kwargs_are_kerass_parameters():
    callbacks = [object()]
    call = read(hub_fit, "x", "y", epochs=3, callbacks=callbacks, shuffle=False)
    assert call.arguments == {
        "x": "x",
        "y": "y",
        "epochs": 3,
        "callbacks": callbacks,
        "shuffle": False,
    }
    assert call.call() == (("x", "y"), {"epochs": 3, "callbacks": callbacks, "shuffle": False})


def test_what_the_kit_changes_goes_back_in_the_overrides_form():
    call = read(hub_fit, "x", "y", 4, epochs=3)
    call.arguments["x"] = "dataset"
    call.arguments["callbacks"] = ["ordered"]
    call.arguments["shuffle"] = False
    for name in ("y", "batch_size"):  # removed: the positions get the override's defaults
        call.arguments.pop(name)
    assert call.call() == (
        ("dataset", None, None),
        {"epochs": 3, "callbacks": ["ordered"], "shuffle": False},
    )


def test_positional_arguments_in_the_overrides_args_are_at_kerass_positions():
    call = read(wrapper_fit, "x", "y", 8, 2, 0, ["cb"], validation_split=0.5)
    assert call.arguments == {
        "x": "x",
        "y": "y",
        "batch_size": 8,
        "epochs": 2,
        "verbose": 0,
        "callbacks": ["cb"],
        "validation_split": 0.5,
    }
    call.arguments["callbacks"] = ["ordered"]
    call.arguments.pop("y")  # removed: Keras' default
    call.arguments["shuffle"] = False  # added: by keyword
    assert call.call() == (
        ("x", None, 8, 2, 0, ["ordered"]),
        {"validation_split": 0.5, "shuffle": False},
    )


def test_the_overrides_own_parameters_pass_through_untouched():
    def own(x, y=None, *args, mode="fast", **kwargs): ...

    call = read(own, "x", None, 8, mode="slow", extra=1, epochs=2)
    assert call.arguments == {"x": "x", "y": None, "batch_size": 8, "epochs": 2}
    call.arguments["batch_size"] = 16
    assert call.call() == (("x", None, 16), {"mode": "slow", "extra": 1, "epochs": 2})


def test_parameters_named_otherwise_than_kerass_are_not_read():
    def renamed(data, *args, **kwargs): ...

    call = read(renamed, "d", "not y", epochs=2)
    assert call.arguments == {"epochs": 2}  # `data` is not `x`, and *args not at Keras' places
    assert call.call() == (("d", "not y"), {"epochs": 2})


def test_an_argument_the_override_cannot_take_is_left_out():
    def narrow(x, y=None, epochs=1): ...

    call = read(narrow, "x", epochs=2)
    call.arguments["batch_size"] = 8
    call.arguments["callbacks"] = []
    assert call.call() == (("x",), {"epochs": 2})


@pytest.mark.parametrize("method", ["evaluate", "predict"])
def test_evaluate_and_predict_read_kerass_own_parameters(method):
    def override(x=None, batch_size=None, **kwargs): ...

    call = read(override, "x", method=method, steps=3, callbacks=["cb"], _private=True)
    assert call.arguments == {"x": "x", "steps": 3, "callbacks": ["cb"]}
    assert call.call() == (("x",), {"steps": 3, "callbacks": ["cb"], "_private": True})


def test_a_call_that_does_not_bind_is_not_read():
    def narrow(x, y=None): ...

    assert KerasCall.read("fit", inspect.signature(narrow), ("x",), {"epochs": 1}) is None


def test_kerass_parameters_are_read_when_keras_model_fit_itself_is_wrapped(monkeypatch):
    """A test's recorder or another library may replace `keras.Model.fit` by a wrapper
    taking `*args, **kwargs`: Keras' parameter names still come from its `Trainer`."""
    import keras

    from keras_mirror_kit import fit_arguments

    def recorder(self, *args, **kwargs): ...

    monkeypatch.setattr(keras.Model, "fit", recorder)
    fit_arguments._keras_parameters.cache_clear()
    try:

        def wrapped(*args, **kwargs): ...

        call = read(wrapped, "x", "y", epochs=2, callbacks=["cb"])
        assert call.arguments == {"x": "x", "y": "y", "epochs": 2, "callbacks": ["cb"]}
        call.arguments["callbacks"] = ["arranged"]
        assert call.call() == (("x", "y"), {"epochs": 2, "callbacks": ["arranged"]})
    finally:
        fit_arguments._keras_parameters.cache_clear()
