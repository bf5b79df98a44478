"""`keras-mirror-kit launch`: run one training script as N local workers, like torchrun.

```
keras-mirror-kit launch -n 2 train.py --epochs 10
keras-mirror-kit launch -n 2 -- train.py --epochs 10      # "--" ends the launcher's options
keras-mirror-kit launch -n 2 -- python3 train.py --epochs 10   # a command, as for mpirun
keras-mirror-kit launch -n 2 -- ./run.sh
python -m keras_mirror_kit.multi_worker.launch -n 2 -m my_package.train
```

The first word after the launcher's options decides how a worker is started (see
`resolve_target`): a Python script (a `.py`/`.pyw`/`.pyz` path, a directory with a
`__main__.py`, or a file whose `#!` line names python, or with no `#!` line, that
compiles as Python) runs as `sys.executable -u script args...`; `-m module` as
`sys.executable -u -m module args...`; an executable file or a program on `PATH` runs as
the command itself (`python3 train.py`, `./run.sh`). Anything else is refused before any
worker starts. Each worker gets a `TF_CONFIG` naming N workers on free 127.0.0.1 ports
(found by binding port 0) and its own `task.index`, so `kmk.distributed()` picks
`MultiWorkerMirroredStrategy` without a code change. Every line a worker writes is
relayed with a `[worker i] ` prefix (stdout to stdout, stderr to stderr).

TensorFlow does not bound how long a worker waits for its peers, so the launcher does: a
worker is *ready* once its strategy exists (the kit creates the file named by
`KMK_LAUNCH_READY_FILE` then, after every worker has connected), and if any worker is not
ready within `--startup-timeout` seconds the group is stopped. The group is also stopped
when any worker exits with a non-zero status, when a worker exits with status 0 and the
others have not all exited `--finish-window` seconds later (it left its peers waiting in a
collective), or after `--timeout` seconds if given: the others get SIGTERM, then SIGKILL
after `--grace` seconds (TensorFlow's coordination service catches SIGTERM, so a blocked
worker often needs the SIGKILL). Each worker runs in its own process group, and the whole
group is stopped, so processes the worker started do not outlive it (at a normal end too,
with the same grace period). The launcher then exits with the failing worker's status (128
+ N when it was killed by signal N; 1 for a worker that left early; 124 on a timeout) after
a message naming that worker and the last lines of its stderr.

Workers never outlive the launcher: SIGINT, SIGTERM and SIGHUP stop them as above, and if
the launcher dies without doing so (SIGKILL, a crash), each worker gets SIGKILL from the
kernel (Linux only: a parent-death signal, set by a small Python wrapper that then execs
the worker's program) and a small watchdog process kills every worker's process group as
soon as the launcher is gone. For tests and debugging only, `KMK_LAUNCH_NO_PDEATHSIG=1` or
`KMK_LAUNCH_NO_WATCHDOG=1` in the launcher's environment turns one of the two off.
Elsewhere than Linux, the watchdog alone does this, and what a worker left in its group
gets SIGKILL right after SIGTERM at a normal end (no /proc to wait on); where `os.waitid`
is missing (macOS before Python 3.13) the launcher reaps a worker when it sees it exit,
so what that worker left in its group is no longer stopped.

`--max-restarts K` turns the launcher into a supervisor: when a worker fails (a non-zero
status or a signal, including status 75, `PREEMPTED_EXIT_CODE`, of a worker that saved on a
stop signal someone sent it) or a worker does not join within `--startup-timeout`, the
others are stopped as above and all N start again on new ports, up to K times, with
`KMK_LAUNCH_RESTART_COUNT` telling each attempt its number; a script with a
`SyncedCheckpoint` resumes from its newest checkpoint. A worker that exits with status 75
lets its peers (which saved at the same step) exit by themselves within `--finish-window`
seconds before they are stopped. No restart follows a worker that left early with status
0 (a script error a restart would repeat), `--timeout` (it bounds all attempts together)
or a signal to the launcher itself. After K restarts the launcher exits with the last
failure, naming the worker.

On a host with GPUs each worker gets its own: `--gpus-per-worker K` (default: the visible
GPUs split evenly) sets `CUDA_VISIBLE_DEVICES` per worker (see `visible_gpus` and
`assign_gpus`); `--memory-growth` sets `TF_FORCE_GPU_ALLOW_GROWTH=true` in every worker.

This module uses only the standard library (it never imports TensorFlow).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import difflib
import json
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from keras_mirror_kit.multi_worker import (
    GPU_ENV,
    PREEMPTED_EXIT_CODE,
    READY_FILE_ENV,
    visible_gpus,
)

__all__ = [
    "LaunchError",
    "assign_gpus",
    "free_ports",
    "main",
    "resolve_target",
    "tf_config_for",
    "visible_gpus",
    "worker_environment",
]

PROG = "keras-mirror-kit launch"
RANK_ENV = "KMK_LAUNCH_RANK"
WORLD_SIZE_ENV = "KMK_LAUNCH_WORLD_SIZE"
RESTART_ENV = "KMK_LAUNCH_RESTART_COUNT"  # 0 in the first attempt, then 1, 2, ...
MEMORY_GROWTH_ENV = "TF_FORCE_GPU_ALLOW_GROWTH"  # read by TensorFlow's GPU allocator
EXIT_FAILED = 1  # a worker left early (exited with status 0 while the others ran)
EXIT_TIMEOUT = 124
EXIT_USAGE = 2
FINISH_WINDOW_S = 30.0
# For tests and debugging only: "1" turns off the parent-death signal / the watchdog.
NO_PDEATHSIG_ENV = "KMK_LAUNCH_NO_PDEATHSIG"
NO_WATCHDOG_ENV = "KMK_LAUNCH_NO_WATCHDOG"
TAIL_LINES = 20
POLL_S = 0.05
PYTHON_SUFFIXES = (".py", ".pyw", ".pyz")
_SNIFF_BYTES = 1 << 20  # a bigger extensionless file is not taken for a Python script


class LaunchError(RuntimeError):
    """The launcher cannot start the workers (bad arguments, no free port)."""


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """Finds `n` distinct free TCP ports on `host` by binding port 0.

    All `n` sockets are held open together (so the ports differ) and closed just before
    returning; the workers bind them moments later.

    Args:
        n: How many ports (>= 1).
        host: Interface to bind.

    Returns:
        A list of `n` port numbers.

    Raises:
        ValueError: If `n` < 1.
        LaunchError: If the ports cannot be bound.

    Example:

    ```python
    free_ports(2)   # e.g. [40017, 40125]
    ```
    """
    if n < 1:
        raise ValueError(f"`n` must be >= 1. Received: n={n}")
    sockets: list[socket.socket] = []
    try:
        for _ in range(n):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    except OSError as err:
        raise LaunchError(f"could not find {n} free ports on {host}: {err}") from err
    finally:
        for sock in sockets:
            sock.close()


def tf_config_for(ports: Sequence[int], index: int, host: str = "127.0.0.1") -> str:
    """The `TF_CONFIG` JSON of worker `index` in a worker-only cluster on `host`.

    Args:
        ports: One port per worker.
        index: This worker's index, `0 <= index < len(ports)`.
        host: Host of every worker.

    Returns:
        The JSON string.

    Raises:
        ValueError: If `index` is out of range.

    Example:

    ```python
    tf_config_for([2222, 2223], 1)
    # '{"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}, "task": ...}'
    ```
    """
    if not 0 <= index < len(ports):
        raise ValueError(
            f"`index` must be in [0, {len(ports)}). Received: index={index}, ports={ports}"
        )
    cluster = {"worker": [f"{host}:{port}" for port in ports]}
    return json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})


def assign_gpus(
    nproc: int, gpus: Sequence[str], gpus_per_worker: int | None = None
) -> list[list[str]] | None:
    """Which GPUs each of `nproc` workers gets: consecutive, disjoint slices of `gpus`.

    Args:
        nproc: Number of workers.
        gpus: The visible GPUs (see `visible_gpus`).
        gpus_per_worker: GPUs per worker; 0 runs every worker without a GPU. None (the
            default) splits `gpus` evenly, and leaves the workers' environment alone
            when there is no GPU.

    Returns:
        One list of GPU entries per worker (an empty list: no GPU), or None when nothing
        is to be set.

    Raises:
        LaunchError: If `gpus_per_worker` is None and `nproc` does not divide the number
            of GPUs, if `gpus_per_worker` is negative, or if `nproc * gpus_per_worker`
            exceeds the number of GPUs.

    Example:

    ```python
    assign_gpus(2, ["0", "1", "2", "3"])      # [["0", "1"], ["2", "3"]]
    assign_gpus(2, ["0", "1", "2", "3"], 1)   # [["0"], ["1"]]
    assign_gpus(2, [])                        # None
    ```
    """
    listed = ",".join(gpus)
    if gpus_per_worker is None:
        if not gpus:
            return None
        if len(gpus) % nproc:
            fit = len(gpus) // nproc
            hint = (
                f"--gpus-per-worker {fit} (GPUs {','.join(gpus[fit * nproc :])} stay unused)"
                if fit
                else f"-n {len(gpus)} (one worker per GPU)"
            )
            raise LaunchError(
                f"cannot split the {len(gpus)} visible GPU(s) ({listed}) evenly among {nproc} "
                f"workers, and workers sharing a GPU would each take all of its memory. Pass "
                f"{hint}, --gpus-per-worker 0 to run the workers without GPUs, or set "
                f"CUDA_VISIBLE_DEVICES to the GPUs to use. Received: -n {nproc}, "
                f"{len(gpus)} GPU(s) ({listed})"
            )
        gpus_per_worker = len(gpus) // nproc
    if gpus_per_worker < 0:
        raise LaunchError(
            f"--gpus-per-worker must be >= 0. Received: --gpus-per-worker {gpus_per_worker}"
        )
    if gpus_per_worker * nproc > len(gpus):
        raise LaunchError(
            f"--gpus-per-worker {gpus_per_worker} needs {gpus_per_worker * nproc} GPUs for "
            f"{nproc} workers, but {len(gpus)} {'is' if len(gpus) == 1 else 'are'} visible"
            f"{f' ({listed})' if gpus else ''}. Pass a smaller --gpus-per-worker or -n, or "
            f"--gpus-per-worker 0 to run the workers without GPUs. Received: -n {nproc}, "
            f"--gpus-per-worker {gpus_per_worker}"
        )
    k = gpus_per_worker
    return [list(gpus[i * k : (i + 1) * k]) for i in range(nproc)]


def worker_environment(
    base: dict[str, str],
    ports: Sequence[int],
    index: int,
    ready_file: str | None,
    gpus: Sequence[str] | None = None,
    memory_growth: bool = False,
    restart_count: int = 0,
) -> dict[str, str]:
    """The environment of worker `index`: `base` plus TF_CONFIG and the launcher's variables.

    Args:
        base: The launcher's environment.
        ports: One port per worker.
        index: This worker's index.
        ready_file: Path the worker creates once its strategy exists, or None.
        gpus: This worker's GPUs, set as `CUDA_VISIBLE_DEVICES` (an empty list: `-1`, no
            GPU), or None to leave `CUDA_VISIBLE_DEVICES` as in `base`.
        memory_growth: Whether to set `TF_FORCE_GPU_ALLOW_GROWTH=true` (TensorFlow then
            allocates GPU memory as needed instead of taking it all at start-up).
        restart_count: How many times the group was restarted before this attempt
            (`--max-restarts`), set as `KMK_LAUNCH_RESTART_COUNT`.

    Returns:
        A new dict.

    Example:

    ```python
    env = worker_environment(dict(os.environ), [2222, 2223], 0, None, gpus=["0"])
    ```
    """
    env = dict(base)
    env["TF_CONFIG"] = tf_config_for(ports, index)
    env[RANK_ENV] = str(index)
    env[WORLD_SIZE_ENV] = str(len(ports))
    env[RESTART_ENV] = str(restart_count)
    env["PYTHONUNBUFFERED"] = "1"
    if ready_file is not None:
        env[READY_FILE_ENV] = ready_file
    else:
        env.pop(READY_FILE_ENV, None)
    if gpus is not None:
        env[GPU_ENV] = ",".join(gpus) if gpus else "-1"
    if memory_growth:
        env[MEMORY_GROWTH_ENV] = "true"
    return env


@dataclass
class _Worker:
    index: int
    process: subprocess.Popen[bytes]
    ready_file: str | None
    tail: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=TAIL_LINES)
    )
    threads: list[threading.Thread] = field(default_factory=list)
    ready: bool = False
    exit_code: int | None = None  # known before the process is reaped (see _peek_exit)
    exited_at: float | None = None  # time.monotonic() when the launcher saw it exit

    @property
    def label(self) -> str:
        return f"worker {self.index} (pid {self.process.pid})"

    @property
    def status(self) -> str:
        return _describe_status(self.exit_code or 0)

    @property
    def exit_time(self) -> float:
        return math.inf if self.exited_at is None else self.exited_at


class _Relay:
    """Copies worker output line by line to our stdout/stderr with a `[worker i] ` prefix."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def start(self, worker: _Worker, stream: IO[bytes], sink: IO[str], keep: bool) -> None:
        thread = threading.Thread(
            target=self._pump, args=(worker, stream, sink, keep), daemon=True
        )
        thread.start()
        worker.threads.append(thread)

    def _pump(self, worker: _Worker, stream: IO[bytes], sink: IO[str], keep: bool) -> None:
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


