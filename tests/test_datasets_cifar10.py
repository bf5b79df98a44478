"""Tests for `keras_mirror_kit.datasets.load_cifar10` and the safe unpickler.

Every archive here is written in the real "CIFAR-10 python version" format: a
gzip tar holding `cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}`,
each a pickle *as Python 2's cPickle wrote it* (protocol 2, byte strings as
BINSTRING, arrays through `numpy.core.multiarray._reconstruct`), just with
fewer rows than the official 10000 per batch. No test touches the network: downloads
go to `file://` URLs or to an HTTP server on 127.0.0.1 run by the test (`serve`).
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import io
import ipaddress
import os
import pickle
import shlex
import socket
import struct
import tarfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from keras_mirror_kit.datasets import (
    CIFAR10_SHA256,
    CIFAR10_URL,
    CIFAR10ChecksumError,
    CIFAR10FormatError,
    CIFAR10NotAvailableError,
    SafeUnpickler,
    UnsafePickleError,
    default_cache_dir,
    load_cifar10,
)
from keras_mirror_kit.datasets import cifar10 as cifar10_module
from keras_mirror_kit.datasets.safe_pickle import safe_loads

TRAIN = [f"data_batch_{i}" for i in range(1, 6)]
TEST = "test_batch"
FOLDER = "cifar-10-batches-py"
ROWS = {
    "data_batch_1": 2,
    "data_batch_2": 3,
    "data_batch_3": 4,
    "data_batch_4": 5,
    "data_batch_5": 6,
    "test_batch": 3,
}


# --------------------------------------------------------------------------------------
# Writing batches exactly like Python 2's cPickle (protocol 2) did.
# --------------------------------------------------------------------------------------


def _py2_str(value: bytes) -> bytes:
    """A Python 2 `str`: SHORT_BINSTRING or BINSTRING."""
    if len(value) < 256:
        return b"U" + bytes([len(value)]) + value
    return b"T" + struct.pack("<i", len(value)) + value


def _py2_int(value: int) -> bytes:
    if 0 <= value < 256:
        return b"K" + bytes([value])
    if 0 <= value < 65536:
        return b"M" + struct.pack("<H", value)
    return b"J" + struct.pack("<i", value)


def _py2_tuple(items: list[bytes]) -> bytes:
    if 1 <= len(items) <= 3:
        return b"".join(items) + {1: b"\x85", 2: b"\x86", 3: b"\x87"}[len(items)]
    return b"(" + b"".join(items) + b"t"


def _py2_array(arr: np.ndarray) -> bytes:
    """A uint8 ndarray as NumPy 1.x under Python 2 pickled it."""
    assert arr.dtype == np.uint8 and arr.flags.c_contiguous
    dtype = (
        b"cnumpy\ndtype\n"
        + _py2_str(b"u1")
        + _py2_int(0)
        + _py2_int(1)
        + b"\x87R"
        + b"("
        + _py2_int(3)
        + _py2_str(b"|")
        + b"NNN"
        + b"J\xff\xff\xff\xffJ\xff\xff\xff\xff"
        + _py2_int(0)
        + b"tb"
    )
    state = (
        b"("
        + _py2_int(1)
        + _py2_tuple([_py2_int(d) for d in arr.shape])
        + dtype
        + b"\x89"
        + _py2_str(arr.tobytes())
        + b"t"
    )
    return (
        b"cnumpy.core.multiarray\n_reconstruct\n"
        + b"cnumpy\nndarray\n"
        + _py2_int(0)
        + b"\x85"
        + _py2_str(b"b")
        + b"\x87R"
        + state
        + b"b"
    )


def _py2_obj(obj: object) -> bytes:
    if obj is None:
        return b"N"
    if isinstance(obj, bool):
        return b"\x88" if obj else b"\x89"
    if isinstance(obj, int):
        return _py2_int(obj)
    if isinstance(obj, bytes):
        return _py2_str(obj)
    if isinstance(obj, np.ndarray):
        return _py2_array(obj)
    if isinstance(obj, list):
        return b"]" + (b"(" + b"".join(map(_py2_obj, obj)) + b"e" if obj else b"")
    if isinstance(obj, dict):
        items = b"".join(_py2_obj(k) + _py2_obj(v) for k, v in obj.items())
        return b"}" + (b"(" + items + b"u" if obj else b"")
    raise TypeError(type(obj))


def py2_pickle(obj: object) -> bytes:
    return b"\x80\x02" + _py2_obj(obj) + b"."


def batch_pickle(name: str, data: np.ndarray, labels: list[int]) -> bytes:
    """One batch file, with the same four entries as the official ones."""
    return py2_pickle(
        {
            b"batch_label": f"{name} of 5".encode(),
            b"labels": labels,
            b"data": data,
            b"filenames": [f"img_{name}_{i}.png".encode() for i in range(len(labels))],
        }
    )


META = py2_pickle(
    {
        b"num_cases_per_batch": 10000,
        b"label_names": [
            b"airplane",
            b"automobile",
            b"bird",
            b"cat",
            b"deer",
            b"dog",
            b"frog",
            b"horse",
            b"ship",
            b"truck",
        ],
        b"num_vis": 3072,
    }
)


@dataclass
class Cifar:
    """A small CIFAR-10 in the official format, plus what loading it must give."""

    data: dict[str, np.ndarray]
    labels: dict[str, list[int]]
    files: dict[str, bytes]

    def expected(self) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
        # Independent of the loader's reshape/transpose: pixel (row, col, channel) of an
        # image is column channel*1024 + row*32 + col of its data row.
        row, col, channel = np.indices((32, 32, 3))
        columns = channel * 1024 + row * 32 + col

        def split(names: list[str]) -> tuple[np.ndarray, np.ndarray]:
            x = np.concatenate([self.data[n][:, columns] for n in names])
            y = np.concatenate([self.labels[n] for n in names]).astype(np.uint8)[:, None]
            return x, y

        return split(TRAIN), split([TEST])


def make_cifar(seed: int = 0) -> Cifar:
    rng = np.random.default_rng(seed)
    data, labels, files = {}, {}, {}
    for name in [*TRAIN, TEST]:
        data[name] = rng.integers(0, 256, (ROWS[name], 3072), dtype=np.uint8)
        labels[name] = [int(v) for v in rng.integers(0, 10, ROWS[name])]
    # Known pixels: image 0 of data_batch_1 is black but for one pixel per channel.
    data["data_batch_1"][0] = 0
    data["data_batch_1"][0, 0 * 1024 + 1 * 32 + 2] = 200  # R at row 1, col 2
    data["data_batch_1"][0, 1 * 1024 + 3 * 32 + 4] = 150  # G at row 3, col 4
    data["data_batch_1"][0, 2 * 1024 + 31 * 32 + 0] = 99  # B at row 31, col 0
    labels["data_batch_1"][:2] = [9, 0]
    for name in data:
        files[name] = batch_pickle(name, data[name], labels[name])
    files["batches.meta"] = META
    return Cifar(data, labels, files)


def write_folder(parent: Path, files: dict[str, bytes]) -> Path:
    folder = parent / FOLDER
    folder.mkdir(parents=True)
    for name, blob in files.items():
        (folder / name).write_bytes(blob)
    return folder


def write_archive(
    path: Path,
    files: dict[str, bytes],
    *,
    order: list[str] | None = None,
    extra: list[tarfile.TarInfo] | None = None,
) -> str:
    """Writes a gzip tar like the official one; returns its SHA-256."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        folder = tarfile.TarInfo(FOLDER)
        folder.type = tarfile.DIRTYPE
        folder.mode = 0o755
        tar.addfile(folder)
        for name in order or list(files):
            info = tarfile.TarInfo(f"{FOLDER}/{name}")
            info.size = len(files[name])
            tar.addfile(info, io.BytesIO(files[name]))
        for info in extra or []:
            tar.addfile(info, io.BytesIO(b"x" * info.size) if info.isreg() else None)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_loaded(result: object, cifar: Cifar) -> None:
    (x_train, y_train), (x_test, y_test) = result  # type: ignore[misc]
    (ex_train, ey_train), (ex_test, ey_test) = cifar.expected()
    assert x_train.shape == (20, 32, 32, 3) and x_test.shape == (3, 32, 32, 3)
    assert y_train.shape == (20, 1) and y_test.shape == (3, 1)
    for arr in (x_train, y_train, x_test, y_test):
        assert arr.dtype == np.uint8 and arr.flags.c_contiguous
    np.testing.assert_array_equal(x_train, ex_train)
    np.testing.assert_array_equal(y_train, ey_train)
    np.testing.assert_array_equal(x_test, ex_test)
    np.testing.assert_array_equal(y_test, ey_test)


