"""Dataset files someone else made (issue 33): each gives a clear error, in bounded memory.

* CIFAR-10 (`load_cifar10`, NumPy only): pickles that make more bytes than the file holds
  (a zero-strided `numpy.ndarray(...)` call, a huge `_reconstruct`, one memoized text
  decoded into bytes many times) and tar archives whose pax or GNU long-name header declares a
  huge size or holds digits only (CVE-2024-6232). Each runs in a cheap child under an
  address-space cap, its peak RSS compared with a benign load's.
* Image headers (`data.image_headers`): the sizes PNG, JPEG, GIF and BMP headers declare,
  in process, without TensorFlow.
* Image and text folders (`image_dataset_from_directory`, `text_dataset_from_directory`):
  a decompression-bomb PNG, a GIF of many frames, a bomb named `.jpg`, symbolic-link loops;
  one TensorFlow child (forked from the tests' zygote) runs them in sequence, reporting
  each as a JSON line, with its peak RSS after each.

Every file is written here; nothing downloads.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import resource
import struct
import subprocess
import sys
import tarfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from keras_mirror_kit.data.image_headers import (
    DEFAULT_MAX_IMAGE_PIXELS,
    ImageHeaderError,
    ImageTooLargeError,
    check_image_file,
    read_image_size,
)
from keras_mirror_kit.datasets.bounded_tar import TarFormatError, iter_members
from keras_mirror_kit.datasets.safe_pickle import PickleBoundsError, safe_loads
from tests import forkserver
from tests.test_datasets_cifar10 import (
    FOLDER,
    _py2_int,
    _py2_str,
    make_cifar,
    write_archive,
    write_folder,
)

REPO = Path(__file__).resolve().parent.parent
MIB = 1024 * 1024
# The address-space cap of a CIFAR child: a benign load of the small test batches needs
# about 150 MiB of address space (Python and NumPy), each hostile file far more before the fix.
CHILD_ADDRESS_SPACE = 1024 * MIB
CHILD_ENV = {
    **os.environ,
    "PYTHONPATH": str(REPO),
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
}

# --------------------------------------------------------------------------------------
# CIFAR-10, in children that import NumPy only.
# --------------------------------------------------------------------------------------

CIFAR_CHILD = """
import json, resource, sys
from keras_mirror_kit.datasets import load_cifar10
try:
    (x_train, _), (x_test, _) = load_cifar10(sys.argv[1], sha256=None)
    out = {"ok": True, "rows": int(x_train.shape[0] + x_test.shape[0])}
except BaseException as e:
    out = {"ok": False, "error": type(e).__name__, "message": str(e)[:3000]}
