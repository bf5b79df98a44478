"""The one reader of `"module:name"` specs (and `"path/to/file.py:name"`), used everywhere.

`kmk.restore`/`export_checkpoint` (`--model` of `keras-mirror-kit ckpt`), `check_replicas`
and `keras-mirror-kit doctor` name a user's factory or data this way. The module is imported
with the current directory first on `sys.path`, as `python -m` would; a `.py` file is run
once per process (as a module is imported once) under another `__name__` than
`"__main__"`, so its `if __name__ == "__main__":` block does not run. The name after the
colon may be dotted (`module:Class.method`).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import runpy
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["FILE_RUN_NAME", "find_attribute", "resolve"]

#: The `__name__` a `.py` file named by a spec runs under.
FILE_RUN_NAME = "__kmk_named_file__"
_FILES: dict[str, dict[str, Any]] = {}  # the namespace of each file run, by its real path


@contextlib.contextmanager
def _cwd_on_path() -> Iterator[None]:
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def find_attribute(root: Any, qualname: str, where: str, argument: str, spec: str) -> Any:
    """`root.<qualname>` (a dict's items count), or a `ValueError` naming `argument`."""
    value = root
    for part in qualname.split("."):
        try:
            value = value[part] if isinstance(value, dict) else getattr(value, part)
        except (AttributeError, KeyError):
            raise ValueError(
                f"{where} has no attribute {qualname!r} (looked up for `{argument}`). Check "
                f"the name after the colon. Received: {argument}={spec!r}"
            ) from None
    return value


def _import(module_name: str, argument: str, spec: str) -> Any:
    with _cwd_on_path():
        try:
            if module_name.endswith(".py"):
                path = os.path.realpath(module_name)
                if not os.path.isfile(path):
                    raise FileNotFoundError(f"no such file: {path}")
                if path not in _FILES:  # run once per process, as an import would be
                    _FILES[path] = runpy.run_path(path, run_name=FILE_RUN_NAME)
                return _FILES[path]
            return importlib.import_module(module_name)
        except Exception as err:
            raise ValueError(
                f"Cannot import the module {module_name!r} named by `{argument}` (looked in "
                f"the current directory {os.getcwd()} and on sys.path): "
                f"{type(err).__name__}: {err}. Received: {argument}={spec!r}"
            ) from err


def resolve(spec: str, argument: str, callable_only: bool = False) -> Any:
    """The object `spec` (`"module:name"` or `"file.py:name"`) names.

    Args:
        spec: The module (or `.py` file), a colon, and the (possibly dotted) name in it.
        argument: The argument or option the spec was given as, for the messages.
        callable_only: Refuse an object that is not callable.

    Returns:
        The object.

    Raises:
        TypeError: `spec` is not a string.
        ValueError: A spec without both parts, a module that cannot be imported, a missing
            name, or (with `callable_only`) an object that is not callable.

    Example:

    ```python
    build = resolve("train:build_model", "model", callable_only=True)
    ```
    """
    if not isinstance(spec, str):
        raise TypeError(f"`{argument}` must be a string. Received: {argument}={spec!r}")
    # The last colon: a file path may hold one (C:\\...), a dotted name never does.
    module_name, colon, qualname = spec.rpartition(":")
    if not colon or not module_name or not qualname:
        raise ValueError(
            f"`{argument}` must be 'module:name' (or 'file.py:name'), the module importable "
            f"from the current directory and the name defined in it, e.g. "
            f"'train:build_model'. Received: {argument}={spec!r}"
        )
    where = "The script" if module_name.endswith(".py") else "The module"
    module = _import(module_name, argument, spec)
    found = find_attribute(module, qualname, f"{where} {module_name!r}", argument, spec)
    if callable_only and not callable(found):
        raise ValueError(
            f"{where} {module_name!r} has {qualname!r}, but it is not callable: `{argument}` "
            f"names a function that returns the model. Received: {argument}={spec!r}"
        )
    return found
