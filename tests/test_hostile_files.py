"""Checkpoint directories someone else made (issue 33): links, FIFOs, bombs, malformed fields.

Each hostile directory is a good one (two checkpoints) with one thing changed by a function
of `HOSTILE`; a changed checkpoint gets a manifest entry that matches it (size, checksum),
as whoever made it would write. Each goes through the real entry points:

* `keras-mirror-kit ckpt verify` (and `ls`): in this process (`cli.main`) for files that
  cannot blow memory or hang; one cheap child per case (no TensorFlow) under
  `RLIMIT_AS` and a timeout for those that could, its peak RSS within 100 MiB of a good
  directory's;
* `fit` resuming with `SyncedCheckpoint`, and `kmk.restore` with `ckpt export`: one
  TensorFlow child (slow tier, one test) that trains the good directory once and
  runs every case of both in turn, each in a copy of its own, whose peak memory per case
  (`tracemalloc`, which NumPy reports to) is compared with a good case's of the same
  kind, under a watchdog that ends the child should its memory run away.

Outside the directory, a file a link points to is never read (the model never gets its
weights; a FIFO there is never opened, which would hang), written or deleted (its bytes
and mtime are compared). The directory named may itself be a link (the user named it),
and a hard link is a regular file like any other: both are read.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import warnings
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from keras_mirror_kit.checkpoint.lock import (
    LOCK_FILE,
    CheckpointLockedError,
    DirectoryLock,
    StaleLockWarning,
)
from keras_mirror_kit.checkpoint.meta import CheckpointMeta, checkpoint_index, checkpoint_name
from keras_mirror_kit.checkpoint.store import (
    CheckpointStore,
    CorruptCheckpointWarning,
    _members_checksum,
)
from keras_mirror_kit.cli import main
from tests.subproc import REPO, last_json, run_python

MIB = 1 << 20
GIB = 1 << 30

# -- building checkpoint files by hand (NumPy only) ---------------------------------------------


def plain_directory(directory: Path) -> Path:
    """Two checkpoints as SyncedCheckpoint writes them, of made-up variables (no TensorFlow)."""
    store = CheckpointStore(directory)
    store.prepare()
    paths = ("model:dense/kernel", "model:dense/bias", "model:dense_1/kernel")
    paths += ("model:dense_1/bias", "optimizer:adam/iteration")
    for epoch in (1, 2):
        arrays = {
            "model/00000": np.full((6, 8), epoch, np.float32),
            "model/00001": np.full((8,), epoch, np.float32),
            "model/00002": np.full((8, 3), epoch, np.float32),
            "model/00003": np.full((3,), epoch, np.float32),
            "optimizer/00004": np.array(6 * epoch, np.int64),
            "random/global": np.array([0, 42], np.int64),
        }
        meta = CheckpointMeta(
            epoch=epoch,
            step=0,
            epoch_end=True,
            variables=paths,
            callbacks={"EarlyStopping#0": {"wait": 0, "best": 0.5}},
        )
        store.write(arrays, meta)
    return directory


def _checkpoints(directory: Path) -> list[Path]:
    """The regular checkpoint files of a directory, oldest first."""
    return sorted(p for p in directory.iterdir() if checkpoint_index(p.name) and p.is_file())


def _newest(directory: Path) -> Path:
    return _checkpoints(directory)[-1]


def _next_name(directory: Path) -> Path:
    return directory / checkpoint_name(checkpoint_index(_newest(directory).name) + 1)


def _members(path: Path) -> list[tuple[str, bytes]]:
    """Every member of a zip with its bytes (a `.npy` header and data), in order."""
    with zipfile.ZipFile(path) as archive:
        return [(info.filename, archive.read(info)) for info in archive.infolist()]


def _write_zip(path: Path, members: list[tuple[str, bytes]], deflated: tuple[str, ...] = ()):
    """Writes `members` as a new zip at `path` (stored, but `deflated` members), CRCs right."""
    path.unlink(missing_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile's "Duplicate name"
        with zipfile.ZipFile(path, "w") as archive:
            for name, data in members:
                info = zipfile.ZipInfo(name)
                info.compress_type = zipfile.ZIP_DEFLATED if name in deflated else 0
                archive.writestr(info, data)


def _relist(directory: Path, path: Path) -> None:
    """Makes the manifest's entry of `path` match it (size and checksum), as a forger would."""
    manifest = directory / "manifest.json"
    data = json.loads(manifest.read_text())
    with zipfile.ZipFile(path) as archive:
        crc = _members_checksum(archive)
    for entry in data["checkpoints"]:
        if entry["file"] == path.name:
            entry.update(crc32=crc, size=path.stat().st_size)
    manifest.write_text(json.dumps(data))


def npy(shape: tuple[int, ...], descr: str, data: bytes, version: int = 1) -> bytes:
    """An `.npy` member: a header of `version` (1 or 3) saying `shape` and `descr`, then `data`."""
    text = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape!r}, }}"
    prefix = 10 if version == 1 else 12
    text += " " * (-(prefix + len(text) + 1) % 64) + "\n"
    size = struct.pack("<H" if version == 1 else "<I", len(text))
    return b"\x93NUMPY" + bytes([version, 0]) + size + text.encode("ascii") + data


