"""Workers never outlive the launcher: the parent-death signal and the watchdog process.

Two mechanisms, as neither covers everything: the parent-death signal (Linux only) reaches
each worker but not what the worker started; the watchdog kills every worker's whole
process group once the launcher is gone, but not a worker that left its group.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Mapping

# For tests and debugging only: "1" turns off the parent-death signal / the watchdog.
NO_PDEATHSIG_ENV = "KMK_LAUNCH_NO_PDEATHSIG"
NO_WATCHDOG_ENV = "KMK_LAUNCH_NO_WATCHDOG"


# Each worker's first program on Linux: asks the kernel for SIGKILL when the launcher dies
# (PR_SET_PDEATHSIG outlives exec), then becomes the worker's program with os.execvp. Done
# here, not in a Popen preexec_fn: that runs in the forked launcher, which Python documents
# as unsafe in a process with threads (the relay threads; TensorFlow's, under the CLI).
# argv: the launcher's pid, "=" + the worker's LC_CTYPE or "" for none, the command.
_PDEATHSIG_WRAPPER = """
import os, signal, sys
launcher, lc_ctype, command = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
if lc_ctype:  # undoes this interpreter's own locale coercion (PEP 538)
    os.environ["LC_CTYPE"] = lc_ctype[1:]
else:
    os.environ.pop("LC_CTYPE", None)
try:
    import ctypes
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
except (ImportError, OSError, AttributeError):
    pass
if os.getppid() != launcher:  # the launcher died before the line above
    os.kill(os.getpid(), signal.SIGKILL)
try:
    os.execvp(command[0], command)
except OSError as err:
    sys.stderr.write(f"keras-mirror-kit launch: cannot run {command[0]!r}: {err}\\n")
    sys.exit(127)
"""


def _disabled(name: str) -> bool:
    """Whether the launcher's environment turns a mechanism off (`name` set, not "" or "0")."""
    return os.environ.get(name, "") not in ("", "0")


def with_parent_death_signal(command: list[str], env: Mapping[str, str]) -> list[str]:
    """`command` started through _PDEATHSIG_WRAPPER on Linux; as is elsewhere or when off."""
    if not sys.platform.startswith("linux") or not sys.executable or _disabled(NO_PDEATHSIG_ENV):
        return command
    lc_ctype = "=" + env["LC_CTYPE"] if "LC_CTYPE" in env else ""
    # The signal fires when the thread that started the worker exits: the launcher's thread
    # running main(), which outlives the workers.
    wrapper = [sys.executable, "-I", "-S", "-c", _PDEATHSIG_WRAPPER, str(os.getpid())]
    return [*wrapper, lc_ctype, *command]


# Reads the workers' process-group ids from stdin until EOF; unless the launcher wrote
# "done" (it stopped the workers itself), it died: kill every group.
_WATCHDOG = """
import os, signal, sys
words = sys.stdin.buffer.read().split()
if b"done" not in words:
    for word in words:
        try:
            os.killpg(int(word), signal.SIGKILL)
        except (ValueError, OSError):
            pass
"""


class Watchdog:
    """A process that kills the workers' process groups if the launcher dies (any way)."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        if not sys.executable or _disabled(NO_WATCHDOG_ENV):
            return
        with contextlib.suppress(OSError):
            self.process = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _WATCHDOG],
                stdin=subprocess.PIPE,  # our end is the only writer: EOF when we die
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # out of reach of the terminal's signals
            )

    def guard(self, pgid: int) -> None:
        self._send(f"{pgid}\n")

    def _send(self, text: str) -> None:
        if self.process is not None and self.process.stdin is not None:
            with contextlib.suppress(OSError, ValueError):
                self.process.stdin.write(text.encode())
                self.process.stdin.flush()

    def close(self) -> None:
        """The launcher stopped the workers itself: the watchdog exits without killing."""
        if self.process is None:
            return
        self._send("done\n")
        with contextlib.suppress(OSError, ValueError):
            self.process.stdin.close()  # type: ignore[union-attr]
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None