@dataclass
class Served:
    """What `serve` answers with, and the paths it was asked for."""

    body: bytes
    status: int = 200
    content_type: str = "application/gzip"
    requests: list[str] = field(default_factory=list)


@contextlib.contextmanager
def serve(served: Served) -> Iterator[str]:
    """A real HTTP server on 127.0.0.1 (in a thread); yields the URL of the archive on it."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            served.requests.append(self.path)
            self.send_response(served.status)
            self.send_header("Content-Type", served.content_type)
            self.send_header("Content-Length", str(len(served.body)))
            self.end_headers()
            self.wfile.write(served.body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # keep the test output quiet

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/cifar-10-python.tar.gz"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


CAPTIVE_PORTAL = Served(
    b"<!DOCTYPE html><html><head><title>Sign in to the network</title></head>"
    b"<body><form action='/login'>Accept the terms to continue</form></body></html>",
    content_type="text/html; charset=utf-8",
)


def _is_loopback(host: object) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(str(host)).is_loopback
    except ValueError:
        return False


# For the environment of anything that downloads from `serve`: a user's `http_proxy` must
# not receive the requests meant for 127.0.0.1 (urllib bypasses only what `no_proxy` lists).
NO_PROXY_ENV = {"no_proxy": "127.0.0.1,localhost,::1", "NO_PROXY": "127.0.0.1,localhost,::1"}


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to reach beyond this machine fails, as it would on an offline machine.

    Loopback stays open, and bypasses any proxy, for the tests' own server (`serve`).
    """
    for name, value in NO_PROXY_ENV.items():
        monkeypatch.setenv(name, value)
    real_getaddrinfo = socket.getaddrinfo
    real_connect = socket.socket.connect
    real_connect_ex = socket.socket.connect_ex

    def getaddrinfo(host: object, *args: object, **kwargs: object) -> object:
        if not _is_loopback(host):
            raise OSError("network disabled in tests")
        return real_getaddrinfo(host, *args, **kwargs)  # type: ignore[arg-type]

    def guard(real: object) -> object:
        def connect(sock: socket.socket, address: object) -> object:
            host = address[0] if isinstance(address, tuple) else None
            if not _is_loopback(host):
                raise OSError("network disabled in tests")
            return real(sock, address)  # type: ignore[operator]

        return connect

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket.socket, "connect", guard(real_connect))
    monkeypatch.setattr(socket.socket, "connect_ex", guard(real_connect_ex))


