"""Checkpoints outside `fit` (issue 12, items 6 and 7): restore matches variables by path,
`restore()` loads into a model, `keras-mirror-kit ckpt ls|verify|export` lists, verifies and
exports to Keras' own formats, which load with plain Keras."""

from __future__ import annotations

import json
import shutil

import keras
import numpy as np
import pytest

import keras_mirror_kit as kmk
from keras_mirror_kit.callbacks.synced_checkpoint import SyncedCheckpoint
from keras_mirror_kit.checkpoint.restore import restore
from keras_mirror_kit.checkpoint.store import CheckpointError
from keras_mirror_kit.cli import main
from tests.ckpt_helpers import CountBatches, build, dataset
from tests.subproc import REPO, last_json, run_python

# -- item 6: variables are matched by path ------------------------------------------------


def _blocks(names: tuple[str, str], compiled: bool = True):
    """Dense(8) -> Dense(8) -> Dense(3) on 8 features: the two blocks have the same shapes."""

    @kmk.distributed(global_batch_size=16)
    def factory():
        model = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(8, name=names[0])]
            + [keras.layers.Dense(8, name=names[1]), keras.layers.Dense(3, name="head")]
        )
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))
        return model

    if compiled:
        return factory()
    return keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(8, name=names[0])]
        + [keras.layers.Dense(8, name=names[1]), keras.layers.Dense(3, name="head")]
    )


def _block_data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 8)).astype("float32")
    return kmk.make_dataset(x, (x[:, 0] > 0).astype("int32"), 16, seed=0)


@pytest.fixture(scope="module")
def blocks_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("blocks") / "ckpt"
    model, ds = _blocks(("block_1", "block_2")), _block_data()
    model.fit(ds, epochs=1, verbose=0, callbacks=[SyncedCheckpoint(directory, dataset=ds)])
    return directory, {layer.name: layer.get_weights() for layer in model.layers}


@pytest.mark.slow
def test_another_architecture_with_the_same_shapes_is_refused_naming_the_paths(
    blocks_checkpoint,
):
    directory, _ = blocks_checkpoint
    other, ds, counter = _blocks(("block_1", "block_3")), _block_data(), CountBatches()
    before = other.layers[1].get_weights()
    with pytest.raises(CheckpointError, match="does not match this model") as info:
        other.fit(ds, epochs=2, verbose=0, callbacks=[SyncedCheckpoint(directory), counter])
    message = str(info.value)
    assert "block_3/kernel" in message and "block_2/kernel" in message
    assert "never by position" in message
    assert counter.batches == 0
    np.testing.assert_array_equal(other.layers[1].get_weights()[0], before[0])
    with pytest.raises(CheckpointError, match="block_3/kernel"):  # outside fit alike
        restore(other, directory)


def test_the_same_paths_in_another_order_are_restored_by_path(blocks_checkpoint):
    directory, saved = blocks_checkpoint
    swapped = _blocks(("block_2", "block_1"), compiled=False)  # same shapes, names swapped
    restore(swapped, directory)
    for name in ("block_1", "block_2", "head"):
        for got, want in zip(swapped.get_layer(name).get_weights(), saved[name]):
            np.testing.assert_array_equal(got, want)


# -- item 7: restore() outside fit ------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    directory = tmp_path_factory.mktemp("trained") / "ckpt"
    model, ds = build("adam"), dataset()
    model.fit(ds, epochs=2, verbose=0, callbacks=[SyncedCheckpoint(directory, dataset=ds)])
    return directory, model


@pytest.mark.slow
def test_restore_loads_weights_and_the_optimizer_state_into_a_new_model(trained):
    directory, model = trained
    fresh = build("adam", seed=7)  # compiled; its optimizer is built by optimizer=True
    loaded = restore(fresh, directory, optimizer=True)
    assert loaded.meta["epoch"] == 2 and loaded.path.name == "ckpt-00000002.npz"
    for got, want in zip(fresh.weights, model.weights):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    assert int(fresh.optimizer.iterations.numpy()) == int(model.optimizer.iterations.numpy())
    for got, want in zip(fresh.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    x = np.ones((4, 6), "float32")
    np.testing.assert_allclose(fresh.predict(x, verbose=0), model.predict(x, verbose=0))


def test_restore_a_named_checkpoint_weights_only_into_a_plain_model(trained):
    directory, _ = trained
    plain = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)]
    )  # not compiled, no strategy: weights only
    loaded = restore(plain, directory, name="ckpt-00000001")
    assert loaded.meta["epoch"] == 1
    first = restore(build("adam"), directory, name="1", optimizer=False)
    for got, want in zip(
        plain.weights, [first.arrays["model/00000"], first.arrays["model/00001"]]
    ):
        np.testing.assert_array_equal(got.numpy(), want)
    with pytest.raises(CheckpointError, match="There is no checkpoint 'ckpt-00000009'"):
        restore(plain, directory, name="ckpt-00000009")
    with pytest.raises(ValueError, match="needs a compiled model"):
        restore(plain, directory, optimizer=True)
    unbuilt = keras.Sequential([keras.layers.Dense(8), keras.layers.Dense(3)])
    with pytest.raises(ValueError, match="needs a built model"):
        restore(unbuilt, directory)


