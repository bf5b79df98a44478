"""Process helpers for the launcher tests: alive by pid, kill what is left, assert none."""

from __future__ import annotations

import os
import signal

import psutil


def alive(pid: int) -> bool:
    """Whether `pid` is a running (not zombie) process."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill(pids: list[int]) -> None:
    """SIGKILLs every pid that still exists."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def assert_none_left(pids: list[int]) -> None:
    """Fails (after killing them) if any of `pids` is still alive."""
    left = [pid for pid in pids if alive(pid)]
    kill(left)
    assert not left, f"processes left behind: {left}"
