"""Where the next epoch of a `keras.utils.PyDataset` starts: its batch order and position.

A `PyDataset` is addressable (`__getitem__`, `__len__`): an epoch is the order Keras reads
its batches in (`0..n-1`, or with `fit(shuffle=True)`, Keras' default, Python's
`random.shuffle` of it; from Keras 3.16 `random.Random(epoch).shuffle`). A
`PyDatasetCursor` makes that order in the main thread as each epoch begins, with the very
call Keras makes, so an epoch reads what plain Keras reads, and keeps it: a checkpoint
written part-way through the epoch saves the order and the state of Python's `random`
after it (`checkpoint_arrays`), and the resumed run reads the epoch's remaining batches in
that order and goes on with that `random` state (`resume_from`): the epochs after it are
shuffled as the uninterrupted run shuffled them.

The cursor is made for the `PyDataset`s a kit-built model's `fit` reads (TensorFlow
backend: `backends.tensorflow.py_dataset_cursor`); `workarounds.keras_pydataset_epochs`
keeps it (`cursor_of`) and hands Keras' data adapter the order it gives.
Its batches are the `PyDataset`'s own, whatever the global batch size (`own_batches`).
"""

from __future__ import annotations

import random
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from keras_mirror_kit.upstream import keras_private

__all__ = ["ARRAY_KINDS", "PyDatasetCursor"]

_ORDER, _RANDOM, _GAUSS = "data/order", "data/python_random", "data/python_gauss"
#: The arrays a checkpoint holds the position in (`checkpoint_arrays`), each 1-D, with the
#: NumPy dtype kinds it may have (`checkpoint.archive.check_layout`).
ARRAY_KINDS = {_ORDER: "iu", _RANDOM: "iu", _GAUSS: "f"}


