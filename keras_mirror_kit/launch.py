"""`keras-mirror-kit launch`: run one training script as N local workers, like torchrun.

```
keras-mirror-kit launch -n 2 train.py --epochs 10
keras-mirror-kit launch -n 2 -- train.py --epochs 10      # "--" ends the launcher's options
python -m keras_mirror_kit.launch -n 2 -m my_package.train
```

Each worker is `python -u script.py args...` with a `TF_CONFIG` naming N workers on free
127.0.0.1 ports (found by binding port 0) and its own `task.index`, so `kmk.distributed()`
picks `MultiWorkerMirroredStrategy` without a code change. Every line a worker writes is
relayed with a `[worker i] ` prefix (stdout to stdout, stderr to stderr).

TensorFlow does not bound how long a worker waits for its peers, so the launcher does: a
worker is *ready* once its strategy exists (the kit creates the file named by
`KMK_LAUNCH_READY_FILE` then, after every worker has connected), and if any worker is not
ready within `--startup-timeout` seconds the group is stopped. The group is also stopped
when any worker exits with a non-zero status, or after `--timeout` seconds if given: the
others get SIGTERM, then SIGKILL after `--grace` seconds (TensorFlow's coordination service
catches SIGTERM, so a blocked worker often needs the SIGKILL). Each worker runs in its own
process group, and the whole group is killed, so processes the worker started do not
outlive it. The launcher then exits with the failing worker's status (128 + N when it was
killed by signal N; 124 on a timeout) after a message naming that worker and the last lines
of its stderr.

This module uses only the standard library (it never imports TensorFlow).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any

__all__ = ["LaunchError", "free_ports", "main", "tf_config_for", "worker_environment"]

PROG = "keras-mirror-kit launch"
READY_FILE_ENV = "KMK_LAUNCH_READY_FILE"  # keras_mirror_kit.multi_worker.READY_FILE_ENV
RANK_ENV = "KMK_LAUNCH_RANK"
WORLD_SIZE_ENV = "KMK_LAUNCH_WORLD_SIZE"
EXIT_TIMEOUT = 124
EXIT_USAGE = 2
TAIL_LINES = 20
POLL_S = 0.05


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


def worker_environment(
    base: dict[str, str], ports: Sequence[int], index: int, ready_file: str | None
) -> dict[str, str]:
    """The environment of worker `index`: `base` plus TF_CONFIG and the launcher's variables.

    Args:
        base: The launcher's environment.
        ports: One port per worker.
        index: This worker's index.
        ready_file: Path the worker creates once its strategy exists, or None.

    Returns:
        A new dict.

    Example:

    ```python
    env = worker_environment(dict(os.environ), [2222, 2223], 0, None)
    ```
    """
    env = dict(base)
    env["TF_CONFIG"] = tf_config_for(ports, index)
    env[RANK_ENV] = str(index)
    env[WORLD_SIZE_ENV] = str(len(ports))
    env["PYTHONUNBUFFERED"] = "1"
    if ready_file is not None:
        env[READY_FILE_ENV] = ready_file
    else:
        env.pop(READY_FILE_ENV, None)
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

    @property
    def label(self) -> str:
        return f"worker {self.index} (pid {self.process.pid})"


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


def _peek_exit(worker: _Worker) -> int | None:
    """The worker's exit code if it has exited, without reaping it (Popen-style sign)."""
    if worker.exit_code is not None or worker.process.returncode is not None:
        if worker.exit_code is None:
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


_VALUE_OPTIONS = ("-n", "--nproc", "--startup-timeout", "--timeout", "--grace")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} -n N [options] [-m] [--] script.py [args ...]",
        description=(
            "Start N local worker processes of a training script, each with a TF_CONFIG "
            "for a MultiWorkerMirroredStrategy cluster on 127.0.0.1. If one fails, the "
            "others are stopped and the launcher exits non-zero."
        ),
        epilog=f"example: {PROG} -n 2 train.py --epochs 10",
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
        help="seconds between SIGTERM and SIGKILL when stopping workers (default 5)",
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


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = _build_parser()
    own, command = _split_argv(argv)
    args = parser.parse_args(own)
    if not command:
        parser.error("the script to run is missing (e.g. `-n 2 train.py`)")
    args.target, args.args = command[0], command[1:]
    return args


def _validate(args: argparse.Namespace) -> None:
    if args.nproc < 1:
        raise LaunchError(f"-n must be a positive number of workers. Received: -n {args.nproc}")
    for name in ("startup_timeout", "timeout", "grace"):
        value = getattr(args, name)
        if value < 0:
            flag = "--" + name.replace("_", "-")
            raise LaunchError(f"{flag} must be >= 0 seconds. Received: {flag} {value}")
    if not args.module and not os.path.exists(args.target):
        raise LaunchError(f"no such script: {args.target!r}")


