"""Reading one checkpoint file (`ckpt-NNNNNNNN.npz`) that anyone may have made, with bounds.

A checkpoint directory may hold files someone else made (a shared cluster directory, a
co-tenant, a copy from elsewhere). Everything here reads an already opened regular file
(`atomic_files.open_regular`: never through a link, never a FIFO or device) and checks
each claim of the file against what it should be before it reads what the claim sizes:

* the zip's central directory is at most `CENTRAL_DIRECTORY_LIMIT` bytes (checked from
  its end record before `zipfile` parses it), and its members are stored uncompressed (as
  the kit writes them), have names of a checkpoint's arrays (`model/00003.npy`, ...;
  nothing is ever extracted to a path), no duplicates, and sizes that add up to no more
  than the file: no read is larger than the file itself;
* every `.npy` header (versions 1.0, 2.0 and 3.0) is parsed from at most
  `NPY_HEADER_LIMIT` bytes without reading the array, and the data after it must be
  exactly what its shape and dtype need; dtypes holding Python objects are refused;
* the metadata member is a byte array of at most `META_LIMIT` bytes, read once;
* the arrays' names agree with the metadata (`check_layout`): one array per variable
  number, Keras' seed state as two integers, every array a callback state refers to.

Every failure is a `ValueError` (or one of `UNREADABLE`, what `zipfile` raises on a
damaged file), which the store reports as an unreadable checkpoint. Nothing here imports
Keras or TensorFlow.
"""

from __future__ import annotations

import io
import math
import os
import re
import struct
import zipfile
import zlib
from collections.abc import Mapping
from typing import BinaryIO

import numpy as np

from keras_mirror_kit.checkpoint.meta import (
    CheckpointMeta,
    callback_array_keys,
    parse_json,
    shortened,
)
from keras_mirror_kit.data.py_dataset_cursor import ARRAY_KINDS

__all__ = [
    "CENTRAL_DIRECTORY_LIMIT",
    "META_KEY",
    "META_LIMIT",
    "NPY_HEADER_LIMIT",
    "UNREADABLE",
    "array_headers",
    "check_layout",
    "file_identity",
    "member_header",
    "open_zip",
    "read_array",
    "read_meta",
    "valid_key",
]

META_KEY = "__meta__"
# About 100,000 arrays' records (a model of 30,000 variables with Adam); what zipfile
# builds of it in memory is about 8x its size.
CENTRAL_DIRECTORY_LIMIT = 16 << 20
META_LIMIT = 64 << 20  # the metadata: the variables' paths, the architecture, callbacks
NPY_HEADER_LIMIT = 10_000  # NumPy's own bound on a header it parses safely
_MAX_DIMS = 64  # NumPy's most dimensions
# What zipfile raises on a damaged file: besides BadZipFile, a flipped bit in a member's
# flags, method or version gives NotImplementedError, RuntimeError (encrypted) or zlib.error;
# a cut extra field, struct.error; an offset past what a seek takes, OverflowError.
UNREADABLE = (
    OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, NotImplementedError,
    RuntimeError, zlib.error, struct.error, OverflowError,
)  # fmt: skip
_KEY = re.compile(
    r"(?:model|optimizer|metrics)/[0-9]{1,9}|random/[^/]+|callback(?:/[^/]+){2,}|"
    + "|".join(map(re.escape, ARRAY_KINDS))  # a PyDataset's position
)
_BAD_CHARACTER = re.compile(r"[\x00-\x1f\x7f\\]")
_RANDOM_SHAPE = (2,)  # Keras' seed generator state: two integers


def file_identity(info: os.stat_result) -> tuple[int, int, int, int]:
    """What tells a file apart from another one put in its place (device, inode, size, mtime)."""
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


def _short(name: str) -> str:
    """`repr(name)`, shortened (a member name of a hostile file)."""
    return shortened(repr(name), 80)


