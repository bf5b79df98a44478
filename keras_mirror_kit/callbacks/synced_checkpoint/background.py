"""Asynchronous saves: one checkpoint write at a time in a background thread.

`SyncedCheckpoint(async_save=True)` hands each write to a `BackgroundWriter`: the training
loop goes on while the file is written; the next save, the end of `fit` and
`SyncedCheckpoint.wait_for_pending_save()` wait for it, and its error (a
`CheckpointWriteError` for a full disk) is raised there or at the next training step.
The thread is not a daemon: a process that ends while a write runs lets it finish.

On Linux the writer thread lowers its own scheduling priority (`nice` 19, this thread
only): checksumming and writing the state then uses CPU time training leaves idle
instead of taking it from training's threads, which matters where training itself runs on
the CPU (on a GPU host the writer mostly waits for the disk). The write still finishes
before the next save or the end of `fit`, which wait for it.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable

__all__ = ["WRITER_NICE", "BackgroundWriter"]

#: The `nice` value of the writer thread on Linux (the lowest scheduling priority).
WRITER_NICE = 19


def _lower_this_threads_priority() -> None:
    """Gives the calling thread the lowest scheduling priority (Linux: per thread)."""
    if sys.platform.startswith("linux") and hasattr(os, "setpriority"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        except OSError:  # not permitted here: the write runs at normal priority
            pass


class BackgroundWriter:
    """Runs one write at a time in a background thread and hands back its error.

    Example:

    ```python
    writer = BackgroundWriter()
    writer.submit(lambda: store.write(snapshot.items(), meta))
    ...                      # training goes on
    writer.wait()            # raises what the write raised, if anything
    ```
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def pending(self) -> bool:
        """Whether a write was submitted and not yet waited for."""
        return self._thread is not None

    def submit(self, write: Callable[[], object]) -> None:
        """Waits for the previous write, then starts `write` in a new thread.

        Args:
            write: The write to run.

        Returns:
            None.

        Raises:
            BaseException: What the previous write raised (then `write` is not started).

        Example:

        ```python
        writer.submit(lambda: store.write(arrays, meta))
        ```
        """
        self.wait()

        def run() -> None:
            try:
                _lower_this_threads_priority()
                write()
            except BaseException as err:  # handed to the training thread
                self._error = err

        self._thread = threading.Thread(target=run, name="kmk-checkpoint-writer", daemon=False)
        self._thread.start()

    def wait(self) -> None:
        """Waits for the write in progress, if any, and raises what it raised.

        Returns:
            None.

        Raises:
            BaseException: What the write raised (once).

        Example:

        ```python
        writer.wait()
        ```
        """
        if self._thread is not None:
            self._thread.join()  # an interrupt here keeps the write known as pending
            self._thread = None
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        """Raises what a finished write raised (once); returns at once otherwise.

        Returns:
            None.

        Raises:
            BaseException: What the write raised.

        Example:

        ```python
        writer.raise_if_failed()  # each training step
        ```
        """
        error, self._error = self._error, None
        if error is not None:
            if self._thread is not None and not self._thread.is_alive():
                self._thread = None
            raise error