class _Group:
    """The running workers, and how to stop them."""

    def __init__(self, args: argparse.Namespace, out: IO[str], err: IO[str]) -> None:
        self.args = args
        self.out, self.err = out, err
        self.relay = _Relay()
        self.workers: list[_Worker] = []
        self.ready_dir: str | None = None
        self.stop_signal: int | None = None

    def note(self, text: str) -> None:
        self.relay.write(self.err, f"{PROG}: {text}")

    def start(self) -> None:
        n = self.args.nproc
        ports = free_ports(n)
        if self.args.startup_timeout and n > 1:  # one worker has no peer to wait for
            self.ready_dir = tempfile.mkdtemp(prefix="kmk-launch-")
        command = [sys.executable, "-u"]
        command += ["-m", self.args.target] if self.args.module else [self.args.target]
        command += list(self.args.args)
        self.note(
            f"starting {n} worker(s) on 127.0.0.1 ports {', '.join(map(str, ports))}: "
            f"{' '.join(command[2:])}"
        )
        for index in range(n):
            ready = os.path.join(self.ready_dir, f"ready-{index}") if self.ready_dir else None
            env = worker_environment(dict(os.environ), ports, index, ready)
            process = subprocess.Popen(
                command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # its own process group: we can kill all of it
            )
            worker = _Worker(index, process, ready)
            self.workers.append(worker)
            self.relay.start(worker, process.stdout, self.out, keep=False)  # type: ignore[arg-type]
            self.relay.start(worker, process.stderr, self.err, keep=True)  # type: ignore[arg-type]

    def watch(self) -> int:
        start = time.monotonic()
        startup = self.args.startup_timeout
        overall = self.args.timeout
        while True:
            if self.stop_signal is not None:
                self.note(f"received {signal.Signals(self.stop_signal).name}; stopping workers")
                self.stop()
                return 128 + self.stop_signal
            failed = None
            for worker in self.workers:
                code = _peek_exit(worker)
                if code is not None and code != 0 and failed is None:
                    failed = worker
                if not worker.ready and worker.ready_file and os.path.exists(worker.ready_file):
                    worker.ready = True
            if failed is not None:
                self.stop(exclude=failed)
                self.report_failure(failed)
                return _exit_code(int(failed.exit_code))  # type: ignore[arg-type]
            if all(w.exit_code == 0 for w in self.workers):
                self.stop()  # leftover children of the workers, if any
                return 0
            elapsed = time.monotonic() - start
            late = [
                w
                for w in self.workers
                if not w.ready and w.exit_code is None and w.ready_file
            ]
            if startup and late and elapsed > startup:
                names = ", ".join(f"worker {w.index}" for w in late)
                self.stop()
                self.note(
                    f"{names} did not join the cluster within --startup-timeout "
                    f"{startup:g} s (no MultiWorkerMirroredStrategy was created: a peer "
                    "that never started, a port taken, or a script that does not use "
                    "keras_mirror_kit; pass --startup-timeout 0 for such scripts)"
                )
                for worker in late:
                    self.print_tail(worker)
                return EXIT_TIMEOUT
            if overall and elapsed > overall:
                running = [w for w in self.workers if w.exit_code is None]
                self.stop()
                names = ", ".join(f"worker {w.index}" for w in running) or "no worker"
                self.note(f"--timeout {overall:g} s reached; stopped {names}")
                return EXIT_TIMEOUT
            time.sleep(POLL_S)

    def stop(self, exclude: _Worker | None = None) -> None:
        """SIGTERM every worker's process group, SIGKILL after the grace period, reap all."""
        for worker in self.workers:
            if worker is not exclude:
                _signal_group(worker.process, signal.SIGTERM)
        deadline = time.monotonic() + self.args.grace
        while time.monotonic() < deadline and any(_peek_exit(w) is None for w in self.workers):
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

    def print_tail(self, worker: _Worker) -> None:
        if worker.tail:
            self.note(f"last lines of worker {worker.index}'s stderr:")
            for line in list(worker.tail):
                self.relay.write(self.err, f"  [worker {worker.index}] {line}")

    def report_failure(self, worker: _Worker) -> None:
        status = _describe_status(int(worker.exit_code))  # type: ignore[arg-type]
        others = ", ".join(f"worker {w.index}" for w in self.workers if w is not worker)
        self.note(f"{worker.label} {status}{f'; stopped {others}' if others else ''}")
        self.print_tail(worker)
        self.note(f"FAILED: worker {worker.index} {status}")

    def cleanup(self) -> None:
        if self.ready_dir:
            shutil.rmtree(self.ready_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Runs `keras-mirror-kit launch -n N [--] script.py args...`.

    Args:
        argv: The arguments after `launch` (default: `sys.argv[1:]`).

    Returns:
        0 when every worker exited with status 0; otherwise the failing worker's status
        (128 + N if it was killed by signal N), 124 on `--startup-timeout` or `--timeout`,
        2 on a usage error, 128 + N when the launcher itself got SIGINT/SIGTERM.

    Raises:
        Nothing for a worker's failure or a usage error (they are exit codes); an
        unexpected error in the launcher itself propagates after the workers are stopped.

    Example:

    ```python
    from keras_mirror_kit import launch
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
    group = _Group(args, sys.stdout, sys.stderr)
    previous: dict[int, Any] = {}

    def on_signal(signum: int, _frame: Any) -> None:
        group.stop_signal = signum

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    try:
        try:
            group.start()
        except (LaunchError, OSError) as err:
            group.stop()
            sys.stderr.write(f"{PROG}: error: could not start the workers: {err}\n")
            return 1
        return group.watch()
    except BaseException:
        group.stop()
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        group.cleanup()


if __name__ == "__main__":
    sys.exit(main())