out["maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print("RESULT " + json.dumps(out), flush=True)
"""


def _cap_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_ADDRESS_SPACE, CHILD_ADDRESS_SPACE))


def load_in_child(path: Path, timeout: float = 90) -> dict[str, Any]:
    """`load_cifar10(path, sha256=None)` in a capped child: its outcome and peak RSS."""
    proc = subprocess.run(
        [sys.executable, "-c", CIFAR_CHILD, str(path)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=CHILD_ENV,
        preexec_fn=_cap_address_space,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise AssertionError(f"child gave no result (rc={proc.returncode}):\n{proc.stderr[-3000:]}")


def _py2_dtype() -> bytes:
    """`numpy.dtype("u1")` with its state, as Python 2's NumPy pickled it."""
    return (
        b"cnumpy\ndtype\n"
        + _py2_str(b"u1")
        + _py2_int(0)
        + _py2_int(1)
        + b"\x87R("
        + _py2_int(3)
        + _py2_str(b"|")
        + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xff"
        + _py2_int(0)
        + b"tb"
    )


def _py2_reduce(module: bytes, name: bytes, args: list[bytes]) -> bytes:
    return b"c" + module + b"\n" + name + b"\n(" + b"".join(args) + b"tR"


def _py2_shape(shape: tuple[int, ...]) -> bytes:
    return b"(" + b"".join(_py2_int(d) for d in shape) + b"t"


def strided_batch(rows: int) -> bytes:
    """A batch whose data and labels are `numpy.ndarray(shape, u1, buffer=b"\\0",
    strides=0)`: a one-byte buffer laid out as `rows` images."""

    def strided(shape: tuple[int, ...]) -> bytes:
        strides = b"(" + _py2_int(0) * len(shape) + b"t"
        return _py2_reduce(
            b"numpy",
            b"ndarray",
            [_py2_shape(shape), _py2_dtype(), _py2_str(b"\0"), b"K\0", strides],
        )

    body = b"(" + _py2_str(b"data") + strided((rows, 3072))
    body += _py2_str(b"labels") + strided((rows,)) + b"d"
    return b"\x80\x02" + body + b"."


def reconstruct_batch(elements: int) -> bytes:
    """A batch whose data is `_reconstruct(ndarray, (elements,), "b")`: an allocation of
    `elements` bytes before any state is set."""
    size = (elements.bit_length() + 8) // 8
    shape = b"(\x8a" + bytes([size]) + elements.to_bytes(size, "little") + b"t"  # LONG1
    array = _py2_reduce(
        b"numpy.core.multiarray",
        b"_reconstruct",
        [b"cnumpy\nndarray\n", shape, _py2_str(b"b")],
    )
    return b"\x80\x02(" + _py2_str(b"data") + array + _py2_str(b"labels") + b"]d."


def _py2_array_from(shape: tuple[int, ...], raw: bytes) -> bytes:
    """An array as NumPy pickles it, its data given by the opcodes `raw`."""
    start = _py2_reduce(
        b"numpy.core.multiarray",
        b"_reconstruct",
        [b"cnumpy\nndarray\n", _py2_shape((0,)), _py2_str(b"b")],
    )
    return start + b"(" + _py2_int(1) + _py2_shape(shape) + _py2_dtype() + b"\x89" + raw + b"tb"


def decoded_many_times_batch(copies: int) -> bytes:
    """A valid 2-image batch plus `copies` calls of `_codecs.encode(text, "latin1")` on ONE
    memoized 1 MiB text (8 bytes of pickle per call, each making 1 MiB of bytes)."""
    good = _py2_array_from((2, 3072), _py2_str(bytes(2 * 3072)))
    text = b"X" + struct.pack("<i", MIB) + bytes(MIB)
    first = b"c_codecs\nencode\nq\x01" + text + b"q\x00X\x06\0\0\0latin1q\x02\x86R"
    again = b"h\x01h\x00h\x02\x86R"
    extra = b"](" + first + again * (copies - 1) + b"e"
    body = _py2_str(b"data") + good + _py2_str(b"labels") + b"](" + b"K\0K\0e"
    return b"\x80\x02(" + body + _py2_str(b"extra") + extra + b"d."


def tar_header(name: bytes, size: int, kind: bytes) -> bytes:
    """A 512-byte ustar header (any declared size, no data)."""
    header = bytearray(512)
    header[0 : len(name)] = name
    header[100:108] = b"0000644\0"
    header[108:124] = b"0000000\0" * 2
    header[124:136] = b"%011o\0" % size
    header[136:148] = b"%011o\0" % 0
    header[148:156] = b" " * 8
    header[156:157] = kind
    header[257:265] = b"ustar\x0000"
    header[148:156] = b"%06o\0 " % sum(header)
    return bytes(header)


def gzip_with_zeros(prefix: bytes, zero_mib: int, suffix: bytes = b"") -> bytes:
    """A valid gzip of `prefix`, `zero_mib` MiB of zeros and `suffix`, made in milliseconds:
    one compressed MiB of zeros (after a full flush, so it refers to nothing before it)
    repeated."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = compressor.compress(prefix) + compressor.flush(zlib.Z_FULL_FLUSH)
    zeros = bytes(MIB)
    chunk = compressor.compress(zeros) + compressor.flush(zlib.Z_FULL_FLUSH)
    tail = compressor.compress(suffix) + compressor.flush()
    crc = zlib.crc32(prefix)
    for _ in range(zero_mib):
        crc = zlib.crc32(zeros, crc)
    crc = zlib.crc32(suffix, crc)
    size = len(prefix) + zero_mib * MIB + len(suffix)
    trailer = struct.pack("<II", crc, size & 0xFFFFFFFF)
    return b"\x1f\x8b\x08\x00\0\0\0\0\x02\xff" + head + chunk * zero_mib + tail + trailer


def huge_extended_header_archive(path: Path, kind: bytes) -> Path:
    """A tar.gz of a few hundred KiB whose first header (`x` pax or `L` GNU long name)
    declares 7 GiB, followed by 700 MiB of zeros."""
    header = tar_header(b"././@PaxHeader" if kind == b"x" else b"././@LongLink", 7 << 30, kind)
    path.write_bytes(gzip_with_zeros(header, 700))
    return path


def digit_pax_archive(path: Path, digits: int = 500_000) -> Path:
    """A tar.gz whose pax header is `digits` digits and nothing else (CVE-2024-6232)."""
    data = b"1" * digits
    padded = data + bytes(-len(data) % 512)
    member = tar_header(f"{FOLDER}/readme.html".encode(), 0, b"0")
    tar = tar_header(b"././@PaxHeader", len(data), b"x") + padded + member + bytes(1024)
    path.write_bytes(zlib.compress(tar, 9, 31))
    return path


@pytest.fixture(scope="module")
def benign(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A benign load through the same entry point, in the same kind of child."""
    archive = tmp_path_factory.mktemp("benign") / "cifar-10-python.tar.gz"
    write_archive(archive, make_cifar().files)
    result = load_in_child(archive)
    assert result["ok"] and result["rows"] == 23, result
    return result


def _folder_with(tmp_path: Path, name: str, blob: bytes) -> Path:
    return write_folder(tmp_path, dict(make_cifar().files, **{name: blob}))


CIFAR_CASES = {
    # name: (what to write, the error's member, words the error must contain)
    "zero-strided ndarray": (
        lambda tmp: write_folder(
            tmp,
            {
                **{f"data_batch_{i}": strided_batch(100_000) for i in range(1, 6)},
                "test_batch": strided_batch(100_000),
            },
        ),
        "data_batch_1",
        "numpy.ndarray(...)",
    ),
    "huge _reconstruct": (
        lambda tmp: _folder_with(tmp, "data_batch_2", reconstruct_batch(10**10)),
        "data_batch_2",
        "_reconstruct",
    ),
    "one text decoded many times": (
        lambda tmp: _folder_with(tmp, "test_batch", decoded_many_times_batch(900)),
        "test_batch",
        "more than the",
    ),
    "pax header of 7 GiB": (
        lambda tmp: huge_extended_header_archive(tmp / "pax.tar.gz", b"x"),
        "pax.tar.gz",
        "declares 7516192768 bytes",
    ),
    "GNU long name of 7 GiB": (
        lambda tmp: huge_extended_header_archive(tmp / "longname.tar.gz", b"L"),
        "longname.tar.gz",
        "declares 7516192768 bytes",
    ),
    "digit-only pax header": (
        lambda tmp: digit_pax_archive(tmp / "digits.tar.gz"),
        "digits.tar.gz",
        "malformed pax extended header",
    ),
}


@pytest.mark.parametrize("case", list(CIFAR_CASES))
def test_hostile_cifar_files_are_format_errors_in_bounded_memory(
    tmp_path: Path, benign: dict[str, Any], case: str
) -> None:
    write, member, words = CIFAR_CASES[case]
    path = write(tmp_path)
    files = [path] if path.is_file() else list(path.iterdir())
    assert all(f.stat().st_size < 2 * MIB for f in files)  # small files
    result = load_in_child(path)
    assert not result["ok"], f"{case}: loaded {result}"
    assert result["error"] == "CIFAR10FormatError", result
    assert member in result["message"] and words in result["message"], result["message"]
    assert "delete" in result["message"] or "Expected the official" in result["message"]
    grown = (result["maxrss_kib"] - benign["maxrss_kib"]) / 1024
    assert grown < 100, f"{case}: peak RSS {grown:.0f} MiB above a benign load"


# In process: bounded even before the fix (nothing here can allocate much).


def test_only_plain_dtypes_load_and_real_numpy_pickles_still_do() -> None:
    for array in (np.zeros(3, dtype=[("a", "u1")]), np.array([1, "x"], dtype=object)):
        with pytest.raises(PickleBoundsError, match="plain bool, integer, float"):
            safe_loads(pickle.dumps({b"data": array}, protocol=2), source="batch")
    value = {
        "a": np.arange(12, dtype=">i4").reshape(3, 4),
        "f": np.asfortranarray(np.ones((2, 3), np.float32)),
        "s": [np.float64(1.5), np.bool_(True), np.uint8(7)],
    }
    for protocol in (2, 4, 5):
        blob = pickle.dumps(value, protocol=protocol)
        restored, plain = safe_loads(blob), pickle.loads(blob)
        np.testing.assert_array_equal(restored["a"], value["a"])
        np.testing.assert_array_equal(restored["f"], value["f"])
        assert restored["s"] == value["s"] and restored["a"].dtype == plain["a"].dtype
        assert restored["f"].flags.f_contiguous and restored["f"].dtype == np.float32


def test_protocol5_buffer_shorter_than_its_shape_is_refused() -> None:
    nbytes = 100 * 3072  # written outside the pickle's frames, so it can be cut here
    blob = pickle.dumps(np.zeros((100, 3072), np.uint8), protocol=5)
    short = blob.replace(struct.pack("<Q", nbytes) + bytes(nbytes), struct.pack("<Q", 1) + b"\0")
    assert short != blob
    with pytest.raises(PickleBoundsError, match=f"needs exactly {nbytes} bytes"):
        safe_loads(short, source="p5")


def test_a_shape_of_huge_integers_is_refused_before_it_is_multiplied() -> None:
    huge = b"\x8b" + struct.pack("<i", 1 << 16) + b"\xff" * ((1 << 16) - 1) + b"\x7f"  # LONG4
    shape = b"(" + huge * 3 + b"t"  # three 2**524287-sized dimensions
    array = _py2_array_from((1,), _py2_str(b"\0")).replace(_py2_shape((1,)), shape, 1)
    assert shape in array
    with pytest.raises(PickleBoundsError, match="shape must be a tuple"):
        safe_loads(b"\x80\x02" + array + b".", source="huge-dims")


def test_an_image_that_is_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "x.jpg")  # Keras lists it by its name; opening it would block
    with pytest.raises(ImageHeaderError, match="not a regular file"):
        check_image_file(str(tmp_path / "x.jpg"), DEFAULT_MAX_IMAGE_PIXELS)


