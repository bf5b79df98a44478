"""Crash-safe checkpoint files: atomic writes, a manifest, verification and retention.

This module knows nothing of Keras or TensorFlow: a checkpoint is a set of named NumPy
arrays plus its metadata (`meta.CheckpointMeta`), stored as one `.npz` file. The file is
streamed: its arrays are written one at a time into the temporary file (each with its zip
CRC-32) and read back one at a time, so a save or a restore holds about one array in
memory, never the whole state (files of 0.1.0, written in one piece, are the same `.npz`
and read alike). The guarantees:

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
* Only files this module names (`ckpt-NNNNNNNN.npz`, `manifest.json`, `fit-start.kmk` and
  their hidden temporaries) are ever deleted; anything else in the directory is left alone.
* `fit-start.kmk` (`START_FILE`) is no checkpoint: the state a running `fit()` started
  from, in the same format, outside the manifest, which a retry of that `fit()` in the same
  process goes back to (`checkpoint.start_state`); no resume, listing or export reads it.
* Only regular files inside the directory are read, never through a symbolic link, a
  FIFO or a device (`atomic_files.open_regular`), and every read is bounded by what the
  file should hold: the manifest at most `MANIFEST_LIMIT` bytes, a checkpoint file no
  more than its own size (`archive`: its zip directory, members, headers and metadata are
  checked before what they size is read). Whatever a file someone else made holds, the
  result is a checkpoint that verifies, or an unreadable one (a `ValueError` here, a
  `CorruptCheckpointWarning` and the previous checkpoint when resuming).
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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from keras_mirror_kit.atomic_files import atomic_write, open_regular, read_regular
from keras_mirror_kit.checkpoint.archive import (
    META_KEY,
    UNREADABLE,
    array_headers,
    check_layout,
    file_identity,
    open_zip,
    read_array,
    read_meta,
    valid_key,
)
from keras_mirror_kit.checkpoint.best import best_entries
from keras_mirror_kit.checkpoint.meta import (
    MANIFEST,
    CheckpointMeta,
    ManifestEntry,
    checkpoint_index,
    checkpoint_name,
    manifest_json,
    parse_json,
    read_manifest_json,
)
from keras_mirror_kit.data.py_dataset_cursor import ARRAY_KINDS
from keras_mirror_kit.validation import non_negative_int, positive_int

__all__ = [
    "CheckpointArrays",
    "CheckpointError",
    "CheckpointStore",
    "CheckpointWriteError",
    "CorruptCheckpointWarning",
    "LoadedCheckpoint",
    "START_FILE",
]

logger = logging.getLogger("keras_mirror_kit")

_TMP_RE = re.compile(
    r"\.(ckpt-[0-9]{8}\.npz|manifest\.json|fit-start\.kmk|write-probe|writer\.lock)\.[0-9a-f]+\.tmp"
)  # fullmatch
START_FILE = "fit-start.kmk"  # the state the running fit() started from (start_state.py)
MANIFEST_LIMIT = 8 << 20  # about 30,000 entries
_CHUNK = 1 << 20  # bytes per read when verifying a file; bytes per write (x16)


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
    `with` block, or the mapping is garbage collected). `shapes` holds each array's shape
    and `dtypes` its NumPy dtype, read from the file's array headers.
    """

    def __init__(
        self,
        path: Path,
        shapes: Mapping[str, tuple[int, ...]],
        dtypes: Mapping[str, np.dtype] | None = None,
        identity: tuple[int, ...] | None = None,
    ) -> None:
        self.path = Path(path)
        self.shapes: dict[str, tuple[int, ...]] = dict(shapes)
        self.dtypes: dict[str, np.dtype] = dict(dtypes or {})
        # The verified file (archive.file_identity): another one in its place is refused.
        self.identity = identity
        # The open zip and its file, shared with the finalizer.
        self._archive: list[Any] = []
        weakref.finalize(self, _close_all, self._archive)

    def __getitem__(self, key: str) -> np.ndarray:
        if key not in self.shapes:
            raise KeyError(key)
        if not self._archive:
            self._open()
        dtype = self.dtypes.get(key)
        if dtype is None:  # no header recorded (made by hand): as the file says
            with self._archive[-1].open(f"{key}.npy") as member:
                return np.lib.format.read_array(member, allow_pickle=False)
        return read_array(self._archive[-1], key, self.shapes[key], dtype)

    def _open(self) -> None:
        """Opens the file (no link followed), refusing another file than the one verified."""
        handle = open_regular(self.path)
        try:
            if self.identity is not None and file_identity(os.fstat(handle.fileno())) != (
                self.identity
            ):
                raise ValueError(
                    f"{self.path.name} was replaced or changed since it was verified; nothing "
                    "more is read from it. Restore again. "
                    f"Received: path={str(self.path)!r}"
                )
            archive = open_zip(handle)
        except BaseException:
            handle.close()
            raise
        self._archive += [handle, archive]  # closed in reverse

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def close(self) -> None:
        """Closes the file (a later lookup opens it again)."""
        _close_all(self._archive)

    def __enter__(self) -> CheckpointArrays:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _close_all(archives: list[Any]) -> None:
    """Closes and forgets the open zip file and its file of a `CheckpointArrays`."""
    while archives:
        archives.pop().close()


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A checkpoint read back from disk (verified; its arrays are read when asked for).

    Attributes:
        path: The file it came from.
        arrays: Its arrays by name, each read from the file when asked for.
        meta: Its metadata (also readable as a mapping: `meta["epoch"]`).
    """

    path: Path
    arrays: CheckpointArrays
    meta: CheckpointMeta

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of each array by name, without reading the arrays."""
        return dict(self.arrays.shapes)

    @property
    def dtypes(self) -> dict[str, np.dtype]:
        """The NumPy dtype of each array by name, without reading the arrays."""
        return dict(self.arrays.dtypes)


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
    handle: BinaryIO, arrays: Iterable[tuple[str, Any]], meta: CheckpointMeta
) -> tuple[str, int]:
    """Streams `arrays` then the metadata into an `.npz` on `handle`: (checksum, size)."""
    out = _CountingWriter(handle)
    # An unseekable output: zipfile writes each member's CRC and sizes after its data, so
    # nothing is rewritten.
    with zipfile.ZipFile(out, mode="w", compression=zipfile.ZIP_STORED) as archive:  # type: ignore[arg-type]
        names: set[str] = set()
        for key, value in arrays:
            if key in names or key == META_KEY:
                raise ValueError(f"duplicate array name in a checkpoint: {key!r}")
            if not valid_key(key):  # what a read would refuse
                raise ValueError(
                    f"cannot store an array named {key!r} in a checkpoint: a name is "
                    "model/N, optimizer/N, metrics/N, random/NAME, callback/KEY/NAME or a "
                    f"PyDataset's {', '.join(ARRAY_KINDS)}, without control characters, "
                    "backslashes or '.' and '..' parts"
                )
            names.add(key)
            with archive.open(f"{key}.npy", "w", force_zip64=True) as member:
                _write_array(member, value)  # type: ignore[arg-type]
            del value  # one array at a time
        blob = np.frombuffer(json.dumps(meta.to_json()).encode("utf-8"), dtype=np.uint8)
        with archive.open(f"{META_KEY}.npy", "w", force_zip64=True) as member:
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


