"""How the launcher reports: its name in messages, `LaunchError`, and its exit codes."""

from __future__ import annotations

PROG = "keras-mirror-kit launch"
EXIT_FAILED = 1  # a worker left early (exited with status 0 while the others ran)
EXIT_TIMEOUT = 124
EXIT_USAGE = 2


class LaunchError(RuntimeError):
    """The launcher cannot start the workers (bad arguments, no free port)."""
