"""The state one save writes, read where it lives and brought to the host one array at a time.

`take_snapshot` reads every variable of the state on its device, checks on the device that
the floating-point ones are finite (only one boolean per variable comes to the host), and
returns a `StateSnapshot` whose `items()` copies the values to the host one variable at a
time while the checkpoint file is written, so a save holds about one variable in host
memory, not the state.

For asynchronous saves the snapshot copies the state into a `HostStaging`: host arrays
allocated (and their pages touched) once, at the start of `fit`, and reused by every save,
as PyTorch's asynchronous checkpoints reuse their staging buffers. Taking the snapshot is
then one copy into memory that is already there (about 40 ms for 576 MiB on one CPU core)
and nothing else: training goes on with its own buffers, no device memory is added, and
the background thread writes straight from the staging arrays. (Holding the read tensors
instead, TensorFlow's copy-on-write, costs the training step that next updates each
variable a fresh allocation of it, on every save.) The staging holds at most a share of
the state (`SyncedCheckpoint(async_host_memory=)`): the last variables of the saved order
that fit in it. The others, first in the file, are read from the variables themselves,
one at a time as they are written, while training waits (`StateSnapshot.wait_live_read`);
the staged rest is written in the background: a save costs the loop the write of the
unstaged part.

`BackgroundWriter` runs those writes for `SyncedCheckpoint(async_save=True)`, one at a
time in a background thread: the training loop goes on while the file is written; the
next save, the end of `fit` and `SyncedCheckpoint.wait_for_pending_save()` wait for it,
and its error (a `CheckpointWriteError` for a full disk) is raised there or at the next
training step. The thread is not a daemon: a process that ends while a write runs lets it
finish. On Linux the writer thread lowers its own scheduling priority (`nice` 19, this
thread only): checksumming and writing the state then uses CPU time training leaves idle
instead of taking it from training's threads, which matters where training itself runs on
the CPU (on a GPU host the writer mostly waits for the disk).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from keras_mirror_kit import backends
from keras_mirror_kit.checkpoint.state import global_random_state
from keras_mirror_kit.checkpoint.store import CheckpointError

__all__ = [
    "WRITER_NICE",
    "BackgroundWriter",
    "HostStaging",
    "StateSnapshot",
    "take_snapshot",
]

logger = logging.getLogger("keras_mirror_kit")

#: The `nice` value of the writer thread on Linux (the lowest scheduling priority).
WRITER_NICE = 19


class HostStaging:
    """Host arrays an asynchronous save copies the state into, allocated once and reused.

    `prepare` allocates one array for each of the last variables that fit in a share of the
    state and touches its pages, so that no save pays for fresh memory; `copy` copies a
    tensor into its array (a new array only when the variable's shape or dtype changed).
    The next snapshot may only be taken once the previous one is written
    (`SyncedCheckpoint` waits for it).
    """

    def __init__(self) -> None:
        self._arrays: list[np.ndarray | None] = []
        self.first_staged = 0  # the variables from this index on are staged
        self._count: int | None = None  # how many variables prepare() was given

    @property
    def nbytes(self) -> int:
        """The host memory held, in bytes."""
        return sum(a.nbytes for a in self._arrays if a is not None)

    def prepare(self, named: list[tuple[str, Any]], share: float = 1.0) -> tuple[int, int]:
        """Allocates and touches arrays for the last variables that fit in `share` of the state.

        Nothing is read (no collective). Logged at INFO.

        Args:
            named: The state's `(group, variable)` pairs, in the saved order.
            share: The most of the state's bytes to stage, from 0 to 1.

        Returns:
            The bytes staged and the state's bytes.
        """
        backend = backends.current()
        layouts = [backend.host_layout(variable) for _, variable in named]
        sizes = [int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
                 for shape, dtype in layouts]  # fmt: skip
        budget, staged, first = share * sum(sizes), 0, len(named)
        while first > 0 and staged + sizes[first - 1] <= budget:
            first -= 1
            staged += sizes[first]
        self.first_staged, self._count = first, len(named)
        unstaged = min(first, len(self._arrays))
        self._arrays[:unstaged] = [None] * unstaged  # freed: those are read live
        for i in range(first, len(named)):
            self._array(i, *layouts[i])
        del self._arrays[len(named) :]
        _log_staging(staged, sum(sizes), sizes[-1] if sizes else 0)
        return staged, sum(sizes)

    def prepared_for(self, count: int) -> bool:
        """Whether `prepare` was given a state of `count` variables (else none is staged)."""
        return count == self._count

    def holds(self, index: int, count: int) -> bool:
        """Whether variable `index` of a state of `count` variables is staged."""
        return self.prepared_for(count) and index >= self.first_staged

    def copy(self, index: int, tensor: Any) -> np.ndarray:
        """Copies `tensor` (a backend's array) into the array of variable `index`; returns it.

        On the host, `np.asarray` of the tensor is a view: one copy in all.
        """
        value = np.asarray(tensor)
        target = self._array(index, value.shape, value.dtype)
        np.copyto(target, value)
        return target

    def release(self) -> None:
        """Frees the arrays (at the end of `fit`)."""
        self._arrays = []
        self.first_staged, self._count = 0, None

    def _array(self, index: int, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """The staging array of variable `index`, (re)allocated and touched if needed."""
        self._arrays.extend([None] * (index + 1 - len(self._arrays)))
        array = self._arrays[index]
        if array is None or array.shape != shape or array.dtype != np.dtype(dtype):
            array = np.empty(shape, dtype)
            array.reshape(-1).view(np.uint8).fill(0)  # touch every page now, not at a save
            self._arrays[index] = array
        return array


def _log_staging(staged: int, state: int, last: int) -> None:
    """Says at INFO how much of the state an asynchronous save writes in the background."""
    mib = 1024**2
    if staged >= state:
        logger.info(
            "keras-mirror-kit: async_save copies all of the state (%.1f MiB) to host memory "
            "at each save and writes it in the background.",
            state / mib,
        )
        return
    logger.info(
        "keras-mirror-kit: async_save copies %.1f of the state's %.1f MiB to host memory at "
        "each save and writes it in the background; the other %.1f MiB are written before "
        "training goes on%s (raise SyncedCheckpoint(async_host_memory=) up to 1.0 to write "
        "more in the background, at that share of the state in host memory).",
        staged / mib,
        state / mib,
        (state - staged) / mib,
        f" (the last variable alone is {last / mib:.1f} MiB)" if staged == 0 else "",
    )


class StateSnapshot:
    """The values one save writes, in their saved order (staged on the host, or read when written).

    Made by `take_snapshot`. `items()` yields the arrays one at a time, each copied to the
    host when it is asked for and released once the next is asked for. `keys` are the
    array names (`"model/00000"`, `"optimizer/00003"`), `paths` the `"group:path"` of each
    variable (for the metadata), `sources` what each value is read from (a host array when
    staged, a tensor read at snapshot time, or the variable itself, read when written),
    `non_finite` the paths holding NaN or Inf, `extra` small host arrays written after the
    variables (Keras' global random state as `"random/global"`; the callbacks' arrays are
    added by the caller). The first `live` values are read from the variables when
    written: training must wait until they are (`wait_live_read`).
    """

    def __init__(
        self,
        keys: list[str],
        paths: list[str],
        sources: list[Any],
        non_finite: list[str],
        extra: dict[str, np.ndarray],
        live: int = 0,
    ) -> None:
        self.keys = keys
        self.paths = paths
        self.non_finite = non_finite
        self.extra = extra
        self._sources: list[Any] | None = sources
        self._host_value = backends.current().host_value  # also from the writer thread
        self.live = live
        self._live_read = threading.Event()
        self._abandoned = False  # the training thread stopped waiting: no live read may follow
        if live == 0:
            self._live_read.set()

    def mark_live_read(self) -> None:
        """Lets `wait_live_read` return (the live values are read, or never will be)."""
        self._live_read.set()

    def wait_live_read(self) -> None:
        """Waits until the values read from the variables themselves are written.

        Raises:
            BaseException: What interrupted the wait (KeyboardInterrupt); the write then
                fails instead of reading variables training may change.
        """
        try:
            self._live_read.wait()
        except BaseException:
            self._abandoned = True
            raise

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        """Yields `(name, array)`, the variables' then `extra`'s, one host copy at a time.

        Once only: the snapshot is spent (RuntimeError when it was written or released).
        """
        sources, self._sources = self._sources, None
        if sources is None:
            raise RuntimeError("This state snapshot was already written or released.")
        host_value = self._host_value
        try:
            for i, key in enumerate(self.keys):
                if i == self.live and i > 0:  # the live values are written: training goes on
                    self._live_read.set()
                    _lower_this_threads_priority()  # the writer thread's rest yields the CPU
                if i < self.live and self._abandoned:
                    raise RuntimeError("The training thread stopped waiting for this save.")
                source, sources[i] = sources[i], None  # held no longer than its write
                if isinstance(source, np.ndarray):
                    value = source  # staged: written from the staging array itself
                else:
                    value = host_value(source)
                del source
                yield key, value
                del value
            self._live_read.set()
            yield from self.extra.items()
        finally:
            self._live_read.set()

    def release(self) -> None:
        """Drops the tensors held (a snapshot that will not be written)."""
        self._sources = None


def take_snapshot(
    named: list[tuple[str, Any]], allow_non_finite: bool, staging: HostStaging | None = None
) -> StateSnapshot:
    """Reads the state for a save and checks, on the devices, that it is finite.

    Every worker calls this alike (reads of variables synchronized on read are collectives),
    and every worker refuses a non-finite state alike. Only one boolean per variable comes
    to the host. With `staging`, the values it holds are copied into its host arrays now,
    so that those variables may change before the snapshot is written (asynchronous
    saves); the others are read again, one at a time, when written.

    Raises:
        CheckpointError: When a variable holds NaN or Inf and `allow_non_finite` is False.
    """
    backend = backends.current()
    keys: list[str] = []
    paths: list[str] = []
    sources: list[Any] = []
    checks: list[tuple[str, Any]] = []
    for i, (group, variable) in enumerate(named):
        tensor = backend.read_value(variable)  # on the variable's (primary) device
        finite = backend.finite_check(tensor)
        if finite is not None and group != "metrics":  # figures for the logs, not training
            checks.append((variable.path, finite))
        on_read = backend.reads_collectively(variable)
        if staging is not None and staging.holds(i, len(named)):
            sources.append(staging.copy(i, tensor))
        else:  # reads of on-read variables are collectives: read once here, on every worker
            sources.append(tensor if on_read else variable)
        del tensor
        keys.append(f"{group}/{i:05d}")
        paths.append(f"{group}:{variable.path}")
    flags = backend.finite_flags([flag for _, flag in checks])  # one transfer
    bad = [path for (path, _), ok in zip(checks, flags) if not ok]
    if bad and not allow_non_finite:
        raise CheckpointError(
            f"The training state holds NaN or Inf in {len(bad)} variable(s): "
            f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}. Training diverged, so "
            "no checkpoint was written and the earlier ones (finite) are kept: resume "
            "from them with a lower learning rate, or pass allow_non_finite=True to save "
            f"such states anyway. Received: allow_non_finite=False"
        )
    extra: dict[str, np.ndarray] = {}
    global_random = global_random_state()
    if global_random is not None:
        extra["random/global"] = global_random
    live = 0  # synchronous: nothing waits
    if staging is not None:  # the unstaged values are read while training waits
        live = staging.first_staged if staging.prepared_for(len(named)) else len(named)
    return StateSnapshot(keys, paths, sources, bad, extra, live)


def _lower_this_threads_priority() -> None:
    """Gives the calling thread the lowest scheduling priority (Linux: per thread)."""
    if sys.platform.startswith("linux") and hasattr(os, "setpriority"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        except OSError:  # not permitted here: the write runs at normal priority
            pass


class BackgroundWriter:
    """Runs one write at a time in a background thread and hands back its error."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def pending(self) -> bool:
        """Whether a write was submitted and not yet waited for."""
        return self._thread is not None

    def submit(self, write: Callable[[], object], snapshot: StateSnapshot | None = None) -> None:
        """Waits for the previous write (raising what it raised), then starts `write`.

        Args:
            write: Writes the checkpoint (in the writer thread).
            snapshot: What `write` writes: `submit` returns once its live values are written
                (at the writer's normal priority; the rest at `WRITER_NICE`).

        Raises:
            Exception: What the previous write raised.
        """
        self.wait()

        def run() -> None:
            try:
                if snapshot is None or snapshot.live == 0:
                    _lower_this_threads_priority()
                write()
            except BaseException as err:  # handed to the training thread
                self._error = err
            finally:
                if snapshot is not None:
                    snapshot.mark_live_read()

        self._thread = threading.Thread(target=run, name="kmk-checkpoint-writer", daemon=False)
        self._thread.start()
        if snapshot is not None:
            snapshot.wait_live_read()

    def wait(self) -> None:
        """Waits for the write in progress, if any, and raises what it raised (once)."""
        if self._thread is not None:
            self._thread.join()  # an interrupt here keeps the write known as pending
            self._thread = None
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        """Raises what a finished write raised (once); returns at once otherwise."""
        error, self._error = self._error, None
        if error is not None:
            if self._thread is not None and not self._thread.is_alive():
                self._thread = None
            raise error
