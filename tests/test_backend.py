"""Another Keras backend than TensorFlow: a clear error at distributed(), in a fresh process."""

from __future__ import annotations

import importlib.util

import pytest

from tests.subproc import last_json, run_python

CODE = """
import json, keras, keras_mirror_kit as kmk
errors = []
for attempt in (lambda: kmk.distributed(per_replica_batch_size=8),
                lambda: kmk.distributed(global_batch_size=8).__enter__()):
    try:
        attempt()
        errors.append(None)
    except Exception as err:
        errors.append([type(err).__name__, str(err)])
print("RESULT " + json.dumps({"backend": keras.backend.backend(), "errors": errors}))
"""


@pytest.mark.parametrize("backend", ["jax", "numpy"])
def test_another_backend_is_named_in_a_clear_error(backend):
    if importlib.util.find_spec("jax") is None:  # Keras' jax and numpy backends need jax
        pytest.skip("jax is not installed (it comes with keras-mirror-kit[dev])")
    result = last_json(run_python(CODE, env={"KERAS_BACKEND": backend}))
    assert result["backend"] == backend
    for kind, message in result["errors"]:
        assert kind == "RuntimeError"
        assert f"runs on the {backend!r} backend" in message
        assert "KERAS_BACKEND=tensorflow" in message
