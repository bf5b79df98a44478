"""Each worker's first program: the parent-death signal, the group's namespace, then exec.

A small Python wrapper (`-I -S`: single-threaded, as entering a user namespace requires)
asks the kernel for SIGKILL when the launcher dies (`PR_SET_PDEATHSIG`, Linux; it outlives
exec, and joining the namespace keeps it), enters the attempt's network namespace (and its
user namespace) with `setns(2)` on the descriptors it inherited (see `isolation`), then
becomes the worker's program with `os.execvp`. Done here, not in a Popen `preexec_fn`: that
runs in the forked launcher, which Python documents as unsafe in a process with threads (the
relay threads; TensorFlow's, under the CLI).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from keras_mirror_kit.multi_worker.launch.orphan_guard import NO_PDEATHSIG_ENV, disabled

# argv: the launcher's pid (0: no parent-death signal), "=" + the worker's LC_CTYPE or ""
# for none, "FD:NSTYPE,..." of the namespaces to enter in order or "-", the command.
_WRAPPER = """
import os, signal, sys
launcher, lc_ctype, joins, command = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
if lc_ctype:  # undoes this interpreter's own locale coercion (PEP 538)
    os.environ["LC_CTYPE"] = lc_ctype[1:]
else:
    os.environ.pop("LC_CTYPE", None)
if launcher:
    try:
        import ctypes
        prctl = ctypes.CDLL(None, use_errno=True).prctl
        prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
        prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (ImportError, OSError, AttributeError):
        pass
    if os.getppid() != launcher:  # the launcher died before the line above
        os.kill(os.getpid(), signal.SIGKILL)
if joins != "-":
    try:
        import ctypes
        setns = ctypes.CDLL(None, use_errno=True).setns
        setns.argtypes = [ctypes.c_int, ctypes.c_int]
        for join in joins.split(","):
            fd, nstype = (int(word) for word in join.split(":"))
            if setns(fd, nstype) != 0:
                code = ctypes.get_errno()
                raise OSError(code, os.strerror(code))
            os.close(fd)
    except (ImportError, OSError, AttributeError) as err:
        sys.stderr.write(
            f"keras-mirror-kit launch: cannot enter the workers' network namespace: {err}\\n")
        sys.exit(127)
try:
    os.execvp(command[0], command)
except OSError as err:
    sys.stderr.write(f"keras-mirror-kit launch: cannot run {command[0]!r}: {err}\\n")
    sys.exit(127)
"""


def wrapped_command(
    command: list[str], env: Mapping[str, str], joins: Sequence[tuple[int, int]] = ()
) -> list[str]:
    """`command` started through _WRAPPER on Linux; as is where there is nothing to do."""
    pdeathsig = sys.platform.startswith("linux") and not disabled(NO_PDEATHSIG_ENV)
    if not sys.executable or not (pdeathsig or joins):
        return command
    lc_ctype = "=" + env["LC_CTYPE"] if "LC_CTYPE" in env else ""
    spec = ",".join(f"{fd}:{nstype}" for fd, nstype in joins) or "-"
    # The signal fires when the thread that started the worker exits: the launcher's thread
    # running main(), which outlives the workers.
    launcher = str(os.getpid()) if pdeathsig else "0"
    return [sys.executable, "-I", "-S", "-c", _WRAPPER, launcher, lc_ctype, spec, *command]