@pytest.fixture(autouse=True)
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake HOME and no KERAS_HOME: even a buggy loader cannot touch the real cache."""
    home = tmp_path / "fake_home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("KERAS_HOME", raising=False)
    return home


@pytest.fixture
def cifar() -> Cifar:
    return make_cifar()


@pytest.fixture
def keras_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "keras_home"
    monkeypatch.setenv("KERAS_HOME", str(home))
    return home


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under `directory` (recursively) with its bytes."""
    if not directory.exists():
        return {}
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


# --------------------------------------------------------------------------------------
# The test batches really are in the official format.
# --------------------------------------------------------------------------------------


def test_batches_are_python2_pickles_readable_by_plain_pickle(cifar: Cifar) -> None:
    batch = pickle.loads(cifar.files["data_batch_2"], encoding="bytes")
    assert sorted(batch) == [b"batch_label", b"data", b"filenames", b"labels"]
    assert batch[b"data"].dtype == np.uint8 and batch[b"data"].shape == (3, 3072)
    np.testing.assert_array_equal(batch[b"data"], cifar.data["data_batch_2"])
    assert batch[b"labels"] == cifar.labels["data_batch_2"]
    # Python 2 idioms, not Python 3 ones: no `_codecs.encode`, numpy.core module path.
    assert b"_codecs" not in cifar.files["data_batch_2"]
    assert b"cnumpy.core.multiarray\n_reconstruct\n" in cifar.files["data_batch_2"]


def test_batches_match_keras_own_cifar_parser(tmp_path: Path, cifar: Cifar) -> None:
    try:
        from keras.src.datasets.cifar import load_batch
    except ImportError:  # pragma: no cover - private Keras API moved
        pytest.skip("keras.src.datasets.cifar.load_batch is not available")
    folder = write_folder(tmp_path, cifar.files)
    (x_train, _), (x_test, y_test) = load_cifar10(folder)
    keras_x, keras_y = load_batch(str(folder / TEST))
    np.testing.assert_array_equal(x_test, np.asarray(keras_x).transpose(0, 2, 3, 1))
    np.testing.assert_array_equal(y_test[:, 0], keras_y)
    keras_x1, _ = load_batch(str(folder / "data_batch_1"))
    np.testing.assert_array_equal(x_train[:2], np.asarray(keras_x1).transpose(0, 2, 3, 1))


# --------------------------------------------------------------------------------------
# Loading from the places it looks.
# --------------------------------------------------------------------------------------


def test_loads_archive_path(tmp_path: Path, cifar: Cifar) -> None:
    archive = tmp_path / "cifar-10-python.tar.gz"
    digest = write_archive(archive, cifar.files)
    assert_loaded(load_cifar10(archive, sha256=digest), cifar)
    assert_loaded(load_cifar10(str(archive), sha256=digest.upper()), cifar)


def test_pixel_layout_and_label_order(tmp_path: Path, cifar: Cifar) -> None:
    archive = tmp_path / "any-name.tgz"
    # Members in reverse order: the train split must still be batch 1, 2, ..., 5.
    digest = write_archive(archive, cifar.files, order=list(reversed(cifar.files)))
    (x_train, y_train), _ = load_cifar10(archive, sha256=digest)
    image = x_train[0]
    assert image[1, 2, 0] == 200 and image[3, 4, 1] == 150 and image[31, 0, 2] == 99
    assert set(zip(*np.nonzero(image))) == {(1, 2, 0), (3, 4, 1), (31, 0, 2)}
    expected_labels = sum((cifar.labels[n] for n in TRAIN), [])
    assert y_train[:, 0].tolist() == expected_labels
    assert y_train[:2, 0].tolist() == [9, 0]


