"""Crash-safe checkpoint files: atomic writes, a manifest, verification and retention.

This module knows nothing of Keras or TensorFlow: a checkpoint is a set of named NumPy
arrays plus a JSON-able metadata dict, stored as one `.npz` file. The file is streamed: its
arrays are written one at a time into the temporary file (each with its zip CRC-32) and
read back one at a time, so a save or a restore holds about one array in memory, never the
whole state (files of 0.1.0, written in one piece, are the same `.npz` and read alike).
The guarantees:

* Every file is written atomically: to a hidden temporary file in the same directory,
  flushed and fsync'ed, moved into place with `os.replace`, then the directory is fsync'ed.
* The manifest (`manifest.json`), which names the checkpoints with their size and
  checksum, is replaced last, so a kill at any instant leaves the previous checkpoint loadable.
* Each checkpoint file also carries its own metadata, so the directory can be read even
  without the manifest (what a lost manifest knew is rebuilt from the files before anything
  is pruned); reading verifies the size, the checksum and every array's CRC-32, and a
  corrupt file is skipped with a warning in favour of the previous good one.
* The checksum (`crc32` in the manifest) is the CRC-32 of the zip's own records of its
  members (name, CRC-32, sizes, offset, method, flags), in order: with the members' CRCs,
  which every read checks, it detects any damage to the data or to the zip's directory
  and any other file in its place (not timestamps or attributes, which change neither), at
  about a third of the CPU time of a SHA-256 of the file (what a background save on a busy
  CPU host must not take from training). Like TensorFlow's own checkpoints (a CRC-32C per
  tensor), it guards against damage, not against deliberate tampering. Manifests of
  keras-mirror-kit 0.1.0, which list a `sha256`, are verified by that hash.
* Retention keeps the newest `keep` checkpoints and, beyond the newest, at least two older
  usable resume points (and the newest one whose values are all finite, and the newest
  finite one written at an epoch boundary), so a damaged newest checkpoint always leaves a
  way back, and a run that cannot resume mid-epoch finds an epoch boundary.
* Only files this module names (`ckpt-NNNNNNNN.npz`, `manifest.json` and their hidden
  temporaries) are ever deleted; anything else in the directory is left alone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import warnings
import weakref
import zipfile
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from keras_mirror_kit.atomic_files import atomic_write
from keras_mirror_kit.validation import positive_int

__all__ = [
    "CheckpointArrays",
    "CheckpointError",
    "CheckpointStore",
    "CheckpointWriteError",
    "CorruptCheckpointWarning",
    "LoadedCheckpoint",
    "best_entries",
    "check_keep_best",
]

logger = logging.getLogger("keras_mirror_kit")

MANIFEST = "manifest.json"
FORMAT = "keras-mirror-kit-checkpoint"
VERSION = 1
_CKPT_RE = re.compile(r"^ckpt-(\d{8})\.npz$")
_TMP_RE = re.compile(
    r"^\.(ckpt-\d{8}\.npz|manifest\.json|write-probe|writer\.lock)\.[0-9a-f]+\.tmp$"
)
_META_KEY = "__meta__"
# What zipfile raises on a damaged file: besides BadZipFile, a flipped bit in a member's
# flags, method or version gives NotImplementedError, RuntimeError (encrypted) or zlib.error.
_UNREADABLE = (
    OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, NotImplementedError,
    RuntimeError, zlib.error,
)  # fmt: skip
_CHUNK = 1 << 20  # bytes per read when verifying a file; bytes per write (x16)
# Metadata repeated in the manifest's entries (retention and resume decide on them).
_ENTRY_KEYS = (
    "epoch",
    "step",
    "epoch_end",
    "global_step",
    "fit_index",
    "stopped",
    "finite",
    "monitor",  # keep_best: the metric, its direction ("min"/"max") and this save's value
    "mode",
    "score",
)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used or written (not a directory, wrong model, NaN state).

    Raised before anything is restored or trained; the checkpoints on disk are untouched.

    Example:

    ```python
    try:
        kmk.restore(model, "ckpts")
    except kmk.CheckpointError as err:
        print(err)   # says what does not match and what to do
    ```
    """


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, permission denied, ...).

    Every earlier checkpoint is left intact when this is raised.

    Example:

    ```python
    try:
        model.fit(ds, epochs=10, callbacks=[kmk.SyncedCheckpoint("ckpts")])
    except kmk.CheckpointWriteError as err:
        print(err.errno, err)   # free space or fix permissions, then resume
    ```
    """


class CorruptCheckpointWarning(UserWarning):
    """A checkpoint file failed verification and was skipped (the previous good one is used).

    Example:

    ```python
    import warnings
    warnings.simplefilter("error", kmk.CorruptCheckpointWarning)  # refuse to fall back
    ```
    """


class CheckpointArrays(Mapping[str, np.ndarray]):
    """The arrays of a verified checkpoint file, each read from the file when asked for.

    No array is kept in memory: every lookup reads that one array (its zip CRC is
    checked), so restoring a state variable by variable holds one variable at a time. The
    file is opened at the first lookup and stays open until `close()` (or the end of a
    `with` block, or the mapping is garbage collected).

    Args:
        path: The checkpoint file.
        shapes: The shape of each array by name (read from the file's array headers).

    Example:

    ```python
    loaded = store.load_latest()
    with loaded.arrays as arrays:
        for name in arrays:
            print(name, arrays.shapes[name], arrays[name].dtype)
    ```
    """

    def __init__(self, path: Path, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.path = Path(path)
        self.shapes: dict[str, tuple[int, ...]] = dict(shapes)
        self._archive: list[zipfile.ZipFile] = []  # the open file, shared with the finalizer
        weakref.finalize(self, _close_all, self._archive)

    def __getitem__(self, key: str) -> np.ndarray:
        if key not in self.shapes:
            raise KeyError(key)
        if not self._archive:
            self._archive.append(zipfile.ZipFile(self.path))
        with self._archive[0].open(f"{key}.npy") as member:
            return np.lib.format.read_array(member, allow_pickle=False)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def close(self) -> None:
        """Closes the file (a later lookup opens it again).

        Returns:
            None.

        Example:

        ```python
        loaded.arrays.close()
        ```
        """
        _close_all(self._archive)

    def __enter__(self) -> CheckpointArrays:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _close_all(archives: list[zipfile.ZipFile]) -> None:
    """Closes and forgets the open zip files of a `CheckpointArrays`."""
    while archives:
        archives.pop().close()


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A checkpoint read back from disk (verified; its arrays are read when asked for).

    Args:
        path: The file it came from.
        arrays: Its arrays by name, each read from the file when asked for.
        meta: Its metadata.
    """

    path: Path
    arrays: CheckpointArrays
    meta: dict[str, Any]

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of each array by name, without reading the arrays."""
        return dict(self.arrays.shapes)


class _CountingWriter:
    """A write-only, unseekable file that counts what it passes on to `handle`."""

    def __init__(self, handle: BinaryIO) -> None:
        self._handle = handle
        self.size = 0

    def write(self, data: bytes | memoryview) -> int:
        self._handle.write(data)
        size = memoryview(data).nbytes
        self.size += size
        return size

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self._handle.flush()


def _write_array(member: BinaryIO, value: Any) -> None:
    """Writes one array as `.npy` (NumPy's format), its data straight from its buffer."""
    array = np.asarray(value)
    if not array.flags.c_contiguous:
        array = array.copy(order="C")  # a view of another layout: one copy of this array
    if array.dtype.hasobject:
        raise ValueError(f"cannot store an array of Python objects ({array.dtype})")
    header = np.lib.format.header_data_from_array_1_0(array)
    try:
        np.lib.format.write_array_header_1_0(member, header)
    except ValueError:  # a header too long for format 1.0 (a very high-dimensional shape)
        np.lib.format.write_array_header_2_0(member, header)
    data = array.reshape(-1).view(np.uint8)
    for start in range(0, data.size, _CHUNK * 16):
        member.write(memoryview(data[start : start + _CHUNK * 16]))


def _write_npz(
    handle: BinaryIO, arrays: Iterable[tuple[str, Any]], meta: Mapping[str, Any]
) -> tuple[str, int]:
    """Streams `arrays` then the metadata into an `.npz` on `handle`: (checksum, size)."""
    out = _CountingWriter(handle)
    # An unseekable output: zipfile writes each member's CRC and sizes after its data, so
    # nothing is rewritten.
    with zipfile.ZipFile(out, mode="w", compression=zipfile.ZIP_STORED) as archive:  # type: ignore[arg-type]
        names: set[str] = set()
        for key, value in arrays:
            if key in names or key == _META_KEY:
                raise ValueError(f"duplicate array name in a checkpoint: {key!r}")
            names.add(key)
            with archive.open(f"{key}.npy", "w", force_zip64=True) as member:
                _write_array(member, value)  # type: ignore[arg-type]
            del value  # one array at a time
        blob = np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8)
        with archive.open(f"{_META_KEY}.npy", "w", force_zip64=True) as member:
            _write_array(member, blob)  # type: ignore[arg-type]
    return _members_checksum(archive), out.size


def _members_checksum(archive: zipfile.ZipFile) -> str:
    """The CRC-32 (8 hex digits) of the members' records (name, CRC, sizes, layout), in order."""
    record = "".join(
        f"{i.filename}\t{i.CRC:08x}\t{i.file_size}\t{i.compress_size}\t{i.header_offset}\t"
        f"{i.compress_type}\t{i.flag_bits}\t{i.extract_version}\n"
        for i in archive.infolist()
    )
    return f"{zlib.crc32(record.encode('utf-8')):08x}"


def _sha256_of(path: Path) -> str:
    """The SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _member_shape(archive: zipfile.ZipFile, name: str) -> tuple[int, ...]:
    """The shape of one `.npy` member, from its header alone."""
    with archive.open(name) as member:
        version = np.lib.format.read_magic(member)
        if version == (1, 0):
            return tuple(np.lib.format.read_array_header_1_0(member)[0])
        if version == (2, 0):
            return tuple(np.lib.format.read_array_header_2_0(member)[0])
    with archive.open(name) as member:  # another header version: read the array
        return tuple(np.lib.format.read_array(member, allow_pickle=False).shape)


def _read_meta(archive: zipfile.ZipFile) -> dict[str, Any]:
    """The metadata member of a checkpoint file."""
    with archive.open(f"{_META_KEY}.npy") as member:
        blob = np.lib.format.read_array(member, allow_pickle=False)
    meta = json.loads(blob.tobytes().decode("utf-8"))
    if not isinstance(meta, dict):
        raise ValueError("its metadata is not a JSON object")
    return meta


def best_entries(entries: Iterable[Mapping[str, Any]], monitor: str) -> list[dict[str, Any]]:
    """The entries scored by `monitor`, best first (the earliest of equal scores first).

    Args:
        entries: Items of `CheckpointStore.entries()`.
        monitor: The metric name (`"val_loss"`); entries scored by another metric, without
            a finite score, or holding a non-finite state are left out.

    Returns:
        Copies of the scored entries, best first, by each entry's `mode` (`"min"`/`"max"`).

    Example:

    ```python
    best = best_entries(store.entries(), "val_loss")[:1]
    ```
    """
    scored = [
        dict(e)
        for e in entries
        if e.get("monitor") == monitor
        and e.get("mode") in ("min", "max")
        and isinstance(e.get("score"), (int, float))
        and not isinstance(e.get("score"), bool)
        and np.isfinite(e["score"])
        and e.get("finite") is not False
        and not e.get("unreadable")
    ]
    return sorted(
        scored,
        key=lambda e: (e["score"] if e["mode"] == "min" else -e["score"], e.get("index", 0)),
    )


def check_keep_best(keep_best: object) -> int:
    """Checks `keep_best`: how many best checkpoints to keep beyond the newest (0: none).

    Args:
        keep_best: The value to check.

    Returns:
        `keep_best`.

    Raises:
        ValueError: If it is not an integer >= 0.

    Example:

    ```python
    check_keep_best(2)  # -> 2
    ```
    """
    if isinstance(keep_best, bool) or not isinstance(keep_best, int) or keep_best < 0:
        raise ValueError(
            "`keep_best` must be a non-negative integer (0: keep no best checkpoints beyond "
            f"the newest). Received: keep_best={keep_best!r}"
        )
    return keep_best


class CheckpointStore:
    """A directory of numbered, verified `.npz` checkpoints with a manifest.

    Args:
        directory: Where checkpoints live; created on `prepare()`.
        keep: How many of the newest checkpoints to keep (>= 1). Beyond the newest, the
            two newest older *usable* resume points are kept as well (epoch-boundary
            checkpoints, or any checkpoint when `mid_epoch_resumable` is set), the
            newest checkpoint whose values are all finite, and the newest finite one
            written at an epoch boundary.
        keep_best: How many checkpoints to keep besides for their score (0: none): the
            `keep_best` best entries by the metric named in `store.monitor` (set by the
            writer; each entry records its `monitor`, `mode` and `score`).

    Raises:
        ValueError: If `keep` is not a positive integer or `keep_best` is negative.

    Example:

    ```python
    store = CheckpointStore("ckpts", keep=3)
    store.prepare()
    store.write({"w": np.ones(3)}, {"epoch": 1, "step": 0, "epoch_end": True})
    latest = store.load_latest()
    ```
    """

    def __init__(
        self, directory: str | os.PathLike[str], keep: int = 3, keep_best: int = 0
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int):
            raise ValueError(f"`keep` must be a positive integer. Received: keep={keep!r}")
        positive_int("keep", keep)
        check_keep_best(keep_best)
        self.directory = Path(directory)
        self.keep = keep
        self.keep_best = keep_best
        # The metric keep_best ranks by (entries' "monitor"); set by the writer.
        self.monitor: str | None = None
        # Whether the run writing here can resume from a mid-epoch checkpoint (retention
        # then counts those as resume points); set by the writer.
        self.mid_epoch_resumable = False

    # -- directory ---------------------------------------------------------------------------

    def prepare(self) -> None:
        """Creates the directory, checks it is writable, removes orphaned temporaries.

        Returns:
            None.

        Raises:
            CheckpointError: If the path is a file, or the directory cannot be created or
                written.

        Example:

        ```python
        store.prepare()
        ```
        """
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(
                f"The checkpoint directory {str(self.directory)!r} exists and is not a "
                "directory. Pass a directory path (it is created if missing). "
                f"Received: directory={str(self.directory)!r}"
            )
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / f".write-probe.{os.urandom(4).hex()}.tmp"
            with open(probe, "wb") as handle:
                handle.write(b"probe")
            probe.unlink()
        except OSError as err:
            raise CheckpointError(
                f"The checkpoint directory {str(self.directory)!r} is not writable "
                f"({err.strerror or err}). Choose a writable directory or fix its "
                f"permissions. Received: directory={str(self.directory)!r}"
            ) from err
        self.remove_orphans()

    def remove_orphans(self) -> list[str]:
        """Deletes temporary files that a killed writer left behind.

        Returns:
            The names removed.

        Example:

        ```python
        store.remove_orphans()
        ```
        """
        removed = []
        for entry in self._listdir():
            if _TMP_RE.match(entry):
                try:
                    (self.directory / entry).unlink()
                    removed.append(entry)
                except OSError:
                    pass
        if removed:
            logger.info("keras-mirror-kit: removed %d orphaned temporary file(s)", len(removed))
        return removed

    def _listdir(self) -> list[str]:
        try:
            return sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return []

    # -- manifest ----------------------------------------------------------------------------

    def read_manifest(self) -> dict[str, Any] | None:
        """Returns the parsed manifest, or None when it is missing or unreadable.

        Returns:
            The manifest dict or None (a broken manifest is reported with a warning).

        Example:

        ```python
        manifest = store.read_manifest()
        ```
        """
        path = self.directory / MANIFEST
        if not path.exists():
            return None
        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
            if manifest.get("format") != FORMAT or not isinstance(
                manifest.get("checkpoints"), list
            ):
                raise ValueError("not a keras-mirror-kit manifest")
            return manifest
        except (OSError, ValueError, AttributeError) as err:
            warnings.warn(
                f"Ignoring unreadable checkpoint manifest {str(path)!r} ({err}); reading the "
                "checkpoint files directly.",
                CorruptCheckpointWarning,
                stacklevel=2,
            )
            return None

    def entries(self) -> list[dict[str, Any]]:
        """Lists known checkpoints, oldest first (from the manifest, plus unlisted files).

        Returns:
            Dicts with at least `file` and `index`; manifest entries also carry `crc32`
            (`sha256` for checkpoints written by 0.1.0).

        Example:

        ```python
        newest = store.entries()[-1]["file"]
        ```
        """
        listed: dict[str, dict[str, Any]] = {}
        manifest = self.read_manifest()
        if manifest is not None:
            for entry in manifest["checkpoints"]:
                if isinstance(entry, dict) and _CKPT_RE.match(str(entry.get("file", ""))):
                    listed[entry["file"]] = dict(entry)
        for name in self._listdir():
            match = _CKPT_RE.match(name)
            if match and name not in listed:
                # Not in the manifest (lost, damaged or older): rebuild what it knew from the
                # file's own metadata, so retention never mistakes it for something else.
                listed[name] = {"file": name, **self._entry_from_file(name)}
        for name, entry in listed.items():
            entry["index"] = int(_CKPT_RE.match(name).group(1))  # type: ignore[union-attr]
        return sorted(listed.values(), key=lambda e: e["index"])

    def _entry_from_file(self, name: str) -> dict[str, Any]:
        """The manifest fields of one file, read from its own metadata (`unreadable` if not)."""
        try:
            with zipfile.ZipFile(self.directory / name) as archive:
                meta = _read_meta(archive)
            if meta.get("format") != FORMAT:
                raise ValueError("not a keras-mirror-kit checkpoint")
        except _UNREADABLE:
            return {"unreadable": True}
        return {key: meta[key] for key in _ENTRY_KEYS if key in meta}

    # -- write -------------------------------------------------------------------------------

    def write(
        self,
        arrays: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]],
        meta: Mapping[str, Any],
    ) -> Path:
        """Writes a new checkpoint, then the manifest, then prunes old checkpoints.

        The arrays are streamed into the file one at a time (each with its CRC-32), so an
        iterable of `(name, array)` pairs that makes each array when asked (a generator)
        keeps about one array in memory, not the whole state.

        Args:
            arrays: Named arrays to store: a mapping, or an iterable of `(name, array)`
                pairs, consumed once.
            meta: JSON-serializable metadata (progress, shapes, ...).

        Returns:
            The path of the new checkpoint file.

        Raises:
            CheckpointWriteError: If the disk is full, the directory read-only, etc. Every
                earlier checkpoint (and the manifest naming it) is left intact.

        Example:

        ```python
        store.write({"w": np.ones(3)}, {"epoch": 1, "step": 0, "epoch_end": True})
        ```
        """
        entries = self.entries()
        index = entries[-1]["index"] + 1 if entries else 1
        name = f"ckpt-{index:08d}.npz"
        meta = dict(meta, format=FORMAT, version=VERSION, file=name)
        pairs = arrays.items() if isinstance(arrays, Mapping) else arrays
        written: list[tuple[str, int]] = []
        path = self.directory / name
        try:
            atomic_write(
                path, lambda handle: written.append(_write_npz(handle, pairs, meta)), direct=True
            )
            digest, size = written[0]
            entry = {key: meta[key] for key in _ENTRY_KEYS if key in meta}
            entry.update(file=name, crc32=digest, size=size)
            kept = self._retain([*entries, {"index": index, **entry}])
            manifest = {
                "format": FORMAT,
                "version": VERSION,
                "latest": name,
                "checkpoints": [{k: v for k, v in e.items() if k != "index"} for e in kept],
            }
            data = json.dumps(manifest, indent=1).encode("utf-8")
            atomic_write(self.directory / MANIFEST, lambda handle: handle.write(data))
        except OSError as err:
            latest = entries[-1]["file"] if entries else None
            raise CheckpointWriteError(
                err.errno,
                f"Could not write checkpoint {str(path)!r}: {err.strerror or err}. Earlier "
                f"checkpoints are intact (latest: {latest!r}). Free disk space, fix the "
                "directory's permissions or choose another directory, then resume.",
            ) from err
        for old in entries:
            if old["file"] not in {e["file"] for e in kept}:
                try:
                    (self.directory / old["file"]).unlink()
                except OSError:
                    pass
        return path

    def _usable(self, entry: Mapping[str, Any]) -> bool:
        """Whether a resume could start from this entry in the current run's mode."""
        if entry.get("unreadable") or entry.get("finite") is False:
            return False
        return bool(entry.get("epoch_end")) or self.mid_epoch_resumable

    def _retain(self, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        keep = {e["index"] for e in entries[-self.keep :]}
        usable = 0
        for entry in reversed(entries[:-1]):  # two usable resume points beyond the newest
            if usable >= 2:
                break
            if self._usable(entry):
                usable += 1
                keep.add(entry["index"])
        finite = [e for e in entries if e.get("finite") is not False and not e.get("unreadable")]
        if finite:  # never rotate the last finite state away because of non-finite saves
            keep.add(finite[-1]["index"])
        # A later run that cannot resume mid-epoch (data, replicas or dataset= changed)
        # needs an epoch boundary, even when mid-epoch saves fill the resume points above.
        boundaries = [e for e in finite if e.get("epoch_end")]
        if boundaries:
            keep.add(boundaries[-1]["index"])
        if self.keep_best and self.monitor is not None:
            keep.update(e["index"] for e in best_entries(finite, self.monitor)[: self.keep_best])
        return [e for e in entries if e["index"] in keep]

    # -- read --------------------------------------------------------------------------------

    def read(self, entry: Mapping[str, Any]) -> LoadedCheckpoint:
        """Reads and verifies one checkpoint (its metadata; its arrays when asked for).

        The file is checked against the manifest's size and checksum, and every member's
        CRC-32 is checked (reading the file in chunks); the arrays are then read one at a
        time from `LoadedCheckpoint.arrays`. A file the manifest does not list gets the
        CRC check alone; one listed with a `sha256` (written by 0.1.0), that hash.

        Args:
            entry: An item of `entries()`.

        Returns:
            The loaded checkpoint.

        Raises:
            ValueError: If the file is missing, truncated, fails its checksum or zip CRC, or is
                not a keras-mirror-kit checkpoint.

        Example:

        ```python
        ckpt = store.read(store.entries()[-1])
        ```
        """
        path = self.directory / entry["file"]
        try:
            size = path.stat().st_size
            if "size" in entry and size != entry["size"]:
                raise ValueError(f"{path.name} has {size} bytes, expected {entry['size']}")
            if "sha256" in entry and _sha256_of(path) != entry["sha256"]:
                raise ValueError(f"{path.name} does not match its SHA-256 in the manifest")
        except OSError as err:
            raise ValueError(f"cannot read {path.name}: {err.strerror or err}") from err
        try:
            with zipfile.ZipFile(path) as archive:
                if "crc32" in entry and _members_checksum(archive) != entry["crc32"]:
                    raise ValueError(f"{path.name} does not match its checksum in the manifest")
                # Every member's CRC (already covered by a legacy SHA-256 of the file).
                damaged = None if "sha256" in entry else archive.testzip()
                if damaged is not None:
                    raise ValueError(f"member {damaged} fails its CRC")
                meta = _read_meta(archive)
                shapes = {
                    name[: -len(".npy")]: _member_shape(archive, name)
                    for name in archive.namelist()
                    if name.endswith(".npy") and name != f"{_META_KEY}.npy"
                }
        except _UNREADABLE as err:
            raise ValueError(f"{path.name} is not a readable checkpoint ({err})") from err
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path.name} is not a keras-mirror-kit checkpoint")
        arrays = CheckpointArrays(path, shapes)
        return LoadedCheckpoint(path=path, arrays=arrays, meta=meta)

    def load_latest(self, require_epoch_end: bool = False) -> LoadedCheckpoint | None:
        """Returns the newest checkpoint that verifies, warning about any skipped.

        Args:
            require_epoch_end: Only consider checkpoints written at an epoch boundary.

        Returns:
            The newest good checkpoint, or None when there is none.

        Example:

        ```python
        ckpt = store.load_latest()
        ```
        """
        for entry in reversed(self.entries()):
            if require_epoch_end and "epoch_end" in entry and not entry["epoch_end"]:
                continue
            try:
                loaded = self.read(entry)
            except ValueError as err:
                message = (
                    f"Skipping corrupt checkpoint in {str(self.directory)!r}: {err}. "
                    "Trying the previous one."
                )
                warnings.warn(message, CorruptCheckpointWarning, stacklevel=2)
                logger.warning("keras-mirror-kit: %s", message)
                continue
            if require_epoch_end and not loaded.meta.get("epoch_end"):
                continue
            return loaded
        return None
