"""Works around the cost of a new tf.data iterator: every function of the pipeline optimized anew.

The symptom. Keras' `fit` (without `steps_per_epoch`) makes a new iterator over its
dataset every epoch, and a kit dataset's first batch of an epoch came 3 to 5x later than
Keras' loader's: on 480 small JPEGs, `iter(dataset)` alone took 34 to 48 ms of CPU against
Keras' 5 to 7 ms (`benchmarks/epoch_start_probe.py`), a whole epoch then reading at 0.55
to 0.74x Keras' images/s (`benchmarks/image_folder.py`, the small-folder rows).

The cause (TensorFlow). Each new iterator instantiates every function of its pipeline
(map, scan, flat_map functions, with their `tf.cond` branches and `tf.while_loop` bodies)
for itself, and `CapturedFunction::Instantiate` (tensorflow/core/data/captured_function.cc)
instantiates each as a *multi-device* function unless it carries the
`experimental_ints_on_device` attribute: `ProcessFunctionLibraryRuntime::
InstantiateMultiDevice` then runs placement, Grappler's meta-optimizer and the TFG (MLIR)
passes on it, about 70% of the kit's `iter()` under `perf`, although the function runs on
the host's CPU alone. A function with the attribute is instantiated by the single-device
runtime, as TensorFlow does for the functions of its own `MultiDeviceIterator` and
`prefetch_to_device`. Observed with TensorFlow 2.21.0; no upstream issue describing the
per-iterator cost was found (searched for slow iterator creation, Grappler in tf.data
functions, multi-device instantiation), so none is named here.

The workaround. Inside `host_functions()`, the tf.data functions this thread traces carry
`experimental_ints_on_device=True` (a wrapper around `StructuredFunctionWrapper.__init__`,
installed once; outside the block it calls the original). The kit builds inside it only
the functions of its own that capture host tensors and CPU tables: its cursor reads,
gathers, decoding of image and text files by Keras' own functions, and label encodings.
A user's `preprocess`, `augment`, `load` or `parse` runs in a function built outside the
block: it may read a variable on an accelerator, which only a multi-device function can.
The pixels and orders are the same (a single-device function computes the same ops).

If this TensorFlow's `StructuredFunctionWrapper` takes no `defun_kwargs`, the block does
nothing and one warning is logged. `tests/test_tf_data_function_instantiation.py::
test_plain_tf_data_functions_are_still_multi_device` shows whether TensorFlow still
instantiates a plain tf.data function as a multi-device one; remove this module when it
fails.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import tensorflow as tf

from keras_mirror_kit.upstream import tensorflow_private
from keras_mirror_kit.workarounds import ThreadBlock

__all__ = ["ATTRIBUTE", "host_functions"]

logger = logging.getLogger("keras_mirror_kit")

#: The function attribute that makes TensorFlow instantiate a tf.data function on one device.
ATTRIBUTE = "experimental_ints_on_device"

_TARGET_MODULE = tensorflow_private.STRUCTURED_FUNCTION_MODULE
_TARGET_CLASS = "StructuredFunctionWrapper"


def _install() -> bool:
    """Wraps TensorFlow's tf.data function tracer (once, by `_BLOCK`); False when it cannot."""

    try:
        wrapper = getattr(tensorflow_private.import_module(_TARGET_MODULE), _TARGET_CLASS)
        original = wrapper.__init__
        takes = "defun_kwargs" in inspect.signature(original).parameters
    except (ImportError, AttributeError, TypeError, ValueError):
        takes = False
    if not takes:
        logger.warning(
            "keras-mirror-kit: this TensorFlow (%s) has no %s.%s taking `defun_kwargs`, so "
            "every new iterator over a kit dataset optimizes its functions again (see "
            "keras_mirror_kit.workarounds.tf_data_function_instantiation).",
            tf.__version__,
            _TARGET_MODULE,
            _TARGET_CLASS,
        )
        return False

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, defun_kwargs: Any = None, **kwargs: Any) -> None:  # noqa: N807
        if _BLOCK.active() and not kwargs.get("use_legacy_function"):
            defun_kwargs = {**(defun_kwargs or {}), ATTRIBUTE: True}
        original(self, *args, defun_kwargs=defun_kwargs, **kwargs)

    wrapper.__init__ = __init__
    return True


_BLOCK = ThreadBlock(_install)  # the functions traced inside `host_functions()`


@contextmanager
def host_functions() -> Iterator[None]:
    """Inside the block, the tf.data functions this thread traces are single-device ones.

    For the kit's own functions only (host tensors and CPU tables, no user code): a new
    iterator then instantiates them without Grappler. Re-entrant, and per thread.
    """
    with _BLOCK.block():
        yield
