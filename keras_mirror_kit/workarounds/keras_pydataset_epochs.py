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

The same patches read a `fit`'s training `PyDataset` in the order of its cursor
(`data.py_dataset_cursor`), when `SyncedCheckpoint` made one (`order_by`, from the
backend's `py_dataset_cursor`): the epoch's order is made as the adapter's epoch begins, in
the main thread, with Keras' own `random.shuffle` call (the order plain Keras reads), and an
epoch resumed part-way reads its remaining batches in the order saved with it. The
enqueuer reads the batches through `_InOrder`, the generator without workers from the order
itself.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any

from keras_mirror_kit.upstream import keras_private, versions
from keras_mirror_kit.workarounds import KerasPatch, Owned

__all__ = ["TESTED_KERAS", "cursor_of", "install", "order_by", "own"]

#: Keras versions the workaround was tested on: `low <= version < high`.
TESTED_KERAS = versions.TESTED_KERAS

_OWNED = Owned()  # the PyDatasets kit-built models read
# The cursors (`data.py_dataset_cursor.PyDatasetCursor`) that order PyDatasets' epochs.
_CURSORS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_PATCHED = ("__init__", "on_epoch_begin", "_finite_generator", "_finite_enqueuer_generator")


def _target() -> str | None:
    """None when Keras' `PyDatasetAdapter` has what `_patch` wraps, else what differs."""
    adapter = keras_private.py_dataset_adapter()
    missing = [
        n for n in (*_PATCHED, "_standardize_batch") if not callable(getattr(adapter, n, None))
    ]
    if missing:
        return f"PyDatasetAdapter has no {', '.join(missing)}"
    if "_within_epoch" not in inspect.getsource(adapter.on_epoch_begin):
        return "PyDatasetAdapter.on_epoch_begin no longer tracks _within_epoch"
    return None


# The patches also read a PyDataset in its cursor's order (a feature), so they stay where
# Keras fixes the stale generator's stop: the canary checks the shape of what they patch.
_PATCH = KerasPatch(
    TESTED_KERAS,
    name="keras_pydataset_epochs",
    feature="the epochs of a keras.utils.PyDataset (their order, and a mid-epoch resume)",
    instead="pass a tf.data.Dataset (kmk.make_dataset) instead of a PyDataset",
    target=_target,
)


def install() -> bool:
    """Patches Keras' enqueuer generator once (inert for data not `own`ed); False where its
    canary refused it (nothing done, logged once)."""
    return _PATCH.apply(_patch)


class _InOrder:
    """What the enqueuer reads for a cursor's epoch: batch `i` is the dataset's `order[i]`."""

    def __init__(self, dataset: Any, order: list[int]) -> None:
        self.dataset, self.order = dataset, order

    @property
    def num_batches(self) -> int:
        return len(self.order)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[self.order[index]]


def _patch() -> None:
    PyDatasetAdapter = keras_private.py_dataset_adapter()  # noqa: N806

    original = PyDatasetAdapter._finite_enqueuer_generator  # noqa: SLF001
    original_generator = PyDatasetAdapter._finite_generator  # noqa: SLF001
    original_init = PyDatasetAdapter.__init__
    original_begin = PyDatasetAdapter.on_epoch_begin

    @functools.wraps(original_init)
    def init(self: Any, x: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, x, *args, **kwargs)
        cursor = cursor_of(x)
        self._kit_cursor = cursor if cursor is not None and cursor.reading else None
        self._kit_order: list[int] | None = None
        if self._kit_cursor is not None:
            cursor.reading, cursor.claimed = False, True  # later adapters read as Keras

    @functools.wraps(original_begin)
    def on_epoch_begin(self: Any) -> None:
        cursor = getattr(self, "_kit_cursor", None)
        if cursor is not None:
            if not hasattr(self, "_kit_first_epoch"):  # Keras 3.16 counts from here
                self._kit_first_epoch = getattr(self, "_epoch", 0)
            if self._within_epoch:  # SyncedCheckpoint ended a resumed epoch after its rest
                self.on_epoch_end()
            self._kit_order = cursor.begin_epoch(self.shuffle, self._kit_first_epoch)
            if self.enqueuer is not None:  # reads _InOrder's batches 0..k-1, unshuffled
                self.enqueuer.py_dataset = _InOrder(self.py_dataset, self._kit_order)
                self.enqueuer.shuffle = False
        original_begin(self)

    @functools.wraps(original_generator)
    def finite_generator(self: Any) -> Any:
        order = getattr(self, "_kit_order", None)
        if order is None:
            yield from original_generator(self)
            return
        for index in order:
            yield self._standardize_batch(self.py_dataset[index])  # noqa: SLF001

    @functools.wraps(original)
    def finite_enqueuer_generator(self: Any) -> Any:
        if self.py_dataset not in _OWNED:
            yield from original(self)
            return
        keras_private.start_enqueuer(self.enqueuer, getattr(self, "_epoch", 0))
        order = getattr(self, "_kit_order", None)
        num_batches = self.py_dataset.num_batches if order is None else len(order)
        for i, batch in enumerate(self.enqueuer.get()):
            yield self._standardize_batch(batch)  # noqa: SLF001
            if i >= num_batches - 1:
                return  # on_epoch_end stops this epoch's run, in the main thread

    PyDatasetAdapter.__init__ = init
    PyDatasetAdapter.on_epoch_begin = on_epoch_begin
    PyDatasetAdapter._finite_generator = finite_generator  # noqa: SLF001
    PyDatasetAdapter._finite_enqueuer_generator = finite_enqueuer_generator  # noqa: SLF001


def cursor_of(x: Any) -> Any:
    """The cursor `order_by` gave `x`, or None."""
    try:
        return _CURSORS.get(x)
    except TypeError:  # not weakly referable
        return None


def order_by(x: Any, cursor: Any) -> bool:
    """Makes the `fit`s of kit-built models read the `PyDataset` `x` in `cursor`'s order
    (a `data.py_dataset_cursor.PyDatasetCursor`); `ValueError` where the canary refused the
    patches (before any step)."""
    if not install():
        _PATCH.require("resuming a keras.utils.PyDataset mid-epoch")
        return False
    _CURSORS[x] = cursor
    return True


def own(x: Any, training: bool | None = None) -> None:
    """Marks `x`, when it is a `keras.utils.PyDataset`, as read by a kit-built model.

    `training`: for a `fit`'s `x`, whether that `fit` reads whole epochs of it (no
    `steps_per_epoch`): then its cursor, if it has one, orders them (None: not a `fit`).
    """
    import keras

    if isinstance(x, keras.utils.PyDataset):
        if not install():
            _PATCH.require("training on a keras.utils.PyDataset")
        _OWNED.add(x)
        cursor = cursor_of(x)
        if cursor is not None and training is not None:
            cursor.reading, cursor.claimed = training, False
