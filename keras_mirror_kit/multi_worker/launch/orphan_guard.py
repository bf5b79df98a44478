"""Workers never outlive the launcher: the parent-death signal and the watchdog process.

Two mechanisms, as neither covers everything: the parent-death signal (Linux only, set by
each worker's wrapper: `wrapper.py`) reaches each worker but not what the worker started;
the watchdog kills every worker's whole process group once the launcher is gone, but not a
worker that left its group.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

# For tests and debugging only: "1" turns off the parent-death signal / the watchdog.
NO_PDEATHSIG_ENV = "KMK_LAUNCH_NO_PDEATHSIG"
NO_WATCHDOG_ENV = "KMK_LAUNCH_NO_WATCHDOG"


def disabled(name: str) -> bool:
    """Whether the launcher's environment turns a mechanism off (`name` set, not "" or "0")."""
    return os.environ.get(name, "") not in ("", "0")


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
        if not sys.executable or disabled(NO_WATCHDOG_ENV):
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
