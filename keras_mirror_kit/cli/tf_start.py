"""Starting TensorFlow without its start-up lines on a new user's first screen.

Importing TensorFlow 2.21 and listing its devices prints, before its logging is set up and
whatever `TF_CPP_MIN_LOG_LEVEL` says, lines such as `WARNING: All log messages before
absl::InitializeLog() is called are written to STDERR`, `I0000 ... cudart_stub.cc:31]
Could not find cuda drivers`, the CPU-instructions notice, and on a machine without a GPU
`E0000 ... failed call to cuInit: INTERNAL: CUDA error`. The command line and the examples
start TensorFlow through `start_tensorflow()`: while it imports TensorFlow and lists the
devices, file descriptor 2 runs through a filter that drops exactly those lines (logged at
DEBUG on the `keras_mirror_kit` logger instead) and passes every other byte on. It also
sets `TF_CPP_MIN_LOG_LEVEL=2` unless the user set it, which silences TensorFlow's later
INFO and WARNING lines from C++ (`TF_CPP_MIN_LOG_LEVEL=0` shows them again). The library
itself never does this: a user's own script keeps TensorFlow's output as it is.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["STARTUP_NOISE", "start_tensorflow"]

logger = logging.getLogger("keras_mirror_kit")

#: The start-up lines dropped (each alone on its line); anything else is passed on.
STARTUP_NOISE = re.compile(
    r"^(?:"
    r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|[IWE]\d{4} [\d:.]+\s+\d+ (?:cudart_stub|cpu_feature_guard)\.cc:\d+\] .*"
    r"|[IWE]\d{4} [\d:.]+\s+\d+ cuda_(?:platform|executor)\.cc:\d+\] failed call to cuInit.*"
    r"|To enable the following instructions: .* rebuild TensorFlow with the appropriate "
    r"compiler flags\."
    r")$"
)


def _pump(source: int, sink: int) -> None:
    """Copies lines from `source` to `sink`, dropping the start-up noise, until EOF."""
    with os.fdopen(source, "rb", buffering=0, closefd=False) as reader:
        pending = b""
        while chunk := reader.read(65536):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            kept = []
            for line in lines:
                text = line.decode("utf-8", "replace")
                if STARTUP_NOISE.match(text):
                    logger.debug("TensorFlow start-up: %s", text)
                else:
                    kept.append(line + b"\n")
            if kept:
                os.write(sink, b"".join(kept))
        if pending:
            os.write(sink, pending)


@contextlib.contextmanager
def _filtered_stderr() -> Iterator[None]:
    try:
        sys.stderr.flush()
        saved = os.dup(2)
        read_end, write_end = os.pipe()
    except (OSError, AttributeError, ValueError):  # no real fd 2 (an IDE): nothing to filter
        yield
        return
    pump = threading.Thread(target=_pump, args=(read_end, saved), daemon=True)
    pump.start()
    os.dup2(write_end, 2)
    os.close(write_end)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last writer is gone: the pump reads EOF and ends
        pump.join(timeout=10)
        os.close(read_end)
        os.close(saved)


def start_tensorflow() -> Any:
    """Imports TensorFlow and lists its devices with the start-up lines filtered; the module.

    None, and nothing imported, where TensorFlow is not installed (a machine with JAX alone,
    where `info` and `doctor` still run on Keras' JAX backend).
    """
    import importlib.util

    if importlib.util.find_spec("tensorflow") is None:
        return None
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    with _filtered_stderr():
        import tensorflow as tf

        tf.config.list_physical_devices()  # where the CUDA driver is looked for (cuInit)
    return tf
