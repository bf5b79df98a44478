"""Shared by the benchmark scripts: how a report line is written."""

from __future__ import annotations

import sys


def say(line: str = "") -> None:
    """Writes one line of the report to stdout, flushed (runs are long)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
