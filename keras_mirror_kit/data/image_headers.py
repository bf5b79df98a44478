"""Image sizes read from file headers, without decoding: PNG, JPEG, GIF and BMP.

`image_dataset_from_directory` decodes each file whole (TensorFlow's `decode_image`), so
a small file that declares a huge image (a "decompression bomb": a 0.7 MiB PNG of
16384x16384) costs about 800 MiB in the middle of training. `check_image_file` reads the
size a file declares (PNG IHDR, the JPEG SOFn marker, every GIF frame's descriptor, the
BMP info header) from its first bytes and refuses more than
`max_image_pixels` pixels before anything is decoded. The format is recognised from the
file's first bytes, as `decode_image` does, not from its name. `check_image_files` checks
a folder's files (in threads: a remote or cold folder's reads overlap), and
`check_link_loops` refuses a symbolic link back to a folder above it, which Keras' walk
with `follow_links=True` would never leave. Standard library only.
"""

from __future__ import annotations

import errno
import os
import struct
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO

from keras_mirror_kit.atomic_files import open_regular

__all__ = [
    "DEFAULT_MAX_IMAGE_PIXELS",
    "ImageHeaderError",
    "ImageSize",
    "ImageTooLargeError",
    "check_image_file",
    "check_image_files",
    "check_link_loops",
    "read_image_size",
]

#: The default pixel limit: Pillow's `Image.MAX_IMAGE_PIXELS` (1024 * 1024 * 1024 // 4 // 3).
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485

_CHUNK = 4096
_AFTER_SEEK = 512
_MAX_JPEG_SEGMENTS = 4096
# SOFn markers: every C0-CF except DHT (C4), JPG (C8) and DAC (CC).
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_JPEG_NO_LENGTH = frozenset({0x01, *range(0xD0, 0xD9)})  # TEM, RSTn, SOI
# `check_image_files`: files per task; threads, when the first task's files took longer
# than `_SLOW_READ_S` each to check (they wait on a disk or the network, not the CPU).
_FILES_PER_TASK, _THREADS, _SLOW_READ_S = 256, 8, 200e-6


class ImageHeaderError(ValueError):
    """Raised when a file's header does not give the size of a BMP, GIF, JPEG or PNG image.

    Example:

    ```python
    try:
        size = read_image_size(open("x.png", "rb"), name="x.png")
    except ImageHeaderError as e:
        print(e)
    ```
    """


class ImageTooLargeError(ValueError):
    """Raised when an image declares more pixels than the limit.

    Args:
        message: The full error message.
        path: The file.
        size: What its header declares.
        limit: The limit it exceeds.

    Example:

    ```python
    try:
        check_image_file("bomb.png", max_image_pixels=DEFAULT_MAX_IMAGE_PIXELS)
    except ImageTooLargeError as e:
        print(e.path, e.size.pixels, e.limit)
    ```
    """

    def __init__(self, message: str, *, path: str, size: ImageSize, limit: int) -> None:
        super().__init__(message)
        self.path = path
        self.size = size
        self.limit = limit


@dataclass(frozen=True)
class ImageSize:
    """The size an image file declares.

    Args:
        format: `"png"`, `"jpeg"`, `"gif"` or `"bmp"`.
        width: Width in pixels (a GIF's widest frame: TensorFlow's canvas).
        height: Height in pixels (a GIF's tallest frame).
        frames: Number of frames (a GIF's images; 1 for the other formats).
        pixels: Pixels the decoder makes: `frames * width * height`.

    Example:

    ```python
    ImageSize("png", 640, 480, 1, 307200).pixels  # -> 307200
    ```
    """

    format: str
    width: int
    height: int
    frames: int
    pixels: int


