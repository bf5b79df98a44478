"""A Keras backend without a data-parallel API: a clear error at distributed(), in a child."""

from __future__ import annotations

import importlib.util

import pytest

from tests.subproc import last_json, run_python

pytestmark = pytest.mark.slow  # every test here starts children or trains for long

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


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_another_backend_is_named_in_a_clear_error(backend):
    needs = {"numpy": "jax", "torch": "torch"}[backend]  # Keras' numpy backend needs jax
    if importlib.util.find_spec(needs) is None:
        pytest.skip(f"{needs} is not installed, so Keras cannot run on the {backend} backend")
    result = last_json(run_python(CODE, env={"KERAS_BACKEND": backend}))
    assert result["backend"] == backend
    from keras_mirror_kit.upstream import versions

    # From Keras 3.16 torch has a data-parallel API, which the kit does not support.
    torch_api = backend == "torch" and versions.keras_version_in(((3, 16, 0), (4, 0, 0)))
    for kind, message in result["errors"]:
        assert kind == "RuntimeError"
        if torch_api:
            assert "has a data-parallel API for torch" in message
            assert "which the kit does not support" in message
        else:
            assert f"no data-parallel API for the {backend!r} backend" in message
        assert "KERAS_BACKEND=tensorflow (or jax)" in message