def _array_data(member: bytes) -> bytes:
    """The data of a version 1.0 `.npy` member (after its header)."""
    (length,) = struct.unpack("<H", member[8:10])
    return member[10 + length :]


def _edit_member(directory: Path, name: str, make: Callable[[bytes | None], bytes | None]):
    """Replaces (or adds, or with None drops) one member of the newest checkpoint."""
    path = _newest(directory)
    members = _members(path)
    old = dict(members).get(name)
    new = make(old)
    members = [(n, d) for n, d in members if n != name]
    if new is not None:
        members.insert(0, (name, new))
    _write_zip(path, members)
    _relist(directory, path)


def _meta_of(path: Path) -> dict:
    return json.loads(_array_data(dict(_members(path))["__meta__.npy"]))


def _set_meta(directory: Path, text: bytes) -> None:
    """The newest checkpoint's metadata member, holding `text`."""
    _edit_member(directory, "__meta__.npy", lambda _: npy((len(text),), "|u1", text))


def _edited_meta(edit: Callable[[dict], None]) -> Callable[[Path, Path], None]:
    def mutate(directory: Path, outside: Path) -> None:
        meta = _meta_of(_newest(directory))
        edit(meta)
        _set_meta(directory, json.dumps(meta).encode())

    return mutate


# -- the hostile directories ------------------------------------------------------------------


def _outside_checkpoint(directory: Path, outside: Path) -> Path:
    """A valid checkpoint outside: the newest one's state, every float value + 100."""
    source = _newest(directory)
    with np.load(source, allow_pickle=False) as npz:
        arrays = {k[: -len(".npy")] if k.endswith(".npy") else k: npz[k] for k in npz.files}
    meta = CheckpointMeta.from_json(json.loads(arrays.pop("__meta__").tobytes()))
    shifted = {k: v + 100 if v.dtype.kind == "f" else v for k, v in arrays.items()}
    store = CheckpointStore(outside / "elsewhere")
    store.prepare()
    return store.write(shifted, meta)


def symlink_elsewhere(directory: Path, outside: Path) -> None:
    """A newer `ckpt-*.npz` (not in the manifest) that links to a checkpoint elsewhere."""
    _next_name(directory).symlink_to(_outside_checkpoint(directory, outside))


def listed_symlink(directory: Path, outside: Path) -> None:
    """The newest, listed checkpoint moved outside and linked back: the same bytes."""
    path = _newest(directory)
    moved = outside / "moved.npz"
    shutil.move(path, moved)
    path.symlink_to(moved)


def _raw_zip(members: list[tuple[str, int, int, int, bytes]]) -> bytes:
    """A zip of `(name, method, crc, size, payload)` members, their payloads as given."""
    local, central = b"", b""
    for name, method, crc, size, payload in members:
        raw = name.encode()
        central += struct.pack(
            "<4s6H3L5H2L", b"PK\1\2", 20, 20, 0, method, 0, 0, crc, len(payload), size,
            len(raw), 0, 0, 0, 0, 0, len(local),
        ) + raw  # fmt: skip
        local += struct.pack(
            "<4s5H3L2H", b"PK\3\4", 20, 0, method, 0, 0, crc, len(payload), size, len(raw), 0
        ) + raw + payload  # fmt: skip
    count = len(members)
    end = struct.pack("<4s4H2LH", b"PK\5\6", 0, 0, count, count, len(central), len(local), 0)
    return local + central + end


def meta_bomb(directory: Path, outside: Path) -> None:
    """The metadata member deflated: valid JSON, then spaces, 1 GiB expanded (about 1 MiB)."""
    path = _newest(directory)
    members = _members(path)
    meta = _array_data(dict(members)["__meta__.npy"])
    chunk, count = b" " * (8 * MIB), GIB // (8 * MIB)
    prefix = npy((len(meta) + count * len(chunk),), "|u1", meta)
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = deflate.compress(prefix) + deflate.flush(zlib.Z_FULL_FLUSH)
    # After a full flush the compressor starts afresh: each chunk compresses alike.
    body = deflate.compress(chunk) + deflate.flush(zlib.Z_FULL_FLUSH)
    payload = head + body * count + deflate.flush()
    crc = zlib.crc32(prefix)
    for _ in range(count):
        crc = zlib.crc32(chunk, crc)
    stored = [(name, 0, zlib.crc32(data), len(data), data) for name, data in members]
    bomb = ("__meta__.npy", 8, crc, len(prefix) + count * len(chunk), payload)
    path.write_bytes(_raw_zip([*stored[:-1], bomb]))
    _relist(directory, path)


def meta_huge_header(directory: Path, outside: Path) -> None:
    """The metadata's header claims 10**12 bytes; the member holds its few real ones."""
    meta = _array_data(dict(_members(_newest(directory)))["__meta__.npy"])
    _edit_member(directory, "__meta__.npy", lambda _: npy((10**12,), "|u1", meta))


def v3_huge(directory: Path, outside: Path) -> None:
    """A model array with an .npy 3.0 header claiming 10**12 values."""
    _edit_member(
        directory, "model/00000.npy", lambda old: npy((10**12,), "<f4", _array_data(old), 3)
    )


def short_data(directory: Path, outside: Path) -> None:
    """A model array (the third) with its CRC right but half the data its header needs."""
    _edit_member(directory, "model/00002.npy", lambda old: old[: len(old) - 48])