def test_loads_extracted_folder_and_its_parent(tmp_path: Path, cifar: Cifar) -> None:
    folder = write_folder(tmp_path / "data", cifar.files)
    assert_loaded(load_cifar10(folder), cifar)
    assert_loaded(load_cifar10(folder.parent), cifar)


def test_loads_directory_holding_the_archive(tmp_path: Path, cifar: Cifar) -> None:
    digest = write_archive(tmp_path / "dl" / "cifar-10-python.tar.gz", cifar.files)
    assert_loaded(load_cifar10(tmp_path / "dl", sha256=digest), cifar)


@pytest.mark.parametrize(
    "layout",
    [
        "cifar-10-python.tar.gz",
        "cifar-10-batches-py.tar.gz",
        "cifar-10-batches-py-target_archive",
        "cifar-10-batches-py",
        "cifar-10-batches-py-target/cifar-10-batches-py",
    ],
)
def test_discovers_keras_cache_via_keras_home(keras_home: Path, cifar: Cifar, layout: str) -> None:
    datasets = keras_home / "datasets"
    if layout.endswith("py"):
        write_folder((datasets / layout).parent, cifar.files)
        digest = "0" * 64  # folders are not hash-checked
    else:
        digest = write_archive(datasets / layout, cifar.files)
    before = snapshot(keras_home)
    assert_loaded(load_cifar10(download=False, sha256=digest), cifar)
    assert snapshot(keras_home) == before  # nothing written, nothing extracted


def test_default_cache_dir_follows_keras_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "kh"))
    assert default_cache_dir() == tmp_path / "kh" / "datasets"
    monkeypatch.delenv("KERAS_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".keras" / "datasets"
    monkeypatch.setenv("KERAS_HOME", "")  # empty counts as unset
    assert default_cache_dir() == tmp_path / "home" / ".keras" / "datasets"


def test_without_keras_home_looks_in_home(isolated_home: Path, cifar: Cifar) -> None:
    write_folder(isolated_home / ".keras" / "datasets", cifar.files)
    assert_loaded(load_cifar10(download=False), cifar)


def test_archive_is_preferred_over_folder(keras_home: Path, cifar: Cifar) -> None:
    datasets = keras_home / "datasets"
    digest = write_archive(datasets / "cifar-10-python.tar.gz", cifar.files)
    write_folder(datasets, make_cifar(seed=1).files)  # different content
    assert_loaded(load_cifar10(download=False, sha256=digest), cifar)


def test_cache_dir_argument(tmp_path: Path, keras_home: Path, cifar: Cifar) -> None:
    write_folder(tmp_path / "elsewhere", cifar.files)
    assert_loaded(load_cifar10(cache_dir=tmp_path / "elsewhere", download=False), cifar)
    with pytest.raises(CIFAR10NotAvailableError):
        load_cifar10(download=False)  # the Keras cache itself is empty


# --------------------------------------------------------------------------------------
# Hash verification.
# --------------------------------------------------------------------------------------


def test_wrong_hash_is_a_clear_error_and_leaves_file_intact(tmp_path: Path, cifar: Cifar) -> None:
    archive = tmp_path / "cifar-10-python.tar.gz"
    actual = write_archive(archive, cifar.files)
    before, stat_before = archive.read_bytes(), archive.stat()
    with pytest.raises(CIFAR10ChecksumError) as info:
        load_cifar10(archive)  # default: the official hash
    error = info.value
    assert isinstance(error, ValueError)
    assert (error.expected, error.actual, error.path) == (CIFAR10_SHA256, actual, str(archive))
    message = str(error)
    assert str(archive) in message and CIFAR10_SHA256 in message and actual in message
    assert "delete" in message and "sha256=" in message
    assert archive.read_bytes() == before
    assert archive.stat().st_mtime_ns == stat_before.st_mtime_ns
    assert sorted(p.name for p in tmp_path.iterdir()) == [archive.name]


def test_mismatching_cached_file_is_not_replaced_by_a_download(
    keras_home: Path, tmp_path: Path, cifar: Cifar
) -> None:
    good = tmp_path / "good.tar.gz"
    digest = write_archive(good, cifar.files)
    cached = keras_home / "datasets" / "cifar-10-python.tar.gz"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"a half-finished download")
    before = snapshot(keras_home)
    with pytest.raises(CIFAR10ChecksumError, match="left untouched"):
        load_cifar10(sha256=digest, url=good.as_uri(), download=True)
    assert snapshot(keras_home) == before


