"""An allowlisting unpickler for CIFAR-10 batch files.

The official CIFAR-10 "python version" stores every batch as a pickle, and
unpickling runs whatever callables the pickle names. `SafeUnpickler` only lets a
pickle reach the handful of NumPy reconstructors that a NumPy array (and
therefore a CIFAR batch) needs; any other global (`os.system`, `builtins.eval`,
`subprocess.Popen`, ...) is refused with `UnsafePickleError` *before* it is
imported or called.
"""

from __future__ import annotations

import codecs
import importlib
import io
import logging
import pickle
from typing import Any

import numpy as np

__all__ = [
    "ALLOWED_GLOBALS",
    "SafeUnpickler",
    "UnsafePickleError",
    "safe_loads",
]

logger = logging.getLogger(__name__)

#: The `(module, name)` globals a pickle may reference. Both the NumPy 1.x
#: (`numpy.core`) and the NumPy 2.x (`numpy._core`) spellings are accepted,
#: because pickles record the module path of the NumPy that wrote them.
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        # ndarray.__reduce__ (protocols 0-4) and NumPy scalars.
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        # ndarray.__reduce_ex__ with protocol 5.
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        # Python 3 writes `bytes` as `_codecs.encode(str, "latin1")` under
        # protocol 2; only the latin-1 codec is let through (see `_latin1_encode`).
        ("_codecs", "encode"),
    }
)


class UnsafePickleError(pickle.UnpicklingError):
    """Raised when a pickle references a global outside `ALLOWED_GLOBALS`.

    The refused global is never imported and never called.

    Args:
        module: The module named by the pickle, e.g. `"posix"`.
        name: The attribute named by the pickle, e.g. `"system"`.
        source: A description of where the pickle came from, used in the message.

    Example:

    ```python
    try:
        safe_loads(untrusted_bytes, source="data_batch_1")
    except UnsafePickleError as e:
        print(e.module, e.name)
    ```
    """

    def __init__(self, module: str, name: str, source: str = "<pickle>") -> None:
        self.module = module
        self.name = name
        self.source = source
        allowed = ", ".join(f"{m}.{n}" for m, n in sorted(ALLOWED_GLOBALS))
        super().__init__(
            f"Refused to unpickle {source}: it references the global `{module}.{name}`, "
            "which is not on the allowlist of a CIFAR-10 batch, so it was neither imported "
            "nor called. The file is not a genuine CIFAR-10 batch (it may be corrupted or "
            "malicious): delete it and get the dataset again from the official source. "
            f"Allowed globals: {allowed}. Received: global={module}.{name}"
        )


def _latin1_encode(obj: str, encoding: str = "utf-8", errors: str = "strict") -> bytes:
    """`_codecs.encode` for the latin-1 codec only; anything else is an `UnpicklingError`.

    Python 3 pickles `bytes` under protocol 2 as `_codecs.encode(text, "latin1")`; arbitrary
    codecs are not needed for that, so no other is honoured.
    """
    normalized = encoding.lower().replace("_", "-") if isinstance(encoding, str) else None
    if not isinstance(obj, str) or normalized not in {"latin1", "latin-1", "iso-8859-1"}:
        raise pickle.UnpicklingError(
            "Refused `_codecs.encode` call in pickle: only latin-1 encoding of text is "
            f"allowed. Received: encoding={encoding!r}, obj of type {type(obj).__name__}"
        )
    return codecs.encode(obj, "latin1", errors)


def _first_attr(modules: tuple[str, ...], name: str) -> Any:
    """Returns `name` from the first importable module of `modules`."""
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, name):
            return getattr(module, name)
    raise ImportError(f"None of {modules} provides `{name}`.")  # pragma: no cover


def _resolve(module: str, name: str) -> Any:
    """Maps an allowlisted `(module, name)` to the object of the installed NumPy."""
    if module == "numpy":
        return getattr(np, name)
    if module == "_codecs":
        return _latin1_encode
    leaf = module.rsplit(".", 1)[1]  # "multiarray" or "numeric"
    # Prefer NumPy 2's private package; `numpy.core` is a deprecated alias there.
    return _first_attr((f"numpy._core.{leaf}", f"numpy.core.{leaf}"), name)


