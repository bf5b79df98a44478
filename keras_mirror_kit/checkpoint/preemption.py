"""Saving on a stop signal: `SyncedCheckpoint`'s signal handlers and the workers' agreement.

While a `fit()` with `SyncedCheckpoint` runs (in the main thread), the signals of
`preemption_signals` (SIGTERM by default) only set a flag. The callback looks at the flag
at batch ends: the current step finishes, the training state is saved at that step, and
`Preempted` (a `SystemExit` with status `PREEMPTED_EXIT_CODE`) ends the process, so that a
script never goes on as if training had finished. Further signals during the save are
counted and ignored (the save is atomic either way). The handlers that were installed
before (Python's, and on Linux and macOS also a C-level one such as TensorFlow's own
SIGTERM handler of multi-worker runs) are put back when `fit()` ends, raises, or when a
signal arrives after a `fit()` that raised without the callback being told.

With several workers (`MultiWorkerMirroredStrategy`) every worker must save at the same
step, whichever got the signal. They agree through TensorFlow's coordination service (its
key-value store, as TensorFlow's own `PreemptionCheckpointHandler` does), without any
collective while no signal comes: the first worker to see its signal at a batch end claims
the stop and publishes the next step as the step to save at; a thread on every worker
waits for that key and acknowledges it, and the claimant goes on only once every worker has
acknowledged, so no worker can pass that step unaware (the workers are never more than one
step apart). At the end of `fit()` the workers exchange once more whether a signal came
late. A single process checks its flag at every batch end (an attribute read).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import signal
import sys
import threading
from collections.abc import Iterable
from types import FrameType
from typing import Any

from keras_mirror_kit import backends
from keras_mirror_kit.multi_worker import PREEMPTED_EXIT_CODE
from keras_mirror_kit.multi_worker.cluster import strategy_workers

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "Preempted",
    "PreemptionGuard",
    "parse_signals",
]

logger = logging.getLogger("keras_mirror_kit")

_UNCATCHABLE = {getattr(signal, name) for name in ("SIGKILL", "SIGSTOP") if hasattr(signal, name)}
_SIGACTION_BYTES = 512  # larger than struct sigaction on every libc


class Preempted(SystemExit):
    """`fit()` stopped on a signal after saving its state; the process exits with status 75.

    Raised by `SyncedCheckpoint` from inside `fit()` once the checkpoint of the step reached
    is written (on every worker of a multi-worker run). As a `SystemExit` it ends the script
    with status `PREEMPTED_EXIT_CODE` (75, `EX_TEMPFAIL`) and prints no traceback, unless
    the script catches it. Rerun the script to resume from that checkpoint.

    Attributes:
        signal_name: The signal that asked to stop (e.g. `"SIGTERM"`), or `"another
            worker's signal"` on a worker that did not get it.
        epoch: The epoch of the checkpoint (the next epoch to train when it was written at
            an epoch end).
        step: The batch of that epoch where training stopped (0 at an epoch end).
        global_step: The optimizer's step count saved.
        directory: The checkpoint directory.

    Example:

    ```python
    try:
        model.fit(train_ds, epochs=10, callbacks=[kmk.SyncedCheckpoint("ckpts")])
    except kmk.Preempted as stop:
        upload_logs()      # anything that must happen before the process ends
        raise              # exits with status 75 (kmk.PREEMPTED_EXIT_CODE)
    ```
    """

    def __init__(
        self, signal_name: str, epoch: int, step: int, global_step: int | None, directory: str
    ) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.signal_name = signal_name
        self.epoch, self.step, self.global_step = epoch, step, global_step
        self.directory = directory

    def __str__(self) -> str:
        return (
            f"training stopped on {self.signal_name} after saving epoch {self.epoch}, batch "
            f"{self.step} (optimizer step {self.global_step}) in {self.directory!r}; exit "
            f"status {PREEMPTED_EXIT_CODE}. Rerun the script to resume from there."
        )


def parse_signals(signals: Any) -> tuple[signal.Signals, ...]:
    """Validates `preemption_signals`: signal numbers or names, catchable, no duplicates.

    Returns the signals in the order given, without repeats.

    Raises:
        TypeError: When `signals` is not an iterable of ints or strings.
        ValueError: For an unknown signal, or SIGKILL / SIGSTOP (which cannot be caught).
    """
    if isinstance(signals, (str, bytes, int)) or not isinstance(signals, Iterable):
        raise TypeError(
            "`preemption_signals` must be a list or tuple of signals (signal.SIGTERM, "
            f"'SIGUSR1', ...); () turns saving on a signal off. Received: "
            f"preemption_signals={signals!r}"
        )
    parsed: list[signal.Signals] = []
    for item in list(signals):
        if isinstance(item, str):
            name = item.upper() if item.upper().startswith("SIG") else "SIG" + item.upper()
            found = getattr(signal.Signals, name, None) if name.isidentifier() else None
            if found is None:
                raise ValueError(
                    f"`preemption_signals` names an unknown signal {item!r}. Use names such "
                    f"as 'SIGTERM' or 'SIGUSR1'. Received: preemption_signals={signals!r}"
                )
            sig = found
        elif isinstance(item, int) and not isinstance(item, bool):
            try:
                sig = signal.Signals(item)
            except ValueError:
                raise ValueError(
                    f"`preemption_signals` holds {item}, which is not a signal number here. "
                    f"Received: preemption_signals={signals!r}"
                ) from None
        else:
            raise TypeError(
                "`preemption_signals` must hold signal numbers or names, not "
                f"{type(item).__name__}. Received: preemption_signals={signals!r}"
            )
        if sig in _UNCATCHABLE:
            raise ValueError(
                f"{sig.name} cannot be caught, so no checkpoint can be saved on it; Slurm's "
                "--signal and most schedulers send SIGTERM or SIGUSR1 first. Received: "
                f"preemption_signals={signals!r}"
            )
        if sig not in parsed:
            parsed.append(sig)
    return tuple(parsed)


def _libc_sigaction() -> Any:
    """libc's `sigaction` (Linux, macOS), or None."""
    if not sys.platform.startswith(("linux", "darwin")):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).sigaction
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    function.restype = ctypes.c_int
    return function


