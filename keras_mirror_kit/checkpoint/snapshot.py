"""The state one save writes, read where it lives and brought to the host one array at a time.

`take_snapshot` reads every variable of the state on its device, checks on the device that
the floating-point ones are finite (only one boolean per variable comes to the host), and
returns a `StateSnapshot` whose `items()` copies the values to the host one variable at a
time while the checkpoint file is written, so a save holds about one variable in host
memory, not the state.

For asynchronous saves the snapshot copies the state into a `HostStaging`: host arrays
allocated (and their pages touched) once, at the start of `fit`, and reused by every save,
as PyTorch's asynchronous checkpoints reuse their staging buffers. Taking the snapshot is
then one copy of the state into memory that is already there (about 40 ms for 576 MiB on
one CPU core) and nothing else: training goes on with its own buffers, no device memory is
added, and the background thread writes straight from the staging arrays. (Holding the
read tensors instead, TensorFlow's copy-on-write, costs the training step that next
updates each variable a fresh allocation of it, on every save.)

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

import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from keras_mirror_kit.checkpoint.state import global_random_state
from keras_mirror_kit.checkpoint.store import CheckpointError

__all__ = ["WRITER_NICE", "BackgroundWriter", "HostStaging", "StateSnapshot", "take_snapshot"]

#: The `nice` value of the writer thread on Linux (the lowest scheduling priority).
WRITER_NICE = 19


def _tf_value(variable: Any) -> Any:
    """The TensorFlow variable behind a Keras variable (a tensor or TF variable as it is)."""
    if isinstance(variable, (tf.Tensor, tf.Variable)):
        return variable
    return getattr(variable, "value", variable)


def _all_finite(tensor: tf.Tensor) -> tf.Tensor | None:
    """A scalar bool tensor, on the tensor's device: all values finite (None: not floating)."""
    if tensor.dtype.is_complex:
        parts = (tf.math.real(tensor), tf.math.imag(tensor))
        return tf.reduce_all([tf.reduce_all(tf.math.is_finite(p)) for p in parts])
    if tensor.dtype.is_floating:
        return tf.reduce_all(tf.math.is_finite(tensor))
    return None


class HostStaging:
    """Host arrays an asynchronous save copies the state into, allocated once and reused.

    `prepare` allocates one array per state variable and touches its pages, so that no
    save pays for fresh memory; `copy` copies a tensor into its array (a new array only
    when the variable's shape or dtype changed). The next snapshot may only be taken once
    the previous one is written (`SyncedCheckpoint` waits for it).
    """

    def __init__(self) -> None:
        self._arrays: list[np.ndarray | None] = []

    @property
    def nbytes(self) -> int:
        """The host memory held, in bytes."""
        return sum(a.nbytes for a in self._arrays if a is not None)

    def prepare(self, named: list[tuple[str, Any]]) -> None:
        """Allocates and touches an array for each variable (none is read: no collective)."""
        for i, (_, variable) in enumerate(named):
            value = _tf_value(variable)
            self._array(i, tuple(value.shape), tf.as_dtype(value.dtype).as_numpy_dtype)
        del self._arrays[len(named) :]

    def copy(self, index: int, tensor: tf.Tensor) -> np.ndarray:
        """Copies `tensor` into the array of variable `index` and returns that array.

        On the host, `np.asarray` of the tensor is a view: one copy in all.
        """
        value = np.asarray(tensor)
        target = self._array(index, value.shape, value.dtype)
        np.copyto(target, value)
        return target

    def release(self) -> None:
        """Frees the arrays (at the end of `fit`)."""
        self._arrays = []

    def _array(self, index: int, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """The staging array of variable `index`, (re)allocated and touched if needed."""
        self._arrays.extend([None] * (index + 1 - len(self._arrays)))
        array = self._arrays[index]
        if array is None or array.shape != shape or array.dtype != np.dtype(dtype):
            array = np.empty(shape, dtype)
            array.reshape(-1).view(np.uint8).fill(0)  # touch every page now, not at a save
            self._arrays[index] = array
        return array


class StateSnapshot:
    """The values one save writes, in their saved order (staged on the host, or read when written).

    Made by `take_snapshot`. `items()` yields the arrays one at a time, each copied to the
    host when it is asked for and released once the next is asked for. `keys` are the
    array names (`"model/00000"`, `"optimizer/00003"`), `paths` the `"group:path"` of each
    variable (for the metadata), `sources` what each value is read from (a host array when
    staged, a tensor read at snapshot time, or the variable itself, read when written),
    `non_finite` the paths holding NaN or Inf, `extra` small host arrays written after the
    variables (Keras' global random state as `"random/global"`; the callbacks' arrays are
    added by the caller).
    """

    def __init__(
        self,
        keys: list[str],
        paths: list[str],
        sources: list[Any],
        non_finite: list[str],
        extra: dict[str, np.ndarray],
    ) -> None:
        self.keys = keys
        self.paths = paths
        self.non_finite = non_finite
        self.extra = extra
        self._sources: list[Any] | None = sources

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        """Yields `(name, array)`, the variables' then `extra`'s, one host copy at a time.

        Once only: the snapshot is spent (RuntimeError when it was written or released).
        """
        sources, self._sources = self._sources, None
        if sources is None:
            raise RuntimeError("This state snapshot was already written or released.")
        for i, key in enumerate(self.keys):
            source, sources[i] = sources[i], None  # held no longer than its write
            if isinstance(source, np.ndarray):
                value = source  # staged: written from the staging array itself
            else:
                value = np.asarray(tf.convert_to_tensor(_tf_value(source)))
            del source
            yield key, value
            del value
        yield from self.extra.items()

    def release(self) -> None:
        """Drops the tensors held (a snapshot that will not be written)."""
        self._sources = None


def take_snapshot(
    named: list[tuple[str, Any]], allow_non_finite: bool, staging: HostStaging | None = None
) -> StateSnapshot:
    """Reads the state for a save and checks, on the devices, that it is finite.

    Every worker calls this alike (reads of variables synchronized on read are collectives),
    and every worker refuses a non-finite state alike. Only one boolean per variable comes
    to the host. With `staging`, the values are copied into those host arrays now, so that
    the variables may change before the snapshot is written (asynchronous saves); without
    it the variables are read again, one at a time, when written.

    Raises:
        CheckpointError: When a variable holds NaN or Inf and `allow_non_finite` is False.
    """
    keys: list[str] = []
    paths: list[str] = []
    sources: list[Any] = []
    checks: list[tuple[str, tf.Tensor]] = []
    for i, (group, variable) in enumerate(named):
        value = _tf_value(variable)
        tensor = tf.convert_to_tensor(value)  # on the variable's (primary) device
        finite = _all_finite(tensor)
        if finite is not None:
            checks.append((variable.path, finite))
        on_read = getattr(value, "synchronization", None) == tf.VariableSynchronization.ON_READ
        if staging is not None:
            sources.append(staging.copy(i, tensor))
        else:  # reads of on-read variables are collectives: read once here, on every worker
            sources.append(tensor if on_read else variable)
        del tensor
        keys.append(f"{group}/{i:05d}")
        paths.append(f"{group}:{variable.path}")
    flags = np.asarray(tf.stack([flag for _, flag in checks])) if checks else np.ones(0, bool)
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
    return StateSnapshot(keys, paths, sources, bad, extra)


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

    def submit(self, write: Callable[[], object]) -> None:
        """Waits for the previous write (raising what it raised), then starts `write`."""
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
