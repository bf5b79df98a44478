"""A `PyDataset` with workers trains each epoch on its own batches, in its own order.

No upstream report was found. Keras feeds a `PyDataset` with `workers > 1` (or
`use_multiprocessing=True`) through an enqueuer: `on_epoch_begin` starts a run of it (a
new shuffle of the batch indices, in a worker thread), `on_epoch_end` stops it, and the
generator `fit`'s `tf.data` pipeline reads (`PyDatasetAdapter._finite_enqueuer_generator`)
stops it too, after its last batch, when the pipeline asks for the element after it. On one
device nothing asks for that element. Under a `tf.distribute` strategy over several
devices the input pipeline prefetches ahead and asks for it whenever its thread gets to
it: when that is after the next epoch's `on_epoch_begin`, the stale generator stops the
new run, and the next epoch's generator starts another one, shuffled again: that epoch
trains on another order than plain Keras (a draw more of Python's `random`), depending
on timing (seen on 2 replicas: one run in a few).

The fix, for the `PyDataset`s given to the `fit` and `evaluate` of models the kit built
(`own`; Keras' class and other data are untouched): their generator ends after its last
batch without stopping the enqueuer, whose run `on_epoch_end` stops in the main thread
as before. `tests/test_ecosystem_inputs.py::
test_plain_keras_still_lets_a_stale_generator_stop_the_next_epochs_enqueuer` shows the
upstream behaviour.
"""

from __future__ import annotations

import functools
from typing import Any

from keras_mirror_kit.workarounds import KerasPatch, Owned

__all__ = ["TESTED_KERAS", "install", "own"]

#: Keras versions the workaround was tested on: `low <= version < high`.
TESTED_KERAS = ((3, 15, 0), (3, 16, 0))

_OWNED = Owned()  # the PyDatasets kit-built models read
_PATCH = KerasPatch(TESTED_KERAS)


def install() -> bool:
    """Patches Keras' enqueuer generator once (inert for data not `own`ed); False when
    Keras is outside `TESTED_KERAS` (nothing done)."""
    return _PATCH.apply(_patch)


def _patch() -> None:
    from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter

    original = PyDatasetAdapter._finite_enqueuer_generator  # noqa: SLF001

    @functools.wraps(original)
    def finite_enqueuer_generator(self: Any) -> Any:
        if self.py_dataset not in _OWNED:
            yield from original(self)
            return
        self.enqueuer.start()
        num_batches = self.py_dataset.num_batches
        for i, batch in enumerate(self.enqueuer.get()):
            yield self._standardize_batch(batch)  # noqa: SLF001
            if i >= num_batches - 1:
                return  # on_epoch_end stops this epoch's run, in the main thread

    PyDatasetAdapter._finite_enqueuer_generator = finite_enqueuer_generator  # noqa: SLF001


def own(x: Any) -> None:
    """Marks `x`, when it is a `keras.utils.PyDataset`, as read by a kit-built model."""
    import keras

    if isinstance(x, keras.utils.PyDataset) and install():
        _OWNED.add(x)
