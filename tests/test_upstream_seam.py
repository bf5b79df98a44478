"""The one seam to Keras' and TensorFlow's internals, and no protection skipped silently.

* No module outside `keras_mirror_kit/upstream/` imports `keras.src` or a TensorFlow
  private module, or reaches `tf.__internal__` (read from the source, so a new import
  anywhere fails here).
* Every resolver of the seam finds its symbol on the installed Keras and TensorFlow (the
  compatibility stage of `.ci/run` runs this file on the other tested pairs too).
* On a Keras version outside the tested range (faked), every workaround either applies
  after its canary, retires itself with a log line, or refuses its feature with a message
  naming the installed version and the tested ones: never a silent skip.
"""

from __future__ import annotations

import ast
import inspect
import logging
import pathlib
import types

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "keras_mirror_kit"
SEAM = PACKAGE / "upstream"
PRIVATE_PREFIXES = ("keras.src", "tensorflow.python", "tensorflow.core", "tensorflow.compiler")
FAKE = "3.99.0"


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring constants of a module, its classes and functions."""
    found = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
        ):
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def private_reaches(source: str) -> list[str]:
    """Where `source` imports or names a private module, or reaches `__internal__`."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Attribute) and node.attr == "__internal__":
            found.append(f"line {node.lineno}: .__internal__")
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
            and node.value.startswith(tuple(p + "." for p in PRIVATE_PREFIXES))
        ):
            found.append(f"line {node.lineno}: {node.value!r}")
        found.extend(
            f"line {node.lineno}: import {name}"
            for name in names
            if name.startswith(PRIVATE_PREFIXES)
        )
    return found


def test_the_scan_finds_each_kind_of_private_reach():
    source = (
        '"""A docstring may name keras.src.trainers freely."""\n'
        "import tensorflow as tf\n"
        "from keras.src.trainers.trainer import Trainer\n"
        "import tensorflow.python.data.ops as ops\n"
        "def f():\n"
        "    return tf.__internal__.distribute\n"
        'NAME = "tensorflow.python.data.ops.structured_function"\n'
    )
    found = private_reaches(source)
    assert len(found) == 4, found
    assert private_reaches('"""keras.src.x"""\nimport keras\nx = keras.ops\n') == []


def test_no_module_outside_the_seam_reaches_upstream_internals():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if SEAM in path.parents:
            continue
        found = private_reaches(path.read_text(encoding="utf-8"))
        if found:
            offenders[str(path.relative_to(PACKAGE))] = found
    assert offenders == {}, (
        "resolve these through keras_mirror_kit.upstream (keras_private, tensorflow_private)"
    )


def _resolvers(module: types.ModuleType) -> list[tuple[str, object]]:
    """The seam's functions that take no argument."""
    return [
        (name, getattr(module, name))
        for name in module.__all__
        if inspect.isfunction(getattr(module, name))
        and not inspect.signature(getattr(module, name)).parameters
    ]


def test_every_resolver_of_the_seam_finds_its_symbol_on_the_installed_versions():
    from keras_mirror_kit.upstream import keras_private, tensorflow_private

    resolved = {}
    for module in (keras_private, tensorflow_private):
        for name, resolver in _resolvers(module):
            resolved[name] = resolver()
            assert resolved[name] is not None, name
    assert len(resolved) >= 20
    trainer = keras_private.tensorflow_trainer()
    assert issubclass(trainer, keras_private.base_trainer())
    import keras

    assert issubclass(keras.Model, trainer) or keras.backend.backend() != "tensorflow"
    assert keras_private.start_enqueuer is not None


def test_a_symbol_on_no_known_layout_is_an_import_error_naming_the_keras():
    import keras

    from keras_mirror_kit.upstream import keras_private

    with pytest.raises(ImportError, match=rf"Keras {keras.__version__} has none of"):
        keras_private._first(("keras.src.no_such_module", "Nothing"))


def test_the_first_step_iterator_is_the_last_item_of_either_form():
    from keras_mirror_kit.upstream.keras_private import first_step_iterator

    assert first_step_iterator(iter([(0, "it")])) == "it"  # Keras 3.10: (step, iterator)
    assert first_step_iterator(iter([(0, 0, "it")])) == "it"  # 3.11+: (begin, end, iterator)
    assert first_step_iterator(iter([])) is None  # no step: Keras builds without a batch


