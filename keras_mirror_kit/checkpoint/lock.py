"""One writer per checkpoint directory: a lock file naming the process that writes there.

The lock is the file `writer.lock` in the checkpoint directory, holding the owner's pid,
host name, process start time and a random token as JSON. It is created atomically
(`atomic_files.create_if_absent`: written to a temporary file, then hard-linked into
place, which fails when a lock exists), so a reader never sees a half-written lock. A lock
whose owner is gone (same host, that pid no longer runs, or now runs another process) is
stale and is taken over with a warning; a lock of a live process, or of another host, is
refused with `CheckpointLockedError`. The
process that holds a lock may take it again (a later `fit()` after one that raised).

Under Slurm the lock also records the job id and its restart count: a requeued job
(`--requeue`, same `SLURM_JOB_ID`, higher `SLURM_RESTART_COUNT`) takes over the lock of its
earlier run even when that ran on another node, since Slurm ended that run before
requeueing it.

The lock is read as any file of a directory someone else may have made: only a regular
file of at most `LOCK_LIMIT` bytes, never through a symbolic link, never a FIFO
(`atomic_files.read_regular`). A lock that cannot be read as the JSON record the kit
writes is refused like a live one, the message saying why; a record naming a pid that no
process can have (beyond the 31 bits of a pid) counts as stale.

This module knows nothing of Keras or TensorFlow.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from keras_mirror_kit.atomic_files import create_if_absent, link_if_absent, read_regular
from keras_mirror_kit.checkpoint.meta import parse_json, shortened
from keras_mirror_kit.checkpoint.store import CheckpointError

__all__ = ["LOCK_FILE", "CheckpointLockedError", "DirectoryLock", "StaleLockWarning"]

logger = logging.getLogger("keras_mirror_kit")

LOCK_FILE = "writer.lock"
LOCK_LIMIT = 64 << 10  # a record is about 200 bytes
_PID_MAX = (1 << 31) - 1  # pid_t: no process has a larger pid

# Locks this process holds: resolved path -> token (released at exit as well).
_HELD: dict[str, str] = {}
_HELD_LOCK = threading.Lock()


class CheckpointLockedError(CheckpointError):
    """Another live process writes to the checkpoint directory (its `writer.lock`).

    Raised at `on_train_begin`, before any step; the message names the pid and host.

    Example:

    ```python
    try:
        model.fit(ds, callbacks=[kmk.SyncedCheckpoint("ckpts")])
    except kmk.CheckpointLockedError as err:
        print(err)   # use another directory, or stop the other run
    ```
    """


class StaleLockWarning(UserWarning):
    """A lock left by a process that no longer runs (or an earlier Slurm run) was taken over.

    Example:

    ```python
    import warnings
    warnings.simplefilter("error", kmk.StaleLockWarning)  # never take a lock over
    ```
    """


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of `/proc/<pid>/stat` after the command name (Linux); None if unknown."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as handle:
            stat = handle.read()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()


def _process_start(pid: int) -> str | None:
    """The start time of `pid`, which tells a reused pid apart; None if unknown."""
    fields = _proc_stat(pid)
    return fields[19] if fields is not None and len(fields) > 19 else None


def _slurm_job() -> dict[str, Any]:
    """This process's Slurm job id and restart count, or {} outside a Slurm job."""
    job = os.environ.get("SLURM_JOB_ID", "").strip()
    if not job:
        return {}
    try:
        restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    except ValueError:
        restarts = 0
    return {"slurm_job_id": job, "slurm_restart_count": restarts}