# -- item 7: the command line -----------------------------------------------------------------


@pytest.fixture(scope="module")
def cnn_checkpoint(tmp_path_factory):
    """The tutorial CNN, trained 1 epoch of 2 batches on 2 replicas, checkpointed."""
    directory = tmp_path_factory.mktemp("cnn") / "ckpt"

    @kmk.distributed(global_batch_size=16)
    def factory():
        keras.utils.set_random_seed(0)
        model = kmk.models.tutorial_cnn()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        return model

    model = factory()
    rng = np.random.default_rng(0)
    x = rng.integers(0, 255, size=(32, 32, 32, 3)).astype("float32") / 255.0
    ds = kmk.make_dataset(x, rng.integers(0, 10, size=32), 16, seed=0)
    model.fit(ds, epochs=1, verbose=0, callbacks=[SyncedCheckpoint(directory, dataset=ds)])
    return directory, model, x[:4]


@pytest.mark.slow
def test_ckpt_ls_and_verify(cnn_checkpoint, capsys, tmp_path):
    directory, _, _ = cnn_checkpoint
    assert main(["ckpt", "ls", str(directory), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    manifest = json.loads((directory / "manifest.json").read_text())["checkpoints"]
    assert [r["file"] for r in rows] == [e["file"] for e in manifest]
    newest = rows[-1]
    assert (newest["epoch"], newest["step"], newest["epoch_end"]) == (1, 0, True)
    assert newest["size"] == (directory / newest["file"]).stat().st_size
    assert newest["checksum"] == "crc32:" + manifest[-1]["crc32"] and newest["latest"]
    assert main(["ckpt", "ls", str(directory)]) == 0
    table = capsys.readouterr().out
    assert newest["file"] in table and newest["checksum"] in table and "epoch end" in table
    assert main(["ckpt", "verify", str(directory)]) == 0
    assert "1 of 1 checkpoint(s) verified, 0 corrupt" in capsys.readouterr().out
    # A damaged copy: verify names it and fails.
    damaged = tmp_path / "damaged"
    shutil.copytree(directory, damaged)
    path = damaged / newest["file"]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert main(["ckpt", "verify", str(damaged)]) == 1
    out = capsys.readouterr().out
    assert f"{newest['file']}: CORRUPT" in out and "fails its CRC" in out


@pytest.mark.parametrize(
    ("folder", "how"),
    [("ckpt-v0.1.0", "size and SHA-256 ok"), ("ckpt-ee9bcb3", "size, checksum and CRCs ok")],
)
def test_ckpt_verify_and_ls_accept_earlier_versions_without_tensorflow(tmp_path, folder, how):
    """Checkpoints written by 0.1.0 and by commit ee9bcb3 (before the checkpoint package)
    verify and list as they did, and `ckpt ls|verify` import neither TensorFlow nor Keras."""
    directory = tmp_path / folder
    shutil.copytree(REPO / "tests" / "data" / folder, directory)
    damaged = tmp_path / "damaged"
    shutil.copytree(directory, damaged)
    newest = damaged / "ckpt-00000003.npz"
    data = bytearray(newest.read_bytes())
    data[len(data) // 3] ^= 0x01
    newest.write_bytes(bytes(data))
    proc = run_python(
        f"""
        import contextlib, io, json, sys
        from keras_mirror_kit.cli import main
        runs = {{}}
        for argv in (["verify", {str(directory)!r}], ["ls", "--json", {str(directory)!r}],
                     ["verify", {str(damaged)!r}]):
            with contextlib.redirect_stdout(io.StringIO()) as out:
                rc = main(["ckpt", *argv])
            runs[argv[0] if argv[-1] != {str(damaged)!r} else "damaged"] = [rc, out.getvalue()]
        modules = [m for m in ("tensorflow", "keras") if m in sys.modules]
        print("RESULT " + json.dumps({{"runs": runs, "modules": modules}}))
        """,
        timeout=120,
        fresh=True,
    )
    result = last_json(proc)
    assert result["modules"] == []
    rc, out = result["runs"]["verify"]
    assert rc == 0 and "3 of 3 checkpoint(s) verified, 0 corrupt" in out, out
    assert all(f"ckpt-0000000{i}.npz: ok ({how})" in out for i in (1, 2, 3)), out
    rc, out = result["runs"]["ls"]
    rows = json.loads(out)
    assert rc == 0 and [(r["epoch"], r["step"], r["epoch_end"]) for r in rows] == [
        (0, 4, False),
        (1, 0, True),
        (1, 2, False),
    ]
    assert [r["latest"] for r in rows] == [False, False, True] and all(r["listed"] for r in rows)
    assert rows[-1]["checksum"].startswith("sha256:" if "SHA" in how else "crc32:")
    rc, out = result["runs"]["damaged"]
    assert rc == 1 and "ckpt-00000003.npz: CORRUPT" in out and "2 of 3" in out, out


@pytest.mark.slow
def test_ckpt_export_loads_with_plain_keras(cnn_checkpoint, capsys, tmp_path):
    directory, model, x = cnn_checkpoint
    want = model.predict(x, verbose=0)
    to = tmp_path / "model.keras"
    assert main(["ckpt", "export", str(directory), "--to", str(to)]) == 0
    assert f"wrote {to}" in capsys.readouterr().out
    served = keras.saving.load_model(to)  # plain Keras, no kit object involved
    np.testing.assert_allclose(served.predict(x, verbose=0), want, rtol=1e-5, atol=1e-6)
    weights = tmp_path / "cnn.weights.h5"
    assert main(["ckpt", "export", str(directory), "--to", str(weights)]) == 0
    fresh = kmk.models.tutorial_cnn()
    fresh.load_weights(weights)
    np.testing.assert_allclose(fresh.predict(x, verbose=0), want, rtol=1e-5, atol=1e-6)
    # Nothing is overwritten unless asked; a wrong suffix is refused.
    before = to.read_bytes()
    assert main(["ckpt", "export", str(directory), "--to", str(to)]) == 2
    assert "exists; it is left as it is" in capsys.readouterr().err
    assert to.read_bytes() == before
    assert main(["ckpt", "export", str(directory), "--to", str(tmp_path / "m.h5")]) == 2
    assert "must end in '.keras'" in capsys.readouterr().err
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp.keras")]


@pytest.mark.slow
def test_ckpt_export_with_a_model_factory(trained, tmp_path, capsys):
    directory, model = trained
    to = tmp_path / "small.weights.h5"
    factory = "tests.test_restore_outside_fit:small_model"
    assert main(["ckpt", "export", str(directory), "--to", str(to), "--model", factory]) == 0
    fresh = small_model()
    fresh.load_weights(to)
    for got, want in zip(fresh.weights, model.weights):
        np.testing.assert_array_equal(got.numpy(), want.numpy())


def small_model():
    """The architecture of tests.ckpt_helpers.build, plain Keras (for --model)."""
    return keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)]
    )


