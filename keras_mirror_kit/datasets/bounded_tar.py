"""A small, bounded reader of tar streams: the members of an archive without `tarfile`.

The standard library's `tarfile` reads a pax extended header (`x`, `g`) or a GNU long
name (`L`, `K`) whole, whatever size its header declares, and on Python before 3.11.10
parses digit-only pax records in quadratic time (CVE-2024-6232). `iter_members` reads the
512-byte ustar headers itself: an extended header may declare at most
`MAX_EXTENDED_HEADER_BYTES`, its records are checked in one linear pass, and the whole
stream may hold at most `max_stream_bytes`; members are read or skipped in chunks, never
extracted. It supports what archive writers produce for ordinary files (ustar, GNU and
pax names and sizes, directories, links); sparse members are refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import BinaryIO

__all__ = ["MAX_EXTENDED_HEADER_BYTES", "TarFormatError", "TarMember", "iter_members"]

#: The most bytes a pax extended header or a GNU long name/link may declare.
MAX_EXTENDED_HEADER_BYTES = 1024 * 1024

_BLOCK = 512
_CHUNK = 1024 * 1024
_REGULAR = (b"0", b"\0", b"7")
# Types whose header is followed by no data, whatever its size field says (as tarfile).
_NO_DATA = (b"1", b"2", b"3", b"4", b"5", b"6")
_EXTENDED = (b"x", b"g", b"X", b"L", b"K")
_SPARSE = b"S"


class TarFormatError(ValueError):
    """Raised when a tar stream is malformed or exceeds the reader's bounds.

    Example:

    ```python
    try:
        names = [m.name for m in iter_members(stream, where="a.tar", max_stream_bytes=2**30)]
    except TarFormatError as e:
        print(e)
    ```
    """


class TarMember:
    """One member's header: its name, type flag (`b"0"`: a regular file) and data size.

    Its data is read with `read()`, at most once and only before the next member.

    Args:
        name: The member's path in the archive (pax `path` and GNU long names applied).
        type: The tar type flag, e.g. `b"0"` (a regular file), `b"2"` (a symbolic link).
        size: The size of its data in bytes (0 for links and directories).

    Example:

    ```python
    if member.isreg() and member.size < 2**20:
        content = member.read()
    ```
    """

    def __init__(self, name: str, type: bytes, size: int, reader: _Reader | None = None) -> None:  # noqa: A002
        self.name = name
        self.type = type
        self.size = size
        self._reader = reader
        self._readable = reader is not None

    def isreg(self) -> bool:
        """Whether the member is a regular file (type `0`, NUL or `7`), as `tarfile` says.

        Returns:
            True for a regular file.

        Example:

        ```python
        TarMember("a", b"0", 3).isreg()  # -> True
        ```
        """
        return self.type in _REGULAR

    def read(self) -> bytes:
        """Reads the member's data, whole.

        Returns:
            The `size` bytes of the member.

        Raises:
            TarFormatError: If the stream ends early or passes `max_stream_bytes`.
            RuntimeError: If called twice, or after the iteration moved on.

        Example:

        ```python
        content = member.read()
        ```
        """
        if not self._readable or self._reader is None:
            raise RuntimeError(
                f"The data of tar member {self.name!r} can be read once, before the next "
                "member. Received: a second read"
            )
        self._readable = False
        return self._reader.read(_padded(self.size))[: self.size]

    def __repr__(self) -> str:
        return f"TarMember(name={self.name!r}, type={self.type!r}, size={self.size})"


class _Reader:
    """The stream, read in exact amounts, counted against `max_stream_bytes`."""

    def __init__(self, stream: BinaryIO, where: str, max_stream_bytes: int) -> None:
        self.stream = stream
        self.where = where
        self.max = max_stream_bytes
        self.offset = 0

    def read(self, n: int, *, eof_ok: bool = False) -> bytes:
        """Exactly `n` bytes (b"" at a clean end when `eof_ok`), or `TarFormatError`."""
        if self.offset + n > self.max:
            raise TarFormatError(
                f"{self.where} holds more than {self.max} bytes of tar data, more than any "
                f"archive this reader accepts. Received: offset={self.offset}, next read={n}"
            )
        parts, left = [], n
        while left:
            chunk = self.stream.read(min(left, _CHUNK))
            if not chunk:
                break
            parts.append(chunk)
            left -= len(chunk)
        data = b"".join(parts)
        self.offset += len(data)
        if len(data) != n and not (eof_ok and not data):
            raise TarFormatError(
                f"{self.where} ends in the middle of a tar entry (truncated). "
                f"Received: {len(data)} of {n} bytes at offset {self.offset}"
            )
        return data

    def skip(self, n: int) -> None:
        """Reads and drops `n` bytes, a chunk at a time."""
        while n:
            step = min(n, _CHUNK)
            self.read(step)
            n -= step


def _padded(size: int) -> int:
    """`size` rounded up to whole 512-byte blocks."""
    return -(-size // _BLOCK) * _BLOCK


def _number(field: bytes, what: str, where: str) -> int:
    """A numeric header field: octal (NUL/space terminated) or GNU base-256."""
    if field[:1] in (b"\x80", b"\xff"):
        value = int.from_bytes(field[1:], "big")
        return value - (1 << (8 * len(field) - 8)) if field[0] == 0xFF else value
    text = field.split(b"\0", 1)[0].strip(b" ")
    if text and not all(48 <= c <= 55 for c in text):
        raise TarFormatError(
            f"{where} has a tar header whose {what} field is not an octal number. "
            f"Received: {what}={field!r}"
        )
    return int(text, 8) if text else 0


def _text(field: bytes) -> str:
    """A NUL-terminated header field as text (undecodable bytes kept as surrogates)."""
    return field.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


_PAX_KEYS = frozenset({"path", "linkpath", "size"})  # the pax keys a member's reading needs


def _pax_records(data: bytes, where: str) -> dict[str, str]:
    """The `"%d %s=%s\\n"` records of a pax header, checked in one linear pass."""
    records: dict[str, str] = {}
    pos = 0
    while pos < len(data) and data[pos] != 0:  # NUL padding may follow the records
        space = data.find(b" ", pos, pos + 21)
        digits = data[pos:space] if space > pos else b""
        length = int(digits) if digits.isdigit() else 0
        record = data[pos : pos + length]
        equals = record.find(b"=", len(digits) + 1)
        if (
            not length
            or pos + length > len(data)
            or equals <= len(digits) + 1
            or record[-1:] != b"\n"
        ):
            raise TarFormatError(
                f"{where} has a malformed pax extended header: each record must be "
                f"'<length> <key>=<value>\\n' within the header. Received: "
                f"{data[pos : pos + 60]!r}"
            )
        key = record[len(digits) + 1 : equals].decode("utf-8", "surrogateescape")
        records[key] = record[equals + 1 : -1].decode("utf-8", "surrogateescape")
        pos += length
    return records


def _header(block: bytes, where: str) -> tuple[str, bytes, int, str]:
    """`(name, type, size, linkname)` of a 512-byte header, its checksum verified."""
    stored = _number(block[148:156], "checksum", where)
    unsigned = sum(block[:148]) + 8 * 32 + sum(block[156:])
    signed = unsigned - 256 * sum(1 for b in block[:148] + block[156:] if b > 127)
    if stored not in (unsigned, signed):
        raise TarFormatError(
            f"{where} is not a tar archive: a header's checksum does not match. "
            f"Received: checksum={stored}, computed={unsigned}"
        )
    kind = block[156:157]
    name = _text(block[0:100])
    prefix = _text(block[345:500]) if block[257:263] == b"ustar\0" else ""
    if kind == b"\0" and name.endswith("/"):
        kind = b"5"
    if kind == b"5":
        name = name.rstrip("/")
    if prefix:
        name = f"{prefix}/{name}"
    return name, kind, _number(block[124:136], "size", where), _text(block[157:257])


def iter_members(stream: BinaryIO, *, where: str, max_stream_bytes: int) -> Iterator[TarMember]:
    """Yields each member of the tar `stream`; `member.read()` reads its data.

    Pax (`x`, `g`) and GNU long-name (`L`, `K`) headers are applied to the member they
    describe (`path`, `size`), never yielded; each may declare at most
    `MAX_EXTENDED_HEADER_BYTES`. A member's data is read by `member.read()` before the
    iteration moves on, or else skipped a chunk at a time. The stream ends at its first
    all-zero block (or at its end).

    Args:
        stream: The uncompressed tar stream (e.g. a `gzip.GzipFile`).
        where: A description of the archive, used in error messages.
        max_stream_bytes: The most bytes of tar data read from `stream`.

    Returns:
        An iterator of `TarMember`s.

    Raises:
        TarFormatError: On a bad checksum, a malformed or oversized extended header, a
            sparse member, a truncated stream, or more than `max_stream_bytes` of data.

    Example:

    ```python
    with gzip.open("archive.tar.gz") as stream:
        for member in iter_members(stream, where="archive.tar.gz", max_stream_bytes=2**30):
            if member.isreg() and member.name == "folder/file" and member.size < 2**20:
                content = member.read()
    ```
    """
    reader = _Reader(stream, where, max_stream_bytes)
    overrides: dict[str, str] = {}
    global_overrides: dict[str, str] = {}
    while True:
        block = reader.read(_BLOCK, eof_ok=True)
        if not block or block.count(0) == _BLOCK:
            return
        name, kind, size, _ = _header(block, where)
        if kind in _EXTENDED:
            if not 0 <= size <= MAX_EXTENDED_HEADER_BYTES:  # before reading any of it
                raise TarFormatError(
                    f"{where} has a tar extended header (type {kind.decode()!r}) that declares "
                    f"{size} bytes; at most {MAX_EXTENDED_HEADER_BYTES} are accepted (real "
                    "archives need a few hundred). The archive is corrupted or crafted: "
                    f"delete it and get it again. Received: extended header size={size}"
                )
            data = reader.read(_padded(size))[:size]
            if kind in (b"L", b"K"):
                key = "path" if kind == b"L" else "linkpath"
                overrides[key] = data.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            else:
                records = _pax_records(data, where)
                # Only what a member's name, size and kind need is kept (a few keys, however
                # many records the headers hold), so chained headers cost no memory.
                kept = {k: v for k, v in records.items() if k in _PAX_KEYS}
                if any(k.startswith("GNU.sparse.") for k in records):
                    kept["GNU.sparse."] = ""
                (global_overrides if kind == b"g" else overrides).update(kept)
            continue
        applied = {**global_overrides, **overrides}
        overrides = {}
        if kind == _SPARSE or "GNU.sparse." in applied:
            raise TarFormatError(
                f"{where} holds a sparse member ({name!r}); sparse files are not supported. "
                f"Received: member type={kind!r}"
            )
        name = applied.get("path", name)
        if kind == b"5":
            name = name.rstrip("/")
        if "size" in applied:
            value = applied["size"]
            if not (value.isascii() and value.isdigit()) or len(value) > 20:
                raise TarFormatError(
                    f"{where} has a pax 'size' that is not a decimal number. "
                    f"Received: size={applied['size'][:40]!r}"
                )
            size = int(applied["size"])
        if size < 0:
            raise TarFormatError(f"{where}: a member declares a negative size. Received: {size}")
        if kind in _NO_DATA:
            size = 0
        member = TarMember(name, kind, size, reader)
        yield member
        if member._readable:
            member._readable = False
            reader.skip(_padded(size))
