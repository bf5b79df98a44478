"""Crash-safe checkpoint files: atomic writes, a manifest, verification and retention.

This module knows nothing of Keras or TensorFlow: a checkpoint is a set of named NumPy
arrays plus a JSON-able metadata dict, stored as one `.npz` file. The guarantees:

* Every file is written atomically: to a hidden temporary file in the same directory,
  flushed and fsync'ed, moved into place with `os.replace`, then the directory is fsync'ed.
* The manifest (`manifest.json`), which names the checkpoints and their SHA-256, is
  replaced last, so a kill at any instant leaves the previous checkpoint loadable.
* Each checkpoint file also carries its own metadata, so the directory can be read even
  without the manifest (what a lost manifest knew is rebuilt from the files before anything
  is pruned); reading verifies the hash (and the zip CRCs), and a corrupt file is skipped
  with a warning in favour of the previous good one.
* Retention keeps the newest `keep` checkpoints and, beyond the newest, at least two older
  usable resume points (and the newest one whose values are all finite, and the newest
  finite one written at an epoch boundary), so a damaged newest checkpoint always leaves a
  way back, and a run that cannot resume mid-epoch finds an epoch boundary.
* Only files this module names (`ckpt-NNNNNNNN.npz`, `manifest.json` and their hidden
  temporaries) are ever deleted; anything else in the directory is left alone.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import warnings
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from keras_mirror_kit.batching import validate_positive_int

__all__ = [
    "CheckpointError",
    "CheckpointStore",
    "CheckpointWriteError",
    "CorruptCheckpointWarning",
    "LoadedCheckpoint",
]

logger = logging.getLogger("keras_mirror_kit")

MANIFEST = "manifest.json"
FORMAT = "keras-mirror-kit-checkpoint"
VERSION = 1
_CKPT_RE = re.compile(r"^ckpt-(\d{8})\.npz$")
_TMP_RE = re.compile(r"^\.(ckpt-\d{8}\.npz|manifest\.json|write-probe)\.[0-9a-f]+\.tmp$")
_META_KEY = "__meta__"
# Metadata repeated in the manifest's entries (retention and resume decide on them).
_ENTRY_KEYS = ("epoch", "step", "epoch_end", "global_step", "fit_index", "stopped", "finite")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used or written (not a directory, wrong model, NaN state)."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, permission denied, ...).

    Every earlier checkpoint is left intact when this is raised.
    """


class CorruptCheckpointWarning(UserWarning):
    """A checkpoint file failed verification and was skipped."""


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A checkpoint read back from disk.

    Args:
        path: The file it came from.
        arrays: Its arrays by name.
        meta: Its metadata.
    """

    path: Path
    arrays: dict[str, np.ndarray]
    meta: dict[str, Any]


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Writes `data` to `path` atomically (temp file, fsync, replace, fsync directory).

    Args:
        path: Destination file.
        data: Bytes to write.

    Returns:
        None.

    Raises:
        OSError: If any step fails; the temporary file is removed and `path` is untouched.

    Example:

    ```python
    atomic_write_bytes(Path("dir/manifest.json"), b"{}")
    ```
    """
    tmp = path.with_name(f".{path.name}.{os.urandom(4).hex()}.tmp")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)


class CheckpointStore:
    """A directory of numbered, verified `.npz` checkpoints with a manifest.

    Args:
        directory: Where checkpoints live; created on `prepare()`.
        keep: How many of the newest checkpoints to keep (>= 1). Beyond the newest, the
            two newest older *usable* resume points are kept as well (epoch-boundary
            checkpoints, or any checkpoint when `mid_epoch_resumable` is set), the
            newest checkpoint whose values are all finite, and the newest finite one
            written at an epoch boundary.

    Raises:
        ValueError: If `keep` is not a positive integer.

    Example:

    ```python
    store = CheckpointStore("ckpts", keep=3)
    store.prepare()
    store.write({"w": np.ones(3)}, {"epoch": 1, "step": 0, "epoch_end": True})
    latest = store.load_latest()
    ```
    """

    def __init__(self, directory: str | os.PathLike[str], keep: int = 3) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int):
            raise ValueError(f"`keep` must be a positive integer. Received: keep={keep!r}")
        validate_positive_int("keep", keep)
        self.directory = Path(directory)
        self.keep = keep
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
            Dicts with at least `file` and `index`; manifest entries also carry `sha256`.

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
            with np.load(self.directory / name, allow_pickle=False) as npz:
                meta = json.loads(npz[_META_KEY].tobytes().decode("utf-8"))
            if meta.get("format") != FORMAT:
                raise ValueError("not a keras-mirror-kit checkpoint")
        except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError):
            return {"unreadable": True}
        return {key: meta[key] for key in _ENTRY_KEYS if key in meta}

    # -- write -------------------------------------------------------------------------------

    def write(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> Path:
        """Writes a new checkpoint, then the manifest, then prunes old checkpoints.

        Args:
            arrays: Named arrays to store.
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
        buffer = io.BytesIO()
        payload = dict(arrays)
        payload[_META_KEY] = np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8)
        np.savez(buffer, **payload)
        data = buffer.getvalue()
        digest = hashlib.sha256(data).hexdigest()
        path = self.directory / name
        try:
            atomic_write_bytes(path, data)
            entry = {key: meta[key] for key in _ENTRY_KEYS if key in meta}
            entry.update(file=name, sha256=digest, size=len(data))
            kept = self._retain([*entries, {"index": index, **entry}])
            manifest = {
                "format": FORMAT,
                "version": VERSION,
                "latest": name,
                "checkpoints": [{k: v for k, v in e.items() if k != "index"} for e in kept],
            }
            atomic_write_bytes(
                self.directory / MANIFEST, json.dumps(manifest, indent=1).encode("utf-8")
            )
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
        return [e for e in entries if e["index"] in keep]

    # -- read --------------------------------------------------------------------------------

    def read(self, entry: Mapping[str, Any]) -> LoadedCheckpoint:
        """Reads and verifies one checkpoint.

        Args:
            entry: An item of `entries()`.

        Returns:
            The loaded checkpoint.

        Raises:
            ValueError: If the file is missing, truncated, fails its hash or zip CRC, or is
                not a keras-mirror-kit checkpoint.

        Example:

        ```python
        ckpt = store.read(store.entries()[-1])
        ```
        """
        path = self.directory / entry["file"]
        try:
            data = path.read_bytes()
        except OSError as err:
            raise ValueError(f"cannot read {path.name}: {err.strerror or err}") from err
        if "size" in entry and len(data) != entry["size"]:
            raise ValueError(f"{path.name} has {len(data)} bytes, expected {entry['size']}")
        if "sha256" in entry and hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise ValueError(f"{path.name} does not match its SHA-256 in the manifest")
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as npz:
                arrays = {key: npz[key] for key in npz.files}
            meta = json.loads(arrays.pop(_META_KEY).tobytes().decode("utf-8"))
        except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as err:
            raise ValueError(f"{path.name} is not a readable checkpoint ({err})") from err
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path.name} is not a keras-mirror-kit checkpoint")
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