def test_user_chosen_names_that_end_like_auto_numbers_must_be_equal():
    from keras_mirror_kit.checkpoint.state import pair_by_path

    shape = (2, 2)
    mine = pair_by_path([("model", "my_dense_1/kernel", shape)],
                        [("model", "my_dense_2/kernel", shape)], {"dense"})  # fmt: skip
    assert mine.pairs == [] and len(mine.differences) == 2
    # Keras' own numbering still matches, also in the optimizer's flattened paths.
    saved = [("model", "dense_1/kernel", shape),
             ("optimizer", "adam/sequential_1_dense_1_kernel", shape)]  # fmt: skip
    here = [("model", "dense_3/kernel", shape),
            ("optimizer", "adam_2/sequential_4_dense_3_kernel", shape)]  # fmt: skip
    auto = pair_by_path(saved, here, {"dense", "sequential", "adam"})
    assert auto.pairs == [(0, 0), (1, 1)] and auto.differences == []


def test_bfloat16_variables_restore_bit_for_bit(tmp_path):
    """NumPy has no bfloat16: its arrays are stored as their 2-byte patterns ('|V2'), and a
    restore reinterprets them as the variable's dtype (before: `ValueError: No cast function
    available`, or a value of another kind)."""

    def half_model():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, dtype="bfloat16")])
        model.compile(optimizer="sgd", loss="mse")
        return model

    model = half_model()
    x, y = np.ones((8, 3), "float32"), np.ones((8, 2), "float32")
    model.fit(x, y, epochs=1, verbose=0, callbacks=[SyncedCheckpoint(tmp_path / "ckpt")])
    fresh = half_model()
    restore(fresh, tmp_path / "ckpt")
    for saved, restored in zip(model.layers[0].weights, fresh.layers[0].weights):
        assert restored.dtype == "bfloat16"
        assert np.array_equal(
            np.asarray(saved).view(np.uint16), np.asarray(restored).view(np.uint16)
        )
