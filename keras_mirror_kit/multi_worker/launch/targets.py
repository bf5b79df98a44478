"""What a worker runs: a Python script, a module, or a command (`resolve_target`)."""

from __future__ import annotations

import os
import shutil
import sys

from keras_mirror_kit.multi_worker.launch.errors import LaunchError

PYTHON_SUFFIXES = (".py", ".pyw", ".pyz")
_SNIFF_BYTES = 1 << 20  # a bigger extensionless file is not taken for a Python script


def _is_python_source(path: str) -> bool:
    """A `#!` line naming python, or (without one) text that compiles as Python."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(_SNIFF_BYTES + 1)
    except OSError:
        return False
    if head.startswith(b"#!"):
        return b"python" in head.split(b"\n", 1)[0]
    if len(head) > _SNIFF_BYTES or b"\0" in head:
        return False
    try:
        compile(head, path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError, UnicodeError, RecursionError, MemoryError, OverflowError):
        return False
    return True


def resolve_target(target: str, module: bool = False) -> tuple[str, list[str]]:
    """How each worker runs `target`: as a Python script, a module, or a command.

    Decided in this order: with `module`, `python -m target`. A path ending in `.py`,
    `.pyw` or `.pyz` is a Python script (it must exist). An existing directory with a
    `__main__.py` is a Python script. An existing file is a Python script when its `#!`
    line names python, or when it has no `#!` line and compiles as Python; otherwise it
    must be executable and runs as a command (`./run.sh`, `/usr/bin/env`). A word without
    a `/` that names a program on `PATH` runs as a command (`python3 train.py`,
    `bash run.sh`). Python scripts and modules run on this launcher's interpreter
    (`sys.executable -u`); a command runs as given, with the same environment
    (`PYTHONUNBUFFERED=1` included).

    Args:
        target: The first word after the launcher's options.
        module: Whether `-m` was given.

    Returns:
        `(kind, prefix)`: kind is `"script"`, `"module"` or `"command"`; prefix is the
        worker's command line before the user's arguments.

    Raises:
        LaunchError: If `target` is none of these (no such file or program, a file that is
            neither Python nor executable, a directory without `__main__.py`).

    Example:

    ```python
    resolve_target("train.py")   # ("script", [sys.executable, "-u", "train.py"])
    resolve_target("python3")    # ("command", ["python3"])
    ```
    """
    if module:
        return "module", [sys.executable, "-u", "-m", target]
    has_dir = os.sep in target or (os.altsep is not None and os.altsep in target)
    if target.lower().endswith(PYTHON_SUFFIXES):
        if not os.path.exists(target):
            raise LaunchError(
                f"no such script: {target!r} (relative to {os.getcwd()!r}). Pass the path "
                f"of an existing Python file. Received: {target}"
            )
        return "script", [sys.executable, "-u", target]
    if os.path.isdir(target):
        if os.path.isfile(os.path.join(target, "__main__.py")):
            return "script", [sys.executable, "-u", target]
        raise LaunchError(
            f"{target!r} is a directory without a __main__.py: name a script in it, or use "
            f"-m for a package. Received: {target}"
        )
    if os.path.isfile(target):
        if _is_python_source(target):
            return "script", [sys.executable, "-u", target]
        if os.access(target, os.X_OK):
            return "command", [target if has_dir else os.path.join(os.curdir, target)]
        raise LaunchError(
            f"{target!r} is neither a Python script nor an executable file, so the launcher "
            f"cannot run it. Make it executable (`chmod +x {target}`), name its interpreter "
            f"(e.g. `-- bash {target}`), or pass a Python script. Received: {target}"
        )
    if not has_dir and shutil.which(target) is not None:
        return "command", [target]
    where = "no such file" if has_dir else "no such file here and no program of that name on PATH"
    raise LaunchError(
        f"cannot run {target!r}: {where}. The first word after the launcher's options must "
        "be a Python script (`train.py`), a module with -m (`-m pkg.train`) or a command "
        f"(`python3 train.py`, `./run.sh`). Received: {target}"
    )