def test_sha256_none_skips_the_check(
    tmp_path: Path, cifar: Cifar, caplog: pytest.LogCaptureFixture
) -> None:
    archive = tmp_path / "cifar-10-python.tar.gz"
    write_archive(archive, cifar.files)
    with caplog.at_level("WARNING", logger="keras_mirror_kit.datasets.cifar10"):
        assert_loaded(load_cifar10(archive, sha256=None), cifar)
    assert "Skipping the SHA-256 check" in caplog.text


@pytest.mark.parametrize("bad", ["abc", "g" * 64, "0" * 63])
def test_malformed_sha256_is_rejected(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ValueError, match="Received: sha256="):
        load_cifar10(tmp_path, sha256=bad)


# --------------------------------------------------------------------------------------
# Nothing available.
# --------------------------------------------------------------------------------------


def test_missing_data_without_download_says_where_and_how(keras_home: Path) -> None:
    with pytest.raises(CIFAR10NotAvailableError) as info:
        load_cifar10(download=False)
    assert isinstance(info.value, FileNotFoundError)
    message = str(info.value)
    datasets = keras_home / "datasets"
    assert "download=False" in message
    assert str(datasets / "cifar-10-python.tar.gz") in message
    assert str(datasets / "cifar-10-batches-py-target_archive") in message
    assert str(datasets / FOLDER) in message
    assert CIFAR10_URL in message and CIFAR10_SHA256 in message
    assert "KERAS_HOME" in message and "path=" in message
    assert not keras_home.exists()  # looking created nothing


def test_missing_explicit_path_is_never_downloaded(tmp_path: Path, cifar: Cifar) -> None:
    source = tmp_path / "src.tar.gz"
    digest = write_archive(source, cifar.files)
    missing = tmp_path / "nope" / "cifar-10-python.tar.gz"
    with pytest.raises(CIFAR10NotAvailableError, match="does not exist"):
        load_cifar10(missing, download=True, sha256=digest, url=source.as_uri())
    assert not missing.parent.exists()


def test_empty_directory_path(tmp_path: Path) -> None:
    with pytest.raises(CIFAR10NotAvailableError, match="No CIFAR-10 archive"):
        load_cifar10(tmp_path)


def test_offline_download_fails_cleanly(keras_home: Path) -> None:
    # The real URL, with the network disabled by the `no_network` fixture.
    with pytest.raises(CIFAR10NotAvailableError, match="Downloading CIFAR-10 from") as info:
        load_cifar10(download=True, timeout=5)
    assert "Looked for CIFAR-10 in" in str(info.value)
    assert snapshot(keras_home) == {}


# --------------------------------------------------------------------------------------
# Download (through file:// URLs: the real code path, no network).
# --------------------------------------------------------------------------------------


def test_download_via_file_url(tmp_path: Path, keras_home: Path, cifar: Cifar) -> None:
    source = tmp_path / "server" / "cifar-10-python.tar.gz"
    digest = write_archive(source, cifar.files)
    assert_loaded(load_cifar10(sha256=digest, url=source.as_uri()), cifar)
    saved = keras_home / "datasets" / "cifar-10-python.tar.gz"
    assert snapshot(keras_home / "datasets") == {saved.name: source.read_bytes()}
    # Cached now: a second call does not download (the URL no longer works).
    source.unlink()
    assert_loaded(load_cifar10(sha256=digest, url=source.as_uri()), cifar)


def test_download_into_cache_dir(tmp_path: Path, cifar: Cifar) -> None:
    source = tmp_path / "server.tar.gz"
    digest = write_archive(source, cifar.files)
    cache = tmp_path / "new" / "cache"
    assert_loaded(load_cifar10(cache_dir=cache, sha256=digest, url=source.as_uri()), cifar)
    assert snapshot(cache) == {"cifar-10-python.tar.gz": source.read_bytes()}


def test_download_with_bad_hash_leaves_nothing(tmp_path: Path, cifar: Cifar) -> None:
    source = tmp_path / "server.tar.gz"
    actual = write_archive(source, cifar.files)
    cache = tmp_path / "cache"
    with pytest.raises(CIFAR10ChecksumError, match="discarded") as info:
        load_cifar10(cache_dir=cache, sha256="0" * 64, url=source.as_uri())
    assert info.value.actual == actual
    assert list(cache.iterdir()) == []  # no partial file, no final file