def traversal(directory: Path, outside: Path) -> None:
    """A member named `model/../x.npy`."""
    first = dict(_members(_newest(directory)))["model/00000.npy"]
    _edit_member(directory, "model/../x.npy", lambda _: first)


def absolute_name(directory: Path, outside: Path) -> None:
    """A member named with an absolute path, `/model/00000.npy`."""
    first = dict(_members(_newest(directory)))["model/00000.npy"]
    _edit_member(directory, "/model/00000.npy", lambda _: first)


def nul_name(directory: Path, outside: Path) -> None:
    """A member whose name holds a NUL (`model/00099.npy\\0x`: zipfile cuts it there)."""
    path = _newest(directory)
    first = dict(_members(path))["model/00000.npy"]
    _edit_member(directory, "model/00099.npy#x", lambda _: first)
    path.write_bytes(path.read_bytes().replace(b"model/00099.npy#x", b"model/00099.npy\0x"))
    _relist(directory, path)


def duplicate_member(directory: Path, outside: Path) -> None:
    """A second member of one name (zipfile reads the last)."""
    path = _newest(directory)
    members = _members(path)
    first = dict(members)["model/00000.npy"]
    _write_zip(path, [*members, ("model/00000.npy", first)])
    _relist(directory, path)


def compressed_member(directory: Path, outside: Path) -> None:
    """A model array deflated (of its true size; the kit writes members stored)."""
    path = _newest(directory)
    _write_zip(path, _members(path), deflated=("model/00000.npy",))
    _relist(directory, path)


def random_shape(directory: Path, outside: Path) -> None:
    """Keras' global random state saved as 3 integers (it is 2)."""
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, np.array([1, 2, 3], np.int64))
    _edit_member(directory, "random/global.npy", lambda _: buffer.getvalue())


def callback_missing(directory: Path, outside: Path) -> None:
    """A callback state naming arrays the file does not hold (KeyError at the first epoch)."""
    _edited_meta(
        lambda meta: (
            meta["callbacks"]
            .setdefault("EarlyStopping#0", {})
            .update(best_weights={"__arrays__": 2})
        )
    )(directory, outside)


def meta_types(directory: Path, outside: Path) -> None:
    """The metadata's `variables` a number, not a list (TypeError before)."""
    _edited_meta(lambda meta: meta.update(variables=5))(directory, outside)


def meta_infinity(directory: Path, outside: Path) -> None:
    """The metadata's epoch `1e400` (a float infinity when parsed; OverflowError before)."""
    meta = _meta_of(_newest(directory))
    text = json.dumps(meta).replace(f'"epoch": {meta["epoch"]}', '"epoch": 1e400', 1)
    _set_meta(directory, text.encode())


