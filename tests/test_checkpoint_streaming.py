"""Checkpoints of big models (issue 12 items 1 and 2): a save streams the state variable by
variable into its file, a restore reads it back variable by variable, the replica check
compares the copies on their devices, and files written by keras-mirror-kit 0.1.0 (in one
piece) and by the code before the checkpoint package still resume exactly.

Host memory is measured with `tracemalloc`, which sees NumPy's buffers and Python's bytes
(everything a save or a restore copies to the host), not TensorFlow's own tensors. The
uninterrupted run the old files are compared with (`reference`) and the big model the
save is measured on (`big_model`) are made once for the module.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tracemalloc
import zipfile
from pathlib import Path
from typing import NamedTuple

import keras
import numpy as np
import pytest

import keras_mirror_kit as kmk
from keras_mirror_kit.callbacks.synced_checkpoint import SyncedCheckpoint
from keras_mirror_kit.checkpoint.divergence import (
    ReplicaDivergenceError,
    check_replicas,
)
from keras_mirror_kit.checkpoint.meta import CheckpointMeta, ManifestEntry
from keras_mirror_kit.checkpoint.state import state_variables
from keras_mirror_kit.checkpoint.store import CheckpointStore
from tests.ckpt_helpers import CountBatches, build, dataset, max_diff

MIB = 1 << 20
ARRAYS, ARRAY_MIB = 16, 2  # a 32 MiB state of 2 MiB arrays
DATA = Path(__file__).parent / "data"
# Checkpoints written by earlier versions, by the version that wrote them.
OLD_FILES = {"0.1.0": DATA / "ckpt-v0.1.0", "ee9bcb3": DATA / "ckpt-ee9bcb3"}


def _state():
    """The arrays, each made only when asked for (as the callback reads variables)."""
    for i in range(ARRAYS):
        yield f"model/{i:05d}", np.full(ARRAY_MIB * MIB // 4, i, np.float32)


def _peak_during(action) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        action()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_save_and_a_restore_hold_about_one_array_not_the_state(tmp_path):
    store = CheckpointStore(tmp_path)
    store.prepare()
    state = ARRAYS * ARRAY_MIB * MIB
    saved = _peak_during(lambda: store.write(_state(), CheckpointMeta(epoch=1, step=0)))
    # 0.1.0 built the whole file in memory (BytesIO, then a copy): over 2x the state.
    assert saved <= 0.25 * state, f"save peak {saved / MIB:.1f} MiB of a 32 MiB state"

    def restore():
        loaded = store.load_latest()
        assert loaded is not None and len(loaded.arrays) == ARRAYS
        for i, key in enumerate(sorted(loaded.arrays)):
            array = loaded.arrays[key]
            assert array.shape == loaded.shapes[key] and array[0] == i and array[-1] == i
            del array

    restored = _peak_during(restore)
    assert restored <= 0.25 * state, f"restore peak {restored / MIB:.1f} MiB"

    # The streamed file is an ordinary .npz (what 0.1.0 and NumPy read), still verified.
    path = tmp_path / store.entries()[-1].file
    with np.load(path, allow_pickle=False) as npz:
        assert npz["model/00003"][7] == 3 and len(npz.files) == ARRAYS + 1
    entry = store.entries()[-1]
    assert entry.crc32 and entry.size and entry.sha256 is None
    good = path.read_bytes()
    raw = bytearray(good)
    raw[len(raw) // 2] ^= 1  # one bit flipped inside an array
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="model/00008.npy fails its CRC"):
        store.read(entry)
    unlisted = ManifestEntry(file=path.name, index=entry.index)
    with pytest.raises(ValueError, match="CRC"):  # a file the manifest does not list
        store.read(unlisted)
    # Another whole, valid checkpoint in its place (same size): the manifest's checksum.
    other = CheckpointStore(tmp_path / "other")
    other.prepare()
    other.write(((k, v + 1) for k, v in _state()), CheckpointMeta(epoch=1, step=0))
    path.write_bytes((tmp_path / "other" / other.entries()[-1].file).read_bytes())
    assert path.stat().st_size == entry.size
    with pytest.raises(ValueError, match="does not match its checksum in the manifest"):
        store.read(entry)
    # One flipped bit in the zip's own directory (the first member's flags: "encrypted";
    # its method: "deflated"; its version needed): a ValueError, so a resume falls back.
    central = good.index(b"PK\x01\x02")
    for offset, bit in ((8, 0x01), (10, 0x08), (6, 0x40)):
        raw = bytearray(good)
        raw[central + offset] ^= bit
        path.write_bytes(bytes(raw))
        with pytest.raises(ValueError):
            store.read(entry)
        with pytest.raises(ValueError):
            store.read(unlisted)
    path.write_bytes(good)
    assert store.read(entry).meta.epoch == 1


@pytest.fixture(scope="module")
def big_model():
    """A 2-replica Adam model of about 3.3M weights (a 40 MiB state), shared by the two
    modes below: the second fit goes on from the first one's weights (same variables)."""

    @kmk.distributed(global_batch_size=16)
    def big():
        keras.utils.set_random_seed(1)
        model = keras.Sequential(
            [keras.Input((256,))]
            + [keras.layers.Dense(1024, activation="relu") for _ in range(3)]
            + [keras.layers.Dense(3)]
        )
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        return model

    return big()


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_save_of_the_callback_copies_one_variable_at_a_time_to_the_host(
    tmp_path, async_save, big_model
):
    model = big_model
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 256)).astype("float32"), rng.integers(0, 3, 32)
    mode = {"async_save": True} if async_save else {}  # the default: synchronous
    checkpoint = SyncedCheckpoint(tmp_path, save_freq="epoch", **mode)
    peaks: list[int] = []

    class Before(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            tracemalloc.start()
            tracemalloc.reset_peak()

    class After(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if async_save:
                checkpoint.wait_for_pending_save()  # the write, in the background
            peaks.append(tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()

    model.fit(x, y, epochs=1, verbose=0, callbacks=[Before(), checkpoint, After()])
    sizes = [int(np.prod(v.shape)) * 4 for _, v in state_variables(model)]  # Adam built
    state, largest = sum(sizes), max(sizes)
    assert state > 24 * MIB and peaks and CheckpointStore(tmp_path).load_latest() is not None
    # Before: every variable copied to NumPy, then the whole .npz built in memory (>2x).
    assert peaks[0] <= max(0.25 * state, 2.5 * largest), (peaks[0] / MIB, state / MIB)


def test_the_replica_check_brings_only_scalars_to_the_host():
    @kmk.distributed(global_batch_size=16)
    def wide():
        model = keras.Sequential([keras.Input((512,)), keras.layers.Dense(2048)])
        model.compile(optimizer="adam", loss="mse")
        return model

    model = wide()
    named = state_variables(model)
    kernel = model.layers[0].kernel  # 4 MiB, 2 copies
    assert check_replicas(model, named, atol=0.0) == 0.0
    peak = _peak_during(lambda: check_replicas(model, named, atol=0.0))
    assert peak < 1 * MIB, peak / MIB  # before: both copies of each variable, as NumPy
    copies = model.distribute_strategy.experimental_local_results(kernel.value)
    copies[1].assign(copies[1] + 1e-3)
    with pytest.raises(ReplicaDivergenceError, match=r"kernel \(max \|diff\| 0\.001\)"):
        check_replicas(model, named, atol=1e-4)
    assert check_replicas(model, named, atol=1e-2) == 0.0  # within the tolerance
    iterations = model.optimizer.iterations  # an integer variable
    int_copies = model.distribute_strategy.experimental_local_results(iterations.value)
    int_copies[1].assign(7)
    with pytest.raises(ReplicaDivergenceError, match=r"iteration.*max \|diff\| 7"):
        check_replicas(model, named, atol=1e-2)


class Reference(NamedTuple):
    weights: list[np.ndarray]
    directory: Path


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The run the old files were stopped in, uninterrupted (read-only: its weights, and
    its directory, whose files are compared with the old ones)."""
    directory = tmp_path_factory.mktemp("reference") / "ckpt"
    model, ds = build("adam"), dataset()
    uninterrupted = SyncedCheckpoint(directory, save_freq=4, dataset=ds)
    model.fit(ds, epochs=3, verbose=0, callbacks=[uninterrupted])
    return Reference(model.get_weights(), directory)


@pytest.mark.slow
@pytest.mark.parametrize("written_by", sorted(OLD_FILES))
def test_checkpoints_written_by_earlier_versions_resume_exactly(tmp_path, written_by, reference):
    """tests/data/ckpt-v0.1.0 was written by keras-mirror-kit 0.1.0 (commit 7cdaa18: the
    whole .npz built in memory, a SHA-256 per file in the manifest), tests/data/ckpt-ee9bcb3
    by commit ee9bcb3 (streamed, a CRC-32 of the members), the code before the checkpoint
    package; both with tests.ckpt_helpers' Adam model, dataset(), save_freq=4, fit(epochs=3)
    stopped by StopAt(1, 4). Their newest checkpoint is epoch 1, batch 2."""
    directory = tmp_path / "ckpt"
    shutil.copytree(OLD_FILES[written_by], directory)
    model, ds, counter = build("adam", seed=77), dataset(), CountBatches()
    checkpoint = SyncedCheckpoint(directory, save_freq=4, dataset=ds)
    model.fit(ds, epochs=3, verbose=0, callbacks=[checkpoint, counter])
    restored = checkpoint.last_restored
    assert restored.path.name == "ckpt-00000003.npz"  # the newest verified, none skipped
    assert (restored.meta.epoch, restored.meta.step, restored.meta.version) == (1, 2, 1)
    assert (restored.meta["epoch"], restored.meta["step"]) == (1, 2)  # the mapping view
    assert counter.batches == 4 + 6  # the rest of epoch 1, then epoch 2
    assert int(model.optimizer.iterations.numpy()) == 18
    assert max_diff(reference.weights, model.get_weights()) <= 1e-6
    # A save now writes what that version wrote: the same arrays, metadata keys (in order;
    # 0.1.0 did not record the architecture) and manifest keys (0.1.0: a SHA-256).
    files = []
    for folder in (reference.directory, OLD_FILES[written_by]):
        listed = json.loads((folder / "manifest.json").read_text())["checkpoints"][-1]
        files.append((listed, folder / listed["file"]))
    (now, new), (then, old) = files
    assert list(now) == [key.replace("sha256", "crc32") for key in then]
    meta_now, meta_then = _raw_meta(new), _raw_meta(old)
    added = ("model_config", "backend", "trained")  # keys added since those versions
    assert [k for k in meta_now if k not in added or k in meta_then] == list(meta_then)
    assert meta_now["backend"] == "tensorflow"
    # ...and the metrics' values, which resume part-way epochs since (those old files have
    # none: their resumed epoch logs its batches from the checkpoint on).
    assert [n for n in _array_names(new) if not n.startswith("metrics/")] == _array_names(old)
    assert [n for n in _array_names(new) if n.startswith("metrics/")]


def _raw_meta(path: Path) -> dict:
    """The metadata of a checkpoint file as its JSON holds it."""
    with zipfile.ZipFile(path) as archive, archive.open("__meta__.npy") as member:
        return json.loads(np.lib.format.read_array(member).tobytes())


def _array_names(path: Path) -> list[str]:
    with zipfile.ZipFile(path) as archive:
        return archive.namelist()


@pytest.mark.parametrize("written_by", sorted(OLD_FILES))
def test_the_metadata_schema_reads_and_writes_earlier_files_key_for_key(written_by):
    """`CheckpointMeta` and `ManifestEntry` give back the JSON of the files and the manifest
    of earlier versions exactly (keys, values, order): the format did not change."""
    directory = OLD_FILES[written_by]
    manifest = json.loads((directory / "manifest.json").read_text())
    assert len(manifest["checkpoints"]) == 3
    for listed in manifest["checkpoints"]:
        entry = ManifestEntry.from_json(listed)
        assert json.dumps(entry.to_json()) == json.dumps(listed)
        raw = _raw_meta(directory / listed["file"])
        meta = CheckpointMeta.from_json(raw)
        assert json.dumps(meta.to_json()) == json.dumps(raw)
        assert dict(meta) == raw and not meta.legacy_state
        # The manifest entry a save makes of this metadata is the one listed.
        made = ManifestEntry.of(meta, listed["file"], entry.crc32, entry.size)
        assert dataclasses.replace(made, sha256=entry.sha256) == entry
    # A file without "state" (before random-state saving) holds model.weights.
    assert CheckpointMeta.from_json({k: v for k, v in raw.items() if k != "state"}).legacy_state