def test_failed_download_leaves_nothing(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with pytest.raises(CIFAR10NotAvailableError, match="nothing was saved"):
        load_cifar10(cache_dir=cache, url=(tmp_path / "missing.tar.gz").as_uri())
    assert list(cache.iterdir()) == []


def test_download_never_overwrites_a_file_that_appears_meanwhile(
    tmp_path: Path, cifar: Cifar, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "server.tar.gz"
    digest = write_archive(source, cifar.files)
    cache = tmp_path / "cache"
    dest = cache / "cifar-10-python.tar.gz"
    real_urlopen = cifar10_module.urllib.request.urlopen
    theirs: list[int] = []

    def urlopen_while_someone_else_saves(url: str, timeout: float) -> object:
        dest.write_bytes(source.read_bytes())  # another process finished first
        theirs.append(dest.stat().st_ino)
        return real_urlopen(url, timeout=timeout)

    monkeypatch.setattr(cifar10_module.urllib.request, "urlopen", urlopen_while_someone_else_saves)
    assert_loaded(load_cifar10(cache_dir=cache, sha256=digest, url=source.as_uri()), cifar)
    inode = dest.stat().st_ino
    assert theirs == [inode]  # their file was kept, not replaced by ours
    assert [p.name for p in cache.iterdir()] == [dest.name]
    monkeypatch.undo()
    load_cifar10(cache_dir=cache, sha256=digest, url=source.as_uri())
    assert dest.stat().st_ino == inode  # the same file, never replaced


# --------------------------------------------------------------------------------------
# Download over HTTP, from a real server on 127.0.0.1.
# --------------------------------------------------------------------------------------


def test_download_over_http_from_a_local_server(keras_home: Path, cifar: Cifar) -> None:
    archive = keras_home.parent / "served.tar.gz"
    digest = write_archive(archive, cifar.files)
    served = Served(archive.read_bytes())
    with serve(served) as url:
        assert_loaded(load_cifar10(sha256=digest, url=url, timeout=30), cifar)
        assert served.requests == ["/cifar-10-python.tar.gz"]
        datasets = keras_home / "datasets"
        assert snapshot(datasets) == {"cifar-10-python.tar.gz": archive.read_bytes()}
        # Cached now: the second call reads the saved copy, the server is not asked again.
        assert_loaded(load_cifar10(sha256=digest, url=url, timeout=30), cifar)
        assert len(served.requests) == 1


def test_captive_portal_page_is_a_checksum_error_and_is_not_kept(keras_home: Path) -> None:
    served = Served(CAPTIVE_PORTAL.body, content_type=CAPTIVE_PORTAL.content_type)
    with serve(served) as url, pytest.raises(CIFAR10ChecksumError) as info:
        load_cifar10(url=url, timeout=30)
    assert served.requests == ["/cifar-10-python.tar.gz"]  # it really was downloaded
    error = info.value
    assert (error.path, error.expected) == (url, CIFAR10_SHA256)
    assert error.actual == hashlib.sha256(CAPTIVE_PORTAL.body).hexdigest()
    assert "discarded" in str(error) and "proxy" in str(error)
    # Nothing kept: no final file and no temporary file.
    assert snapshot(keras_home) == {}


def test_captive_portal_page_without_hash_check_is_a_format_error_and_is_not_kept(
    keras_home: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # sha256=None skips the hash: the page must still never land in the cache, where every
    # later call would find it and fail.
    with (
        serve(Served(CAPTIVE_PORTAL.body, content_type="text/html")) as url,
        caplog.at_level("WARNING", logger="keras_mirror_kit.datasets.cifar10"),
        pytest.raises(CIFAR10FormatError, match="not a readable gzip-compressed tar") as info,
    ):
        load_cifar10(url=url, sha256=None, timeout=30)
    assert f"The file downloaded from {url} is not the CIFAR-10 archive" in str(info.value)
    assert "Skipping the SHA-256 check of the download" in caplog.text
    assert snapshot(keras_home) == {}


def test_downloaded_archive_missing_a_batch_is_not_kept(keras_home: Path, cifar: Cifar) -> None:
    archive = keras_home.parent / "partial.tar.gz"
    digest = write_archive(archive, {k: v for k, v in cifar.files.items() if k != TEST})
    with (
        serve(Served(archive.read_bytes())) as url,
        pytest.raises(CIFAR10FormatError, match="lacks test_batch"),
    ):
        load_cifar10(url=url, sha256=digest, timeout=30)
    assert snapshot(keras_home) == {}


@pytest.mark.parametrize("status", [404, 503])
def test_http_error_status_is_not_available_and_saves_nothing(
    keras_home: Path, status: int
) -> None:
    served = Served(b"<html>error</html>", status=status, content_type="text/html")
    with serve(served) as url, pytest.raises(CIFAR10NotAvailableError) as info:
        load_cifar10(url=url, timeout=30)
    assert f"HTTP Error {status}" in str(info.value) and "nothing was saved" in str(info.value)
    assert snapshot(keras_home) == {}


def test_users_cached_file_is_never_replaced_by_a_download(keras_home: Path, cifar: Cifar) -> None:
    # The user's copy fails the hash: it is reported, the server is never asked.
    cached = keras_home / "datasets" / "cifar-10-python.tar.gz"
    write_archive(cached, cifar.files)
    before = snapshot(keras_home)
    served = Served(CAPTIVE_PORTAL.body)
    with serve(served) as url, pytest.raises(CIFAR10ChecksumError, match="left untouched"):
        load_cifar10(url=url, timeout=30)
    assert served.requests == []
    assert snapshot(keras_home) == before


def test_argument_validation(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="Received: url='ftp://example.com/x'"):
        load_cifar10(cache_dir=tmp_path, url="ftp://example.com/x")
    with pytest.raises(ValueError, match="not both"):
        load_cifar10(tmp_path, cache_dir=tmp_path)


# --------------------------------------------------------------------------------------
# Malicious or malformed content.
# --------------------------------------------------------------------------------------


class _Reduce:
    """Pickles as a call of `func(*args)`, like an attacker's payload would."""

    def __init__(self, func: object, *args: object) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return self.func, self.args


def payload(kind: str, marker: Path) -> bytes:
    if kind == "os.system":
        evil: object = _Reduce(os.system, f"echo pwned > {shlex.quote(str(marker))}")
    elif kind == "builtins.exec":
        evil = _Reduce(exec, f"open({str(marker)!r}, 'w').write('pwned')")
    else:  # hidden inside an otherwise plausible batch
        evil = {
            b"data": _Reduce(exec, f"open({str(marker)!r}, 'w').write('pwned')"),
            b"labels": [],
        }
    return pickle.dumps(evil, protocol=2)


KINDS = ["os.system", "builtins.exec", "nested"]


@pytest.mark.parametrize("kind", KINDS)
def test_payloads_are_live_under_plain_pickle(tmp_path: Path, kind: str) -> None:
    # The control: without the allowlist these payloads do run.
    marker = tmp_path / "control-marker"
    pickle.loads(payload(kind, marker))
    assert marker.read_text().strip() == "pwned"


@pytest.mark.parametrize("kind", KINDS)
def test_malicious_pickle_in_archive_is_refused(tmp_path: Path, cifar: Cifar, kind: str) -> None:
    marker = tmp_path / "marker"
    files = dict(cifar.files, data_batch_3=payload(kind, marker))
    archive = tmp_path / "evil.tar.gz"
    digest = write_archive(archive, files)  # even a "trusted" hash does not help
    with pytest.raises(pickle.UnpicklingError) as info:
        load_cifar10(archive, sha256=digest)
    assert isinstance(info.value, UnsafePickleError)
    # Protocol 2 writes builtins under their Python 2 name, `__builtin__`.
    refused = {"os.system": f"{os.system.__module__}.system"}.get(kind, "__builtin__.exec")
    assert refused in str(info.value) and "data_batch_3" in str(info.value)
    assert not marker.exists()


def test_malicious_pickle_in_folder_is_refused(tmp_path: Path, cifar: Cifar) -> None:
    marker = tmp_path / "marker"
    folder = write_folder(tmp_path, dict(cifar.files, test_batch=payload("os.system", marker)))
    with pytest.raises(UnsafePickleError, match="system"):
        load_cifar10(folder)
    assert not marker.exists()


def test_tar_members_are_never_extracted(tmp_path: Path, cifar: Cifar) -> None:
    extra = []
    for name in ["../escape.txt", f"{FOLDER}/../../escape2.txt", "readme.html"]:
        info = tarfile.TarInfo(name)
        info.size = 3
        extra.append(info)
    archive = tmp_path / "a" / "b" / "archive.tar.gz"
    digest = write_archive(archive, cifar.files, extra=extra)
    before = snapshot(tmp_path)
    assert_loaded(load_cifar10(archive, sha256=digest), cifar)
    assert snapshot(tmp_path) == before
    assert not Path("escape.txt").exists() and not Path("escape2.txt").exists()


def test_link_member_is_refused(tmp_path: Path, cifar: Cifar) -> None:
    files = dict(cifar.files)
    del files["data_batch_1"]
    link = tarfile.TarInfo(f"{FOLDER}/data_batch_1")
    link.type = tarfile.SYMTYPE
    link.linkname = "/etc/passwd"
    archive = tmp_path / "link.tar.gz"
    digest = write_archive(archive, files, extra=[link])
    with pytest.raises(CIFAR10FormatError, match="not a link"):
        load_cifar10(archive, sha256=digest)


def test_duplicate_member_is_refused(tmp_path: Path, cifar: Cifar) -> None:
    archive = tmp_path / "dup.tar.gz"
    digest = write_archive(archive, cifar.files, order=[*cifar.files, "test_batch"])
    with pytest.raises(CIFAR10FormatError, match="more than once"):
        load_cifar10(archive, sha256=digest)


def test_oversized_member_is_refused(
    tmp_path: Path, cifar: Cifar, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cifar10_module, "_MAX_MEMBER_BYTES", 1000)
    archive = tmp_path / "big.tar.gz"
    digest = write_archive(archive, cifar.files)
    with pytest.raises(CIFAR10FormatError, match="refusing to read it"):
        load_cifar10(archive, sha256=digest)
    with pytest.raises(CIFAR10FormatError, match="refusing to read it"):
        load_cifar10(write_folder(tmp_path, cifar.files))


def test_missing_member_is_named(tmp_path: Path, cifar: Cifar) -> None:
    files = {k: v for k, v in cifar.files.items() if k != "test_batch"}
    archive = tmp_path / "partial.tar.gz"
    digest = write_archive(archive, files)
    with pytest.raises(CIFAR10FormatError, match="lacks test_batch"):
        load_cifar10(archive, sha256=digest)
    with pytest.raises(CIFAR10FormatError, match="lacks test_batch"):
        load_cifar10(write_folder(tmp_path, files))


def test_not_an_archive(tmp_path: Path) -> None:
    bogus = tmp_path / "cifar-10-python.tar.gz"
    bogus.write_bytes(b"<html>404 Not Found</html>")
    with pytest.raises(CIFAR10FormatError, match="not a readable gzip-compressed tar"):
        load_cifar10(bogus, sha256=None)


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [1]}, "disagree"),
        ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [1, 10]}, r"0\.\.9"),
        ({b"data": np.zeros((2, 100), np.uint8), b"labels": [1, 2]}, r"\(N, 3072\)"),
        ({b"data": np.zeros((1, 3072), np.uint8)}, "no 'labels' entry"),
        ([1, 2, 3], "expected a pickled dict"),
    ],
)
def test_malformed_batches(tmp_path: Path, cifar: Cifar, batch: object, match: str) -> None:
    folder = write_folder(tmp_path, dict(cifar.files, data_batch_5=py2_pickle(batch)))
    with pytest.raises(CIFAR10FormatError, match=match):
        load_cifar10(folder)


