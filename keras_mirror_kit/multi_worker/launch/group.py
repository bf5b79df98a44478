"""The N workers of one attempt: started together, watched, stopped, and reported on."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO

from keras_mirror_kit.multi_worker import PREEMPTED_EXIT_CODE
from keras_mirror_kit.multi_worker.gpus import GPU_ENV
from keras_mirror_kit.multi_worker.launch.environment import (
    MEMORY_GROWTH_ENV,
    free_ports,
    worker_environment,
)
from keras_mirror_kit.multi_worker.launch.errors import EXIT_FAILED, EXIT_TIMEOUT, PROG
from keras_mirror_kit.multi_worker.launch.isolation import Namespace, NetworkPlan
from keras_mirror_kit.multi_worker.launch.orphan_guard import Watchdog
from keras_mirror_kit.multi_worker.launch.workers import (
    Relay,
    Worker,
    group_members,
    launcher_exit_code,
    peek_exit,
    signal_group,
    start_worker,
)

POLL_S = 0.05
KILL_WAIT_S = 10.0  # for SIGKILLed processes to die (uninterruptible sleep may delay it)


@dataclass
class Outcome:
    """How an attempt ended: the launcher's exit code, and whether a restart may follow."""

    code: int
    restart: bool = False  # a worker failed (or did not join): --max-restarts may retry
    failure: str = ""  # "worker 1 was killed by SIGKILL"