def _describe_status(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    if returncode == PREEMPTED_EXIT_CODE:
        return f"exited with status {returncode} (it saved its state on a stop signal)"
    return f"exited with status {returncode}"


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else max(1, returncode)


def _signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
    # Safe only while the worker (the group's leader) is not yet reaped: its zombie keeps the
    # group id from being reused by an unrelated process. Workers are reaped last, in stop().
    if process.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


def _group_members(pgid: int) -> list[int] | None:
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


def _with_parent_death_signal(command: list[str], env: Mapping[str, str]) -> list[str]:
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


class _Watchdog:
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


def _can_peek() -> bool:
    """Whether os.waitid can see an exit without reaping (not on macOS before Python 3.13)."""
    return all(hasattr(os, name) for name in ("waitid", "WNOWAIT", "P_PID", "CLD_EXITED"))


def _peek_exit(worker: _Worker) -> int | None:
    """The worker's exit code if it has exited, without reaping it (Popen-style sign)."""
    if worker.exit_code is not None or worker.process.returncode is not None:
        if worker.exit_code is None:
            worker.exit_code = worker.process.returncode
        return worker.exit_code
    if not _can_peek():  # reaps it: from here its group is out of reach (_signal_group)
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


_VALUE_OPTIONS = (
    "-n",
    "--nproc",
    "--startup-timeout",
    "--timeout",
    "--grace",
    "--finish-window",
    "--gpus-per-worker",
    "--max-restarts",
)
_FLAG_OPTIONS = ("-m", "--memory-growth", "-h", "--help")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage=(
            f"{PROG} -n N [options] [--] script.py [args ...]\n"
            f"       {PROG} -n N [options] [--] command [args ...]\n"
            f"       {PROG} -n N [options] -m module [args ...]"
        ),
        description=(
            "Start N local worker processes of a training script or command, each with a "
            "TF_CONFIG for a MultiWorkerMirroredStrategy cluster on 127.0.0.1. If one "
            "fails, the others are stopped and the launcher exits non-zero. A Python "
            "script (a .py file, or a file that is Python source) runs on this "
            "launcher's Python; a command (a program on PATH or an executable file, as "
            "for mpirun or horovodrun) runs as given."
        ),
        epilog=(
            "examples:\n"
            f"  {PROG} -n 2 train.py --epochs 10\n"
            f"  {PROG} -n 2 -- python3 train.py --epochs 10\n"
            f"  {PROG} -n 2 -- ./run.sh\n"
            f"  {PROG} -n 2 -m my_package.train --epochs 10\n"
            f"  {PROG} -n 4 --gpus-per-worker 2 --memory-growth train.py   # 8 GPUs\n"
            f"  {PROG} -n 2 --max-restarts 3 train.py   # restart all after a failure\n"
            "\n"
            "Options are not abbreviated; everything after `--` goes to the script.\n"
            "The workers never outlive the launcher: SIGINT, SIGTERM and SIGHUP stop them,\n"
            "and if the launcher is killed, they are killed."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # `--startup 5` is an error, not --startup-timeout
    )
    parser.add_argument(
        "-n", "--nproc", type=int, required=True, metavar="N", help="number of workers (>= 1)"
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="seconds for every worker to join the cluster, i.e. to create its strategy "
        "(default 300; 0: no limit, e.g. for scripts that do not use keras_mirror_kit)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=0.0,
        metavar="S",
        help="stop the workers if they have not all finished after S seconds (default: none)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds between SIGTERM and SIGKILL when stopping workers, and for what "
        "they leave behind at a normal end (default 5)",
    )
    parser.add_argument(
        "--finish-window",
        type=float,
        default=FINISH_WINDOW_S,
        metavar="S",
        help="once a worker exits with status 0, the others must exit within S seconds, "
        "else that worker left them waiting: the run fails and they are stopped "
        f"(default {FINISH_WINDOW_S:g}; 0: wait without limit)",
    )
    parser.add_argument(
        "--gpus-per-worker",
        type=int,
        default=None,
        metavar="K",
        help="give each worker K GPUs of its own via CUDA_VISIBLE_DEVICES (default: the "
        "visible GPUs split evenly, an error if N does not divide them; nothing set "
        "without GPUs; 0: no GPU for any worker)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="K",
        help="when a worker fails (a non-zero status, a signal, also status "
        f"{PREEMPTED_EXIT_CODE} after a save on a stop signal) or does not join, stop the "
        "others and start all N again on new ports, up to K times; the script resumes "
        "from its SyncedCheckpoint (default 0: no restart)",
    )
    parser.add_argument(
        "--memory-growth",
        action="store_true",
        help="set TF_FORCE_GPU_ALLOW_GROWTH=true in every worker: TensorFlow takes GPU "
        "memory as needed instead of all of it at start-up",
    )
    parser.add_argument(
        "-m",
        dest="module",
        action="store_true",
        help="run the target as a module (python -m TARGET), like python's -m",
    )
    return parser


def _split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Splits argv into the launcher's options and `script.py args...`.

    The launcher's options end at a `--` or at the first word that is neither an option
    nor an option's value; everything from there on belongs to the script.
    """
    argv = list(argv)
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return argv[:i], argv[i + 1 :]
        if not token.startswith("-") or token == "-":
            return argv[:i], argv[i:]
        i += 2 if token in _VALUE_OPTIONS else 1
    return argv, []


def _check_options(parser: argparse.ArgumentParser, own: Sequence[str]) -> None:
    """Refuses an unknown or abbreviated option with the options it may have meant."""
    known = (*_VALUE_OPTIONS, *_FLAG_OPTIONS)
    skip = False
    for token in own:
        if skip:
            skip = False
            continue
        name = token.split("=", 1)[0]
        if name in known or (len(name) > 2 and name[:2] in ("-n", "-h") and name[1] != "-"):
            skip = token in _VALUE_OPTIONS
            continue
        close = [o for o in known if o.startswith(name)] or difflib.get_close_matches(
            name, known, n=2, cutoff=0.8
        )
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        parser.error(
            f"unknown option {name}{hint}. The launcher's options are not abbreviated; "
            "options meant for the script or command go after it (e.g. `-n 2 -- train.py "
            f"{token}`). Received: {token}"
        )


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = _build_parser()
    own, command = _split_argv(argv)
    _check_options(parser, own)
    args = parser.parse_args(own)
    if not command:
        parser.error(
            "the script or command to run is missing (e.g. `-n 2 train.py` or "
            "`-n 2 -- python3 train.py`)"
        )
    args.target, args.args = command[0], command[1:]
    return args


def _validate(args: argparse.Namespace) -> None:
    if args.nproc < 1:
        raise LaunchError(f"-n must be a positive number of workers. Received: -n {args.nproc}")
    if args.max_restarts < 0:
        raise LaunchError(
            "--max-restarts must be >= 0 (0: no restart). Received: --max-restarts "
            f"{args.max_restarts}"
        )
    for name in ("startup_timeout", "timeout", "grace", "finish_window"):
        value = getattr(args, name)
        if value < 0:
            flag = "--" + name.replace("_", "-")
            raise LaunchError(f"{flag} must be >= 0 seconds. Received: {flag} {value}")
    args.kind, prefix = resolve_target(args.target, module=args.module)
    args.command = [*prefix, *args.args]
    if args.gpus_per_worker is not None and args.gpus_per_worker < 0:
        raise LaunchError(
            "--gpus-per-worker must be >= 0 (0: no GPU for any worker). Received: "
            f"--gpus-per-worker {args.gpus_per_worker}"
        )
    args.gpus = assign_gpus(args.nproc, visible_gpus(), args.gpus_per_worker)


@dataclass
class _Outcome:
    """How an attempt ended: the launcher's exit code, and whether a restart may follow."""

    code: int
    restart: bool = False  # a worker failed (or did not join): --max-restarts may retry
    failure: str = ""  # "worker 1 was killed by SIGKILL"


class _Group:
    """The running workers of one attempt, and how to stop them."""

    def __init__(
        self,
        args: argparse.Namespace,
        out: IO[str],
        err: IO[str],
        attempt: int = 0,
        deadline: float | None = None,
    ) -> None:
        self.args = args
        self.out, self.err = out, err
        self.attempt = attempt  # restarts before this attempt
        self.deadline = deadline  # time.monotonic() of --timeout, over all attempts
        self.relay = _Relay()
        self.workers: list[_Worker] = []
        self.ready_dir: str | None = None
        self.stop_signal: int | None = None
        self.watchdog: _Watchdog | None = None

    def note(self, text: str) -> None:
        self.relay.write(self.err, f"{PROG}: {text}")

    def start(self) -> None:
        n = self.args.nproc
        ports = free_ports(n)
        if self.args.startup_timeout and n > 1:  # one worker has no peer to wait for
            self.ready_dir = tempfile.mkdtemp(prefix="kmk-launch-")
        command = list(self.args.command)
        shown = command if self.args.kind == "command" else ["python", *command[2:]]
        gpus: list[list[str]] | None = self.args.gpus
        placement = ""
        if gpus is not None and any(gpus):
            each = ", ".join(f"worker {i}: GPU {','.join(g)}" for i, g in enumerate(gpus))
            placement = f"; {each} ({GPU_ENV})"
        elif gpus is not None:
            placement = f"; no GPU ({GPU_ENV}=-1)"
        if self.args.memory_growth:
            placement += f"; {MEMORY_GROWTH_ENV}=true"
        attempt = ""
        if self.args.max_restarts:
            attempt = f"attempt {self.attempt + 1} of {self.args.max_restarts + 1}: "
        self.note(
            f"{attempt}starting {n} worker(s) on 127.0.0.1 ports {', '.join(map(str, ports))}"
            f"{placement}: {shlex.join(shown)}"
        )
        self.watchdog = _Watchdog()
        for index in range(n):
            ready = os.path.join(self.ready_dir, f"ready-{index}") if self.ready_dir else None
            env = worker_environment(
                dict(os.environ),
                ports,
                index,
                ready,
                gpus=None if gpus is None else gpus[index],
                memory_growth=self.args.memory_growth,
                restart_count=self.attempt,
            )
            process = subprocess.Popen(
                _with_parent_death_signal(command, env),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # its own process group: we can kill all of it
            )
            self.watchdog.guard(process.pid)  # the group's id
            worker = _Worker(index, process, ready)
            self.workers.append(worker)
            self.relay.start(worker, process.stdout, self.out, keep=False)  # type: ignore[arg-type]
            self.relay.start(worker, process.stderr, self.err, keep=True)  # type: ignore[arg-type]

    def _poll(self) -> None:
        now = time.monotonic()
        for worker in self.workers:
            if worker.exited_at is None and _peek_exit(worker) is not None:
                worker.exited_at = now
            if not worker.ready and worker.ready_file and os.path.exists(worker.ready_file):
                worker.ready = True

    def _first_early_exit(self) -> _Worker | None:
        """The first worker that exited with status 0 while another still ran."""
        clean = [w for w in self.workers if w.exited_at is not None and w.exit_code == 0]
        for worker in sorted(clean, key=lambda w: (w.exit_time, w.index)):
            if any(w.exit_time > worker.exit_time for w in self.workers):
                return worker
        return None

    def _wait_for_preempted_peers(self) -> None:
        """A worker exited after saving on a stop signal: its peers saved too and are exiting.

        They get --finish-window seconds (a save may take a while on the chief) before
        stop() signals them, so that the chief's save is not cut short.
        """
        window = self.args.finish_window or math.inf
        deadline = time.monotonic() + window
        while self.stop_signal is None and time.monotonic() < deadline:
            self._poll()
            if all(w.exited_at is not None for w in self.workers):
                return
            time.sleep(POLL_S)

    def watch(self) -> _Outcome:
        start = time.monotonic()
        startup = self.args.startup_timeout
        window = self.args.finish_window
        while True:
            if self.stop_signal is not None:
                self.note(f"received {signal.Signals(self.stop_signal).name}; stopping workers")
                self.stop()
                return _Outcome(128 + self.stop_signal)
            self._poll()
            exited = sorted(
                (w for w in self.workers if w.exited_at is not None),
                key=lambda w: (w.exit_time, w.index),
            )
            failed = next((w for w in exited if w.exit_code != 0), None)
            early = self._first_early_exit()
            if failed is not None:
                code = _exit_code(failed.exit_code or 0)
                if early is not None and early.exit_time < failed.exit_time:
                    self.report_early_exit(early, self.stop(), then=failed)
                    return _Outcome(code, failure=f"worker {early.index} left early")
                if failed.exit_code == PREEMPTED_EXIT_CODE:
                    self._wait_for_preempted_peers()
                self.report_failure(failed, self.stop())
                return _Outcome(
                    code, restart=True, failure=f"worker {failed.index} {failed.status}"
                )
            if len(exited) == len(self.workers):
                self.stop()  # what the workers left in their process groups, if anything
                return _Outcome(0)
            now = time.monotonic()
            if early is not None and window and now - early.exit_time > window:
                self.report_early_exit(early, self.stop())
                return _Outcome(EXIT_FAILED, failure=f"worker {early.index} left early")
            late = [
                w for w in self.workers if not w.ready and w.exit_code is None and w.ready_file
            ]
            if startup and late and now - start > startup:
                gone = [w for w in exited if not w.ready and w.ready_file]
                stopped = self.stop()
                names = ", ".join(f"worker {w.index}" for w in late)
                before = "".join(
                    f"worker {w.index} {w.status} before joining the cluster; " for w in gone
                )
                self.note(
                    f"{before}{names} did not join the cluster within --startup-timeout "
                    f"{startup:g} s (no MultiWorkerMirroredStrategy was created: a peer "
                    "that never started or exited early, a port taken, or a script that "
                    "does not use keras_mirror_kit; pass --startup-timeout 0 for such "
                    f"scripts){self._stopped_text(stopped)}"
                )
                for worker in [*gone, *late]:
                    self.print_tail(worker)
                return _Outcome(EXIT_TIMEOUT, restart=True, failure=f"{names} did not join")
            if self.deadline is not None and now > self.deadline:
                stopped = self.stop()
                names = ", ".join(f"worker {w.index}" for w in stopped) or "no worker"
                self.note(f"--timeout {self.args.timeout:g} s reached; stopped {names}")
                return _Outcome(EXIT_TIMEOUT)
            time.sleep(POLL_S)

    def _still_running(self, worker: _Worker) -> bool:
        """The worker, or something it left in its process group, is alive."""
        if _peek_exit(worker) is None:
            return True
        if worker.process.returncode is not None:  # reaped: its group id may be reused
            return False
        members = _group_members(worker.process.pid)
        return bool(members)  # without /proc (None): only the worker itself is waited for

    def stop(self) -> list[_Worker]:
        """SIGTERM every worker's process group, SIGKILL after the grace period, reap all.

        What is still alive after SIGTERM (a worker, or a helper it left in its group, even
        after a normal end) gets up to `--grace` seconds; SIGKILL only for what is left.
        Returns the workers that were still running, i.e. that this stopped.
        """
        stopped = [w for w in self.workers if _peek_exit(w) is None]
        for worker in self.workers:
            _signal_group(worker.process, signal.SIGTERM)
        deadline = time.monotonic() + self.args.grace
        while time.monotonic() < deadline and any(self._still_running(w) for w in self.workers):
            time.sleep(POLL_S)
        for worker in self.workers:
            # Also kills what the worker left behind in its group after exiting; its zombie
            # still holds the group id, so the signal cannot reach an unrelated process.
            _signal_group(worker.process, signal.SIGKILL)
        for worker in self.workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.process.wait(timeout=10)  # reaps: from here the group id is free
            if worker.exit_code is None:
                worker.exit_code = worker.process.returncode
            for thread in worker.threads:
                thread.join(timeout=2)
        return stopped

    @staticmethod
    def _stopped_text(stopped: Sequence[_Worker]) -> str:
        return f"; stopped {', '.join(f'worker {w.index}' for w in stopped)}" if stopped else ""

    def print_tail(self, worker: _Worker) -> None:
        if worker.tail:
            self.note(f"last lines of worker {worker.index}'s stderr:")
            for line in list(worker.tail):
                self.relay.write(self.err, f"  [worker {worker.index}] {line}")

    def report_failure(self, worker: _Worker, stopped: Sequence[_Worker]) -> None:
        self.note(f"{worker.label} {worker.status}{self._stopped_text(stopped)}")
        self.print_tail(worker)
        restarts = self.args.max_restarts
        if self.attempt < restarts:
            return  # main() says that it restarts
        used = f" (attempt {self.attempt + 1}: --max-restarts {restarts} used up)"
        self.note(f"FAILED: worker {worker.index} {worker.status}{used if restarts else ''}")

    def report_early_exit(
        self, worker: _Worker, stopped: Sequence[_Worker], then: _Worker | None = None
    ) -> None:
        """`worker` exited with status 0 while others ran; `then` failed after it, if any."""
        others = [w for w in self.workers if w is not worker and w.exited_at != worker.exited_at]
        running = ", ".join(f"worker {w.index}" for w in others)
        joined = "" if worker.ready or not worker.ready_file else " before joining the cluster"
        left = f"exited with status 0{joined} while {running} still ran"
        if then is not None:
            then_status = then.status
            self.note(
                f"{worker.label} {left}; then {then.label} {then_status}"
                f"{self._stopped_text(stopped)}"
            )
            self.print_tail(then)
            self.note(
                f"FAILED: worker {worker.index} left early (it {left}); then worker "
                f"{then.index} {then_status}"
            )
            return
        unfinished = ", ".join(f"worker {w.index}" for w in stopped) or "the others"
        self.note(
            f"{worker.label} {left}, and {unfinished} had not "
            f"finished --finish-window {self.args.finish_window:g} s later: a worker that "
            "leaves early leaves its peers waiting for it (check that every worker runs "
            "the same number of steps; pass a larger --finish-window if the others only "
            f"needed longer to finish){self._stopped_text(stopped)}"
        )
        self.print_tail(worker)
        self.note(f"FAILED: worker {worker.index} left early (it {left})")

    def cleanup(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
        if self.ready_dir:
            shutil.rmtree(self.ready_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Runs `keras-mirror-kit launch -n N [--] script.py|command args...`.

    Args:
        argv: The arguments after `launch` (default: `sys.argv[1:]`).

    Returns:
        0 when every worker exited with status 0; otherwise the failing worker's status
        (128 + N if it was killed by signal N), 1 when a worker exited with status 0 and
        the others had not finished `--finish-window` seconds later, 124 on
        `--startup-timeout` or `--timeout`, 2 on a usage error (also: GPUs that cannot be
        split as asked), 128 + N when the launcher itself got SIGINT, SIGTERM or SIGHUP.
        With `--max-restarts K`, a failed worker (non-zero status, a signal, or not
        joining the cluster) restarts all workers, up to K times; the code is then that
        of the last attempt.

    Raises:
        Nothing for a worker's failure or a usage error (they are exit codes); an
        unexpected error in the launcher itself propagates after the workers are stopped.

    Example:

    ```python
    from keras_mirror_kit.multi_worker import launch
    exit_code = launch.main(["-n", "2", "train.py", "--epochs", "1"])
    ```
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = _parse(argv)
        _validate(args)
    except LaunchError as err:
        sys.stderr.write(f"{PROG}: error: {err}\n")
        return EXIT_USAGE
    except SystemExit as exit_:
        code = exit_.code
        return code if isinstance(code, int) else EXIT_USAGE
    state = _LaunchState()
    previous: dict[int, Any] = {}

    def on_signal(signum: int, _frame: Any) -> None:
        state.signal = signum
        if state.group is not None:
            state.group.stop_signal = signum

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
            # SIGHUP: a closed terminal or a dropped SSH session, unless ignored (nohup).
            # SIGINT and SIGTERM are always handled: a shell starts background jobs with
            # SIGINT ignored, and a signal sent to the launcher must still stop it.
            sighup = sig is not None and sig == getattr(signal, "SIGHUP", None)
            if sig is not None and not (sighup and signal.getsignal(sig) is signal.SIG_IGN):
                previous[sig] = signal.signal(sig, on_signal)
    deadline = time.monotonic() + args.timeout if args.timeout else None
    try:
        for attempt in range(args.max_restarts + 1):
            outcome = _run_attempt(args, state, attempt, deadline)
            if outcome.restart and state.signal is not None:  # came while it ended
                return 128 + state.signal
            if not outcome.restart or attempt == args.max_restarts:
                return outcome.code
            sys.stderr.write(
                f"{PROG}: {outcome.failure}; restarting all {args.nproc} worker(s) on new "
                f"ports (restart {attempt + 1} of --max-restarts {args.max_restarts})\n"
            )
            sys.stderr.flush()
        raise AssertionError("unreachable")  # pragma: no cover
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@dataclass
class _LaunchState:
    """What the launcher's signal handler sets: the signal, and the group to stop."""

    signal: int | None = None
    group: _Group | None = None


def _run_attempt(
    args: argparse.Namespace, state: _LaunchState, attempt: int, deadline: float | None
) -> _Outcome:
    """Starts the workers once, watches them to their end, and stops what is left."""
    group = _Group(args, sys.stdout, sys.stderr, attempt=attempt, deadline=deadline)
    group.stop_signal = state.signal
    state.group = group
    try:
        try:
            group.start()
        except (LaunchError, OSError) as err:
            group.stop()
            sys.stderr.write(f"{PROG}: error: could not start the workers: {err}\n")
            return _Outcome(1)
        return group.watch()
    except BaseException:
        group.stop()
        raise
    finally:
        state.group = None
        group.cleanup()


if __name__ == "__main__":
    sys.exit(main())