# --------------------------------------------------------------------------------------
# The unpickler itself.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_python3_numpy_pickles_load(protocol: int) -> None:
    batch = {
        b"data": np.arange(3072 * 2, dtype=np.int64).astype(np.uint8).reshape(2, 3072),
        b"labels": [np.int64(3), 4],
        "nested": (1.5, None, True, "text", b"bytes"),
    }
    restored = safe_loads(pickle.dumps(batch, protocol=protocol), source="py3")
    np.testing.assert_array_equal(restored[b"data"], batch[b"data"])
    assert restored[b"labels"] == [3, 4] and restored["nested"] == batch["nested"]


def test_codecs_encode_only_for_latin1() -> None:
    good = b"\x80\x02c_codecs\nencode\nX\x02\x00\x00\x00\xc3\xbfX\x06\x00\x00\x00latin1\x86R."
    assert safe_loads(good) == b"\xff"
    bad = good.replace(b"X\x06\x00\x00\x00latin1", b"X\x04\x00\x00\x00utf8")
    with pytest.raises(pickle.UnpicklingError, match="only latin-1"):
        safe_loads(bad)


@pytest.mark.parametrize(
    "blob",
    [
        b"cbuiltins\neval\n(V1+1\ntR.",
        b"c__builtin__\nopen\n(V/etc/passwd\ntR.",
        b"\x80\x04\x8c\x05numpy\x8c\x04load\x93.",
        b"csubprocess\nPopen\n(Vtrue\ntR.",
    ],
)
def test_unpickler_refuses_everything_else(blob: bytes) -> None:
    with pytest.raises(UnsafePickleError, match="Refused to unpickle") as info:
        SafeUnpickler(io.BytesIO(blob), source="blob").load()
    assert f"{info.value.module}.{info.value.name}" in str(info.value)