_SIGACTION = _libc_sigaction()


def _save_action(sig: int) -> Any:
    """The C-level action of `sig` as an opaque buffer (None where unavailable)."""
    if _SIGACTION is None:
        return None
    buffer = ctypes.create_string_buffer(_SIGACTION_BYTES)
    return buffer if _SIGACTION(int(sig), None, buffer) == 0 else None


def _restore_action(sig: int, buffer: Any) -> None:
    if _SIGACTION is not None and buffer is not None:
        _SIGACTION(int(sig), buffer, None)


class PreemptionGuard:
    """The signal handlers and the stop decision of one `SyncedCheckpoint`.

    `start(model)` at the start of `fit()`, then at batch ends `should_stop(steps)` once
    `next_check` is reached (save, then raise `preempted(...)`), `stop()` at its end or
    when it raised.
    """

    def __init__(self, signals: Any) -> None:
        self.signals = parse_signals(signals)
        self.requested: signal.Signals | None = None  # the first signal of this fit()
        self.repeats = 0  # signals after the first one, ignored
        self.stop_agreed = False
        self.next_check: float = math.inf  # the step count of the next look at the flag
        self._previous: list[tuple[signal.Signals, Any, Any]] = []
        self._workers = 1
        self._cluster: Any = None  # the backend's StopAgreement with several workers
        self._proposed = False

    def start(self, model: Any) -> None:
        """Installs the handlers for a `fit()` of `model` (main thread only; else a warning)."""
        self.stop()
        self.requested, self.repeats, self.stop_agreed = None, 0, False
        self._proposed = False
        self.next_check = math.inf
        self._workers = _num_workers(model) if self.signals else 1
        if not self.signals:
            return
        if self._workers > 1:
            strategy = model.distribute_strategy
            self._cluster = backends.current().stop_agreement(strategy, self._wake)
        if threading.current_thread() is not threading.main_thread():
            logger.warning(
                "keras-mirror-kit: SyncedCheckpoint cannot save on %s here: fit() runs "
                "outside the main thread, and Python lets only the main thread handle "
                "signals. Such a signal ends this process as it would without the kit "
                "(what was not checkpointed is lost). Run fit() in the main thread to "
                "save on a stop signal, or pass preemption_signals=() to silence this.",
                "/".join(s.name for s in self.signals),
            )
            return
        for sig in self.signals:
            raw = _save_action(sig)
            previous = signal.signal(sig, self._on_signal)
            self._previous.append((sig, previous, raw))

    def stop(self) -> None:
        """Puts back the handlers installed before `start` (at once when none are installed)."""
        previous, self._previous = self._previous, []
        cluster, self._cluster = self._cluster, None
        if cluster is not None:
            cluster.release()  # the watching thread ends
        for sig, handler, raw in reversed(previous):
            with contextlib.suppress(ValueError, OSError, TypeError):  # not the main thread
                signal.signal(sig, signal.SIG_DFL if handler is None else handler)
            _restore_action(sig, raw)  # a handler installed outside Python (TensorFlow's)

    def should_stop(self, steps: int) -> bool:
        """Whether the process(es) stop now, `steps` into this `fit()`.

        Called at batch ends once `next_check` is reached (after a signal here, or once a
        worker published the step to stop at). True when a signal reached this process
        (one process), or when the workers' agreed step is reached; the worker that got
        the signal publishes the step and waits for every worker's acknowledgment.
        """
        if self.stop_agreed:
            return True
        if self._cluster is None:
            self.stop_agreed = self.requested is not None
            return self.stop_agreed
        target = self._cluster.target
        if target is not None:
            self.stop_agreed = steps >= target
            return self.stop_agreed
        if self.requested is not None and not self._proposed:
            self._proposed = True
            self._cluster.propose(steps + 1)  # returns once every worker knows the step
        return False

    def pending(self) -> bool:
        """Whether to stop now without an exchange: agreed, or a signal to a single process."""
        return self.stop_agreed or (self._workers < 2 and self.requested is not None)

    def finish(self, steps: int) -> bool:
        """At the end of `fit()`: whether to stop anyway (a late signal); restores handlers.

        With several workers this is one more exchange (every worker's end of `fit()`).
        """
        try:
            if self._cluster is None:
                self.stop_agreed = self.stop_agreed or self.requested is not None
            else:
                late = self.stop_agreed or self.requested is not None
                self.stop_agreed = self._cluster.end(late) or self.stop_agreed
            return self.stop_agreed
        finally:
            self.stop()

    def preempted(
        self, epoch: int, step: int, global_step: int | None, directory: str
    ) -> Preempted:
        """Restores the handlers, logs, and returns the `Preempted` to raise."""
        name = self.requested.name if self.requested is not None else "another worker's signal"
        self.stop()
        if self.repeats:
            logger.warning(
                "keras-mirror-kit: %d more stop signal(s) arrived during the save and were "
                "ignored; the save completed",
                self.repeats,
            )
        stop = Preempted(name, epoch, step, global_step, directory)
        logger.warning("keras-mirror-kit: %s", stop)
        return stop

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.requested is None:
            self.requested = signal.Signals(signum)
            self.next_check = 0  # seen at the next batch end
        else:
            self.repeats += 1

    def _wake(self) -> None:
        """A worker published the step to stop at: look at it from the next batch end."""
        self.next_check = 0


def _num_workers(model: Any) -> int:
    """Worker processes of the model's strategy (1 without a multi-worker strategy)."""
    from keras_mirror_kit.model_record import distribution_of

    dist = distribution_of(model)
    if dist is not None:
        return int(dist.num_workers)
    return strategy_workers(getattr(model, "distribute_strategy", None))
