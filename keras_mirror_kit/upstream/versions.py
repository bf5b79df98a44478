"""The installed Keras and TensorFlow, the versions the kit was tested on, and what it says
about a version outside them.

`TESTED_KERAS` and `TESTED_TENSORFLOW` are the ranges the whole suite and the compatibility
matrix ran on (`benchmarks/compat_matrix.py`, `docs/support.md`); `pyproject.toml` allows
the same ranges. A version outside them is named once, at import and at `distributed()`,
with what that means: every protection checks itself there (its canary) and refuses the
feature it cannot make exact, before any step.
"""

from __future__ import annotations

import logging
import re
import sys
import threading

__all__ = [
    "TESTED_KERAS",
    "TESTED_KERAS_TEXT",
    "TESTED_PAIRS",
    "TESTED_TENSORFLOW",
    "TESTED_TENSORFLOW_TEXT",
    "keras_version",
    "keras_version_in",
    "notice_untested",
    "parse_version",
    "range_text",
    "tensorflow_version",
    "untested",
    "version_in",
]

logger = logging.getLogger("keras_mirror_kit")

#: Keras releases the suite ran on: `low <= version < high` (3.16: keras-nightly 3.16.0.dev).
TESTED_KERAS = ((3, 10, 0), (3, 17, 0))
#: TensorFlow releases the suite ran on (2.23: tf-nightly 2.23.0.dev).
TESTED_TENSORFLOW = ((2, 19, 0), (2, 24, 0))
TESTED_KERAS_TEXT = "Keras 3.10 to 3.16"
TESTED_TENSORFLOW_TEXT = "TensorFlow 2.19 to 2.23"
#: The TensorFlow / Keras pairs of the compatibility matrix (docs/support.md).
TESTED_PAIRS = (
    ("2.19.1", "3.10.0"),
    ("2.20.0", "3.12.1"),
    ("2.21.0", "3.15.1"),
    ("2.21.0", "3.16.0.dev2026102704"),
    ("2.23.0.dev20261026", "3.16.0.dev2026102704"),
)

_noticed: set[str] = set()
_lock = threading.Lock()


def parse_version(text: str) -> tuple[int, int, int]:
    """The first three numbers of a version, zero-filled: `"2.21.0rc1"` -> `(2, 21, 0)`.

    Args:
        text: A version string such as `keras.__version__`.

    Returns:
        Three integers.

    Example:

    ```python
    assert parse_version("3.16.0.dev2026102704") == (3, 16, 0)
    ```
    """
    numbers = [int(part) for part in re.findall(r"\d+", text)[:3]]
    return tuple((numbers + [0, 0, 0])[:3])  # type: ignore[return-value]


def version_in(version: str | tuple[int, ...], bounds: tuple[tuple[int, ...], ...]) -> bool:
    """Whether `version` (text or numbers) is in `low <= v < high`, all zero-filled to three.

    Args:
        version: `"3.15.1"` or `(3, 15, 1)`.
        bounds: `(low, high)`.

    Returns:
        Whether `low <= version < high`.

    Example:

    ```python
    assert version_in("3.12.1", ((3, 10), (3, 17)))
    ```
    """
    numbers = parse_version(version) if isinstance(version, str) else tuple(version)
    low, high = ((*b, 0, 0, 0)[:3] for b in bounds)
    return low <= (*numbers, 0, 0, 0)[:3] < high


def keras_version() -> str:
    """The installed Keras' version (`keras.__version__`)."""
    import keras

    return str(keras.__version__)


def tensorflow_version() -> str | None:
    """The version of the TensorFlow imported in this process, or None when none is (this
    never imports TensorFlow: on Keras' JAX backend it would take the GPUs' memory)."""
    tf = sys.modules.get("tensorflow")
    version = getattr(tf, "__version__", None)
    return None if version is None else str(version)


def keras_version_in(
    tested: tuple[tuple[int, int, int], tuple[int, int, int]], keras_version: str | None = None
) -> bool:
    """Whether a Keras version (default: the installed one) is in a range `low <= v < high`.

    Args:
        tested: `(low, high)`, such as `TESTED_KERAS`.
        keras_version: The version to judge; default: the installed Keras'.

    Returns:
        Whether it is in the range.

    Example:

    ```python
    assert keras_version_in(TESTED_KERAS, "3.15.1")
    ```
    """
    if keras_version is None:
        keras_version = globals()["keras_version"]()
    return version_in(keras_version, tested)


def range_text(bounds: tuple[tuple[int, ...], tuple[int, ...]]) -> str:
    """`((3, 10, 0), (3, 17, 0))` -> `"3.10.0 <= version < 3.17.0"`."""
    low, high = (".".join(map(str, b)) for b in bounds)
    return f"{low} <= version < {high}"


def untested() -> list[str]:
    """The installed Keras and TensorFlow versions outside the tested ranges, as text.

    Returns:
        `["Keras 3.17.0 (tested: Keras 3.10 to 3.16)"]`, or `[]` when both were tested.

    Example:

    ```python
    for line in untested():
        print(line)
    ```
    """
    found = []
    keras = keras_version()
    if not version_in(keras, TESTED_KERAS):
        found.append(f"Keras {keras} (tested: {TESTED_KERAS_TEXT})")
    tf = tensorflow_version()  # imported by Keras' TensorFlow backend, else by the user
    if tf is not None and not version_in(tf, TESTED_TENSORFLOW):
        found.append(f"TensorFlow {tf} (tested: {TESTED_TENSORFLOW_TEXT})")
    return found


def notice_untested(where: str) -> bool:
    """Logs once per version set, at WARNING, that the installed versions were not tested.

    Args:
        where: What is asking (`"import"`, `"distributed()"`), for the log line.

    Returns:
        Whether a version outside the tested ranges is installed.

    Example:

    ```python
    notice_untested("distributed()")
    ```
    """
    found = untested()
    if not found:
        return False
    key = "; ".join(found)
    with _lock:
        if key in _noticed:
            return True
        _noticed.add(key)
    logger.warning(
        "keras-mirror-kit (at %s): %s is outside the versions this kit was tested on. Plain "
        "compile-and-fit, the callbacks and the checkpoints work wherever Keras trains; each "
        "of the kit's protections checks itself on this version first and refuses the "
        "feature it cannot make exact before any step (docs/support.md). To stay on tested "
        "versions: pip install 'keras>=3.10,<3.17' 'tensorflow>=2.19,<2.24'",
        where,
        key,
    )
    return True
