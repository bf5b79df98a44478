"""Finding the user's factory and data again in the check's child process.

The child is a fresh interpreter, so it finds them by name: a `"module:function"` spec, or
for an object its `__module__` and `__qualname__`. A function of the script being run
(`__main__`) is found as `multiprocessing`'s spawn start method finds it: the child runs
the script file under another `__name__`, so its `if __name__ == "__main__":` block does
not run again (and a script that calls `check_replicas` outside such a block is refused in
the child, rather than starting children without end). Modules are imported with the
current directory first on `sys.path`, as `python -m` would.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import runpy
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["CHILD_ENV", "SCRIPT_RUN_NAME", "load", "reference_of", "resolve_spec"]

#: Set in the check's child process; `check_replicas` refuses to run where it is set.
CHILD_ENV = "KMK_REPLICA_CHECK_CHILD"
#: The `__name__` a script runs under when the child loads a factory defined in it.
SCRIPT_RUN_NAME = "__kmk_replica_check__"


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


def _walk(root: Any, qualname: str, where: str, argument: str, spec: str) -> Any:
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
            return importlib.import_module(module_name)
        except Exception as err:
            raise ValueError(
                f"Cannot import the module {module_name!r} named by `{argument}` (looked in "
                f"the current directory {os.getcwd()} and on sys.path): "
                f"{type(err).__name__}: {err}. Received: {argument}={spec!r}"
            ) from err


def resolve_spec(spec: str, argument: str) -> Any:
    """The object a `"module:name"` spec names (`ValueError` for a bad spec or name)."""
    if not isinstance(spec, str):
        raise TypeError(f"`{argument}` must be a string. Received: {argument}={spec!r}")
    module_name, colon, qualname = spec.partition(":")
    if not colon or not module_name or not qualname:
        raise ValueError(
            f"`{argument}` must be 'module:name', the module importable from the current "
            f"directory and the name defined in it, e.g. 'train:build_model'. "
            f"Received: {argument}={spec!r}"
        )
    module = _import(module_name, argument, spec)
    return _walk(module, qualname, f"The module {module_name!r}", argument, spec)


def reference_of(obj: Any, argument: str) -> dict[str, str]:
    """How the child finds `obj` again: `{"module", "qualname"}` or `{"path", "qualname"}`.

    `ValueError` for an object that cannot be found by name (a lambda, a local function, a
    function of an interactive session).
    """
    module_name = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    hint = (
        "Define it at the top level of a module or script (def build_model(): ...), or pass "
        "its name as 'module:function'."
    )
    if not module_name or not qualname or "<" in qualname:
        raise ValueError(
            f"The check runs `{argument}` in a fresh process, which finds it by name, but "
            f"{obj!r} has no importable name. {hint} Received: {argument}={obj!r}"
        )
    if module_name == "__main__":
        path = getattr(sys.modules.get("__main__"), "__file__", None)
        if not path or not os.path.isfile(path):
            raise ValueError(
                f"`{argument}` is defined in an interactive session (no script file), which "
                f"the check's fresh process cannot load. {hint} Received: {argument}={obj!r}"
            )
        return {"path": os.path.abspath(path), "qualname": qualname}
    module = sys.modules.get(module_name)
    spec = f"{module_name}:{qualname}"
    found = _walk(module, qualname, f"The module {module_name!r}", argument, spec)
    # `distributed(...)(build)` kept under another name: its name finds the function itself,
    # and the decorator's options travel apart (`samples.FactorySettings`).
    if found is not obj and found is not getattr(obj, "__wrapped__", None):
        raise ValueError(
            f"`{argument}` is not what {spec!r} names now (redefined or replaced after it "
            f"was created), so the check's fresh process would load something else. "
            f"{hint} Received: {argument}={obj!r}"
        )
    return {"module": module_name, "qualname": qualname}


def load(reference: dict[str, str], argument: str) -> Any:
    """The object a reference of `reference_of` (or a spec) names, in the child."""
    qualname = reference["qualname"]
    if "path" in reference:
        path = reference["path"]
        namespace = runpy.run_path(path, run_name=SCRIPT_RUN_NAME)
        return _walk(namespace, qualname, f"The script {path!r}", argument, qualname)
    return resolve_spec(f"{reference['module']}:{qualname}", argument)