def test_pickle_operations_are_bounded() -> None:
    blob = b"\x80\x04" + b"}" * 500_000 + b"."  # 500,000 empty dicts on the stack
    with pytest.raises(PickleBoundsError, match="more than 400000 pickle operations"):
        safe_loads(blob, source="many")


# --------------------------------------------------------------------------------------
# The bounded tar reader, in process (the crafted headers declare much, hold little).
# --------------------------------------------------------------------------------------


def _tar_of(members: dict[str, bytes], fmt: int) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_tar_reader_gives_the_names_and_data_tarfile_gives(fmt: int) -> None:
    long = "d/" + "x" * 150 + "/f" if fmt != tarfile.USTAR_FORMAT else "p" * 120 + "/f"
    members = {"a/one": b"1", long: b"22" * 300, "ünï/çode": b""}
    blob = _tar_of(members, fmt)
    found = {}
    for member in iter_members(io.BytesIO(blob), where="t.tar", max_stream_bytes=len(blob)):
        found[member.name] = member.read() if member.name != "a/one" else None
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        assert sorted(found) == sorted(tar.getnames())
    assert found[long] == b"22" * 300


@pytest.mark.parametrize("kind", [b"x", b"g", b"L", b"K"])
def test_tar_extended_header_bigger_than_the_bound_is_refused_unread(kind: bytes) -> None:
    stream = io.BytesIO(tar_header(b"h", 2 * MIB, kind) + bytes(4096))
    with pytest.raises(TarFormatError, match=f"declares {2 * MIB} bytes"):
        list(iter_members(stream, where="h.tar", max_stream_bytes=1 << 40))
    assert stream.tell() == 512  # nothing of the declared data was read