def _pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs on this host (a zombie does not)."""
    if not 0 < pid <= _PID_MAX:
        return False  # no process has this pid
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: another user's process
        return True
    fields = _proc_stat(pid)
    return not (fields and fields[0] in ("Z", "X"))


class DirectoryLock:
    """The lock of one checkpoint directory, for the one process that writes there."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self._token: str | None = None

    def _key(self) -> str:
        return os.path.realpath(self.path)

    def _record(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "process_start": _process_start(os.getpid()),
            "token": os.urandom(8).hex(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **_slurm_job(),
        }

    def read(self) -> dict[str, Any] | None:
        """The current lock's record; None when there is none, `{}` when it is unreadable."""
        return _read_record(self.path)

    def acquire(self) -> None:
        """Takes the lock, taking over a stale one with a `StaleLockWarning`.

        A directory that cannot be created is left to `CheckpointStore.prepare()` to
        report (nothing is locked then).

        Raises:
            CheckpointLockedError: When a live process (or one on another host) holds it.
            CheckpointError: When the lock file cannot be written.
        """
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError:
            return  # not a directory, or not creatable: CheckpointStore.prepare() says so
        for _ in range(5):  # a competing takeover can make one round fail
            record = self._record()
            if self._create(record):
                self._held(record)
                return
            current = self.read()
            if current is None:
                continue  # released meanwhile: try again
            if self._own(current):
                self._held(current)
                return
            stale = self._stale_reason(current)
            if stale is None:
                raise self._locked_error(current)
            if self._remove_stale(current):
                message = (
                    f"Taking over the checkpoint lock {str(self.path)!r} of {stale}; that "
                    "run ended without releasing it (killed or crashed)."
                )
                warnings.warn(message, StaleLockWarning, stacklevel=3)
                logger.warning("keras-mirror-kit: %s", message)
        current = self.read() or {}
        raise self._locked_error(current)

    def release(self) -> None:
        """Removes the lock if this object holds it (idempotent)."""
        token, self._token = self._token, None
        if token is None:
            return
        with _HELD_LOCK:
            if _HELD.get(self._key()) == token:
                del _HELD[self._key()]
        _remove_if_token(self.path, token)

    # -- internals -------------------------------------------------------------------------

    def _create(self, record: dict[str, Any]) -> bool:
        """Creates the lock atomically; False when one exists."""
        try:
            return create_if_absent(self.path, json.dumps(record).encode("utf-8"))
        except OSError as err:
            raise CheckpointError(
                f"The checkpoint directory {str(self.directory)!r} is not writable: its "
                f"lock {LOCK_FILE!r} could not be created ({err.strerror or err}). Choose a "
                "writable directory or fix its permissions. "
                f"Received: directory={str(self.directory)!r}"
            ) from err

    def _held(self, record: dict[str, Any]) -> None:
        self._token = str(record.get("token"))
        with _HELD_LOCK:
            _HELD[self._key()] = self._token

    def _own(self, record: dict[str, Any]) -> bool:
        """Whether the lock is this process's own (taken by an earlier `fit()` here)."""
        return (
            record.get("pid") == os.getpid()
            and record.get("host") == socket.gethostname()
            and record.get("process_start") == _process_start(os.getpid())
        )

    def _stale_reason(self, record: dict[str, Any]) -> str | None:
        """Why the lock is stale (its owner is gone), or None when it may be alive."""
        pid, host = record.get("pid"), record.get("host")
        ours = _slurm_job()
        if (
            ours
            and record.get("slurm_job_id") == ours["slurm_job_id"]
            and isinstance(record.get("slurm_restart_count"), int)
            and record["slurm_restart_count"] < ours["slurm_restart_count"]
        ):
            return (
                f"an earlier run (restart {record['slurm_restart_count']}) of Slurm job "
                f"{ours['slurm_job_id']} on {host}, which Slurm ended before requeueing it"
            )
        if not isinstance(pid, int) or host != socket.gethostname():
            return None  # another host (or unreadable): cannot tell, refuse
        if not _pid_alive(pid):
            return f"process {pid} on {host}, which no longer runs"
        started = record.get("process_start")
        if started is not None and _process_start(pid) not in (None, started):
            return f"process {pid} on {host}, which no longer runs (the pid was reused)"
        return None

    def _remove_stale(self, seen: dict[str, Any]) -> bool:
        """Moves the stale lock `seen` aside and deletes it; False if it changed meanwhile."""
        aside = self.directory / f".{LOCK_FILE}.{os.urandom(4).hex()}.tmp"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        except OSError as err:
            raise CheckpointError(
                f"Could not take over the stale checkpoint lock {str(self.path)!r} "
                f"({err.strerror or err}). Fix the directory's permissions, or delete the "
                f"lock file yourself. Received: directory={str(self.directory)!r}"
            ) from err
        moved = _read_record(aside) or {}
        if moved.get("token") == seen.get("token"):
            aside.unlink(missing_ok=True)
            return True
        # Another process replaced the stale lock first: put its fresh lock back.
        try:
            link_if_absent(aside, self.path)
        except OSError:
            pass
        aside.unlink(missing_ok=True)
        return False

    def _locked_error(self, record: dict[str, Any]) -> CheckpointLockedError:
        unreadable = ""
        if not record:  # no record the kit wrote: say what is there instead
            problem = _load_record(self.path)[1] or "it changed while it was read"
            unreadable = (
                f" The lock cannot be read as the record the kit writes ({problem}), so "
                "whether that run still writes cannot be told."
            )
        pid, host = _short(record.get("pid", "?")), record.get("host", "?")
        since = _short(record.get("since", "?"))
        where = "this host" if host == socket.gethostname() else f"host {_short(repr(host))}"
        return CheckpointLockedError(
            f"Another run is writing checkpoints to {str(self.directory)!r}: process {pid} "
            f"on {where} holds its lock {str(self.path)!r} (since {since}).{unreadable} Two "
            "runs writing one directory would rotate each other's checkpoints away. Wait for "
            "that run to end, stop it, or give this run another directory. If you are sure "
            "no run writes there (for example it ran on another machine that is gone), "
            f"delete the lock file. Received: directory={str(self.directory)!r}"
        )


def _short(value: Any) -> str:
    """A field of a lock record for a message: its text, shortened."""
    return shortened(str(value), 80)


def _load_record(path: Path) -> tuple[dict[str, Any] | None, str]:
    """A lock file's record and, when it is `{}` (unreadable), why; None when there is none."""
    try:
        record = parse_json(read_regular(path, LOCK_LIMIT))
    except FileNotFoundError:
        return None, ""
    except OSError as err:
        return {}, str(err.strerror or err)
    except ValueError as err:
        return {}, f"not JSON: {err}"
    if not isinstance(record, dict) or not record:
        return {}, "not a JSON object of the kit's lock fields"
    return record, ""


def _read_record(path: Path) -> dict[str, Any] | None:
    """A lock file's record: None when there is no file, `{}` when it is unreadable."""
    return _load_record(path)[0]


def _remove_if_token(path: Path, token: str) -> None:
    """Deletes the lock file when it still holds `token` (never another run's lock)."""
    record = _read_record(path)
    if record and record.get("token") == token:
        try:
            path.unlink()
        except OSError:
            pass


@atexit.register
def _release_all() -> None:
    """At exit, removes the locks this process still holds (a `fit()` that raised)."""
    with _HELD_LOCK:
        held = list(_HELD.items())
        _HELD.clear()
    for key, token in held:
        _remove_if_token(Path(key), token)
