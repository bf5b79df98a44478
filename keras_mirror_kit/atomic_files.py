"""Atomic file writes: the one way the kit replaces a file, so a crash leaves old or new.

A file is written to a hidden temporary file in the same directory, flushed and fsync'ed,
moved into place with `os.replace`, then the directory is fsync'ed. A failure removes the
temporary file and leaves the destination untouched. (Creating a file only where none
exists, as the checkpoint lock and the CIFAR-10 download do, uses a hard link instead, in
their modules.)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_path", "atomic_write", "atomic_write_bytes"]


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


def atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Writes a file atomically: `write` fills a temporary file, then fsync, replace, fsync.

    Args:
        path: Destination file.
        write: Called with the open temporary file (binary, write-only); it writes the
            content, in as many pieces as it likes.

    Returns:
        None.

    Raises:
        OSError: If any step fails; the temporary file is removed and `path` is untouched.
            Whatever `write` raises propagates the same way.

    Example:

    ```python
    atomic_write(Path("dir/notes.txt"), lambda handle: handle.write(b"hello"))
    ```
    """
    tmp = path.with_name(f".{path.name}.{os.urandom(4).hex()}.tmp")
    try:
        with open(tmp, "wb") as handle:
            write(handle)
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
    atomic_write(path, lambda handle: handle.write(data))


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path to write `path` through, for writers that need a file name.

    The body writes the temporary file (any library's `save(path)`); on success it is
    fsync'ed and moved into place, on failure it is removed and `path` is untouched.

    Args:
        path: Destination file; its suffix is kept on the temporary name (Keras chooses
            the format from it).

    Returns:
        A context manager yielding the temporary path.

    Raises:
        OSError: If the fsync or the replace fails; the temporary file is removed.

    Example:

    ```python
    with atomic_path(Path("model.keras")) as tmp:
        model.save(tmp)
    ```
    """
    suffix = "".join(path.suffixes[-2:]) if path.name.endswith(".weights.h5") else path.suffix
    tmp = path.with_name(f".{path.name}.{os.urandom(4).hex()}.tmp{suffix}")
    try:
        yield tmp
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    _fsync_dir(path.parent)