def _sha256_of(handle: BinaryIO) -> str:
    """The SHA-256 of an open file from its start, read in chunks (then rewound)."""
    digest = hashlib.sha256()
    handle.seek(0)
    while chunk := handle.read(_CHUNK):
        digest.update(chunk)
    handle.seek(0)
    return digest.hexdigest()


class CheckpointStore:
    """A directory of numbered, verified `.npz` checkpoints with a manifest.

    Retention keeps the newest `keep` checkpoints; beyond the newest, the two newest older
    *usable* resume points (epoch-boundary checkpoints, or any checkpoint when
    `mid_epoch_resumable` is set), the newest checkpoint whose values are all finite and
    the newest finite one written at an epoch boundary; and the `keep_best` best by the
    metric named in `monitor` (set by the writer; each entry records its score).
    """

    def __init__(
        self, directory: str | os.PathLike[str], keep: int = 3, keep_best: int = 0
    ) -> None:
        self.directory = Path(directory)
        self.keep = positive_int("keep", keep)
        self.keep_best = non_negative_int("keep_best", keep_best)
        # The metric keep_best ranks by (entries' score.monitor); set by the writer.
        self.monitor: str | None = None
        # Whether the run writing here can resume from a mid-epoch checkpoint (retention
        # then counts those as resume points); set by the writer.
        self.mid_epoch_resumable = False

    # -- directory ---------------------------------------------------------------------------

    def prepare(self) -> None:
        """Creates the directory, checks it is writable, removes orphaned temporaries.

        Raises:
            CheckpointError: If the path is a file, or the directory cannot be created or
                written.
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
        """Deletes the temporary files a killed writer left behind; returns their names."""
        removed = []
        for entry in self._listdir():
            if _TMP_RE.fullmatch(entry):
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

    def read_manifest(self) -> tuple[str | None, list[ManifestEntry]] | None:
        """The manifest's newest file and entries; None when it is missing or unreadable.

        A broken manifest is reported with a `CorruptCheckpointWarning`, and so is one that
        is not a regular file (a symbolic link, FIFO, device or directory: never read) or
        holds more than `MANIFEST_LIMIT` bytes.
        """
        path = self.directory / MANIFEST
        try:
            return read_manifest_json(parse_json(read_regular(path, MANIFEST_LIMIT)))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as err:
            reason = err.strerror if isinstance(err, OSError) and err.strerror else err
            warnings.warn(
                f"Ignoring unreadable checkpoint manifest {str(path)!r} ({reason}); reading "
                "the checkpoint files directly.",
                CorruptCheckpointWarning,
                stacklevel=2,
            )
            return None

    def entries(self) -> list[ManifestEntry]:
        """The known checkpoints, oldest first: the manifest's, plus files it does not list."""
        listed: dict[str, ManifestEntry] = {}
        manifest = self.read_manifest()
        if manifest is not None:
            listed.update((entry.file, entry) for entry in manifest[1])
        for name in self._listdir():
            if checkpoint_index(name) is not None and name not in listed:
                # Not in the manifest (lost, damaged or older): rebuild what it knew from the
                # file's own metadata, so retention never mistakes it for something else.
                listed[name] = self._entry_from_file(name)
        return sorted(listed.values(), key=lambda e: e.index)

    def _entry_from_file(self, name: str) -> ManifestEntry:
        """The entry of one file, from its own metadata (`unreadable` if it has none)."""
        try:
            with open_regular(self.directory / name) as handle, open_zip(handle) as archive:
                meta = CheckpointMeta.from_json(read_meta(archive))
        except UNREADABLE:
            return ManifestEntry(file=name, index=checkpoint_index(name) or 0, unreadable=True)
        return ManifestEntry.of(meta, name)

    # -- write -------------------------------------------------------------------------------

    def write(
        self,
        arrays: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]],
        meta: CheckpointMeta,
    ) -> Path:
        """Writes a new checkpoint, then the manifest, then prunes old checkpoints.

        The arrays are streamed into the file one at a time (each with its CRC-32), so an
        iterable of `(name, array)` pairs that makes each array when asked (a generator)
        keeps about one array in memory, not the whole state.

        Raises:
            CheckpointWriteError: If the disk is full, the directory read-only, etc. Every
                earlier checkpoint (and the manifest naming it) is left intact.
        """
        entries = self.entries()
        name = checkpoint_name(entries[-1].index + 1 if entries else 1)
        meta = replace(meta, file=name)
        pairs = arrays.items() if isinstance(arrays, Mapping) else arrays
        written: list[tuple[str, int]] = []
        path = self.directory / name
        try:
            atomic_write(
                path, lambda handle: written.append(_write_npz(handle, pairs, meta)), direct=True
            )
            digest, size = written[0]
            kept = self._retain([*entries, ManifestEntry.of(meta, name, digest, size)])
            data = json.dumps(manifest_json(name, kept), indent=1).encode("utf-8")
            atomic_write(self.directory / MANIFEST, lambda handle: handle.write(data))
        except OSError as err:
            latest = entries[-1].file if entries else None
            raise CheckpointWriteError(
                err.errno,
                f"Could not write checkpoint {str(path)!r}: {err.strerror or err}. Earlier "
                f"checkpoints are intact (latest: {latest!r}). Free disk space, fix the "
                "directory's permissions or choose another directory, then resume.",
            ) from err
        for old in entries:
            if old.file not in {e.file for e in kept}:
                try:
                    (self.directory / old.file).unlink()
                except OSError:
                    pass
        return path

    def write_start(self, arrays: Iterable[tuple[str, np.ndarray]], meta: CheckpointMeta) -> Path:
        """Writes `START_FILE` (streamed and atomic, as a checkpoint; not in the manifest).

        Raises:
            CheckpointWriteError: If the disk is full, the directory read-only, etc.
        """
        path = self.directory / START_FILE
        try:
            atomic_write(path, lambda handle: _write_npz(handle, arrays, meta), direct=True)
        except OSError as err:
            raise CheckpointWriteError(
                err.errno,
                f"Could not write {str(path)!r}, the state this fit() starts from (what a "
                f"retry of it goes back to): {err.strerror or err}. Free disk space, fix the "
                "directory's permissions or choose another directory.",
            ) from err
        return path

    def read_start(self) -> LoadedCheckpoint:
        """Reads and verifies `START_FILE` (every member's CRC-32), as `read` a checkpoint.

        Raises:
            ValueError: If it is missing or fails verification.
        """
        return self.read(ManifestEntry(file=START_FILE, index=0))

    def remove_start(self) -> None:
        """Deletes `START_FILE`, if there."""
        try:
            (self.directory / START_FILE).unlink()
        except FileNotFoundError:
            pass
        except OSError as err:  # left behind: the next fit() from scratch replaces it
            logger.debug("keras-mirror-kit: could not remove %s: %s", START_FILE, err)

    def _usable(self, entry: ManifestEntry) -> bool:
        """Whether a resume could start from this entry in the current run's mode."""
        return entry.finite_state and (bool(entry.epoch_end) or self.mid_epoch_resumable)

    def _retain(self, entries: list[ManifestEntry]) -> list[ManifestEntry]:
        keep = {e.index for e in entries[-self.keep :]}
        usable = 0
        for entry in reversed(entries[:-1]):  # two usable resume points beyond the newest
            if usable >= 2:
                break
            if self._usable(entry):
                usable += 1
                keep.add(entry.index)
        finite = [e for e in entries if e.finite_state]
        if finite:  # never rotate the last finite state away because of non-finite saves
            keep.add(finite[-1].index)
        # A later run that cannot resume mid-epoch (data, replicas or dataset= changed)
        # needs an epoch boundary, even when mid-epoch saves fill the resume points above.
        boundaries = [e for e in finite if e.epoch_end]
        if boundaries:
            keep.add(boundaries[-1].index)
        if self.keep_best and self.monitor is not None:
            keep.update(e.index for e in best_entries(finite, self.monitor)[: self.keep_best])
        return [e for e in entries if e.index in keep]

    # -- read --------------------------------------------------------------------------------

    def read(self, entry: ManifestEntry) -> LoadedCheckpoint:
        """Reads and verifies one checkpoint (its metadata; its arrays when asked for).

        The file is checked against the manifest's size and checksum, and every member's
        CRC-32 is checked (reading the file in chunks). A file the manifest does not list
        gets the CRC check alone; one listed with a `sha256` (written by 0.1.0), that hash.

        Only a regular file is read, not through a symbolic link, and its zip directory,
        members, headers and metadata are checked before what they size is read
        (`archive`), so whatever the file holds costs at most about its own size.

        Raises:
            ValueError: If the file is missing, a symbolic link, FIFO, device or directory,
                truncated, fails its checksum or zip CRC, holds members that are compressed,
                misnamed or of another size than their headers say, metadata of wrong types,
                or is not a keras-mirror-kit checkpoint.
        """
        path = self.directory / entry.file
        try:
            handle = open_regular(path)  # a regular file inside the directory, no link
        except OSError as err:
            raise ValueError(f"cannot read {path.name}: {err.strerror or err}") from err
        with handle:
            try:
                identity = file_identity(os.fstat(handle.fileno()))
                size = identity[2]
                if entry.size is not None and size != entry.size:
                    raise ValueError(f"{path.name} has {size} bytes, expected {entry.size}")
                if entry.sha256 is not None and _sha256_of(handle) != entry.sha256:
                    raise ValueError(f"{path.name} does not match its SHA-256 in the manifest")
            except OSError as err:
                raise ValueError(f"cannot read {path.name}: {err.strerror or err}") from err
            try:
                with open_zip(handle) as archive:
                    if entry.crc32 is not None and _members_checksum(archive) != entry.crc32:
                        raise ValueError(
                            f"{path.name} does not match its checksum in the manifest"
                        )
                    # Every member's CRC (already covered by a legacy SHA-256 of the file).
                    damaged = None if entry.sha256 is not None else archive.testzip()
                    if damaged is not None:
                        raise ValueError(f"member {damaged} fails its CRC")
                    raw = read_meta(archive)
                    headers = array_headers(archive)
            except UNREADABLE as err:
                raise ValueError(f"{path.name} is not a readable checkpoint ({err})") from err
        try:
            meta = CheckpointMeta.from_json(raw)
        except ValueError as err:
            raise ValueError(f"{path.name} is not a keras-mirror-kit checkpoint ({err})") from err
        try:
            check_layout(headers, meta)
        except ValueError as err:
            raise ValueError(f"{path.name} is not a readable checkpoint ({err})") from err
        shapes = {key: shape for key, (shape, _) in headers.items()}
        dtypes = {key: dtype for key, (_, dtype) in headers.items()}
        arrays = CheckpointArrays(path, shapes, dtypes, identity)
        return LoadedCheckpoint(path=path, arrays=arrays, meta=meta)

    def load_latest(self, require_epoch_end: bool = False) -> LoadedCheckpoint | None:
        """The newest checkpoint that verifies (warning about any skipped), or None.

        With `require_epoch_end`, only checkpoints written at an epoch boundary count.
        """
        for entry in reversed(self.entries()):
            if require_epoch_end and entry.epoch_end is False:
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
            if require_epoch_end and not loaded.meta.epoch_end:
                continue
            return loaded
        return None
