"""CIFAR-10 loading from local files, with an optional verified download.

`load_cifar10` returns the same arrays as `keras.datasets.cifar10.load_data()`
but is explicit about where the data comes from: an archive or folder you
name, the Keras cache, or (only if nothing local exists and `download=True`)
the official URL. Archives are SHA-256 verified before anything in them is
read, tar members are read in memory by the kit's bounded tar reader (nothing is
ever extracted to disk), and the pickled batches go through the allowlisting,
bounded `SafeUnpickler`: a file someone else made is refused, in bounded memory,
when it declares more than it holds.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import http.client
import logging
import os
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import zlib
from pathlib import Path
from typing import BinaryIO

import numpy as np

from keras_mirror_kit.atomic_files import read_regular
from keras_mirror_kit.datasets.bounded_tar import TarFormatError, iter_members
from keras_mirror_kit.datasets.safe_pickle import PickleBoundsError, safe_loads

__all__ = [
    "CIFAR10_ARCHIVE_NAME",
    "CIFAR10_CLASS_NAMES",
    "CIFAR10_FOLDER_NAME",
    "CIFAR10_SHA256",
    "CIFAR10_URL",
    "CIFAR10ChecksumError",
    "CIFAR10FormatError",
    "CIFAR10NotAvailableError",
    "default_cache_dir",
    "load_cifar10",
]

logger = logging.getLogger(__name__)

#: Where the official "CIFAR-10 python version" archive is published.
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
#: SHA-256 of the official archive (the same value Keras checks).
CIFAR10_SHA256 = "6d958be074577803d12ecdefd02955f39262c83c16fe9348329d7fe0b5c001ce"
#: File name of the official archive; downloads are saved under this name.
CIFAR10_ARCHIVE_NAME = "cifar-10-python.tar.gz"
#: Top-level folder inside the archive that holds the batch files.
CIFAR10_FOLDER_NAME = "cifar-10-batches-py"
#: Label names, indexed by the integer label.
CIFAR10_CLASS_NAMES: tuple[str, ...] = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)

# Archive names as they appear in a Keras cache directory, besides the official one:
# Keras 2 / early Keras 3 saved the download as "cifar-10-batches-py.tar.gz", later
# Keras 3 releases as "cifar-10-batches-py-target_archive".
_KERAS_ARCHIVE_NAMES = ("cifar-10-batches-py.tar.gz", "cifar-10-batches-py-target_archive")
# Keras >= 3.6 extracts into "cifar-10-batches-py-target/cifar-10-batches-py/".
_KERAS_EXTRACT_DIR = "cifar-10-batches-py-target"

_TRAIN_MEMBERS = tuple(f"data_batch_{i}" for i in range(1, 6))
_TEST_MEMBER = "test_batch"
_MEMBERS = (*_TRAIN_MEMBERS, _TEST_MEMBER)
_PIXELS = 32 * 32 * 3
_NUM_CLASSES = 10
# An official batch pickle is ~31 MB; anything far larger is not a CIFAR-10 batch.
_MAX_MEMBER_BYTES = 64 * 1024 * 1024
# The official archive holds ~187 MB of tar data; six batches, the meta file and the readme
# at the member bound each is the most a CIFAR-10 archive can hold (bounds a gzip bomb).
_MAX_TAR_BYTES = 8 * _MAX_MEMBER_BYTES
_CHUNK_BYTES = 1024 * 1024

Split = tuple[np.ndarray, np.ndarray]


class CIFAR10NotAvailableError(FileNotFoundError):
    """Raised when no CIFAR-10 copy can be found locally or downloaded.

    The message lists every location that was checked and how to provide the data.

    Example:

    ```python
    try:
        data = load_cifar10(download=False)
    except CIFAR10NotAvailableError:
        data = make_synthetic_cifar10(num_train=5000, num_test=1000)
    ```
    """


class CIFAR10ChecksumError(ValueError):
    """Raised when an archive's SHA-256 differs from the expected value.

    The offending file is never modified or deleted.

    Args:
        message: The full error message.
        path: The file (or URL, for downloads) whose hash did not match.
        expected: The expected SHA-256 hex digest.
        actual: The SHA-256 hex digest that was computed.

    Example:

    ```python
    try:
        load_cifar10("my-copy.tar.gz")
    except CIFAR10ChecksumError as e:
        print(e.path, e.expected, e.actual)
    ```
    """

    def __init__(self, message: str, *, path: str, expected: str, actual: str) -> None:
        super().__init__(message)
        self.path = path
        self.expected = expected
        self.actual = actual


class CIFAR10FormatError(ValueError):
    """Raised when an archive or folder is not in the CIFAR-10 python format.

    Examples: a missing `data_batch_*`/`test_batch` member, a member that is a
    link instead of a regular file, a batch whose `data` is not a C-contiguous
    `(N, 3072)` `uint8` array built from `N * 3072` bytes of the file, labels outside
    `0..9`, a pickle that would make more than its bytes describe (zero strides, huge
    `_reconstruct` shapes: see `safe_pickle.PickleBoundsError`), or a tar header beyond the
    reader's bounds (see `bounded_tar`).

    Example:

    ```python
    try:
        load_cifar10("not-cifar.tar.gz", sha256=None)
    except CIFAR10FormatError as e:
        print(e)
    ```
    """


def default_cache_dir() -> Path:
    """Returns the Keras dataset cache directory, resolved like Keras does.

    That is `$KERAS_HOME/datasets` when the `KERAS_HOME` environment variable
    is set, else `~/.keras/datasets`. It is read at call time, so changing the
    variable takes effect immediately.

    Returns:
        The directory path (it may not exist).

    Raises:
        RuntimeError: If `KERAS_HOME` is unset and the home directory cannot be
            determined (from `pathlib.Path.home()`).

    Example:

    ```python
    os.environ["KERAS_HOME"] = "/data/keras"
    default_cache_dir()  # -> PosixPath('/data/keras/datasets')
    ```
    """
    keras_home = os.environ.get("KERAS_HOME")
    if keras_home:
        return Path(keras_home).expanduser() / "datasets"
    return Path.home() / ".keras" / "datasets"


def _is_writable(directory: Path) -> bool:
    """Whether `directory` exists and is writable, or could be created."""
    for candidate in (directory, *directory.parents):
        if candidate.exists():
            return candidate.is_dir() and os.access(candidate, os.W_OK)
    return False  # pragma: no cover - the root always exists


def _search_dirs() -> list[Path]:
    """The cache directories to search when neither `path` nor `cache_dir` is given."""
    primary = default_cache_dir()
    dirs = [primary]
    if not _is_writable(primary):
        # Keras saves downloads here when its home is read-only.
        dirs.append(Path(tempfile.gettempdir()) / ".keras" / "datasets")
    return dirs


def _candidates(directory: Path) -> list[tuple[str, Path]]:
    """The `(kind, path)` sources looked for in `directory`, in order of preference.

    First `directory` itself (when it holds the batch files), then the archives,
    which can be verified, then the extracted folders, which cannot.
    """
    return [
        ("folder", directory),
        ("archive", directory / CIFAR10_ARCHIVE_NAME),
        *(("archive", directory / name) for name in _KERAS_ARCHIVE_NAMES),
        ("folder", directory / CIFAR10_FOLDER_NAME),
        ("folder", directory / _KERAS_EXTRACT_DIR / CIFAR10_FOLDER_NAME),
    ]


def _source_exists(kind: str, path: Path) -> bool:
    if kind == "archive":
        return path.is_file()
    return path.is_dir() and any((path / member).is_file() for member in _MEMBERS)


def _describe(kind: str, path: Path) -> str:
    if kind == "archive":
        return f"{path} (archive)"
    if path.name == CIFAR10_FOLDER_NAME:
        return f"{path}{os.sep} (extracted folder)"
    return f"{path}{os.sep}{{{','.join(_MEMBERS)}}} (batch files)"


def _find_source(directory: Path, checked: list[str]) -> tuple[str, Path] | None:
    """Returns the first existing source in `directory`, recording what was checked."""
    for kind, candidate in _candidates(directory):
        checked.append(_describe(kind, candidate))
        if _source_exists(kind, candidate):
            return kind, candidate
    return None


def _normalize_sha256(sha256: str | None) -> str | None:
    if sha256 is None:
        return None
    if not isinstance(sha256, str):
        raise TypeError(
            "`sha256` must be a 64-character hex string or None. "
            f"Received: sha256={sha256!r} (of type {type(sha256).__name__})"
        )
    normalized = sha256.strip().lower()
    if len(normalized) != 64 or any(c not in "0123456789abcdef" for c in normalized):
        raise ValueError(
            "`sha256` must be a 64-character hex string (the SHA-256 of the archive), or "
            f"None to skip the check. Received: sha256={sha256!r}"
        )
    return normalized


def _hash_file(f: BinaryIO) -> str:
    digest = hashlib.sha256()
    while chunk := f.read(_CHUNK_BYTES):
        digest.update(chunk)
    return digest.hexdigest()


def _get_key(batch: dict, key: str, source: str) -> object:
    # `encoding="bytes"` gives bytes keys, the latin-1 fallback gives str keys.
    for candidate in (key.encode("ascii"), key):
        if candidate in batch:
            return batch[candidate]
    found = sorted(repr(k) for k in batch)
    raise CIFAR10FormatError(
        f"{source} is not a CIFAR-10 batch: it has no {key!r} entry. "
        f"Received: keys=[{', '.join(found)}]"
    )


def _parse_batch(raw: bytes, source: str) -> Split:
    """Unpickles one batch safely and returns `(data (N, 3072) uint8, labels (N,) uint8)`."""
    try:
        batch = safe_loads(raw, source=source)
    except PickleBoundsError as e:
        raise CIFAR10FormatError(f"{source} is not a CIFAR-10 batch: {e}") from e
    if not isinstance(batch, dict):
        raise CIFAR10FormatError(
            f"{source} is not a CIFAR-10 batch: expected a pickled dict. "
            f"Received: type={type(batch).__name__}"
        )
    data = _get_key(batch, "data", source)
    if (
        not isinstance(data, np.ndarray)
        or data.dtype != np.uint8
        or data.ndim != 2
        or data.shape[1] != _PIXELS
    ):
        description = (
            f"array of shape {data.shape} and dtype {data.dtype}"
            if isinstance(data, np.ndarray)
            else type(data).__name__
        )
        raise CIFAR10FormatError(
            f"{source}: 'data' must be a uint8 array of shape (N, {_PIXELS}) "
            f"(R, G, B planes of 32x32, row-major). Received: data={description}"
        )
    if not data.flags.c_contiguous or data.nbytes > len(raw):
        raise CIFAR10FormatError(
            f"{source}: 'data' must be a C-contiguous array built from its own bytes in the "
            f"file, {_PIXELS} per image, but it claims {data.nbytes} bytes of pixels in a "
            f"{len(raw)}-byte file (or a strided layout). The file is corrupted or crafted: "
            "delete it and get the dataset again from the official source. Received: "
            f"data of shape {data.shape}, strides {data.strides}"
        )
    labels = np.asarray(_get_key(batch, "labels", source))
    if labels.size == 0:
        labels = labels.astype(np.int64)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise CIFAR10FormatError(
            f"{source}: 'labels' must be a flat list of integers. "
            f"Received: labels of shape {labels.shape} and dtype {labels.dtype}"
        )
    if labels.shape[0] != data.shape[0]:
        raise CIFAR10FormatError(
            f"{source}: 'labels' and 'data' disagree on the number of images. "
            f"Received: len(labels)={labels.shape[0]}, data.shape[0]={data.shape[0]}"
        )
    if labels.size and (labels.min() < 0 or labels.max() >= _NUM_CLASSES):
        raise CIFAR10FormatError(
            f"{source}: labels must lie in 0..{_NUM_CLASSES - 1}. "
            f"Received: min={labels.min()}, max={labels.max()}"
        )
    return data, labels.astype(np.uint8)


def _too_large(source: str, size: int) -> CIFAR10FormatError:
    return CIFAR10FormatError(
        f"{source} is {size} bytes, more than any CIFAR-10 batch "
        f"({_MAX_MEMBER_BYTES} bytes at most); refusing to read it. Received: size={size}"
    )


def _checksum_message(path: Path, expected: str, actual: str, url: str) -> str:
    return (
        f"SHA-256 mismatch for {path}: expected {expected}, got {actual}. The file was left "
        "untouched. If it is a partial or corrupted download, delete or move it and call "
        f"load_cifar10() again (or download {url} yourself). If it is intentionally a "
        f"different archive, pass sha256={actual!r} (or sha256=None to skip the check). "
        f"Received: path={str(path)!r}"
    )


def _read_archive(path: Path, sha256: str | None, url: str) -> dict[str, Split]:
    """Verifies and reads the batches of a `cifar-10-python.tar.gz` without extracting it."""
    with open(path, "rb") as f:
        actual = _hash_file(f)
        if sha256 is None:
            logger.warning(
                "Skipping the SHA-256 check of %s (sha256=None); it is %s", path, actual
            )
        elif actual != sha256:
            raise CIFAR10ChecksumError(
                _checksum_message(path, sha256, actual, url),
                path=str(path),
                expected=sha256,
                actual=actual,
            )
        f.seek(0)
        return _read_tar(f, str(path), url)


def _read_tar(f: BinaryIO, where: str, url: str) -> dict[str, Split]:
    """Reads the batches of the gzip tar `f` in one pass; `where` names it in errors."""
    batches: dict[str, Split] = {}
    try:
        # One sequential pass through the kit's bounded tar reader (not `tarfile`, which
        # reads extended headers whole): members are read in memory, never extracted.
        with gzip.GzipFile(fileobj=f, mode="rb") as stream:
            for member in iter_members(stream, where=where, max_stream_bytes=_MAX_TAR_BYTES):
                name = member.name[2:] if member.name.startswith("./") else member.name
                folder, _, leaf = name.partition("/")
                if folder != CIFAR10_FOLDER_NAME or leaf not in _MEMBERS:
                    continue  # batches.meta, readme.html, or anything unexpected
                source = f"{where}:{member.name}"
                if not member.isreg():
                    raise CIFAR10FormatError(
                        f"{source} must be a regular file, not a link or special file; "
                        f"refusing to follow it. Received: member type={member.type!r}"
                    )
                if leaf in batches:
                    raise CIFAR10FormatError(
                        f"{where} contains {member.name} more than once; refusing an "
                        f"ambiguous archive. Received: duplicate member={member.name!r}"
                    )
                if member.size > _MAX_MEMBER_BYTES:
                    raise _too_large(source, member.size)
                batches[leaf] = _parse_batch(member.read(), source)
    except (TarFormatError, EOFError, zlib.error, OSError) as e:
        raise CIFAR10FormatError(
            f"{where} is not a readable gzip-compressed tar archive ({e}). Expected the "
            f"official {CIFAR10_ARCHIVE_NAME} from {url}. Received: path={where!r}"
        ) from e
    return batches


def _read_folder(folder: Path) -> dict[str, Split]:
    """Reads the batch files of an extracted `cifar-10-batches-py/` folder."""
    logger.info(
        "%s is an extracted folder: it cannot be hash-verified; batches are still "
        "loaded with the allowlisting unpickler.",
        folder,
    )
    batches: dict[str, Split] = {}
    for member in _MEMBERS:
        file = folder / member
        if not file.is_file():
            continue  # reported together with the other missing members
        try:  # the size checked on the open file, which must be a regular one
            raw = read_regular(file, _MAX_MEMBER_BYTES, follow_links=True)
        except OSError as err:
            if err.errno == errno.EFBIG:
                raise _too_large(str(file), file.stat().st_size) from err
            raise CIFAR10FormatError(
                f"Cannot read {file}: {err.strerror or err}. Each batch must be a regular "
                "file: delete what is there and put the batch file itself in its place. "
                f"Received: path={str(file)!r}"
            ) from err
        batches[member] = _parse_batch(raw, str(file))
    return batches


def _assemble(batches: dict[str, Split], where: str) -> tuple[Split, Split]:
    """Stacks the batches into channels-last `(x, y)` splits, freeing each batch as it goes."""
    missing = [m for m in _MEMBERS if m not in batches]
    if missing:
        raise CIFAR10FormatError(
            f"{where} is incomplete: it lacks {', '.join(missing)} (expected "
            f"{CIFAR10_FOLDER_NAME}/ with {', '.join(_MEMBERS)}). Received: "
            f"members found=[{', '.join(sorted(batches))}]"
        )

    def stack(members: tuple[str, ...]) -> Split:
        total = sum(batches[m][0].shape[0] for m in members)
        x = np.empty((total, 32, 32, 3), dtype=np.uint8)
        y = np.empty((total, 1), dtype=np.uint8)
        offset = 0
        for m in members:
            data, labels = batches.pop(m)
            n = data.shape[0]
            # Each row is 1024 R, then 1024 G, then 1024 B values, each plane row-major.
            x[offset : offset + n] = data.reshape(n, 3, 32, 32).transpose(0, 2, 3, 1)
            y[offset : offset + n, 0] = labels
            offset += n
        return x, y

    return stack(_TRAIN_MEMBERS), stack((_TEST_MEMBER,))


def _check_url(url: str) -> None:
    scheme = urllib.parse.urlsplit(url).scheme if isinstance(url, str) else None
    if scheme not in {"https", "http", "file"}:
        raise ValueError(
            "`url` must be an https://, http:// or file:// URL of cifar-10-python.tar.gz. "
            f"Received: url={url!r}"
        )


def _download(
    url: str, dest: Path, sha256: str | None, timeout: float, checked: list[str]
) -> tuple[Split, Split]:
    """Downloads `url`, verified in a temporary file before it is linked to `dest`; its data."""
    # On any failure the temporary file is removed: neither a partial nor an unverified file
    # (a proxy's HTML page) is ever left behind, and an existing `dest` is never overwritten.
    logger.info("Downloading CIFAR-10 from %s to %s", url, dest)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    except OSError as e:
        raise CIFAR10NotAvailableError(
            f"Cannot download CIFAR-10: the cache directory {dest.parent} is not writable "
            f"({e}). {_how_to_provide(checked, url)}"
        ) from e
    tmp = Path(tmp_name)
    discarded = f"It was discarded and nothing was written to {dest}."
    try:
        digest = hashlib.sha256()
        try:
            with (
                os.fdopen(fd, "wb") as out,
                urllib.request.urlopen(url, timeout=timeout) as response,
            ):
                while chunk := response.read(_CHUNK_BYTES):
                    digest.update(chunk)
                    out.write(chunk)
        except (OSError, urllib.error.URLError, http.client.HTTPException, ValueError) as e:
            raise CIFAR10NotAvailableError(
                f"Downloading CIFAR-10 from {url} failed ({e}); nothing was saved. "
                f"{_how_to_provide(checked, url)}"
            ) from e
        actual = digest.hexdigest()
        if sha256 is None:
            logger.warning(
                "Skipping the SHA-256 check of the download from %s (sha256=None); it is %s",
                url,
                actual,
            )
        elif actual != sha256:
            raise CIFAR10ChecksumError(
                f"The file downloaded from {url} has SHA-256 {actual}, expected {sha256}. "
                f"{discarded} A proxy or captive portal that answers with a web page "
                f"causes this. Retry later, check any proxy or mirror in between, or "
                f"download {CIFAR10_ARCHIVE_NAME} yourself and pass its path. "
                f"Received: url={url!r}",
                path=url,
                expected=sha256,
                actual=actual,
            )
        try:
            with open(tmp, "rb") as f:
                data = _assemble(_read_tar(f, url, url), url)
        except CIFAR10FormatError as e:
            raise CIFAR10FormatError(
                f"The file downloaded from {url} is not the CIFAR-10 archive. {discarded} {e}"
            ) from e
        os.chmod(tmp, 0o644)
        try:
            # A hard link never replaces an existing file, unlike os.replace: a file that
            # appeared while downloading (another process?) is kept, and ours dropped.
            os.link(tmp, dest)
        except FileExistsError:
            logger.warning("%s appeared during the download; keeping it.", dest)
            return data
        except OSError:  # a filesystem without hard links: check, then rename
            if dest.exists():
                logger.warning("%s appeared during the download; keeping it.", dest)
                return data
            os.replace(tmp, dest)
        logger.info("Saved %s (sha256 %s)", dest, actual)
        return data
    finally:
        # Only ever removes the temporary file created above.
        if tmp.exists():
            tmp.unlink()


def _how_to_provide(checked: list[str], url: str) -> str:
    looked = "".join(f"\n  - {c}" for c in checked) or " (nowhere)"
    return (
        f"Looked for CIFAR-10 in:{looked}\n"
        f"To provide it, download {url} (sha256 {CIFAR10_SHA256}) on a machine with "
        f"network access, then either copy it to {default_cache_dir() / CIFAR10_ARCHIVE_NAME} "
        "(set KERAS_HOME to move that cache), pass load_cifar10(path=...) with the archive "
        f"or its extracted {CIFAR10_FOLDER_NAME}/ folder, or pass cache_dir=... with the "
        "folder that holds it."
    )


def load_cifar10(
    path: str | os.PathLike[str] | None = None,
    *,
    download: bool = True,
    cache_dir: str | os.PathLike[str] | None = None,
    sha256: str | None = CIFAR10_SHA256,
    url: str = CIFAR10_URL,
    timeout: float = 60.0,
) -> tuple[Split, Split]:
    """Loads CIFAR-10 like `keras.datasets.cifar10.load_data()`, from local files first.

    Where it looks, in order (the first match wins):

    1. `path`, if given: the `cifar-10-python.tar.gz` archive itself, the extracted
       `cifar-10-batches-py/` folder, or a directory holding either of them (or a
       Keras cache layout, see 2). An explicit `path` never triggers a download.
    2. Otherwise `cache_dir`, defaulting to the Keras cache (`$KERAS_HOME/datasets`,
       else `~/.keras/datasets`): `cifar-10-python.tar.gz`, then the archives Keras
       caches (`cifar-10-batches-py.tar.gz`, `cifar-10-batches-py-target_archive`),
       then the folders `cifar-10-batches-py/` and
       `cifar-10-batches-py-target/cifar-10-batches-py/`.
    3. Only if none exists and `download=True`: `url` is downloaded to
       `<cache dir>/cifar-10-python.tar.gz` via a temporary file that is verified
       (SHA-256, then read as CIFAR-10) before it is put in place. A download that
       fails verification, such as a proxy's or captive portal's web page, is
       discarded: nothing is written to the cache.

    Archives are checked against `sha256` before anything in them is read, and
    only the expected members are read, in memory (nothing is extracted). Batches
    are unpickled with an allowlist that admits NumPy arrays and nothing else.
    Files this function did not create are never modified or deleted.

    Args:
        path: An archive, an extracted folder or a directory containing either.
        download: Whether to download when no local copy exists (ignored with `path`).
        cache_dir: The directory to search and to download into instead of the Keras
            cache. Mutually exclusive with `path`.
        sha256: The expected SHA-256 of the archive; defaults to the official one.
            `None` skips the check (a warning is logged). Extracted folders cannot be
            hash-checked.
        url: Where to download from; `https://`, `http://` or `file://`.
        timeout: Seconds to wait on the network before giving up.

    Returns:
        `((x_train, y_train), (x_test, y_test))`: `x_*` are `uint8` arrays of shape
        `(N, 32, 32, 3)` (channels-last, whatever `keras.config.image_data_format()`
        says), `y_*` are `uint8` arrays of shape `(N, 1)` with labels in `0..9`
        (names in `CIFAR10_CLASS_NAMES`). The official data has 50000 training and
        10000 test images.

    Raises:
        CIFAR10NotAvailableError: If no copy was found and downloading is disabled or
            failed; the message lists where it looked and how to provide the file.
        CIFAR10ChecksumError: If an archive's SHA-256 (or a download's) is not `sha256`.
        CIFAR10FormatError: If the data (local or downloaded) is not in the CIFAR-10
            python format, or declares more than it holds (arrays larger than their
            bytes in the file, tar extended headers over 1 MiB, more than 512 MiB of tar
            data); the message names the file or member.
        pickle.UnpicklingError: If a batch references a global that is not allowed
            (`UnsafePickleError`) or is not a valid pickle.
        ValueError: If `path` and `cache_dir` are both given, or `sha256`/`url` is malformed.

    Example:

    ```python
    (x_train, y_train), (x_test, y_test) = load_cifar10()
    x_train.shape, y_train.shape  # -> ((50000, 32, 32, 3), (50000, 1))
    # Offline, from a copy you brought along:
    data = load_cifar10("/mnt/data/cifar-10-python.tar.gz")
    ```
    """
    sha256 = _normalize_sha256(sha256)
    _check_url(url)
    if path is not None and cache_dir is not None:
        raise ValueError(
            "Pass either `path` (a CIFAR-10 archive or folder) or `cache_dir` (where to "
            f"look and download), not both. Received: path={path!r}, cache_dir={cache_dir!r}"
        )
    checked: list[str] = []

    if path is not None:
        target = Path(path).expanduser()
        if target.is_file():
            logger.info("Loading CIFAR-10 from archive %s", target)
            return _assemble(_read_archive(target, sha256, url), str(target))
        found = _find_source(target, checked) if target.is_dir() else None
        if found is None:
            if not target.exists():
                checked.insert(0, f"{target} (does not exist)")
            raise CIFAR10NotAvailableError(
                f"No CIFAR-10 archive or extracted folder at {target}; an explicit `path` "
                f"is never downloaded to. {_how_to_provide(checked, url)} "
                f"Received: path={str(path)!r}"
            )
    else:
        search = [Path(cache_dir).expanduser()] if cache_dir is not None else _search_dirs()
        found = None
        for directory in search:
            found = _find_source(directory, checked)
            if found is not None:
                break
        if found is None:
            if not download:
                raise CIFAR10NotAvailableError(
                    f"CIFAR-10 was not found locally and download=False. "
                    f"{_how_to_provide(checked, url)}"
                )
            writable = [d for d in search if _is_writable(d)]
            dest = (writable[0] if writable else search[0]) / CIFAR10_ARCHIVE_NAME
            return _download(url, dest, sha256, timeout, checked)

    kind, source = found
    logger.info("Loading CIFAR-10 from %s", _describe(kind, source))
    if kind == "archive":
        return _assemble(_read_archive(source, sha256, url), str(source))
    return _assemble(_read_folder(source), str(source))