def valid_key(key: str) -> bool:
    """Whether `key` names an array a checkpoint holds (`model/00003`, `callback/K/N`)."""
    return key == META_KEY or (
        _KEY.fullmatch(key) is not None
        and not _BAD_CHARACTER.search(key)
        and not any(part in (".", "..") for part in key.split("/"))
    )


def open_zip(handle: BinaryIO) -> zipfile.ZipFile:
    """The zip of an open checkpoint file, once its directory and members are checked.

    Raises:
        ValueError: A central directory over `CENTRAL_DIRECTORY_LIMIT`, a member that is
            compressed, misnamed, duplicated, or sizes that add up to more than the file.
        zipfile.BadZipFile: Not a zip file (and the others of `UNREADABLE`).
    """
    size = os.fstat(handle.fileno()).st_size
    end_record = getattr(zipfile, "_EndRecData", None)  # private, in every Python 3
    if end_record is not None:
        record = end_record(handle)
        if record is None:
            raise zipfile.BadZipFile("it is not a zip file (no end of central directory)")
        directory = record[getattr(zipfile, "_ECD_SIZE", 5)]
        if directory > CENTRAL_DIRECTORY_LIMIT:
            raise ValueError(
                f"its zip directory claims {directory} bytes, over the "
                f"{CENTRAL_DIRECTORY_LIMIT} a checkpoint's may hold"
            )
    archive = zipfile.ZipFile(handle)
    try:
        _check_members(archive, size)
    except BaseException:
        archive.close()
        raise
    return archive


def _check_members(archive: zipfile.ZipFile, size: int) -> None:
    """Refuses members that are not a checkpoint's stored arrays, or sizes past the file."""
    seen: set[str] = set()
    total = 0
    for info in archive.infolist():
        name = info.filename
        if info.orig_filename != name or name in seen:
            raise ValueError(f"it holds a duplicate or NUL-cut member name {_short(name)}")
        seen.add(name)
        if not name.endswith(".npy") or not valid_key(name[: -len(".npy")]):
            raise ValueError(f"it holds a member {_short(name)}, not one of a checkpoint's")
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise ValueError(
                f"member {_short(name)} is compressed (method {info.compress_type}); the kit "
                "writes and reads members uncompressed"
            )
        total += info.file_size
    if total > size:
        raise ValueError(
            f"its members claim {total} bytes, more than the file's {size} (overlapping "
            "members or false sizes)"
        )