class _Cursor:
    """A file read forward in small chunks; `take(n)` gives exactly `n` bytes."""

    def __init__(self, file: BinaryIO, name: str, what: str) -> None:
        self.file = file
        self.name = name
        self.what = what
        self.buffer = b""
        self.pos = 0
        self.refill = _CHUNK

    def take(self, n: int, *, eof_ok: bool = False) -> bytes:
        """The next `n` bytes (b"" at the end if `eof_ok`), or `ImageHeaderError`."""
        while len(self.buffer) - self.pos < n:
            chunk = self.file.read(max(self.refill, n))
            self.refill = _CHUNK
            if not chunk:
                if eof_ok and self.pos == len(self.buffer):
                    return b""
                raise _error(self.name, f"the file ends inside its {self.what} header")
            self.buffer = self.buffer[self.pos :] + chunk
            self.pos = 0
        data = self.buffer[self.pos : self.pos + n]
        self.pos += n
        return data

    def skip(self, n: int) -> None:
        """Moves `n` bytes forward (a seek past the buffer, when the file can seek)."""
        left = len(self.buffer) - self.pos
        if n <= left:
            self.pos += n
            return
        self.buffer, self.pos = b"", 0
        self.refill = _AFTER_SEEK  # a JPEG segment's next marker: a few bytes are enough
        try:
            self.file.seek(n - left, os.SEEK_CUR)
        except (OSError, AttributeError, ValueError):
            for _ in range((n - left) // _CHUNK):
                self.take(_CHUNK)
            self.take((n - left) % _CHUNK)


def _error(name: str, what: str) -> ImageHeaderError:
    """The error for a header that gives no BMP, GIF, JPEG or PNG size."""
    return ImageHeaderError(
        f"Cannot read the image size of {name}: {what}. It is not a valid BMP, GIF, JPEG or "
        "PNG file (the formats the loader checks before decoding): remove or re-save it, "
        "or pass max_image_pixels=None to skip the check if you trust the folder. "
        f"Received: path={name!r}"
    )


def _png(cursor: _Cursor) -> tuple[int, int, int, int]:
    """Width, height, frames, pixels from the IHDR chunk that follows the signature."""
    cursor.skip(8)
    length, kind, width, height = struct.unpack(">I4sII", cursor.take(16))
    if kind != b"IHDR" or length != 13:
        raise _error(cursor.name, "a PNG must start with its IHDR chunk")
    return width, height, 1, width * height


def _jpeg_in(start: bytes) -> tuple[int, int, int, int] | None:
    """`_jpeg` of a header whose segments follow one another in `start` (the usual file),
    or None (stray or fill bytes, markers without a length, more to read: `_jpeg` then
    reads it, with its errors)."""
    pos = 2
    while pos + 9 <= len(start) and start[pos] == 0xFF:
        marker = start[pos + 1]
        length = (start[pos + 2] << 8) | start[pos + 3]
        if marker in _JPEG_NO_LENGTH or marker in (0x00, 0xD9, 0xDA, 0xFF) or length < 2:
            return None
        if marker in _JPEG_SOF:
            if length < 7:
                return None
            height, width = struct.unpack_from(">HH", start, pos + 5)
            return width, height, 1, width * height
        pos += 2 + length
    return None


def _jpeg(cursor: _Cursor) -> tuple[int, int, int, int]:
    """Width, height, frames, pixels from the first SOFn marker, seeking over segments."""
    found = _jpeg_in(cursor.buffer) if cursor.pos == 0 else None
    if found is not None:
        return found
    cursor.skip(2)
    for _ in range(_MAX_JPEG_SEGMENTS):
        byte = cursor.take(1)[0]
        while byte != 0xFF:  # libjpeg skips stray bytes before a marker; so do we
            byte = cursor.take(1)[0]
        marker = cursor.take(1)[0]
        while marker == 0xFF:  # fill bytes
            marker = cursor.take(1)[0]
        if marker in _JPEG_NO_LENGTH or marker == 0x00:
            continue
        if marker in (0xD9, 0xDA):
            raise _error(cursor.name, "a JPEG has no frame header (SOFn) before its data")
        (length,) = struct.unpack(">H", cursor.take(2))
        if length < 2:
            raise _error(cursor.name, f"a JPEG segment has length {length}")
        if marker in _JPEG_SOF:
            if length < 7:
                raise _error(cursor.name, "a JPEG frame header (SOFn) is too short")
            _, height, width = struct.unpack(">BHH", cursor.take(5))
            return width, height, 1, width * height
        cursor.skip(length - 2)
    raise _error(cursor.name, f"no JPEG frame header in its first {_MAX_JPEG_SEGMENTS} segments")


def _skip_sub_blocks(cursor: _Cursor) -> None:
    """Skips a GIF's data sub-blocks, up to their zero-length terminator."""
    while size := cursor.take(1)[0]:
        cursor.skip(size)


def _gif(cursor: _Cursor) -> tuple[int, int, int, int]:
    """Width, height, frames, pixels of the frames TensorFlow decodes, from every descriptor.

    `decode_gif` decodes every frame (also with `expand_animations=False`) onto a canvas of
    the largest frame width by the largest frame height, whatever the logical screen says.
    """
    cursor.skip(10)  # signature, logical screen width and height
    (flags,) = cursor.take(1)
    cursor.skip(2 + ((3 << ((flags & 7) + 1)) if flags & 0x80 else 0))
    frames = width = height = 0
    while True:
        first = cursor.take(1, eof_ok=bool(frames))  # a missing trailer is tolerated
        if not first or first[0] == 0x3B:  # the end, or the trailer
            break
        block = first[0]
        if block == 0x21:  # extension: its label, then data sub-blocks
            cursor.skip(1)
            _skip_sub_blocks(cursor)
        elif block == 0x2C:  # image descriptor
            _, _, frame_width, frame_height, frame_flags = struct.unpack("<HHHHB", cursor.take(9))
            if frame_flags & 0x80:
                cursor.skip(3 << ((frame_flags & 7) + 1))
            cursor.skip(1)  # LZW minimum code size
            _skip_sub_blocks(cursor)
            frames += 1
            width, height = max(width, frame_width), max(height, frame_height)
        else:
            raise _error(cursor.name, f"a GIF has an unknown block type 0x{block:02x}")
    if not frames:
        raise _error(cursor.name, "a GIF holds no image")
    return width, height, frames, frames * width * height


def _bmp(cursor: _Cursor) -> tuple[int, int, int, int]:
    """Width, height, frames, pixels from the info header (core or BITMAPINFOHEADER and later)."""
    cursor.skip(14)
    (header_size,) = struct.unpack("<I", cursor.take(4))
    if header_size == 12:  # BITMAPCOREHEADER
        width, height = struct.unpack("<HH", cursor.take(4))
    elif header_size >= 40:
        width, height = struct.unpack("<ii", cursor.take(8))
        height = abs(height)  # negative: rows stored top-down
    else:
        raise _error(cursor.name, f"a BMP info header of {header_size} bytes is not a known one")
    if width < 0:
        raise _error(cursor.name, f"a BMP declares a negative width ({width})")
    return width, height, 1, width * height


_FORMATS: tuple[tuple[bytes, str, Callable[[_Cursor], tuple[int, int, int, int]]], ...] = (
    (b"\x89PNG\r\n\x1a\n", "png", _png),
    (b"\xff\xd8", "jpeg", _jpeg),
    (b"GIF87a", "gif", _gif),
    (b"GIF89a", "gif", _gif),
    (b"BM", "bmp", _bmp),
)


def read_image_size(file: BinaryIO, *, name: str = "<image>") -> ImageSize:
    """Reads the size a BMP, GIF, JPEG or PNG file declares, without decoding it.

    The format is recognised from the first bytes (as TensorFlow's `decode_image` does),
    not from the name. Only the header is read (the first few KiB; a JPEG's segments
    before its frame header are skipped by seeking), except for a GIF, whose blocks are
    walked to the end to count its frames (`decode_image` decodes them all).

    Args:
        file: A binary file object positioned at the start of the image.
        name: The file's name, used in error messages.

    Returns:
        An `ImageSize`.

    Raises:
        ImageHeaderError: If the content is not one of the four formats, or its header is
            truncated or malformed.

    Example:

    ```python
    with open("cat.png", "rb") as f:
        read_image_size(f, name="cat.png")  # -> ImageSize('png', 640, 480, 1, 307200)
    ```
    """
    cursor = _Cursor(file, name, "image")
    start = cursor.buffer = file.read(_CHUNK)
    for magic, kind, parse in _FORMATS:
        if start.startswith(magic):
            cursor.what = kind.upper()
            width, height, frames, pixels = parse(cursor)
            if not width or not height:
                raise _error(name, f"its {kind.upper()} header declares {width}x{height} pixels")
            return ImageSize(kind, width, height, frames, pixels)
    if start[:4] == b"RIFF" and start[8:12] == b"WEBP":
        raise _error(name, "it is a WebP image, which the loader does not check")
    raise _error(name, f"its first bytes are not those of one of them ({start[:8]!r})")


def _class_roots(directory: str, labels: Any, class_names: Any) -> list[str]:
    """The folders Keras' `index_directory` walks: the class folders, or `directory`."""
    if labels != "inferred":
        return [directory]
    if class_names:
        return [os.path.join(directory, name) for name in class_names]
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []  # Keras' own indexing reports it
    return [
        os.path.join(directory, name)
        for name in names
        if not name.startswith(".") and os.path.isdir(os.path.join(directory, name))
    ]


def check_link_loops(
    directory: str,
    labels: Any,
    class_names: Any,
    *,
    is_remote: Callable[[str], bool] = lambda path: False,
) -> None:
    """Refuses a symbolic link to a folder above it, which `os.walk(followlinks=True)` loops on.

    Args:
        directory: The folder Keras' `index_directory` walks.
        labels: Its `labels` argument (`"inferred"`: only the class folders are walked).
        class_names: Its `class_names` argument.
        is_remote: Whether a path is remote (no links there: not checked).

    Returns:
        None.

    Raises:
        ValueError: Naming the link, if one leads back to a folder above it.

    Example:

    ```python
    check_link_loops("PetImages", "inferred", None)
    ```
    """
    if is_remote(directory):
        return  # no symbolic links in remote file systems
    for root in _class_roots(directory, labels, class_names):
        try:
            info = os.stat(root)
        except OSError:
            continue
        # (folder, the (st_dev, st_ino) of it and every folder above it, the last link taken)
        stack: list[tuple[str, tuple[tuple[int, int], ...], str | None]] = [
            (root, ((info.st_dev, info.st_ino),), None)
        ]
        while stack:
            folder, above, via = stack.pop()
            try:
                entries = list(os.scandir(folder))
            except OSError:
                continue  # os.walk skips unreadable folders too
            for entry in entries:
                try:
                    if not entry.is_dir():  # follows links, as os.walk(followlinks=True)
                        continue
                    info = entry.stat()
                    link = entry.path if entry.is_symlink() else via
                except OSError:
                    continue
                key = (info.st_dev, info.st_ino)
                if key in above:
                    target = os.path.realpath(link or entry.path)
                    raise ValueError(
                        f"The folder {directory} holds a symbolic link that leads back to a "
                        f"folder above it: {link} -> {target}. With follow_links=True the walk "
                        "over the files (Keras' os.walk) would follow it forever. Remove the "
                        "link, or pass follow_links=False. "
                        f"Received: follow_links=True, link={link!r}"
                    )
                stack.append((entry.path, (*above, key), link))


def check_image_files(
    paths: Sequence[str],
    max_image_pixels: int,
    *,
    is_remote: Callable[[str], bool] = lambda path: False,
    remote_opener: Callable[[str], BinaryIO] | None = None,
) -> list[ImageSize]:
    """`check_image_file` on every path (in threads when reading is slow); the first bad
    file in order is raised.

    Args:
        paths: The image files.
        max_image_pixels: The most pixels one may declare.
        is_remote: Whether a path is remote (read with `remote_opener`).
        remote_opener: Opens a remote path (e.g. `tf.io.gfile.GFile`).

    Returns:
        The `ImageSize` of each file, in the order of `paths`.

    Raises:
        ImageTooLargeError, ImageHeaderError, OSError: As `check_image_file`, for the
            first file in `paths` that fails.

    Example:

    ```python
    sizes = check_image_files(["a.jpg", "b.png"], DEFAULT_MAX_IMAGE_PIXELS)
    ```
    """

    def check(chunk: Sequence[str]) -> list[ImageSize]:
        return [
            check_image_file(
                path,
                max_image_pixels,
                opener=remote_opener if remote_opener is not None and is_remote(path) else None,
            )
            for path in chunk
        ]

    chunks = [paths[i : i + _FILES_PER_TASK] for i in range(0, len(paths), _FILES_PER_TASK)]
    began = time.perf_counter()
    sizes = check(chunks[0]) if chunks else []
    slow = time.perf_counter() - began > _SLOW_READ_S * len(sizes)
    if not slow or len(chunks) == 1:  # cached files: threads would contend for the GIL
        return sizes + [size for chunk in chunks[1:] for size in check(chunk)]
    pool = ThreadPoolExecutor(min(_THREADS, len(chunks) - 1))
    try:
        for future in [pool.submit(check, chunk) for chunk in chunks[1:]]:
            sizes += future.result()  # in order: the first bad file's error
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return sizes


def check_image_file(
    path: str,
    max_image_pixels: int,
    *,
    opener: Callable[[str], BinaryIO] | None = None,
) -> ImageSize:
    """Refuses an image file whose header declares more than `max_image_pixels` pixels.

    Args:
        path: The image file.
        max_image_pixels: The most pixels accepted (for a GIF, over all its frames).
        opener: Opens `path` for binary reading; when None, a regular file opened
            without blocking (`atomic_files.open_regular`, links followed); e.g.
            `tf.io.gfile.GFile` for remote paths.

    Returns:
        The `ImageSize` its header declares.

    Raises:
        ImageTooLargeError: If it declares more than `max_image_pixels` pixels.
        ImageHeaderError: If its header does not give a BMP, GIF, JPEG or PNG size, or it
            is not a regular file (a FIFO, a device).
        OSError: If the file cannot be read.

    Example:

    ```python
    check_image_file("PetImages/Cat/0.jpg", max_image_pixels=DEFAULT_MAX_IMAGE_PIXELS)
    ```
    """
    try:
        file = (opener or _open_binary)(path)
    except OSError as err:
        if err.errno != errno.EINVAL:  # a FIFO, a device, a folder named like an image
            raise
        raise _error(path, f"it is not a regular file ({err.strerror})") from err
    with file:
        size = read_image_size(file, name=path)
    if size.pixels > max_image_pixels:
        frames = f" over {size.frames} frames" if size.frames > 1 else ""
        raise ImageTooLargeError(
            f"The image {path} declares {size.width}x{size.height} pixels{frames} "
            f"({size.pixels} pixels), more than max_image_pixels={max_image_pixels}: "
            f"decoding it would take about {size.pixels * 4 // 2**20} MiB. It may be a "
            "decompression bomb: remove or shrink it, or, if you trust it, pass "
            f"max_image_pixels={size.pixels} or more (None skips the check). "
            f"Received: path={path!r}, {size.format} of {size.pixels} pixels",
            path=path,
            size=size,
            limit=max_image_pixels,
        )
    return size


def _open_binary(path: str) -> BinaryIO:
    """A regular file (links followed, as Keras' loader does), never blocking on a FIFO."""
    return open_regular(path, follow_links=True)