def test_chained_pax_headers_keep_only_what_a_member_needs() -> None:
    import tracemalloc

    def record(key: str, value: str) -> bytes:
        body = f" {key}={value}\n"
        size = len(body) + len(str(len(body)))
        size += len(str(size)) - len(str(len(body)))
        return f"{size}{body}".encode()

    # 400 chained headers of 1,000 records each, all keys different, then one member.
    def header(h: int) -> bytes:
        data = b"".join(record(f"k{h}.{i}", "v") for i in range(1000))
        return tar_header(b"x", len(data), b"x") + data + bytes(-len(data) % 512)

    named = record("path", "folder/file")
    blob = b"".join(header(h) for h in range(399))
    blob += tar_header(b"x", len(named), b"x") + named + bytes(-len(named) % 512)
    blob += tar_header(b"ignored", 3, b"0") + b"abc" + bytes(509) + bytes(1024)
    tracemalloc.start()
    try:
        found = [(m.name, m.read()) for m in iter_members(
            io.BytesIO(blob), where="t", max_stream_bytes=len(blob)
        )]  # fmt: skip
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert found == [("folder/file", b"abc")]
    assert peak < 4 * MIB, peak  # one header's records at a time, not 400,000 of them


def test_tar_reader_refuses_malformed_pax_sparse_bad_checksum_and_too_much_data() -> None:
    def members(blob: bytes, limit: int = 1 << 30) -> list[str]:
        return [m.name for m in iter_members(io.BytesIO(blob), where="t", max_stream_bytes=limit)]

    digits = b"9" * 5000
    with pytest.raises(TarFormatError, match="malformed pax"):
        members(tar_header(b"p", len(digits), b"x") + digits + bytes(-len(digits) % 512))
    with pytest.raises(TarFormatError, match="sparse"):
        members(tar_header(b"s", 0, b"S") + bytes(1024))
    bad = bytearray(tar_header(b"f", 0, b"0"))
    bad[0] = ord("g")
    with pytest.raises(TarFormatError, match="checksum"):
        members(bytes(bad))
    with pytest.raises(TarFormatError, match="holds more than 4096 bytes"):
        members(tar_header(b"big", 10 * MIB, b"0") + bytes(8192), limit=4096)
    with pytest.raises(TarFormatError, match="truncated"):
        members(tar_header(b"big", 7 << 30, b"0") + bytes(8192))


