"""An allowlisting, bounded unpickler for CIFAR-10 batch files.

The official CIFAR-10 "python version" stores every batch as a pickle, and
unpickling runs whatever callables the pickle names. `SafeUnpickler` only lets a
pickle reach the handful of NumPy reconstructors that a NumPy array (and
therefore a CIFAR batch) needs; any other global (`os.system`, `builtins.eval`,
`subprocess.Popen`, ...) is refused with `UnsafePickleError` *before* it is
imported or called.

The reconstructors it lets through are checked versions of NumPy's, so that a small
file cannot describe a large array: every array is built from a buffer of exactly the
bytes its shape and dtype need (no strides, no shared buffer that claims more), only
plain numeric dtypes are accepted, and a pickle can neither make arrays (nor decoded
bytes) that hold more bytes in all than the pickle itself nor run more than
`MAX_OPERATIONS` opcodes. Anything else is a `PickleBoundsError`, raised before the
allocation.
"""

from __future__ import annotations

import codecs
import importlib
import io
import logging
import math
import pickle
import re
import reprlib
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = [
    "ALLOWED_GLOBALS",
    "MAX_OPERATIONS",
    "PickleBoundsError",
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

#: The most pickle opcodes one `load()` runs. An official CIFAR-10 batch takes about
#: 40,000 (90,000 as Python 3 writes it with protocol 2); each opcode makes at most one
#: small object, so this bounds the memory of the containers a pickle can build.
MAX_OPERATIONS = 400_000

# The dtypes NumPy pickles as `dtype("<kind><itemsize>")`: bool, ints, floats, complex.
_DTYPE_CODE = re.compile(r"[biufc][0-9]{1,2}")
_ENDIANS = frozenset({"<", ">", "|", "=", b"<", b">", b"|", b"="})
_MAX_DIMS = 32
_short = reprlib.Repr()
_short.maxstring = _short.maxother = 60


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


class PickleBoundsError(pickle.UnpicklingError):
    """Raised when a pickle would make more, or other, than its own bytes describe.

    For example an array whose buffer is shorter than its shape needs (zero strides), a
    structured or object dtype, arrays or decoded bytes that hold more bytes in all than
    the pickle has, or more than `MAX_OPERATIONS` opcodes. Raised before the allocation.

    Args:
        message: The full error message.
        source: A description of where the pickle came from.

    Example:

    ```python
    try:
        safe_loads(untrusted_bytes, source="data_batch_1")
    except PickleBoundsError as e:
        print(e.source, e)
    ```
    """

    def __init__(self, message: str, source: str = "<pickle>") -> None:
        super().__init__(message)
        self.source = source


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


def _shape_repr(shape: Any) -> str:
    """A short repr of a claimed shape whose integers may be too long to print."""
    if type(shape) is not tuple:
        return _short.repr(shape)
    shown = [
        f"<an integer of {d.bit_length()} bits>" if type(d) is int and d.bit_length() > 64
        else _short.repr(d)
        for d in shape[:8]
    ]  # fmt: skip
    return "(" + ", ".join(shown) + (", ..." if len(shape) > 8 else "") + ")"


class _RefusedCall:
    """Stands in for `numpy.ndarray`: a valid argument of `_reconstruct`, never called."""

    def __init__(self, unpickler: SafeUnpickler) -> None:
        self._unpickler = unpickler

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        raise self._unpickler._refuse(
            "it calls `numpy.ndarray(...)` directly, which can lay a small buffer out as a "
            "large array (zero or custom strides); NumPy's own pickles never do",
            f"numpy.ndarray{_short.repr(args)}",
        )

    def __repr__(self) -> str:
        return "numpy.ndarray"


class SafeUnpickler(pickle._Unpickler):
    """An unpickler that resolves only the globals in `ALLOWED_GLOBALS`, and bounds them.

    Plain containers and scalars (dicts, lists, tuples, bytes, str, int, float,
    bool, None) need no globals and load as usual; NumPy arrays load through checked
    versions of NumPy's reconstructors. A referenced global outside the allowlist raises
    `UnsafePickleError`; an array whose buffer does not hold exactly the bytes of its
    shape (zero strides, a direct `numpy.ndarray(...)` call), a dtype other than bool,
    integer, float or complex, state set on any other object, arrays or decoded bytes
    larger in total than `max_bytes`, or more than `max_operations` opcodes raise
    `PickleBoundsError`, before anything is allocated for them. Persistent IDs are refused
    too. It is Python's own unpickler (`pickle._Unpickler`, the pure-Python twin of
    `pickle.Unpickler`), so that every opcode can be counted and every `BUILD` checked.

    Args:
        file: A binary file object to read the pickle from.
        source: A description of the data (e.g. a path), used in error messages.
        encoding: How Python 2 `str` objects are decoded: `"bytes"` keeps them
            as `bytes` (what CIFAR-10 needs), `"latin1"` decodes them to `str`.
        max_bytes: The most bytes all arrays together (and, separately, all decoded
            `bytes`) may hold; defaults to the size of `file` (it must then be seekable).
        max_operations: The most opcodes `load()` runs; None for no limit.

    Raises:
        UnsafePickleError: From `load()`, when the pickle references a refused global.
        PickleBoundsError: From `load()`, when the pickle would make more than it holds.
        ValueError: If `max_bytes` is None and `file` is not seekable.

    Example:

    ```python
    with open("cifar-10-batches-py/data_batch_1", "rb") as f:
        batch = SafeUnpickler(f, source=f.name).load()
    batch[b"data"].shape  # -> (10000, 3072)
    ```
    """

    dispatch: dict[int, Callable[[Any], None]] = {}

    def __init__(
        self,
        file: io.BufferedIOBase,
        *,
        source: str = "<pickle>",
        encoding: str = "bytes",
        max_bytes: int | None = None,
        max_operations: int | None = MAX_OPERATIONS,
    ) -> None:
        super().__init__(file, fix_imports=True, encoding=encoding)
        self.source = source
        if max_bytes is None:
            try:
                here = file.tell()
                max_bytes = file.seek(0, io.SEEK_END) - here
                file.seek(here)
            except (OSError, AttributeError, ValueError) as e:
                raise ValueError(
                    "SafeUnpickler needs `max_bytes` for a file it cannot seek in. "
                    f"Received: file={file!r}, max_bytes=None"
                ) from e
        self.max_bytes = max_bytes
        self.max_operations = max_operations
        self._operations = 0
        self._array_bytes = 0
        self._decoded_bytes = 0
        self._scalar = _first_attr(("numpy._core.multiarray", "numpy.core.multiarray"), "scalar")
        self._globals: dict[str, Any] = {
            "_reconstruct": self._checked_reconstruct,
            "_frombuffer": self._checked_frombuffer,
            "scalar": self._checked_scalar,
            "ndarray": _RefusedCall(self),
            "dtype": self._checked_dtype,
            "encode": self._checked_encode,
        }

    def find_class(self, module: str, name: str) -> Any:
        """Returns the checked stand-in of an allowlisted global, or raises `UnsafePickleError`.

        Args:
            module: The module name recorded in the pickle.
            name: The attribute name recorded in the pickle.

        Returns:
            The checked version of the allowed callable (`numpy.ndarray` is a token that
            only `_reconstruct` accepts).

        Raises:
            UnsafePickleError: If `(module, name)` is not in `ALLOWED_GLOBALS`.

        Example:

        ```python
        SafeUnpickler(io.BytesIO(b"")).find_class("numpy", "dtype")  # -> a checked dtype()
        ```
        """
        if (module, name) not in ALLOWED_GLOBALS:
            logger.warning("Refused global %s.%s while unpickling %s", module, name, self.source)
            raise UnsafePickleError(module, name, self.source)
        return self._globals[name]

    # -- the checks -----------------------------------------------------------------------

    def _refuse(self, what: str, received: str) -> PickleBoundsError:
        """The error for a pickle that would make more, or other, than it holds."""
        logger.warning("Refused to unpickle %s: %s", self.source, what)
        return PickleBoundsError(
            f"Refused to unpickle {self.source}: {what}. A genuine CIFAR-10 batch holds "
            "plain NumPy arrays, each built from exactly the bytes its shape needs; this "
            "file is corrupted or crafted: delete it and get the dataset again from the "
            f"official source. Received: {received}",
            self.source,
        )

    def _count(self) -> None:
        """Counts one opcode against `max_operations`."""
        self._operations += 1
        if self.max_operations is not None and self._operations > self.max_operations:
            raise self._refuse(
                f"it runs more than {self.max_operations} pickle operations",
                f"operations>{self.max_operations}",
            )

    def _take(self, kind: str, nbytes: int) -> None:
        """Counts `nbytes` of arrays or of decoded bytes against `max_bytes`."""
        total = nbytes + (self._array_bytes if kind == "arrays" else self._decoded_bytes)
        if total > self.max_bytes:
            raise self._refuse(
                f"its {kind} would hold {total} bytes in all, more than the {self.max_bytes} "
                "bytes of the pickle itself",
                f"{kind} bytes={total}",
            )
        if kind == "arrays":
            self._array_bytes = total
        else:
            self._decoded_bytes = total

    def _check_shape(self, shape: Any) -> tuple[int, ...]:
        """`shape` if it is a tuple of at most 32 ints in [0, 2**63) (NumPy's own bound)."""
        if (
            type(shape) is not tuple
            or len(shape) > _MAX_DIMS
            or not all(type(d) is int and 0 <= d < 2**63 for d in shape)
        ):
            raise self._refuse(
                f"an array shape must be a tuple of at most {_MAX_DIMS} non-negative integers "
                "below 2**63",
                f"shape={_shape_repr(shape)}",
            )
        return shape

    def _check_dtype(self, dtype: Any) -> np.dtype:
        """`dtype` if it is a plain bool, integer, float or complex dtype."""
        if (
            not isinstance(dtype, np.dtype)
            or dtype.kind not in "biufc"
            or dtype.fields is not None
            or dtype.subdtype is not None
            or dtype.metadata
        ):
            raise self._refuse(
                "only plain bool, integer, float and complex dtypes are accepted",
                f"dtype={_short.repr(dtype)}",
            )
        return dtype

    def _check_buffer(self, shape: tuple[int, ...], dtype: np.dtype, nbytes: int) -> None:
        """Refuses a buffer that is not exactly the bytes of `shape` and `dtype`."""
        needed = math.prod(shape) * dtype.itemsize  # 32 factors below 2**63: cheap
        if nbytes != needed:
            raise self._refuse(
                f"an array of shape {_short.repr(shape)} and dtype {dtype} needs exactly "
                f"{needed} bytes of data and the pickle gives {nbytes}",
                f"shape={_short.repr(shape)}, data bytes={nbytes}",
            )
        self._take("arrays", needed)

    def _checked_reconstruct(self, subtype: Any, shape: Any, dtype: Any) -> np.ndarray:
        """NumPy's `_reconstruct`, only as its pickles call it: an empty array to BUILD."""
        if (
            subtype is not self._globals["ndarray"]
            or type(shape) is not tuple
            or len(shape) != 1
            or type(shape[0]) is not int
            or shape[0] != 0
            or type(dtype) not in (bytes, str)
            or dtype not in (b"b", "b")
        ):
            raise self._refuse(
                "`_reconstruct` may only start an empty array, as NumPy's pickles do",
                f"_reconstruct{_short.repr((subtype, shape, dtype))}",
            )
        return np.ndarray.__new__(np.ndarray, (0,), "b")

    def _array_state(self, state: Any) -> tuple[Any, ...]:
        """A checked `(1, shape, dtype, is_fortran, bytes)` for `ndarray.__setstate__`."""
        if type(state) is not tuple or len(state) != 5 or type(state[0]) is not int:
            raise self._refuse(
                "an array's state must be NumPy's (1, shape, dtype, is_fortran, data)",
                f"state={_short.repr(state)}",
            )
        version, shape, dtype, fortran, raw = state
        shape = self._check_shape(shape)
        dtype = self._check_dtype(dtype)
        if isinstance(raw, str):
            try:
                raw = raw.encode("latin-1")
            except UnicodeEncodeError:
                raw = None
        if version != 1 or type(raw) is not bytes or type(fortran) not in (bool, int):
            raise self._refuse(
                "an array's state must be NumPy's (1, shape, dtype, is_fortran, data) with "
                "its data as bytes",
                f"state={_short.repr(state)}",
            )
        self._check_buffer(shape, dtype, len(raw))
        return (1, shape, dtype, bool(fortran), raw)

    def _checked_frombuffer(self, buf: Any, dtype: Any, shape: Any, order: Any) -> np.ndarray:
        """NumPy's `_frombuffer` (protocol 5): a buffer of exactly the bytes of `shape`."""
        dtype = self._check_dtype(dtype)
        shape = self._check_shape(shape)
        if type(buf) not in (bytes, bytearray) or order not in ("C", "F"):
            raise self._refuse(
                "`_frombuffer` takes the array's bytes in the pickle and the order 'C' or 'F'",
                f"_frombuffer({type(buf).__name__}, order={_short.repr(order)})",
            )
        self._check_buffer(shape, dtype, len(buf))
        return np.frombuffer(buf, dtype=dtype).reshape(shape, order=order)

    def _checked_scalar(self, dtype: Any, data: Any = None) -> Any:
        """NumPy's `scalar`: a plain dtype and exactly `itemsize` bytes."""
        dtype = self._check_dtype(dtype)
        if isinstance(data, str):
            data = data.encode("latin-1") if max(data, default="\0") <= "\xff" else None
        if type(data) is not bytes or len(data) != dtype.itemsize:
            raise self._refuse(
                f"a scalar of dtype {dtype} needs exactly {dtype.itemsize} bytes",
                f"data={_short.repr(data)}",
            )
        return self._scalar(dtype, data)

    def _checked_dtype(self, obj: Any, align: Any = False, copy: Any = True) -> np.dtype:
        """`numpy.dtype(code)` for a plain numeric type code, always a fresh copy."""
        code = obj.decode("ascii", "replace") if isinstance(obj, bytes) else obj
        if type(code) is not str or not _DTYPE_CODE.fullmatch(code):
            raise self._refuse(
                "only plain bool, integer, float and complex dtypes are accepted",
                f"dtype({_short.repr(obj)})",
            )
        try:
            return np.dtype(code, False, True)  # a copy: BUILD never touches NumPy's own
        except TypeError as e:
            raise self._refuse(f"{code!r} is not a NumPy dtype", f"dtype({code!r})") from e

    def _dtype_state(self, state: Any) -> None:
        """Refuses a dtype state other than the one NumPy writes for a plain dtype."""
        if not (
            type(state) is tuple
            and len(state) == 8
            and state[0] == 3
            and state[1] in _ENDIANS
            and state[2] is None
            and state[3] is None
            and state[4] is None
            and all(type(v) is int for v in state[5:])
            and state[5:] == (-1, -1, 0)
        ):
            raise self._refuse(
                "a dtype's state must be NumPy's (3, byte order, None, None, None, -1, -1, 0)",
                f"state={_short.repr(state)}",
            )

    def _checked_encode(self, obj: Any, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        """`_latin1_encode`, counted against `max_bytes`."""
        result = _latin1_encode(obj, encoding, errors)
        self._take("decoded bytes", len(result))
        return result

    def _load_build(self) -> None:
        """BUILD, for a NumPy array or dtype only, with its state checked first."""
        state = self.stack.pop()
        inst = self.stack[-1]
        if type(inst) is np.ndarray:
            inst.__setstate__(self._array_state(state))
        elif isinstance(inst, np.dtype):
            self._dtype_state(state)
            inst.__setstate__(state)
            self._check_dtype(inst)
        else:
            raise self._refuse(
                f"it sets the state of a {type(inst).__name__}, which a NumPy array pickle "
                "never does",
                f"BUILD on {type(inst).__name__}",
            )


def _counted(load: Callable[[Any], None]) -> Callable[[Any], None]:
    """An opcode handler that first counts the opcode against `max_operations`."""

    def handler(self: SafeUnpickler) -> None:
        self._count()
        load(self)

    return handler


SafeUnpickler.dispatch = {
    code: _counted(SafeUnpickler._load_build if code == pickle.BUILD[0] else load)
    for code, load in pickle._Unpickler.dispatch.items()
}


def safe_loads(data: bytes, *, source: str = "<pickle>") -> Any:
    """Unpickles `data` with `SafeUnpickler`, handling Python 2 pickles.

    Python 2 pickles (like the official CIFAR-10 batches) are read with
    `encoding="bytes"`, which keeps byte strings and the arrays' raw buffers as
    `bytes`. If that fails for a reason other than a refused global or a bound, it is
    tried once more with `encoding="latin1"`, the encoding NumPy documents for Python 2
    array pickles (dict keys then come back as `str`). Arrays (and decoded bytes) may
    hold at most `len(data)` bytes in all.

    Args:
        data: The pickle's bytes.
        source: A description of the data (e.g. a path), used in error messages.

    Returns:
        The unpickled object.

    Raises:
        UnsafePickleError: If the pickle references a global that is not allowed.
        PickleBoundsError: If the pickle would make more than its bytes describe.
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
    except (UnsafePickleError, PickleBoundsError):
        raise
    except Exception as first_error:  # Any decoding problem: retry as NumPy documents.
        logger.debug("encoding='bytes' failed for %s (%s); retrying latin1", source, first_error)
        try:
            return load("latin1")
        except (UnsafePickleError, PickleBoundsError):
            raise
        except Exception as second_error:
            raise pickle.UnpicklingError(
                f"Could not unpickle {source} with encoding='bytes' ({first_error!r}) nor "
                f"with encoding='latin1' ({second_error!r}). The file is truncated or not a "
                "CIFAR-10 batch: delete it and get the dataset again."
            ) from first_error