# The workarounds that patch Keras through a canary (`workarounds.KerasPatch`), and those
# whose `status()` decides from the tested range and Keras' source.
CANARY_MODULES = (
    "keras_uneven_first_batch",
    "keras_replica_shares",
    "tf_generator_buffers",
    "keras_pydataset_epochs",
    "keras_own_step_losses",
    "keras_step_fetch",
)
STATUS_MODULES = (
    "keras_loss_scale",
    "keras_grad_accumulation",
    "keras_gradient_clipping",
    "keras_ema_overwrite",
    "keras_multi_worker_fit",
)


def _workaround(name: str) -> types.ModuleType:
    import importlib

    return importlib.import_module(f"keras_mirror_kit.workarounds.{name}")


def _fresh(name: str, **changes):
    """A new `KerasPatch` like the module's (nothing decided or patched yet), `changes` given."""
    from keras_mirror_kit.workarounds import KerasPatch

    original = _workaround(name)._PATCH
    given = {
        "name": original.name,
        "feature": original.feature,
        "instead": original.instead,
        "target": original._target,
        "bug": original._bug,
    }
    return KerasPatch(original.tested, **(given | changes))


@pytest.mark.parametrize("name", CANARY_MODULES)
def test_on_an_untested_keras_each_canary_decides_and_says_so(name, monkeypatch, caplog):
    from keras_mirror_kit.upstream import versions

    original = _workaround(name)._PATCH
    monkeypatch.setattr(versions, "keras_version", lambda: FAKE)
    fresh = _fresh(name)
    verdict = fresh.verdict()
    assert verdict.state in ("applied", "retired", "refused"), verdict
    if original._bug is not None and original._bug() is False:  # keras_step_fetch before 3.16
        assert verdict.state == "retired", verdict
        return
    # On the installed Keras the canary sees its bug and the expected target: it applies
    # on the faked version too, and says so at INFO (outside the tested range).
    assert verdict.state == "applied", verdict
    patched = []
    with caplog.at_level(logging.INFO, logger="keras_mirror_kit"):
        assert fresh.apply(lambda: patched.append(True)) is True
    assert patched == [True]
    assert f"{original.name} applied on Keras {FAKE}" in caplog.text


@pytest.mark.parametrize("name", CANARY_MODULES)
def test_a_changed_patch_target_refuses_the_feature_naming_both_versions(
    name, monkeypatch, caplog
):
    from keras_mirror_kit.upstream import versions

    original = _workaround(name)._PATCH
    monkeypatch.setattr(versions, "keras_version", lambda: FAKE)
    refused = _fresh(name, target=lambda: "the patched method is gone", bug=lambda: True)
    with caplog.at_level(logging.WARNING, logger="keras_mirror_kit"):
        assert refused.apply(lambda: pytest.fail("patched although refused")) is False
    assert f"{original.name} cannot protect" in caplog.text
    with pytest.raises(ValueError) as info:
        refused.require("the feature")
    message = str(info.value)
    assert f"Keras {FAKE}" in message and versions.TESTED_KERAS_TEXT in message
    assert "the patched method is gone" in message and "Instead:" in message


@pytest.mark.parametrize("name", CANARY_MODULES)
def test_a_bug_fixed_upstream_retires_the_workaround_with_a_log_line(name, monkeypatch, caplog):
    from keras_mirror_kit.upstream import versions
    from keras_mirror_kit.workarounds import KerasPatch

    original = _workaround(name)._PATCH
    monkeypatch.setattr(versions, "keras_version", lambda: FAKE)
    retired = KerasPatch(original.tested, name=original.name, bug=lambda: False)
    with caplog.at_level(logging.INFO, logger="keras_mirror_kit"):
        assert retired.apply(lambda: pytest.fail("patched although retired")) is False
    assert f"{original.name} retires itself" in caplog.text
    retired.require("the feature")  # Keras' own code runs: nothing to refuse


def test_an_unknown_bug_outside_the_tested_range_is_refused_not_applied(monkeypatch):
    from keras_mirror_kit.upstream import versions
    from keras_mirror_kit.workarounds import KerasPatch

    monkeypatch.setattr(versions, "keras_version", lambda: FAKE)
    unsure = KerasPatch(((3, 10, 0), (3, 17, 0)), name="w", bug=lambda: None)
    assert unsure.verdict().state == "refused"
    monkeypatch.setattr(versions, "keras_version", lambda: "3.12.1")
    assert unsure.verdict().state == "applied"  # inside the tested range


@pytest.mark.parametrize("name", STATUS_MODULES)
def test_on_an_untested_keras_each_optimizer_workaround_is_never_tested(name):
    module = _workaround(name)
    state = module.status(FAKE)
    assert state in ("fixed-upstream", "refused", "untested"), state