def test_latin1_fallback(tmp_path: Path, cifar: Cifar, monkeypatch: pytest.MonkeyPatch) -> None:
    from keras_mirror_kit.datasets import safe_pickle

    encodings: list[str] = []

    class BytesEncodingFails(safe_pickle.SafeUnpickler):
        def __init__(
            self, file: io.BufferedIOBase, *, source: str = "<pickle>", encoding: str = "bytes"
        ) -> None:
            super().__init__(file, source=source, encoding=encoding)
            self.encoding_used = encoding
            encodings.append(encoding)

        def load(self) -> object:
            if self.encoding_used == "bytes":
                raise ValueError("pretend this NumPy cannot read bytes-decoded arrays")
            return super().load()

    monkeypatch.setattr(safe_pickle, "SafeUnpickler", BytesEncodingFails)
    # latin1 gives str keys ("data", "labels") and decodes the raw pixel buffer.
    assert_loaded(load_cifar10(write_folder(tmp_path, cifar.files)), cifar)
    assert encodings[:2] == ["bytes", "latin1"]


def test_unreadable_pickle_reports_both_attempts() -> None:
    with pytest.raises(pickle.UnpicklingError, match="encoding='latin1'"):
        safe_loads(b"\x80\x02}q\x00(U\x04data", source="truncated")