def member_header(
    archive: zipfile.ZipFile, info: zipfile.ZipInfo
) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype of one `.npy` member, from its header alone (any version).

    A member whose dtype holds Python objects (a pickle) is refused here, so such a file is
    reported as unreadable (and skipped for the previous checkpoint) before anything reads
    it: the kit never unpickles a checkpoint.

    Raises:
        ValueError: A header of another version, over `NPY_HEADER_LIMIT` bytes, malformed,
            of Python objects, or data of another length than the header needs.
    """
    name = _short(info.filename)
    with archive.open(info) as member:
        version = np.lib.format.read_magic(member)
        if version not in ((1, 0), (2, 0), (3, 0)):
            raise ValueError(f"member {name} has an .npy header of version {version}")
        width = 2 if version == (1, 0) else 4
        raw = member.read(width)
        length = int.from_bytes(raw, "little")
        if len(raw) != width or length > NPY_HEADER_LIMIT:
            raise ValueError(f"member {name} has an .npy header over {NPY_HEADER_LIMIT} bytes")
        text = member.read(length)
    if len(text) != length or (version == (3, 0) and not text.isascii()):
        raise ValueError(f"member {name} has a cut or non-ASCII .npy header")
    # A 3.0 header is a 2.0 one in UTF-8: the same when ASCII.
    read = (
        np.lib.format.read_array_header_1_0 if width == 2 else np.lib.format.read_array_header_2_0
    )
    try:
        shape, _, dtype = read(io.BytesIO(raw + text), max_header_size=NPY_HEADER_LIMIT)
        dtype = np.dtype(dtype)
    except (TypeError, OverflowError, RecursionError, SyntaxError, MemoryError) as err:
        raise ValueError(f"member {name} has a malformed .npy header ({err})") from None
    if dtype.hasobject:
        raise ValueError(
            f"member {name} holds Python objects (a pickle), which the kit never loads"
        )
    if len(shape) > _MAX_DIMS or any(d < 0 for d in shape):
        raise ValueError(f"member {name} has an impossible shape {shape}")
    need = math.prod(shape) * dtype.itemsize
    data = info.file_size - (8 + width + length)
    if data != need:
        raise ValueError(
            f"member {name} holds {data} bytes of data; its header ({tuple(shape)} "
            f"{dtype}) needs {need}"
        )
    return tuple(shape), dtype


def read_meta(archive: zipfile.ZipFile) -> object:
    """The metadata member of a checkpoint file, as JSON (for `CheckpointMeta.from_json`).

    Raises:
        ValueError: Over `META_LIMIT` bytes, not a byte array, or not UTF-8 JSON.
        KeyError: The file has no metadata.
    """
    info = archive.getinfo(f"{META_KEY}.npy")
    if info.file_size > META_LIMIT:
        raise ValueError(
            f"its metadata claims {info.file_size} bytes, over the {META_LIMIT} it may hold"
        )
    shape, dtype = member_header(archive, info)
    if dtype != np.uint8 or len(shape) != 1:
        raise ValueError(f"its metadata is {shape} {dtype}, not a byte array")
    with archive.open(info) as member:
        member.seek(info.file_size - shape[0])  # past the header: its data
        data = member.read(shape[0])
    return parse_json(data)


def array_headers(archive: zipfile.ZipFile) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The shape and dtype of every array (all but the metadata), by name, from headers."""
    return {
        info.filename[: -len(".npy")]: member_header(archive, info)
        for info in archive.infolist()
        if info.filename != f"{META_KEY}.npy"
    }


def check_layout(
    headers: Mapping[str, tuple[tuple[int, ...], np.dtype]], meta: CheckpointMeta
) -> None:
    """Checks that the arrays are those the metadata describes.

    One array per variable number (`model/00003` is variable 3 of `meta.variables`, of that
    group), Keras' seed state (`random/...`) as two integers, and every array a callback
    state refers to present.

    Raises:
        ValueError: Naming the first array that does not fit.
    """
    numbers: dict[int, str] = {}
    listed = meta.variables
    for key, (shape, dtype) in headers.items():
        group, _, rest = key.partition("/")
        if group in ("model", "optimizer", "metrics"):
            number = int(rest)
            if number in numbers:
                raise ValueError(f"arrays {numbers[number]} and {key} hold one variable")
            numbers[number] = key
            if listed and (number >= len(listed) or not listed[number].startswith(f"{group}:")):
                raise ValueError(f"array {key} is not a variable its metadata lists")
        elif group == "random" and (shape != _RANDOM_SHAPE or dtype.kind not in "iu"):
            raise ValueError(f"array {key} is {shape} {dtype}, not a seed state of two integers")
        elif group == "data" and (len(shape) != 1 or dtype.kind not in ARRAY_KINDS[key]):
            raise ValueError(f"array {key} is {shape} {dtype}, not a PyDataset position")
    missing = [key for key in callback_array_keys(meta.callbacks) if key not in headers]
    if missing:
        raise ValueError(
            f"its callback state refers to {len(missing)} missing array(s): "
            f"{', '.join(map(_short, missing[:3]))}"
        )


def read_array(
    archive: zipfile.ZipFile, key: str, shape: tuple[int, ...], dtype: np.dtype
) -> np.ndarray:
    """One array of a verified file (its CRC checked), refused unless of `shape` and `dtype`."""
    with archive.open(f"{key}.npy") as member:
        array = np.lib.format.read_array(
            member, allow_pickle=False, max_header_size=NPY_HEADER_LIMIT
        )
    if array.shape != tuple(shape) or array.dtype != dtype:
        raise ValueError(f"array {key} changed since its file was verified")
    return array