def huge_central_directory(directory: Path, outside: Path) -> None:
    """A newer file of 1.2 million members (a 73 MiB zip directory), all one stored array."""
    name = b"model/00000.npy"
    data = npy((1,), "<f4", b"\0\0\0\0")
    crc = zipfile.crc32(data)
    local = struct.pack(
        "<4s5H3L2H", b"PK\3\4", 20, 0, 0, 0, 0, crc, len(data), len(data), len(name), 0
    ) + name + data  # fmt: skip
    entry = struct.pack(
        "<4s6H3L5H2L", b"PK\1\2", 20, 20, 0, 0, 0, 0, crc, len(data), len(data), len(name),
        0, 0, 0, 0, 0, 0,
    ) + name  # fmt: skip
    count = 1_200_000
    central = entry * count
    end64 = struct.pack(
        "<4sQ2H2L4Q", b"PK\6\6", 44, 45, 45, 0, 0, count, count, len(central), len(local)
    )
    locator = struct.pack("<4sLQL", b"PK\6\7", 0, len(local) + len(central), 1)
    end = struct.pack("<4s4H2LH", b"PK\5\6", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    _next_name(directory).write_bytes(local + central + end64 + locator + end)


def ckpt_fifo(directory: Path, outside: Path) -> None:
    """A newer `ckpt-*.npz` that is a FIFO (opening it for reading would wait for a writer)."""
    os.mkfifo(_next_name(directory))


def ckpt_directory(directory: Path, outside: Path) -> None:
    """A newer `ckpt-*.npz` that is a directory."""
    _next_name(directory).mkdir()


def _manifest(directory: Path) -> Path:
    path = directory / "manifest.json"
    path.unlink()
    return path


def manifest_dev_zero(directory: Path, outside: Path) -> None:
    """`manifest.json` a link to `/dev/zero` (read until memory ran out before)."""
    _manifest(directory).symlink_to("/dev/zero")


def manifest_outside_fifo(directory: Path, outside: Path) -> None:
    """`manifest.json` a link to a FIFO outside (opening it would hang: it is never opened)."""
    os.mkfifo(outside / "fifo")
    _manifest(directory).symlink_to(outside / "fifo")


def manifest_fifo(directory: Path, outside: Path) -> None:
    """`manifest.json` a FIFO."""
    os.mkfifo(_manifest(directory))


def manifest_brackets(directory: Path, outside: Path) -> None:
    """`manifest.json` 100 KB of `[` (RecursionError before)."""
    (directory / "manifest.json").write_text("[" * 100_000)


def _edit_manifest(directory: Path, edit: Callable[[str], str]) -> None:
    path = directory / "manifest.json"
    path.write_text(edit(path.read_text()))


def manifest_numbers(directory: Path, outside: Path) -> None:
    """Sizes and scores no number holds: `Infinity`, 10**400 (OverflowError before)."""
    data = json.loads((directory / "manifest.json").read_text())
    first, newest = data["checkpoints"][0], data["checkpoints"][-1]
    first.update(monitor="loss", mode="min", score=10**400, size=10**400)
    newest["size"] = "SIZE"
    text = json.dumps(data).replace('"SIZE"', "Infinity")
    (directory / "manifest.json").write_text(text)


def manifest_names(directory: Path, outside: Path) -> None:
    """Entries naming files outside, or names that only look like a checkpoint's."""
    copy = outside / "ckpt-00000009.npz"
    shutil.copy(_newest(directory), copy)
    data = json.loads((directory / "manifest.json").read_text())
    for name in (str(copy), "../outside/ckpt-00000009.npz", "ckpt-00000009.npz\n",
                 "ckpt-\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0669.npz"):  # fmt: skip
        data["checkpoints"].append({**data["checkpoints"][-1], "file": name})
    (directory / "manifest.json").write_text(json.dumps(data))


def unregistered_class(directory: Path, outside: Path) -> None:
    """The recorded architecture names a class nobody registered (as a custom model does)."""

    def edit(meta: dict) -> None:
        meta["model_config"].update(
            module=None, class_name="CustomModel", registered_name="my_package>CustomModel"
        )

    _edited_meta(edit)(directory, outside)


def lock_fifo(directory: Path, outside: Path) -> None:
    """`writer.lock` a FIFO (`fit` waited in on_train_begin before)."""
    os.mkfifo(directory / LOCK_FILE)


def lock_dev_zero(directory: Path, outside: Path) -> None:
    """`writer.lock` a link to `/dev/zero`."""
    (directory / LOCK_FILE).symlink_to("/dev/zero")


def lock_big_pid(directory: Path, outside: Path) -> None:
    """A lock of this host naming pid 2**31 + 7, which no process has (OverflowError before)."""
    record = {"pid": 2**31 + 7, "host": socket.gethostname(), "token": "feedface"}
    (directory / LOCK_FILE).write_text(json.dumps(record))


def benign(directory: Path, outside: Path) -> None:
    """Nothing changed: the case the others are compared with."""


HOSTILE: dict[str, Callable[[Path, Path], None]] = {
    f.__name__: f
    for f in (
        benign, symlink_elsewhere, listed_symlink, meta_bomb, meta_huge_header, v3_huge,
        short_data, traversal, absolute_name, nul_name, duplicate_member, compressed_member,
        random_shape, callback_missing, meta_types, meta_infinity, huge_central_directory,
        ckpt_fifo, ckpt_directory, manifest_dev_zero, manifest_outside_fifo, manifest_fifo,
        manifest_brackets, manifest_numbers, manifest_names, unregistered_class, lock_fifo,
        lock_dev_zero, lock_big_pid,
    )
}  # fmt: skip


def prepare(root: Path, good: Path, case: str) -> tuple[Path, Path, dict[str, tuple]]:
    """A copy of `good` made hostile by `HOSTILE[case]`; its outside folder; what is there."""
    directory, outside = root / case, root / f"{case}-outside"
    shutil.copytree(good, directory, symlinks=True)
    outside.mkdir()
    HOSTILE[case](directory, outside)
    return directory, outside, outside_files(outside)


def outside_files(outside: Path) -> dict[str, tuple]:
    """Each file outside with its bytes and mtime (a FIFO: its type), not following links."""
    found = {}
    for path in sorted(outside.rglob("*")):
        info = path.lstat()
        if path.is_file() and not path.is_symlink():
            found[str(path)] = (path.read_bytes(), info.st_mtime_ns)
        else:
            found[str(path)] = (info.st_mode, info.st_mtime_ns)
    return found


# -- ckpt verify and ls, in this process ---------------------------------------------------------


@pytest.fixture
def good(tmp_path: Path) -> Path:
    return plain_directory(tmp_path / "good")


def _cli(*argv: str, capsys) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# case: (what the CORRUPT line of the newest or the added file says)
CORRUPT_IN_PROCESS = {
    "symlink_elsewhere": "ckpt-00000003.npz: CORRUPT (cannot read ckpt-00000003.npz: it is a "
    "symbolic link, which the kit does not follow)",
    "listed_symlink": "ckpt-00000002.npz: CORRUPT (cannot read ckpt-00000002.npz: it is a "
    "symbolic link",
    "short_data": "member 'model/00002.npy' holds 48 bytes of data; its header ((8, 3) "
    "float32) needs 96",
    "traversal": "it holds a member 'model/../x.npy', not one of a checkpoint's",
    "absolute_name": "it holds a member '/model/00000.npy', not one of a checkpoint's",
    "nul_name": "it holds a duplicate or NUL-cut member name 'model/00099.npy'",
    "duplicate_member": "it holds a duplicate or NUL-cut member name 'model/00000.npy'",
    "compressed_member": "member 'model/00000.npy' is compressed (method 8)",
    "random_shape": "array random/global is (3,) int64, not a seed state of two integers",
    "callback_missing": "its callback state refers to 2 missing array(s): "
    "'callback/EarlyStopping#0/best_weights/00000'",
    "meta_types": "its 'variables' is not a list of strings",
    "meta_infinity": "its 'epoch' is not a whole number (inf)",
    "ckpt_directory": "ckpt-00000003.npz: CORRUPT (cannot read ckpt-00000003.npz: it is a "
    "directory, not a regular file)",
}


@pytest.mark.parametrize("case", sorted(CORRUPT_IN_PROCESS))
def test_verify_reports_a_hostile_checkpoint_as_corrupt_and_reads_nothing_outside(
    tmp_path, good, case, capsys
):
    directory, outside, before = prepare(tmp_path, good, case)
    code, out, err = _cli("ckpt", "verify", str(directory), capsys=capsys)
    lines = out.splitlines()
    corrupt = [line for line in lines if "CORRUPT" in line]
    assert code == 1 and len(corrupt) == 1, out + err
    assert CORRUPT_IN_PROCESS[case] in corrupt[0]
    assert lines[0] == "ckpt-00000001.npz: ok (size, checksum and CRCs ok)"
    assert lines[-1].endswith("1 corrupt") and not err
    code, out, err = _cli("ckpt", "ls", str(directory), capsys=capsys)  # lists, no error
    assert code == 0 and "ckpt-00000001.npz" in out and not err
    assert outside_files(outside) == before


def test_verify_reads_the_files_when_the_manifest_is_unreadable(tmp_path, good, capsys):
    for case, says in (
        ("manifest_brackets", "its JSON nests too deeply"),
        ("manifest_numbers", None),
        ("manifest_names", None),
    ):
        directory, outside, before = prepare(tmp_path, good, case)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            code, out, err = _cli("ckpt", "verify", str(directory), capsys=capsys)
            listed, _, ls_err = _cli("ckpt", "ls", str(directory), capsys=capsys)
        messages = [str(w.message) for w in caught if w.category is CorruptCheckpointWarning]
        assert code == 0 and listed == 0 and not err and not ls_err, (case, out, err, ls_err)
        assert out.splitlines()[-1] == "2 of 2 checkpoint(s) verified, 0 corrupt", (case, out)
        assert "Infinity" not in out and "ckpt-00000009" not in out, (case, out)
        assert outside_files(outside) == before
        if says is None:  # the manifest is read; its malformed entries count for nothing
            assert not messages, (case, messages)
        else:
            assert messages and says in messages[0] and "reading the checkpoint" in messages[0]
            assert out.count("not in the manifest; zip CRCs ok") == 2


def test_a_directory_named_through_a_link_hard_links_and_npy_3_headers_are_read(
    tmp_path, good, capsys
):
    """The directory the user names may be a link; inside, a hard link is a regular file
    (its bytes are those of a file of the directory) and an .npy 3.0 header of the right
    length is read like a 1.0 one; a symbolic link inside is not."""
    link = tmp_path / "named"
    link.symlink_to(good)
    elsewhere = _outside_checkpoint(good, tmp_path / "other")
    os.link(elsewhere, good / "ckpt-00000003.npz")
    (good / "ckpt-00000004.npz").symlink_to(elsewhere)
    path = good / "ckpt-00000005.npz"
    members = _members(elsewhere)
    data = _array_data(dict(members)["model/00001.npy"])
    members = [(n, d if n != "model/00001.npy" else npy((8,), "<f4", data, 3)) for n, d in members]
    _write_zip(path, members)
    code, out, err = _cli("ckpt", "verify", str(link), capsys=capsys)
    lines = out.splitlines()
    assert lines[2] == "ckpt-00000003.npz: ok (not in the manifest; zip CRCs ok)", out
    assert lines[3].startswith("ckpt-00000004.npz: CORRUPT (cannot read ckpt-00000004.npz: "
                               "it is a symbolic link")  # fmt: skip
    assert lines[4] == "ckpt-00000005.npz: ok (not in the manifest; zip CRCs ok)", out
    assert code == 1 and lines[-1] == "4 of 5 checkpoint(s) verified, 1 corrupt"
    loaded = CheckpointStore(link).read(CheckpointStore(link).entries()[-1])
    assert loaded.shapes["model/00001"] == (8,)
    np.testing.assert_array_equal(loaded.arrays["model/00001"], np.frombuffer(data, "<f4"))


def test_a_save_refuses_an_array_name_that_a_read_would_refuse(tmp_path):
    store = CheckpointStore(tmp_path)
    store.prepare()
    for name in ("callback/Mine#0/a\\b", "callback/Mine#0/..", "model/../x", "/model/0"):
        with pytest.raises(ValueError, match="cannot store an array named"):
            store.write({name: np.zeros(2)}, CheckpointMeta(epoch=1, step=0))
    assert not _checkpoints(tmp_path) and not list(tmp_path.iterdir())


def test_a_lock_that_is_no_lock_file_is_refused_and_an_impossible_pid_is_stale(tmp_path):
    """`fit` takes the lock through `DirectoryLock.acquire` (FIFO and /dev/zero locks go
    through `fit` itself in the TensorFlow child below)."""
    for name, make, says in (
        ("dir", lambda p: p.mkdir(), "it is a directory, not a regular file"),
        ("link", lambda p: p.symlink_to(tmp_path / "elsewhere.lock"), "symbolic link"),
        ("big", lambda p: p.write_bytes(b" " * (65 << 10)), "over the 65536 bytes"),
    ):
        directory = tmp_path / name
        directory.mkdir()
        (tmp_path / "elsewhere.lock").write_text(json.dumps({"pid": 1, "host": "gone"}))
        make(directory / LOCK_FILE)
        with pytest.raises(CheckpointLockedError, match="cannot be read as the record") as info:
            DirectoryLock(directory).acquire()
        assert says in str(info.value) and "delete the lock file" in str(info.value)
    directory = tmp_path / "pid"
    directory.mkdir()
    lock_big_pid(directory, tmp_path)
    with pytest.warns(StaleLockWarning, match=f"process {2**31 + 7} on .* no longer runs"):
        DirectoryLock(directory).acquire()
    assert DirectoryLock(directory).read()["pid"] == os.getpid()


# -- ckpt verify in a child under a memory cap, for what could blow memory or hang ---------------

_VERIFY_CHILD = """
import os, resource, sys
import keras_mirror_kit.checkpoint.store  # NumPy and the kit's reading code, before the cap
from keras_mirror_kit.cli import main

with open("/proc/self/statm") as f:
    mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
cap = mapped + int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
code = main(["ckpt", "verify", sys.argv[1]])
with open("/proc/self/status") as f:  # this image's own peak (ru_maxrss counts the fork's)
    peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
sys.stderr.write(f"PEAK {peak} TENSORFLOW {'tensorflow' in sys.modules}\\n")
sys.exit(code)
"""
CAP = 512 * MIB  # address space beyond what the child has mapped once imported


def _verify_child(directory: Path) -> tuple[int, str, str, int]:
    """`ckpt verify` in a new interpreter under `RLIMIT_AS` and a timeout: code, out, err, peak."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _VERIFY_CHILD, str(directory), str(CAP)],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    tail = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
    assert tail.startswith("PEAK ") and tail.endswith("TENSORFLOW False"), proc.stderr[-3000:]
    return proc.returncode, proc.stdout, proc.stderr, int(tail.split()[1])


@pytest.fixture(scope="module")
def good_verify_peak(tmp_path_factory) -> int:
    directory = plain_directory(tmp_path_factory.mktemp("verify-peak") / "good")
    code, out, _, peak = _verify_child(directory)
    assert code == 0 and out.splitlines()[-1] == "2 of 2 checkpoint(s) verified, 0 corrupt"
    return peak


# case: (exit code, what stdout holds, what stderr holds)
IN_A_CHILD = {
    "meta_bomb": (1, "ckpt-00000002.npz: CORRUPT (ckpt-00000002.npz is not a readable "
                  "checkpoint (member '__meta__.npy' is compressed (method 8)", ""),
    "meta_huge_header": (1, "its header ((1000000000000,) uint8) needs 1000000000000", ""),
    "v3_huge": (1, "its header ((1000000000000,) float32) needs 4000000000000", ""),
    "huge_central_directory": (1, "ckpt-00000003.npz: CORRUPT (ckpt-00000003.npz is not a "
                               "readable checkpoint (its zip directory claims 73200000 bytes", ""),
    "ckpt_fifo": (1, "ckpt-00000003.npz: CORRUPT (cannot read ckpt-00000003.npz: it is a FIFO "
                  "(named pipe), not a regular file)", ""),
    "manifest_dev_zero": (0, "2 of 2 checkpoint(s) verified, 0 corrupt", "(it is a symbolic "
                          "link, which the kit does not follow); reading the checkpoint files"),
    "manifest_outside_fifo": (0, "2 of 2 checkpoint(s) verified", "it is a symbolic link"),
    "manifest_fifo": (0, "2 of 2 checkpoint(s) verified", "it is a FIFO (named pipe), not a "
                      "regular file"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(IN_A_CHILD))
def test_verify_of_a_file_that_could_blow_memory_or_hang_answers_within_bounds(
    tmp_path, case, good_verify_peak
):
    good = plain_directory(tmp_path / "good")
    directory, outside, before = prepare(tmp_path, good, case)
    code, out, err, peak = _verify_child(directory)
    expected_code, says, err_says = IN_A_CHILD[case]
    assert code == expected_code and says in out, out + err[-3000:]
    assert err_says in err.replace("\n", " ").replace("  ", " ") and "Traceback" not in err, err
    assert peak - good_verify_peak <= 100 * MIB, (peak, good_verify_peak)
    assert outside_files(outside) == before


# -- fit, restore and export: one TensorFlow child, every case in turn ----------------------------


def watchdog(limit: int = 2 * GIB) -> None:
    """Ends this process (status 70) should its RSS grow by `limit`: a runaway read."""
    import threading
    import time

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    base = rss()

    def watch() -> None:
        while rss() - base <= limit:
            time.sleep(0.02)  # a sampling interval: nothing the tests assert depends on it
        os.write(2, b"RSS CAP: a read ran away\n")
        os._exit(70)

    threading.Thread(target=watch, daemon=True).start()


def model_arrays(path: Path) -> list[np.ndarray]:
    """The `model/*` arrays of a checkpoint file, in variable order (read with NumPy)."""
    with np.load(path, allow_pickle=False) as npz:
        return [npz[k] for k in sorted(npz.files) if k.startswith("model/")]


def which(values: list[np.ndarray], candidates: dict[str, Path]) -> list[str]:
    """The candidates (checkpoint files) whose model arrays `values` equal."""
    return [
        name
        for name, path in candidates.items()
        if path.is_file()
        and len(model_arrays(path)) == len(values)
        and all(np.array_equal(a, b) for a, b in zip(model_arrays(path), values))
    ]


_CHILD_START = """
import contextlib, io, json, tracemalloc, warnings
from pathlib import Path
import keras
import numpy as np
import keras_mirror_kit as kmk
from keras_mirror_kit.cli import main
from tests.ckpt_helpers import build, dataset
from tests.test_hostile_files import model_arrays, outside_files, prepare, watchdog, which

watchdog()
ROOT = Path(@ROOT@)
good, ds = ROOT / "good", dataset()
early = lambda: keras.callbacks.EarlyStopping(monitor="loss", patience=50)
build("adam").fit(ds, epochs=2, verbose=0, callbacks=[kmk.SyncedCheckpoint(good), early()])
files = {n: good / n for n in ("ckpt-00000001.npz", "ckpt-00000002.npz")}

def candidates(outside):
    return {**files, "outside": outside / "elsewhere" / "ckpt-00000001.npz"}

def measured(action):
    tracemalloc.start()
    tracemalloc.reset_peak()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            value, error = action(), None
        except Exception as err:
            value, error = None, f"{type(err).__name__}: {err}"
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    said = [f"{w.category.__name__}: {w.message}"[:400] for w in caught
            if w.category.__name__ in ("CorruptCheckpointWarning", "StaleLockWarning")]
    return value, {"error": error and error[:600], "peak": peak, "warnings": said}
"""

_FIT_PART = """
class Probe(keras.callbacks.Callback):  # the state restored, before any step
    weights = None
    def on_train_begin(self, logs=None):
        self.weights = [np.array(v.numpy()) for v in self.model.variables]

FIT_ROOT = ROOT / "fit"  # each case in a copy of the good directory of its own
FIT_ROOT.mkdir()
results, model = {}, build("adam", seed=77)  # one model: its train function is traced once
start = [np.array(v.numpy()) for v in model.variables]
for case in @CASES@:
    directory, outside, before = prepare(FIT_ROOT, good, case)
    for variable, value in zip(model.variables, start):
        variable.assign(value)
    probe, checkpoint = Probe(), kmk.SyncedCheckpoint(directory)
    fit = lambda: model.fit(ds, epochs=2, verbose=0, callbacks=[checkpoint, early(), probe])
    _, result = measured(fit)
    now = [np.array(v.numpy()) for v in model.variables]
    result.update(
        restored=checkpoint.last_restored and checkpoint.last_restored.path.name,
        restored_is=which(probe.weights, candidates(outside)) if probe.weights else None,
        untouched=all(np.array_equal(a, b) for a, b in zip(start, now)),
        outside_same=outside_files(outside) == before,
    )
    results[case] = result
fit_results = results
"""

# case: (checkpoint restored, what its warning says, or the error of fit)
FIT = {
    "benign": ("ckpt-00000002.npz", None),
    "symlink_elsewhere": ("ckpt-00000002.npz", "it is a symbolic link, which the kit does not"),
    "listed_symlink": ("ckpt-00000001.npz", "it is a symbolic link"),
    "meta_bomb": ("ckpt-00000001.npz", "member '__meta__.npy' is compressed"),
    "short_data": ("ckpt-00000001.npz", "holds 48 bytes of data; its header ((8, 3) float32)"),
    "random_shape": ("ckpt-00000001.npz", "not a seed state of two integers"),
    "callback_missing": ("ckpt-00000001.npz", "its callback state refers to 2 missing"),
    "manifest_dev_zero": ("ckpt-00000002.npz", "Ignoring unreadable checkpoint manifest"),
    "lock_big_pid": ("ckpt-00000002.npz", f"process {2**31 + 7} on"),
    "lock_fifo": (None, "CheckpointLockedError: Another run is writing"),
    "lock_dev_zero": (None, "CheckpointLockedError: Another run is writing"),
}


def _tensorflow_child(root: Path) -> dict:
    """The fit, restore and export cases, run in one TensorFlow child: their results."""
    code = _CHILD_START + _FIT_PART + _RESTORE_PART + _CHILD_END
    code = code.replace("@ROOT@", repr(str(root))).replace("@CASES@", repr(list(FIT)))
    code = code.replace("@RESTORE@", repr(list(RESTORE))).replace("@EXPORT@", repr(list(EXPORT)))
    return last_json(run_python(code, timeout=600))


def _within_100_mib(results: dict, key: str = "peak") -> None:
    good = results["benign"][key]
    over = {c: r[key] - good for c, r in results.items() if r[key] - good > 100 * MIB}
    assert not over, (good, over)


def _check_fit(results: dict) -> None:
    """`fit` resumes from the newest checkpoint it can read, never from a file outside."""
    for case, (restored, says) in FIT.items():
        result = results[case]
        assert result["outside_same"], case
        if restored is None:  # refused at on_train_begin, before any step
            assert says in (result["error"] or ""), (case, result)
            assert result["restored"] is None and result["untouched"], (case, result)
            continue
        assert result["error"] is None, (case, result)
        assert result["restored"] == restored and result["restored_is"] == [restored], (
            case, result,
        )  # fmt: skip
        assert (says is None) == (not result["warnings"]), (case, result)
        assert says is None or says in result["warnings"][0], (case, result)
    assert "FIFO (named pipe)" in results["lock_fifo"]["error"]
    assert "symbolic link" in results["lock_dev_zero"]["error"]
    assert results["lock_big_pid"]["warnings"][0].startswith("StaleLockWarning")
    _within_100_mib(results)


_RESTORE_PART = """
RESTORE_ROOT = ROOT / "restore"  # copies of their own, untouched by the fit cases
RESTORE_ROOT.mkdir()
results = {}
model = build("adam", seed=77)
for case in @RESTORE@:
    directory, outside, before = prepare(RESTORE_ROOT, good, case)
    loaded, result = measured(lambda: kmk.restore(model, directory))
    values = [np.array(v.numpy()) for v in model.variables]
    result.update(
        restored=loaded and loaded.path.name,
        restored_is=which(values, candidates(outside)),
        outside_same=outside_files(outside) == before,
    )
    results[case] = result
exports = {}
for case, name in @EXPORT@:
    directory = RESTORE_ROOT / case
    if not directory.exists():
        prepare(RESTORE_ROOT, good, case)
    to = RESTORE_ROOT / f"{case}-{name}.keras"
    err = io.StringIO()
    def export():
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return main(["ckpt", "export", str(directory), "--to", str(to)]
                        + (["--name", name] if name else []))
    code, result = measured(export)
    weights = None
    if to.exists():
        exported = keras.saving.load_model(to, compile=False)
        weights = which([np.array(v.numpy()) for v in exported.variables],
                        candidates(RESTORE_ROOT / f"{case}-outside"))
    result.update(code=code, stderr=err.getvalue()[-1500:], exported_is=weights)
    exports[f"{case}:{name}"] = result
"""
_CHILD_END = """
print("RESULT " + json.dumps({"fit": fit_results, "restore": results, "export": exports}))
"""

# case: (checkpoint restored, what its warning says)
RESTORE = {
    "benign": ("ckpt-00000002.npz", None),
    "symlink_elsewhere": ("ckpt-00000002.npz", "it is a symbolic link, which the kit does not"),
    "meta_bomb": ("ckpt-00000001.npz", "member '__meta__.npy' is compressed"),
    "meta_huge_header": ("ckpt-00000001.npz", "((1000000000000,) uint8) needs 1000000000000"),
    "short_data": ("ckpt-00000001.npz", "holds 48 bytes of data; its header ((8, 3) float32)"),
    "nul_name": ("ckpt-00000001.npz", "a duplicate or NUL-cut member name 'model/00099.npy'"),
    "manifest_dev_zero": ("ckpt-00000002.npz", "(it is a symbolic link, which the kit does"),
    "manifest_outside_fifo": ("ckpt-00000002.npz", "(it is a symbolic link, which the kit"),
    "ckpt_fifo": ("ckpt-00000002.npz", "it is a FIFO (named pipe), not a regular file"),
}
# (case, --name): (exit status, the checkpoint exported, what stderr says)
EXPORT = {
    ("benign", ""): (0, "ckpt-00000002.npz", ""),
    ("symlink_elsewhere", ""): (0, "ckpt-00000002.npz", ""),
    ("symlink_elsewhere", "3"): (2, None, "The checkpoint 'ckpt-00000003.npz' in "),
    ("meta_bomb", ""): (0, "ckpt-00000001.npz", ""),
    ("unregistered_class", ""): (2, None, "The architecture recorded in 'ckpt-00000002.npz' "
                                 "cannot be rebuilt (TypeError: Could not locate class "
                                 "'CustomModel'"),
}  # fmt: skip


def _check_restore_and_export(results: dict) -> None:
    """`kmk.restore` and `ckpt export` never load a file from outside, and say what is wrong."""
    for case, (restored, says) in RESTORE.items():
        result = results["restore"][case]
        assert result["error"] is None and result["outside_same"], (case, result)
        assert result["restored"] == restored and result["restored_is"] == [restored], (
            case, result,
        )  # fmt: skip
        assert (says is None) == (not result["warnings"]), (case, result)
        assert says is None or says in result["warnings"][0], (case, result)
    _within_100_mib(results["restore"])
    for (case, name), (status, exported, says) in EXPORT.items():
        result = results["export"][f"{case}:{name}"]
        assert result["error"] is None and result["code"] == status, (case, name, result)
        assert result["exported_is"] == ([exported] if exported else None), (case, result)
        assert says in result["stderr"] and "Traceback" not in result["stderr"], result
        if status:
            assert result["stderr"].startswith("keras-mirror-kit ckpt: error: "), result
    assert "symbolic link" in results["export"]["symlink_elsewhere:3"]["stderr"]
    assert "--model module:function" in results["export"]["unregistered_class:"]["stderr"]
    _within_100_mib({"benign": results["export"]["benign:"], **{
        k: v for k, v in results["export"].items() if v["code"] == 0
    }})  # fmt: skip


@pytest.mark.slow
def test_fit_restore_and_export_never_read_a_file_from_outside_and_say_what_is_wrong(tmp_path):
    """One TensorFlow child trains the good directory, then runs every `fit` case and every
    `kmk.restore` and `ckpt export` case, each on a hostile copy of its own."""
    results = _tensorflow_child(tmp_path)
    _check_fit(results["fit"])
    _check_restore_and_export(results)