class SafeUnpickler(pickle.Unpickler):
    """A `pickle.Unpickler` that resolves only the globals in `ALLOWED_GLOBALS`.

    Plain containers and scalars (dicts, lists, tuples, bytes, str, int, float,
    bool, None) need no globals and load as usual; NumPy arrays load through
    NumPy's own reconstructors. Anything else raises `UnsafePickleError`.
    Persistent IDs are refused too (the base class raises for them).

    Args:
        file: A binary file object to read the pickle from.
        source: A description of the data (e.g. a path), used in error messages.
        encoding: How Python 2 `str` objects are decoded: `"bytes"` keeps them
            as `bytes` (what CIFAR-10 needs), `"latin1"` decodes them to `str`.

    Raises:
        UnsafePickleError: From `load()`, when the pickle references a refused global.

    Example:

    ```python
    with open("cifar-10-batches-py/data_batch_1", "rb") as f:
        batch = SafeUnpickler(f, source=f.name).load()
    batch[b"data"].shape  # -> (10000, 3072)
    ```
    """

    def __init__(
        self, file: io.BufferedIOBase, *, source: str = "<pickle>", encoding: str = "bytes"
    ) -> None:
        super().__init__(file, fix_imports=True, encoding=encoding)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        """Returns an allowlisted global, or raises `UnsafePickleError`.

        Args:
            module: The module name recorded in the pickle.
            name: The attribute name recorded in the pickle.

        Returns:
            The allowed object.

        Raises:
            UnsafePickleError: If `(module, name)` is not in `ALLOWED_GLOBALS`.

        Example:

        ```python
        SafeUnpickler(io.BytesIO(b"")).find_class("numpy", "dtype")  # -> numpy.dtype
        ```
        """
        if (module, name) not in ALLOWED_GLOBALS:
            logger.warning("Refused global %s.%s while unpickling %s", module, name, self.source)
            raise UnsafePickleError(module, name, self.source)
        return _resolve(module, name)


def safe_loads(data: bytes, *, source: str = "<pickle>") -> Any:
    """Unpickles `data` with `SafeUnpickler`, handling Python 2 pickles.

    Python 2 pickles (like the official CIFAR-10 batches) are read with
    `encoding="bytes"`, which keeps byte strings and the arrays' raw buffers as
    `bytes`. If that fails for a reason other than a refused global, it is tried
    once more with `encoding="latin1"`, the encoding NumPy documents for Python 2
    array pickles (dict keys then come back as `str`).

    Args:
        data: The pickle's bytes.
        source: A description of the data (e.g. a path), used in error messages.

    Returns:
        The unpickled object.

    Raises:
        UnsafePickleError: If the pickle references a global that is not allowed.
        pickle.UnpicklingError: If the data is not a valid pickle under either encoding.

    Example:

    ```python
    batch = safe_loads(Path("cifar-10-batches-py/test_batch").read_bytes(),
                       source="test_batch")
    ```
    """

    def load(encoding: str) -> Any:
        return SafeUnpickler(io.BytesIO(data), source=source, encoding=encoding).load()

    try:
        return load("bytes")
    except UnsafePickleError:
        raise
    except Exception as first_error:  # Any decoding problem: retry as NumPy documents.
        logger.debug("encoding='bytes' failed for %s (%s); retrying latin1", source, first_error)
        try:
            return load("latin1")
        except UnsafePickleError:
            raise
        except Exception as second_error:
            raise pickle.UnpicklingError(
                f"Could not unpickle {source} with encoding='bytes' ({first_error!r}) nor "
                f"with encoding='latin1' ({second_error!r}). The file is truncated or not a "
                "CIFAR-10 batch: delete it and get the dataset again."
            ) from first_error
