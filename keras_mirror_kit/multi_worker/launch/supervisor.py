"""`main()`: the launcher's signals, and the attempts of `--max-restarts`."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from keras_mirror_kit.multi_worker.launch.errors import EXIT_USAGE, PROG, LaunchError
from keras_mirror_kit.multi_worker.launch.group import Group, Outcome
from keras_mirror_kit.multi_worker.launch.isolation import NetworkPlan
from keras_mirror_kit.multi_worker.launch.options import parse, validate


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
        args = parse(argv)
        validate(args)
    except LaunchError as err:
        sys.stderr.write(f"{PROG}: error: {err}\n")
        return EXIT_USAGE
    except SystemExit as exit_:
        code = exit_.code
        return code if isinstance(code, int) else EXIT_USAGE
    state = _LaunchState(network=NetworkPlan(args.network))
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
    """The launch's network plan, and what its signal handler sets: the signal, the group."""

    network: NetworkPlan
    signal: int | None = None
    group: Group | None = None


def _run_attempt(
    args: argparse.Namespace, state: _LaunchState, attempt: int, deadline: float | None
) -> Outcome:
    """Starts the workers once, watches them to their end, and stops what is left."""
    group = Group(
        args, sys.stdout, sys.stderr, attempt=attempt, deadline=deadline, network=state.network
    )
    group.stop_signal = state.signal
    state.group = group
    try:
        try:
            group.start()
        except (LaunchError, OSError) as err:
            group.stop()
            sys.stderr.write(f"{PROG}: error: could not start the workers: {err}\n")
            return Outcome(1)
        return group.watch()
    except BaseException:
        group.stop()
        raise
    finally:
        state.group = None
        group.cleanup()
