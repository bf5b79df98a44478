"""One worker process: how it starts, its output relayed, its exit seen and described."""

from __future__ import annotations

import collections
import contextlib
import math
import os
import signal
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO

from keras_mirror_kit.multi_worker import PREEMPTED_EXIT_CODE
from keras_mirror_kit.multi_worker.launch.wrapper import wrapped_command

TAIL_LINES = 20


@dataclass
class Worker:
    """A started worker process, and what the launcher knows of it."""

    index: int
    process: subprocess.Popen[bytes]
    ready_file: str | None
    tail: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=TAIL_LINES)
    )
    threads: list[threading.Thread] = field(default_factory=list)
    ready: bool = False
    exit_code: int | None = None  # known before the process is reaped (see peek_exit)
    exited_at: float | None = None  # time.monotonic() when the launcher saw it exit

    @property
    def label(self) -> str:
        return f"worker {self.index} (pid {self.process.pid})"

    @property
    def status(self) -> str:
        return describe_status(self.exit_code or 0)

    @property
    def exit_time(self) -> float:
        return math.inf if self.exited_at is None else self.exited_at


def start_worker(
    index: int,
    command: list[str],
    env: dict[str, str],
    ready_file: str | None,
    joins: Sequence[tuple[int, int]] = (),
) -> Worker:
    """Starts worker `index` in a process group of its own, its output on pipes.

    `joins`: the (descriptor, namespace type) pairs of the namespace it enters first.
    """
    process = subprocess.Popen(
        wrapped_command(command, env, joins),
        env=env,
        pass_fds=[fd for fd, _ in joins],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group: we can kill all of it
    )
    return Worker(index, process, ready_file)


class Relay:
    """Copies worker output line by line to our stdout/stderr with a `[worker i] ` prefix."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def start(self, worker: Worker, stream: IO[bytes], sink: IO[str], keep: bool) -> None:
        thread = threading.Thread(
            target=self._pump, args=(worker, stream, sink, keep), daemon=True
        )
        thread.start()
        worker.threads.append(thread)

    def _pump(self, worker: Worker, stream: IO[bytes], sink: IO[str], keep: bool) -> None:
        prefix = f"[worker {worker.index}] "
        with contextlib.suppress(ValueError, OSError):
            for raw in iter(stream.readline, b""):
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                if keep:
                    worker.tail.append(line)
                self.write(sink, prefix + line)
        with contextlib.suppress(OSError):
            stream.close()

    def write(self, sink: IO[str], text: str) -> None:
        with self._lock, contextlib.suppress(OSError, ValueError):
            sink.write(text + "\n")
            sink.flush()


def _can_peek() -> bool:
    """Whether os.waitid can see an exit without reaping (not on macOS before Python 3.13)."""
    return all(hasattr(os, name) for name in ("waitid", "WNOWAIT", "P_PID", "CLD_EXITED"))


def peek_exit(worker: Worker) -> int | None:
    """The worker's exit code if it has exited, without reaping it (Popen-style sign)."""
    if worker.exit_code is not None or worker.process.returncode is not None:
        if worker.exit_code is None:
            worker.exit_code = worker.process.returncode
        return worker.exit_code
    if not _can_peek():  # reaps it: from here its group is out of reach (signal_group)
        if worker.process.poll() is None:
            return None
        worker.exit_code = worker.process.returncode
        return worker.exit_code
    try:
        info = os.waitid(os.P_PID, worker.process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        info = None
    if info is None:
        return None
    if info.si_code == os.CLD_EXITED:
        worker.exit_code = info.si_status
    else:  # killed or dumped core
        worker.exit_code = -info.si_status
    return worker.exit_code


def signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
    """Sends `sig` to the worker's process group (the worker and what it started)."""
    # Safe only while the worker (the group's leader) is not yet reaped: its zombie keeps the
    # group id from being reused by an unrelated process. Workers are reaped last, in stop().
    if process.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


def group_members(pgid: int) -> list[int] | None:
    """Live (not zombie) processes of process group `pgid`, from /proc; None without /proc."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    members = []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()  # state, ppid, pgrp, ...
        if len(fields) > 2 and fields[2] == str(pgid).encode() and fields[0] not in (b"Z", b"X"):
            members.append(int(entry))
    return members


def describe_status(returncode: int) -> str:
    """How a worker ended, in words: "exited with status 1", "was killed by SIGKILL"."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    if returncode == PREEMPTED_EXIT_CODE:
        return f"exited with status {returncode} (it saved its state on a stop signal)"
    return f"exited with status {returncode}"


def launcher_exit_code(returncode: int) -> int:
    """The launcher's exit code for a failed worker: its status, or 128 + N for signal N."""
    return 128 - returncode if returncode < 0 else max(1, returncode)
