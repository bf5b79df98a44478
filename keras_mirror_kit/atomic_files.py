"""Atomic file writes: the one way the kit replaces a file, so a crash leaves old or new.

A file is written to a hidden temporary file in the same directory, flushed and fsync'ed,
moved into place with `os.replace`, then the directory is fsync'ed. A failure removes the
temporary file and leaves the destination untouched. `create_if_absent` creates a file
only where none of that name exists (the checkpoint directory's lock): written to a
temporary file, then hard-linked into place, which fails where a file exists, so a reader
never sees half a file.

`atomic_write(..., direct=True)` (big files: checkpoints) writes the temporary file past
the page cache where the platform and filesystem allow it (Linux `O_DIRECT`), through one
aligned 8 MiB buffer: the kernel does not copy the data into its cache, so writing a file of
several GB costs little CPU time and no page-cache memory that would evict the training
data. Where the filesystem refuses `O_DIRECT`, the same write goes through the page cache.

Reading goes through `open_regular` (and `read_regular`, with a size bound): it opens only
a regular file, never through a symbolic link (`O_NOFOLLOW`) and never blocking on a FIFO
(`O_NONBLOCK`, then the type is checked on the open descriptor), so a file someone else
put in a directory cannot make a reader read another file, a device or a pipe.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = [
    "atomic_path",
    "atomic_write",
    "atomic_write_bytes",
    "create_if_absent",
    "link_if_absent",
    "open_regular",
    "read_regular",
]

_O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux (and some BSDs); 0 elsewhere
_BLOCK = 4096  # what O_DIRECT needs of addresses, lengths and offsets (a multiple of it)
_DIRECT_BUFFER = 8 << 20
_NO_DIRECT = {errno.EINVAL, getattr(errno, "EOPNOTSUPP", -1), getattr(errno, "ENOTSUP", -1)}
# What os.link raises on a filesystem without hard links (some network filesystems).
_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV}
# What opening a symbolic link with O_NOFOLLOW raises: ELOOP (Linux, macOS), EMLINK (BSDs).
_LINK_ERRNOS = {errno.ELOOP, errno.EMLINK}
_READ_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_CLOEXEC", 0)
)
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class _DirectWriter:
    """A write-only file on an `O_DIRECT` descriptor: data goes out in whole aligned blocks."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buffer = mmap.mmap(-1, _DIRECT_BUFFER)  # page-aligned, as O_DIRECT needs
        self._view = memoryview(self._buffer)
        self._fill = 0
        self.size = 0

    def write(self, data: bytes | memoryview) -> int:
        """Copies `data` into the buffer, writing each full buffer out."""
        data = memoryview(data).cast("B")
        done = 0
        while done < len(data):
            take = min(len(data) - done, _DIRECT_BUFFER - self._fill)
            self._view[self._fill : self._fill + take] = data[done : done + take]
            self._fill += take
            done += take
            if self._fill == _DIRECT_BUFFER:
                self._drain(self._fill)
        self.size += len(data)
        return len(data)

    def flush(self) -> None:
        """Nothing: data leaves in whole blocks; `finish` writes the rest."""

    def finish(self) -> None:
        """Writes the last, zero-padded block and cuts the file to its real size."""
        padded = -(-self._fill // _BLOCK) * _BLOCK
        self._view[self._fill : padded] = bytes(padded - self._fill)
        self._drain(padded)
        os.ftruncate(self._fd, self.size)

    def close(self) -> None:
        """Frees the buffer (the descriptor is the caller's)."""
        self._view.release()
        self._buffer.close()

    def _drain(self, length: int) -> None:
        """Writes the buffer's first `length` bytes; a refused O_DIRECT write goes on cached."""
        written = 0
        while written < length:
            try:
                written += os.write(self._fd, self._view[written:length])
            except OSError as err:
                import fcntl  # O_DIRECT exists: a POSIX platform

                flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
                if err.errno not in _NO_DIRECT or not flags & _O_DIRECT:
                    raise
                # The filesystem wants more than 4 KiB alignment, or no O_DIRECT writes.
                fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~_O_DIRECT)
        self._fill = 0


def _open_direct(tmp: Path) -> int | None:
    """A new file opened for `O_DIRECT` writes, or None where that is refused."""
    if not _O_DIRECT:
        return None
    try:
        return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_DIRECT, 0o666)
    except OSError as err:
        if err.errno not in _NO_DIRECT:  # this filesystem has no O_DIRECT
            raise
        return None


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