def test_a_refused_canary_refuses_generators_and_py_datasets_at_their_call(monkeypatch):
    import keras

    from keras_mirror_kit.workarounds import (
        KerasPatch,
        keras_pydataset_epochs,
        keras_uneven_first_batch,
        tf_generator_buffers,
    )

    def refused(name: str) -> KerasPatch:
        return KerasPatch(((3, 10, 0), (3, 17, 0)), name=name, target=lambda: "changed")

    class Batches(keras.utils.PyDataset):
        def __len__(self) -> int:
            return 1

        def __getitem__(self, index: int):
            return [0.0], [0.0]

    generator = (b for b in [([0.0], [0.0])])
    monkeypatch.setattr(tf_generator_buffers, "_PATCH", refused("tf_generator_buffers"))
    with pytest.raises(ValueError, match="tf_generator_buffers"):
        tf_generator_buffers.own(generator)
    monkeypatch.setattr(keras_pydataset_epochs, "_PATCH", refused("keras_pydataset_epochs"))
    with pytest.raises(ValueError, match="keras_pydataset_epochs"):
        keras_pydataset_epochs.own(Batches())
    monkeypatch.setattr(keras_uneven_first_batch, "_PATCH", refused("keras_uneven_first_batch"))
    with pytest.raises(ValueError, match="keras_uneven_first_batch"):
        keras_uneven_first_batch.require(generator, "evaluate")
    keras_uneven_first_batch.require([0.0], "evaluate")  # arrays: the build replays them


def test_a_plain_keras_model_trains_as_without_the_kit_beside_its_callbacks(tmp_path):
    """The kit wraps `keras.Model.fit`: a plain model (no strategy, not built by the kit)
    trains the same weights with the kit's callbacks created, or passed, as without them."""
    import keras
    import numpy as np

    import keras_mirror_kit as kmk

    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")

    def trained(callbacks: list) -> list:
        keras.utils.set_random_seed(4)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(
            optimizer="sgd",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=callbacks)
        assert int(model.optimizer.iterations.numpy()) == 8
        return model.get_weights()

    alone = trained([])
    monitor = kmk.ThroughputMonitor(global_batch_size=16)  # the kit's callbacks exist
    kmk.SyncedCheckpoint(str(tmp_path / "ckpt"))
    for got in (trained([]), trained([monitor])):
        for a, b in zip(alone, got, strict=True):
            np.testing.assert_array_equal(a, b)


def test_the_step_keras_reports_at_a_batch_end_is_the_executions_last(monkeypatch):
    """Keras 3.10 reports an execution's first step at `on_*_batch_end`, 3.11+ its last:
    the kit's step counts (checkpoints, throughput, W&B) read either as the last."""
    from keras_mirror_kit.callbacks.keras_loop import steps_done
    from keras_mirror_kit.upstream import keras_private

    monkeypatch.setattr(keras_private, "batch_end_reports_first_step", lambda: True)
    assert keras_private.last_step_of_execution(8, 4) == 11  # Keras 3.10: 8 is the first
    assert steps_done(8, 10, 0, 4) == 10  # capped at the epoch's length
    assert steps_done(4, 16, 0, 4) == 8
    assert keras_private.last_step_of_execution(3, 1) == 3
    monkeypatch.setattr(keras_private, "batch_end_reports_first_step", lambda: False)
    assert keras_private.last_step_of_execution(11, 4) == 11
    assert steps_done(7, 16, 0, 4) == 8


def test_the_installed_keras_reports_as_the_seam_says():
    import keras
    import numpy as np

    from keras_mirror_kit.upstream import keras_private

    ends = []

    class Ends(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            ends.append(batch)

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
    model.fit(np.ones((16, 2)), np.ones((16, 1)), batch_size=2, verbose=0, callbacks=[Ends()])
    assert ends == ([0, 4] if keras_private.batch_end_reports_first_step() else [3, 7])
    assert [keras_private.last_step_of_execution(b, 4) for b in ends] == [3, 7]


def test_a_keras_outside_the_tested_range_is_named_once(monkeypatch, caplog):
    from keras_mirror_kit.upstream import versions

    monkeypatch.setattr(versions, "keras_version", lambda: "3.99.0")
    monkeypatch.setattr(versions, "_noticed", set())
    with caplog.at_level(logging.WARNING, logger="keras_mirror_kit"):
        assert versions.notice_untested("distributed()") is True
        assert versions.notice_untested("distributed()") is True  # said once
    lines = [r.getMessage() for r in caplog.records if "outside the versions" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "Keras 3.99.0 (tested: Keras 3.10 to 3.16)" in lines[0]
    assert "refuses the feature it cannot make exact before any step" in lines[0]