class PyDatasetCursor:
    """The order and start of the next epoch of a `PyDataset` (see the module docstring).

    Args:
        dataset: The `keras.utils.PyDataset` (of a known, finite length).

    Raises:
        ValueError: When the dataset has no finite length (`num_batches` is None).

    Example:

    ```python
    cursor = PyDatasetCursor(train_py_dataset)
    cursor.set(epoch=3, skip_batches=10)  # next epoch: epoch 3, from its batch 10
    ```
    """

    own_batches = True  # a resumed epoch skips batches of the PyDataset, not samples
    seed: int | None = None  # its order comes from Python's `random`, saved as arrays
    seed_given = False
    num_samples: int | None = None

    def __init__(self, dataset: Any) -> None:
        if getattr(dataset, "num_batches", None) is None:
            raise ValueError(
                "A PyDataset cursor needs a PyDataset of finite length (__len__). "
                f"Received: dataset={type(dataset).__name__} without num_batches"
            )
        self._dataset = weakref.ref(dataset)  # weak: the dataset keys the cursors' registry
        self._length = int(dataset.num_batches)  # its length when it is gone
        self._lock = threading.Lock()
        self._next = (0, 0)
        self._saved: tuple[list[int], Any] | None = None  # the resumed epoch's order, state
        self._order: list[int] | None = None  # the order of the epoch under way
        self._random_after: Any = None  # Python's random state after that epoch's shuffle
        #: Whether the next data adapter made for it is a `fit`'s training data, which reads
        #: its epochs through this cursor (`workarounds.keras_pydataset_epochs.own`), and
        #: whether that `fit`'s adapter took the cursor (else it resumes at epoch starts).
        self.reading = self.claimed = False

    @property
    def num_batches(self) -> int:
        """Batches in one full epoch."""
        dataset = self._dataset()
        return int(dataset.num_batches) if dataset is not None else self._length

    def set(self, epoch: int, skip_batches: int = 0) -> None:
        """Sets the epoch the next `begin_epoch` starts, and its batches already trained.

        Args:
            epoch: The epoch number.
            skip_batches: Batches of it already trained (0: from its start); more than 0
                only after `resume_from` gave that epoch's order.

        Raises:
            ValueError: For a skip outside `[0, num_batches)`, or one without a saved order.
        """
        if not 0 <= skip_batches < max(self.num_batches, 1):
            raise ValueError(
                f"skip_batches must be in [0, {self.num_batches}). "
                f"Received: skip_batches={skip_batches}"
            )
        if skip_batches and self._saved is None:
            raise ValueError(
                "A PyDataset epoch can start part-way only in the order saved with it "
                f"(resume_from). Received: skip_batches={skip_batches}"
            )
        with self._lock:
            self._next = (int(epoch), int(skip_batches))

    def get(self) -> tuple[int, int]:
        """The `(epoch, skip_batches)` the next `begin_epoch` starts."""
        with self._lock:
            return self._next

    def can_resume(self, arrays: Mapping[str, np.ndarray]) -> bool:
        """Whether a checkpoint's arrays hold an order of this dataset's batches."""
        return _saved_position(arrays, self.num_batches) is not None

    def resume_from(self, arrays: Mapping[str, np.ndarray]) -> bool:
        """Takes a checkpoint's position: the order of its epoch and Python's `random` state
        after that epoch's shuffle, for the next `begin_epoch`.

        An epoch resumed part-way (`set(epoch, skip_batches)`) reads its remaining batches
        in that order; an epoch after a finished one is shuffled from that state, as the
        uninterrupted run shuffled it.

        Args:
            arrays: The checkpoint's arrays (`checkpoint_arrays`' names).

        Returns:
            False when they hold no order of this dataset's length (nothing taken).
        """
        saved = _saved_position(arrays, self.num_batches)
        if saved is None:
            return False
        with self._lock:
            self._saved = saved
        return True

    def begin_epoch(self, shuffle: bool, keras_first_epoch: int = 0) -> list[int]:
        """The indices of the batches the epoch beginning now reads, in order.

        Called by the data adapter as each epoch begins (main thread). The order is the
        saved one for an epoch resumed part-way (and Python's `random` takes its saved
        state), else `range(num_batches)`, shuffled as Keras does when `shuffle`.

        Args:
            shuffle: Keras' `shuffle` for this `fit`.
            keras_first_epoch: Keras' own epoch count (3.16's adapter `_epoch`) as the
                first epoch of a run began: epoch `e` is shuffled by `e` plus it there.

        Returns:
            The indices, without the batches already trained.
        """
        with self._lock:
            epoch, skip = self._next
            saved, self._saved = self._saved, None
            if saved is not None:
                random.setstate(saved[1])  # as it was after the saved epoch's shuffle
            if skip and saved is not None:
                order = saved[0]
            else:
                skip = 0
                order = list(range(self.num_batches))
                if shuffle and keras_private.py_dataset_shuffles_by_epoch():
                    # Keras 3.16's: by its epoch count (the uninterrupted run's)
                    random.Random(epoch + keras_first_epoch).shuffle(order)
                elif shuffle:
                    random.shuffle(order)  # Keras' own call: plain Keras' order
            self._order, self._random_after = order, random.getstate()
            self._next = (epoch + 1, 0)
            return order[skip:]

    def checkpoint_arrays(self) -> dict[str, np.ndarray]:
        """The arrays a checkpoint saves: the epoch's order and Python's `random` after it.

        Returns:
            `{}` before the first epoch began.
        """
        with self._lock:
            if self._order is None:
                return {}
            version, words, gauss = self._random_after
            return {
                _ORDER: np.asarray(self._order, np.int64),
                _RANDOM: np.asarray([version, *words], np.int64),
                _GAUSS: np.asarray([] if gauss is None else [gauss], np.float64),
            }


_STATE_WORDS = 626  # Python's Mersenne Twister state: its version, 624 words and a position


def _saved_position(arrays: Mapping[str, np.ndarray], num_batches: int) -> Any:
    """`(order, random state)` of `num_batches` batches from a checkpoint's arrays, or None."""
    if _ORDER not in arrays or _RANDOM not in arrays:
        return None
    order = [int(i) for i in np.asarray(arrays[_ORDER]).ravel()]
    if sorted(order) != list(range(num_batches)):
        return None
    words = tuple(int(w) for w in np.asarray(arrays[_RANDOM]).ravel())
    gauss = np.asarray(arrays.get(_GAUSS, np.zeros(0))).ravel()
    if len(words) != _STATE_WORDS or not all(0 <= w < 2**32 for w in words):
        return None
    state = (words[0], words[1:], float(gauss[0]) if gauss.size else None)
    try:
        random.Random().setstate(state)  # refused here, not at the epoch's start
    except (TypeError, ValueError, OverflowError):
        return None
    return order, state