def atomic_write(path: Path, write: Callable[[BinaryIO], object], *, direct: bool = False) -> None:
    """Writes a file atomically: `write` fills a temporary file, then fsync, replace, fsync.

    `write` gets the open temporary file (binary, write-only; not seekable with `direct=True`)
    and writes the content in as many pieces as it likes. `direct=True` writes past the page
    cache (module docstring). If any step fails, or `write` raises, the error propagates, the
    temporary file is removed and `path` is untouched.
    """
    tmp = path.with_name(f".{path.name}.{os.urandom(4).hex()}.tmp")
    try:
        fd = _open_direct(tmp) if direct else None
        if fd is not None:
            try:
                writer = _DirectWriter(fd)
                try:
                    write(writer)  # type: ignore[arg-type]
                    writer.finish()
                    os.fsync(fd)
                finally:
                    writer.close()
            finally:
                os.close(fd)
        else:
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
    """Writes `data` to `path` atomically (`atomic_write`)."""
    atomic_write(path, lambda handle: handle.write(data))


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path to write `path` through, for writers that need a file name.

    The body writes the temporary file (any library's `save(tmp)`); on success it is fsync'ed
    and moved into place, on failure it is removed and `path` is untouched. Its name keeps
    `path`'s suffix (`.keras`, `.weights.h5`), from which Keras chooses the format.
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


def link_if_absent(source: Path, path: Path) -> bool:
    """Hard-links `source` at `path` unless a file is there; False when one is.

    False also when `source` has vanished (another process removed it as an orphaned
    temporary file): the caller looks again.

    Raises:
        OSError: Any other failure, also a filesystem without hard links (errno `EPERM`,
            `ENOTSUP`, `EOPNOTSUPP` or `EXDEV`).
    """
    try:
        os.link(source, path)
    except (FileExistsError, FileNotFoundError):
        return False
    return True


def create_if_absent(path: Path, data: bytes) -> bool:
    """Creates `path` holding `data` unless a file of that name exists; False when one does.

    The data goes to a hidden temporary file, fsync'ed, then hard-linked into place: the
    link fails where a file exists, and a reader never sees a half-written file. Where the
    filesystem has no hard links, an exclusive create (`O_EXCL`) is written instead. False
    also when the temporary file was removed by another process meanwhile (look again).

    Raises:
        OSError: If the file cannot be written; the temporary file is removed.
    """
    tmp = path.with_name(f".{path.name}.{os.urandom(4).hex()}.tmp")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        try:
            return link_if_absent(tmp, path)
        except OSError as err:
            if err.errno not in _NO_LINKS:
                raise
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        return True
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def open_regular(path: str | os.PathLike[str], *, follow_links: bool = False) -> BinaryIO:
    """Opens a regular file for reading, following no symbolic link and never blocking.

    The file is opened with `O_NOFOLLOW | O_NONBLOCK`, its type is checked on the open
    descriptor (`os.fstat`, so it cannot be swapped in between), then the descriptor is
    made blocking again. Only the last component of `path` is not followed: the directory
    it names is the caller's choice. A hard link is a regular file and is read.

    Args:
        path: The file to open.
        follow_links: Follow a symbolic link in the last component (a dataset's files,
            which may be links); what it leads to must still be a regular file.

    Returns:
        The file, open for binary reads (the caller closes it).

    Raises:
        FileNotFoundError: When there is no such file.
        OSError: When `path` is a symbolic link (errno `ELOOP`), not a regular file (a
            directory, FIFO, device or socket; errno `EINVAL`) or cannot be opened; the
            message says which.

    Example:

    ```python
    with open_regular(directory / "manifest.json") as handle:
        data = handle.read()
    ```
    """
    flags = _READ_FLAGS & ~getattr(os, "O_NOFOLLOW", 0) if follow_links else _READ_FLAGS
    try:
        fd = os.open(path, flags)
    except OSError as err:
        if err.errno in _LINK_ERRNOS and os.path.islink(path):
            raise OSError(
                errno.ELOOP, "it is a symbolic link, which the kit does not follow", str(path)
            ) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
            raise OSError(errno.EINVAL, f"it is {kind}, not a regular file", str(path))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike[str], limit: int, *, follow_links: bool = False) -> bytes:
    """The content of a regular file of at most `limit` bytes (`open_regular`).

    The size is checked on the open descriptor before anything is read, and no more than
    that size is read (a file that grows meanwhile is refused too), so the buffer is the
    file's size, not `limit`.

    Args:
        path: The file to read.
        limit: The most bytes the file may hold.
        follow_links: As for `open_regular`.

    Returns:
        The file's bytes.

    Raises:
        FileNotFoundError: When there is no such file.
        OSError: What `open_regular` raises, and errno `EFBIG` for a file of more than
            `limit` bytes.

    Example:

    ```python
    data = read_regular(directory / "writer.lock", 64 << 10)
    ```
    """
    with open_regular(path, follow_links=follow_links) as handle:
        size = os.fstat(handle.fileno()).st_size
        if size > limit:
            raise OSError(
                errno.EFBIG,
                f"it holds {size} bytes, over the {limit} bytes such a file may hold",
                str(path),
            )
        data = handle.read(size + 1)
        if len(data) > size:
            raise OSError(errno.EFBIG, "it grew while it was read", str(path))
        return data