# --------------------------------------------------------------------------------------
# Image headers, in process, without TensorFlow.
# --------------------------------------------------------------------------------------


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png(width: int, height: int, idat: bytes | None = None) -> bytes:
    """A grayscale 8-bit PNG; `idat` defaults to a valid all-black image (small sizes)."""
    if idat is None:
        idat = zlib.compress(bytes((1 + width) * height))
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", idat)
        + _chunk(b"IEND", b"")
    )


def png_bomb(side: int = 16384) -> bytes:
    """A valid all-black `side` x `side` PNG of well under 1 MiB."""
    row = bytes(1 + side)
    rows_per_chunk = MIB // len(row)
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    chunk = compressor.compress(row * rows_per_chunk) + compressor.flush(zlib.Z_FULL_FLUSH)
    repeats, rest = divmod(side, rows_per_chunk)
    tail = compressor.compress(row * rest) + compressor.flush()
    adler = 1
    block = row * rows_per_chunk
    for _ in range(repeats):
        adler = zlib.adler32(block, adler)
    adler = zlib.adler32(row * rest, adler)
    idat = b"\x78\xda" + chunk * repeats + tail + struct.pack(">I", adler)
    return png(side, side, idat)


def jpeg(width: int, height: int, app_bytes: int = 0) -> bytes:
    """A JPEG's markers up to its frame header (SOF0), after optional large APP1 segments."""
    out = b"\xff\xd8" + b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\0\x01\x01\0\0\x01\0\x01\0\0"
    while app_bytes > 0:
        size = min(app_bytes, 65533)
        out += b"\xff\xe1" + struct.pack(">H", size + 2) + bytes(size)
        app_bytes -= size
    sof = struct.pack(">BHHB", 8, height, width, 3) + b"\x01\x11\0\x02\x11\0\x03\x11\0"
    return out + b"\xff\xc0" + struct.pack(">H", len(sof) + 2) + sof + b"\xff\xd9"


def gif(
    width: int, height: int, frames: int = 1, frame_size: tuple[int, int] | None = None
) -> bytes:
    """A GIF89a of `frames` images of `frame_size` (the screen's by default), each holding a
    one-pixel LZW stream (decoders stop there: only the header matters here)."""
    out = b"GIF89a" + struct.pack("<HHBBB", width, height, 0x80, 0, 0) + bytes(6)
    out += b"\x21\xf9\x04\x00\x00\x00\x00\x00"  # a graphic control extension
    size = frame_size or (width, height)
    image = b"\x2c" + struct.pack("<HHHHB", 0, 0, *size, 0) + b"\x02\x02\x44\x01\x00"
    return out + image * frames + b"\x3b"


def bmp(width: int, height: int) -> bytes:
    """A BITMAPINFOHEADER BMP header (no pixels)."""
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 24, 0, 0, 0, 0, 0, 0)
    return b"BM" + struct.pack("<IHHI", 54 + len(info), 0, 0, 54) + info


