"""`data.py_dataset_cursor.PyDatasetCursor`: a `PyDataset`'s epoch order, saved and resumed."""

from __future__ import annotations

import random

import keras
import numpy as np
import pytest

from keras_mirror_kit.backends import tensorflow as tensorflow_backend
from keras_mirror_kit.data.py_dataset_cursor import PyDatasetCursor
from keras_mirror_kit.upstream import keras_private
from keras_mirror_kit.workarounds import keras_pydataset_epochs


class Six(keras.utils.PyDataset):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int):
        return np.zeros((2, 1)), np.zeros((2, 1))


def test_each_epoch_is_kerass_shuffle_and_a_resumed_one_goes_on_in_its_saved_order() -> None:
    random.seed(11)
    keras_orders = []
    for epoch in range(3):
        order = list(range(6))
        if keras_private.py_dataset_shuffles_by_epoch():  # Keras 3.16's adapter
            random.Random(epoch).shuffle(order)
        else:
            random.shuffle(order)  # what Keras' PyDataset adapter does each epoch
        keras_orders.append(order)
    random.seed(11)
    dataset = Six()
    cursor = PyDatasetCursor(dataset)
    assert cursor.begin_epoch(shuffle=True) == keras_orders[0]
    assert cursor.get() == (1, 0)
    assert cursor.begin_epoch(shuffle=True) == keras_orders[1]
    saved = cursor.checkpoint_arrays()  # part-way through epoch 1

    random.seed(99)  # a new process: another state, which the resume replaces
    resumed = PyDatasetCursor(dataset)
    assert resumed.can_resume(saved) and resumed.resume_from(saved)
    resumed.set(1, 4)
    assert resumed.begin_epoch(shuffle=True) == keras_orders[1][4:]  # its last 2 batches
    assert resumed.begin_epoch(shuffle=True) == keras_orders[2]  # shuffled as before
    assert PyDatasetCursor(dataset).begin_epoch(shuffle=False) == list(range(6))


def test_a_position_of_other_data_or_a_skip_without_one_is_not_taken() -> None:
    cursor = PyDatasetCursor(Six())
    with pytest.raises(ValueError, match="order saved with it"):
        cursor.set(0, 2)
    with pytest.raises(ValueError, match=r"skip_batches must be in \[0, 6\)"):
        cursor.set(0, 6)
    cursor.begin_epoch(shuffle=True)
    saved = cursor.checkpoint_arrays()
    other = dict(saved, **{"data/order": np.arange(5)})  # another length
    broken = dict(saved, **{"data/python_random": np.arange(3)})  # no Mersenne state
    empty = dict(saved, **{"data/python_random": np.zeros(0, np.int64)})
    negative = dict(saved, **{"data/python_random": -saved["data/python_random"] - 1})
    for arrays in ({}, other, broken, empty, negative):
        assert not cursor.can_resume(arrays) and not cursor.resume_from(arrays)
    assert PyDatasetCursor(Six()).checkpoint_arrays() == {}  # before any epoch


def test_the_cursor_of_a_pydataset_is_made_once_and_only_for_finite_ones() -> None:
    class Endless(Six):
        @property
        def num_batches(self):
            return None

    dataset, made_by = Six(), tensorflow_backend.py_dataset_cursor
    assert keras_pydataset_epochs.cursor_of(dataset) is None
    made = made_by(dataset)
    assert made is made_by(dataset) is keras_pydataset_epochs.cursor_of(dataset)
    assert made.num_batches == 6
    assert made_by(Endless()) is None and made_by([1, 2]) is None
    with pytest.raises(ValueError, match="finite length"):
        PyDatasetCursor(Endless())
