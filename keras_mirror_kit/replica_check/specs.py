"""Finding the user's factory and data again in the check's child process.

The child is a fresh interpreter, so it finds them by name: a `"module:function"` spec, or
for an object its `__module__` and `__qualname__`. A function of the script being run
(`__main__`) is found as `multiprocessing`'s spawn start method finds it: the child runs
the script file under another `__name__`, so its `if __name__ == "__main__":` block does
not run again (and a script that calls `check_replicas` outside such a block is refused in
the child, rather than starting children without end). A spec is read by
`keras_mirror_kit.named_objects`, the one reader of `"module:name"`.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Any

from keras_mirror_kit.named_objects import find_attribute, resolve

__all__ = ["CHILD_ENV", "SCRIPT_RUN_NAME", "load", "reference_of"]

#: Set in the check's child process; `check_replicas` refuses to run where it is set.
CHILD_ENV = "KMK_REPLICA_CHECK_CHILD"
#: The `__name__` a script runs under when the child loads a factory defined in it.
SCRIPT_RUN_NAME = "__kmk_replica_check__"


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
    found = find_attribute(module, qualname, f"The module {module_name!r}", argument, spec)
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
        return find_attribute(namespace, qualname, f"The script {path!r}", argument, qualname)
    return resolve(f"{reference['module']}:{qualname}", argument)
