"""`atomic_write(direct=True)`: big files written past the page cache, byte for byte."""

from __future__ import annotations

import errno
import os
import sys

import pytest

from keras_mirror_kit import atomic_files
from keras_mirror_kit.atomic_files import atomic_write

SIZES = [0, 1, 4095, 4096, 4097, (8 << 20) - 1, 8 << 20, (8 << 20) + 3, 20_000_003]


def _pieces(data: bytes, size: int = 1_000_003):
    view = memoryview(data)
    return [view[i : i + size] for i in range(0, len(data), size)]


@pytest.mark.parametrize("size", SIZES)
def test_a_direct_write_holds_exactly_the_bytes_written(tmp_path, size):
    data = os.urandom(size)
    modes: list[bool] = []

    def write(handle):
        fd = getattr(handle, "_fd", None)
        if fd is not None and sys.platform.startswith("linux"):
            import fcntl

            modes.append(bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT))
        for piece in _pieces(data):
            assert handle.write(piece) == len(piece)

    path = tmp_path / "big.bin"
    atomic_write(path, write, direct=True)
    assert path.read_bytes() == data
    assert [p.name for p in tmp_path.iterdir()] == ["big.bin"]  # no temporary left
    if sys.platform.startswith("linux"):
        if not modes:
            pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT: written through the cache")
        assert modes == [True]  # this filesystem took O_DIRECT: the page cache was skipped


def test_a_write_error_leaves_the_old_file(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"old")

    def fail(handle):
        handle.write(os.urandom(9 << 20))  # one full block of the buffer went out already
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        atomic_write(path, fail, direct=True)
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["f.bin"]


@pytest.mark.skipif(not getattr(os, "O_DIRECT", 0), reason="no O_DIRECT on this platform")
def test_a_filesystem_refusing_o_direct_gets_an_ordinary_write(tmp_path, monkeypatch):
    """Filesystems without O_DIRECT refuse it at open or at the first write (EINVAL)."""
    data = os.urandom((8 << 20) + 5)
    real_open, real_write = os.open, os.write
    refused: list[str] = []

    def open_refusing(path, flags, *args):
        if flags & os.O_DIRECT and "at-open" in str(path):
            refused.append("open")
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    def write_refusing(fd, data):
        import fcntl

        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and "at-write" in os.readlink(
            f"/proc/self/fd/{fd}"
        ):
            refused.append("write")
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(atomic_files.os, "open", open_refusing)
    if os.path.exists("/proc/self/fd"):
        monkeypatch.setattr(atomic_files.os, "write", write_refusing)
    for name in ("at-open.bin", "at-write.bin"):
        atomic_write(tmp_path / name, lambda h: [h.write(p) for p in _pieces(data)], direct=True)
        assert (tmp_path / name).read_bytes() == data
    assert refused[0] == "open"
    if os.path.exists("/proc/self/fd"):
        assert refused[1:] == ["write"]  # once: then the descriptor writes through the cache


def test_create_if_absent_creates_once_and_never_replaces(tmp_path):
    """The checkpoint lock's exclusive create: a file appears whole or not at all."""
    path = tmp_path / "writer.lock"
    assert atomic_files.create_if_absent(path, b"first") is True
    assert atomic_files.create_if_absent(path, b"second") is False  # one exists: kept
    assert path.read_bytes() == b"first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["writer.lock"]  # no temporary left
    # Linking a file into place likewise never replaces one.
    other = tmp_path / "other"
    other.write_bytes(b"other")
    assert atomic_files.link_if_absent(other, path) is False and path.read_bytes() == b"first"
    assert atomic_files.link_if_absent(other, tmp_path / "new") is True
    assert (tmp_path / "new").read_bytes() == b"other"
    assert atomic_files.link_if_absent(tmp_path / "gone", tmp_path / "x") is False
    with pytest.raises(OSError):  # not writable here: the caller says so
        atomic_files.create_if_absent(tmp_path / "no-dir" / "writer.lock", b"x")