@pytest.mark.parametrize(
    ("blob", "expected"),
    [
        (png(37, 23), ("png", 37, 23, 1, 851)),
        (jpeg(640, 480), ("jpeg", 640, 480, 1, 307200)),
        (jpeg(41, 17, app_bytes=200_000), ("jpeg", 41, 17, 1, 697)),
        (gif(10, 7), ("gif", 10, 7, 1, 70)),
        (gif(10, 7, frames=5, frame_size=(20, 20)), ("gif", 20, 20, 5, 2000)),
        (gif(4000, 4000, frames=3, frame_size=(1, 1)), ("gif", 1, 1, 3, 3)),
        (bmp(33, -12), ("bmp", 33, 12, 1, 396)),
    ],
    ids=["png", "jpeg", "jpeg-big-app1", "gif", "gif-frames", "gif-small-frames", "bmp-top-down"],
)
def test_image_headers_give_the_declared_size(blob: bytes, expected: tuple) -> None:
    size = read_image_size(io.BytesIO(blob), name="x")
    assert (size.format, size.width, size.height, size.frames, size.pixels) == expected


class CountingFile(io.BytesIO):
    """A file that counts the bytes read from it."""

    read_bytes = 0

    def read(self, n: int | None = -1) -> bytes:
        data = super().read(n)
        self.read_bytes += len(data)
        return data


def test_only_the_first_few_kib_are_read() -> None:
    for blob in (png_bomb(2048), jpeg(41, 17, app_bytes=1_000_000), bmp(5, 5)):
        file = CountingFile(blob)
        read_image_size(file, name="x")
        assert file.read_bytes <= 16 * 1024, (file.read_bytes, len(blob))


def test_pillow_pixel_limit_by_default_and_the_limit_can_be_raised(tmp_path: Path) -> None:
    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(png_bomb())
    assert bomb.stat().st_size < MIB
    with pytest.raises(ImageTooLargeError) as info:
        check_image_file(str(bomb), DEFAULT_MAX_IMAGE_PIXELS)
    message = str(info.value)
    assert str(bomb) in message and "16384x16384" in message and "max_image_pixels=" in message
    assert isinstance(info.value, ValueError) and info.value.size.pixels == 16384**2
    assert check_image_file(str(bomb), 16384**2).pixels == 16384**2
    frames = tmp_path / "frames.gif"
    frames.write_bytes(gif(4096, 4096, frames=10))
    with pytest.raises(ImageTooLargeError, match="over 10 frames"):
        check_image_file(str(frames), DEFAULT_MAX_IMAGE_PIXELS)


@pytest.mark.parametrize(
    ("blob", "match"),
    [
        (b"not an image at all", "first bytes"),
        (png(5, 5)[:20], "ends inside its PNG header"),
        (b"RIFF\0\0\0\0WEBPVP8 ", "WebP"),
        (b"\xff\xd8\xff\xda\0\x02", "no frame header"),
        (png(0, 5), "0x5"),
        (b"GIF89a" + bytes(7) + b"\x3b", "no image"),
    ],
)
def test_unreadable_headers_are_clear_errors(blob: bytes, match: str) -> None:
    with pytest.raises(ImageHeaderError, match=match) as info:
        read_image_size(io.BytesIO(blob), name="/data/cats/1.png")
    assert "/data/cats/1.png" in str(info.value) and "max_image_pixels=None" in str(info.value)


# --------------------------------------------------------------------------------------
# Image and text folders: one TensorFlow child runs every case in sequence.
# --------------------------------------------------------------------------------------

FOLDER_CHILD = """
import json, resource, sys
import keras_mirror_kit as kmk
try:  # a forked child starts with its parent's peak: measure from this process's own start
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError:  # a sandbox without it: the parent's peak stays in, as after an exec
    pass
for case in json.loads(sys.argv[1]):
    load = getattr(kmk, case["loader"])
    try:
        dataset = load(case["dir"], batch_size=4, seed=1, verbose=False, **case["kwargs"])
        if case.get("iterate"):
            next(iter(dataset))
        out = {"ok": True}
    except Exception as e:
        out = {"ok": False, "error": type(e).__name__, "message": str(e)}
    out.update(name=case["name"], maxrss_kib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    print("RESULT " + json.dumps(out), flush=True)
"""


def _image_folder(root: Path, extra: dict[str, bytes] | None = None) -> Path:
    for label in ("cat", "dog"):
        (root / label).mkdir(parents=True)
        for i in range(4):
            (root / label / f"{i}.png").write_bytes(png(12 + i, 9))
    for name, blob in (extra or {}).items():
        (root / name).write_bytes(blob)
    return root


