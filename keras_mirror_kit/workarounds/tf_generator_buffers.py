"""A generator's or a `PyDataset`'s batches are copied before TensorFlow reads them.

The symptom. On several replicas, `fit` on a Python generator or a `keras.utils.PyDataset`
changes the arrays they yield: after two epochs of mean squared error on 2 replicas, the
label arrays a generator yielded again each epoch (`itertools.cycle` over 4 batches) were
changed by up to 1.3, in plain Keras under `MirroredStrategy` as under the kit (on one
device: never). A source that yields the same arrays again (cached batches, a cycle) then
trains on labels an earlier step overwrote, differently from run to run; and a `PyDataset`
whose `__getitem__` returns slices of arrays it holds (`self.y[low:high]`, as in Keras'
own example) has the user's arrays themselves overwritten.

The cause. Keras feeds both through `tf.data.Dataset.from_generator`, which turns each NumPy
array into a tensor that shares the array's memory. Under a `tf.distribute` strategy over
several devices, an op of the training step that receives such a tensor as its only holder
may write its output into that memory (TensorFlow's buffer forwarding): the array is
changed in place, at a moment that depends on tf.data's threads. No upstream report was
found; tensorflow/tensorflow#45964 discusses how tensors that share a NumPy buffer can be
mutated.

The workaround, for the generators and `PyDataset`s given to the `fit`, `evaluate` and
`predict` of models the kit built on several replicas (`own`; one replica, Keras' classes
and other data are untouched):
each NumPy array of a batch is copied as it is yielded (one host copy of a batch, small
next to a step), so TensorFlow writes, if at all, into memory nobody reads again.
`tests/test_ecosystem_inputs.py::test_plain_keras_still_overwrites_a_generators_arrays_on_two_replicas`
shows the upstream behaviour; remove this module when it fails. A
`tf.data.Dataset.from_generator` you build yourself is not reached by this module: yield
fresh arrays from it (`docs/input-pipeline.md`).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import numpy as np

from keras_mirror_kit.upstream import keras_private, versions
from keras_mirror_kit.workarounds import KerasPatch, Owned

__all__ = ["TESTED_KERAS", "install", "own"]

#: Keras versions the workaround was tested on: `low <= version < high`.
TESTED_KERAS = versions.TESTED_KERAS

_OWNED = Owned()  # the generators and PyDatasets kit-built models read


def _target() -> str | None:
    """None when Keras' adapters have what `_patch` wraps, else what differs."""
    if not callable(getattr(keras_private.py_dataset_adapter(), "_standardize_batch", None)):
        return "PyDatasetAdapter has no _standardize_batch"
    init = inspect.getsource(keras_private.generator_data_adapter().__init__)
    return None if "self.generator" in init else "GeneratorDataAdapter keeps no self.generator"


# The copy is exact whether or not TensorFlow still writes into the arrays: its canary
# checks the shape of what it patches only.
_PATCH = KerasPatch(
    TESTED_KERAS,
    name="tf_generator_buffers",
    feature="the batches of Python generators and PyDatasets on several replicas",
    instead=(
        "pass a tf.data.Dataset (kmk.make_dataset, or tf.data.Dataset.from_tensor_slices) "
        "instead of a generator or PyDataset"
    ),
    target=_target,
)


def _copied(batch: Any) -> Any:
    """`batch` with each NumPy array replaced by a copy (other leaves as they are)."""
    from keras import tree

    return tree.map_structure(
        lambda leaf: np.array(leaf, copy=True) if isinstance(leaf, np.ndarray) else leaf, batch
    )


def install() -> bool:
    """Patches Keras' generator and `PyDataset` adapters once (inert for data not `own`ed);
    False where its canary refused it (nothing done, logged once)."""
    return _PATCH.apply(_patch)


def _patch() -> None:
    GeneratorDataAdapter = keras_private.generator_data_adapter()  # noqa: N806
    PyDatasetAdapter = keras_private.py_dataset_adapter()  # noqa: N806

    standardize = PyDatasetAdapter._standardize_batch  # noqa: SLF001

    @functools.wraps(standardize)
    def standardize_batch(self: Any, batch: Any) -> Any:
        batch = standardize(self, batch)
        return _copied(batch) if self.py_dataset in _OWNED else batch

    init = GeneratorDataAdapter.__init__

    @functools.wraps(init)
    def generator_init(self: Any, generator: Any) -> None:
        init(self, generator)
        if generator in _OWNED:
            batches = self.generator  # Keras' peeked batches, then the generator's
            self.generator = lambda: map(_copied, batches())

    PyDatasetAdapter._standardize_batch = standardize_batch  # noqa: SLF001
    GeneratorDataAdapter.__init__ = generator_init


def own(x: Any) -> None:
    """Marks `x`, when it is a Python generator or a `keras.utils.PyDataset`, as read by a
    kit-built model (its batches are then copied); `ValueError` where the canary refused
    the copy (before any step)."""
    import keras

    if isinstance(x, keras.utils.PyDataset) or inspect.isgenerator(x):
        if not install():
            _PATCH.require(f"training on a {type(x).__name__} on several replicas")
        _OWNED.add(x)