class Group:
    """The running workers of one attempt, and how to stop them."""

    def __init__(
        self,
        args: argparse.Namespace,
        out: IO[str],
        err: IO[str],
        attempt: int = 0,
        deadline: float | None = None,
        network: NetworkPlan | None = None,
    ) -> None:
        self.args = args
        self.network = network or NetworkPlan(getattr(args, "network", "auto"))
        self.out, self.err = out, err
        self.attempt = attempt  # restarts before this attempt
        self.deadline = deadline  # time.monotonic() of --timeout, over all attempts
        self.relay = Relay()
        self.workers: list[Worker] = []
        self.ready_dir: str | None = None
        self.stop_signal: int | None = None
        self.watchdog: Watchdog | None = None

    def note(self, text: str) -> None:
        self.relay.write(self.err, f"{PROG}: {text}")

    def start(self) -> None:
        namespace = self.network.namespace(self.args.nproc)
        try:
            self._start(namespace)
        finally:
            if namespace is not None:  # each worker holds it now (see isolation)
                namespace.close()

    def _start(self, namespace: Namespace | None) -> None:
        n = self.args.nproc
        ports = namespace.ports if namespace is not None else free_ports(n)
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
        where = (
            " (this host's network)"
            if namespace is None
            else " in a network namespace of their own (loopback only)"
        )
        self.note(
            f"{attempt}starting {n} worker(s) on 127.0.0.1 ports {', '.join(map(str, ports))}"
            f"{where}{placement}: {shlex.join(shown)}"
        )
        warning = self.network.warning(ports) if namespace is None else None
        if warning is not None:
            self.note(warning)
        self.watchdog = Watchdog()
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
                network="host" if namespace is None else "isolated",
            )
            joins = namespace.joins if namespace is not None else ()
            worker = start_worker(index, command, env, ready, joins)
            process = worker.process
            self.watchdog.guard(process.pid)  # the group's id
            self.workers.append(worker)
            self.relay.start(worker, process.stdout, self.out, keep=False)  # type: ignore[arg-type]
            self.relay.start(worker, process.stderr, self.err, keep=True)  # type: ignore[arg-type]

    def _poll(self) -> None:
        now = time.monotonic()
        for worker in self.workers:
            if worker.exited_at is None and peek_exit(worker) is not None:
                worker.exited_at = now
            if not worker.ready and worker.ready_file and os.path.exists(worker.ready_file):
                worker.ready = True

    def _first_early_exit(self) -> Worker | None:
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

    def watch(self) -> Outcome:
        start = time.monotonic()
        startup = self.args.startup_timeout
        window = self.args.finish_window
        while True:
            if self.stop_signal is not None:
                self.note(f"received {signal.Signals(self.stop_signal).name}; stopping workers")
                self.stop()
                return Outcome(128 + self.stop_signal)
            self._poll()
            exited = sorted(
                (w for w in self.workers if w.exited_at is not None),
                key=lambda w: (w.exit_time, w.index),
            )
            failed = next((w for w in exited if w.exit_code != 0), None)
            early = self._first_early_exit()
            if failed is not None:
                code = launcher_exit_code(failed.exit_code or 0)
                if early is not None and early.exit_time < failed.exit_time:
                    self.report_early_exit(early, self.stop(), then=failed)
                    return Outcome(code, failure=f"worker {early.index} left early")
                if failed.exit_code == PREEMPTED_EXIT_CODE:
                    self._wait_for_preempted_peers()
                self.report_failure(failed, self.stop())
                return Outcome(
                    code, restart=True, failure=f"worker {failed.index} {failed.status}"
                )
            if len(exited) == len(self.workers):
                self.stop()  # what the workers left in their process groups, if anything
                return Outcome(0)
            now = time.monotonic()
            if early is not None and window and now - early.exit_time > window:
                self.report_early_exit(early, self.stop())
                return Outcome(EXIT_FAILED, failure=f"worker {early.index} left early")
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
                return Outcome(EXIT_TIMEOUT, restart=True, failure=f"{names} did not join")
            if self.deadline is not None and now > self.deadline:
                stopped = self.stop()
                names = ", ".join(f"worker {w.index}" for w in stopped) or "no worker"
                self.note(f"--timeout {self.args.timeout:g} s reached; stopped {names}")
                return Outcome(EXIT_TIMEOUT)
            time.sleep(POLL_S)

    def _still_running(self, worker: Worker) -> bool:
        """The worker, or something it left in its process group, is alive."""
        if peek_exit(worker) is None:
            return True
        if worker.process.returncode is not None:  # reaped: its group id may be reused
            return False
        members = group_members(worker.process.pid)
        return bool(members)  # without /proc (None): only the worker itself is waited for

    def _wait_while_running(self, seconds: float, poll: float) -> None:
        """Waits up to `seconds` while a worker, or what it left in its group, is alive."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and any(self._still_running(w) for w in self.workers):
            time.sleep(poll)

    def stop(self) -> list[Worker]:
        """SIGTERM every worker's process group, SIGKILL after the grace period, reap all.

        What is still alive after SIGTERM (a worker, or a helper it left in its group, even
        after a normal end) gets up to `--grace` seconds; SIGKILL only for what is left, and
        the launcher waits (up to KILL_WAIT_S) until what it killed has died.
        Returns the workers that were still running, i.e. that this stopped.
        """
        stopped = [w for w in self.workers if peek_exit(w) is None]
        for worker in self.workers:
            signal_group(worker.process, signal.SIGTERM)
        self._wait_while_running(self.args.grace, POLL_S)
        for worker in self.workers:
            # Also kills what the worker left behind in its group after exiting; its zombie
            # still holds the group id, so the signal cannot reach an unrelated process.
            signal_group(worker.process, signal.SIGKILL)
        # SIGKILL is delivered when the process next runs: on a loaded host a helper can
        # still be alive for a moment. Wait for the groups to empty, while their ids are held.
        self._wait_while_running(KILL_WAIT_S, POLL_S / 5)
        for worker in self.workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.process.wait(timeout=10)  # reaps: from here the group id is free
            if worker.exit_code is None:
                worker.exit_code = worker.process.returncode
            for thread in worker.threads:
                thread.join(timeout=2)
        return stopped

    @staticmethod
    def _stopped_text(stopped: Sequence[Worker]) -> str:
        return f"; stopped {', '.join(f'worker {w.index}' for w in stopped)}" if stopped else ""

    def print_tail(self, worker: Worker) -> None:
        if worker.tail:
            self.note(f"last lines of worker {worker.index}'s stderr:")
            for line in list(worker.tail):
                self.relay.write(self.err, f"  [worker {worker.index}] {line}")

    def report_failure(self, worker: Worker, stopped: Sequence[Worker]) -> None:
        self.note(f"{worker.label} {worker.status}{self._stopped_text(stopped)}")
        self.print_tail(worker)
        restarts = self.args.max_restarts
        if self.attempt < restarts:
            return  # main() says that it restarts
        used = f" (attempt {self.attempt + 1}: --max-restarts {restarts} used up)"
        self.note(f"FAILED: worker {worker.index} {worker.status}{used if restarts else ''}")

    def report_early_exit(
        self, worker: Worker, stopped: Sequence[Worker], then: Worker | None = None
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