def _loop(root: Path, label: str = "cat") -> Path:
    """Two links in `label/` back to it and to `root`: os.walk(followlinks=True) walks
    2**40 paths (until the kernel's 40-link limit on each)."""
    os.symlink(".", root / label / "again")
    os.symlink("..", root / label / "up")
    return root


@pytest.fixture(scope="module")
def folder_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    base = tmp_path_factory.mktemp("folders")
    bomb = png_bomb()
    text = base / "text"
    for label in ("neg", "pos"):
        (text / label).mkdir(parents=True)
        (text / label / "a.txt").write_text(f"{label} text")
    image, texts = "image_dataset_from_directory", "text_dataset_from_directory"
    cases = [
        ("benign", image, _image_folder(base / "benign"), {}, True),
        ("png bomb", image, _image_folder(base / "bomb", {"cat/bomb.png": bomb}), {}, False),
        ("bomb named .jpg", image, _image_folder(base / "jpg", {"dog/x.jpg": bomb}), {}, False),
        (
            "gif of many frames",
            image,
            _image_folder(base / "gif", {"cat/f.gif": gif(4096, 4096, frames=10)}),
            {},
            False,
        ),
        ("bomb, limit raised", image, base / "bomb", {"max_image_pixels": 16384**2}, False),
        ("bomb, check off", image, base / "bomb", {"max_image_pixels": None}, False),
        ("bad limit", image, base / "benign", {"max_image_pixels": 0}, False),
        ("loop, not followed", image, _loop(_image_folder(base / "loop")), {}, False),
        ("image loop", image, base / "loop", {"follow_links": True}, False),
        (
            "text loop",
            texts,
            _loop(text, "neg"),
            {"follow_links": True},
            False,
        ),
    ]
    spec = [
        {"name": n, "loader": f, "dir": str(d), "kwargs": k, "iterate": i}
        for n, f, d, k, i in cases
    ]
    proc = forkserver.run(  # forked from the tests' zygote: TensorFlow already imported
        [sys.executable, "-c", FOLDER_CHILD, json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=120,  # a bound for a stuck child: the builds take a few seconds
        env=CHILD_ENV,
    )
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
            results[result["name"]] = result
    assert len(results) == len(cases), f"rc={proc.returncode}\n{proc.stderr[-3000:]}"
    results["paths"] = {"bomb": str(base / "bomb" / "cat" / "bomb.png")}
    return results


def _refused(result: dict[str, Any], fragment: str) -> str:
    assert not result["ok"], result
    assert result["error"] in ("ValueError", "ImageTooLargeError", "ImageHeaderError"), result
    assert fragment in result["message"], result["message"]
    return result["message"]


@pytest.mark.slow
def test_image_bombs_are_refused_when_the_dataset_is_built(folder_results: dict) -> None:
    benign = folder_results["benign"]
    assert benign["ok"], benign
    message = _refused(folder_results["png bomb"], folder_results["paths"]["bomb"])
    assert "16384x16384" in message and "max_image_pixels=" in message
    _refused(folder_results["bomb named .jpg"], "x.jpg declares 16384x16384")
    _refused(folder_results["gif of many frames"], "over 10 frames")
    for name in ("png bomb", "bomb named .jpg", "gif of many frames"):
        grown = (folder_results[name]["maxrss_kib"] - benign["maxrss_kib"]) / 1024
        assert grown < 100, f"{name}: peak RSS {grown:.0f} MiB above a benign load"


@pytest.mark.slow
def test_the_pixel_limit_can_be_raised_or_turned_off(folder_results: dict) -> None:
    assert folder_results["bomb, limit raised"]["ok"], folder_results["bomb, limit raised"]
    assert folder_results["bomb, check off"]["ok"], folder_results["bomb, check off"]
    bad = folder_results["bad limit"]
    assert bad["error"] == "ValueError" and "max_image_pixels=0" in bad["message"], bad


@pytest.mark.slow
def test_symlink_loops_are_refused_with_follow_links(folder_results: dict) -> None:
    assert folder_results["loop, not followed"]["ok"], folder_results["loop, not followed"]
    for name, label in (("image loop", "cat"), ("text loop", "neg")):
        message = _refused(folder_results[name], "symbolic link that leads back")
        assert "follow_links=False" in message and f"{label}/again" in message, message
