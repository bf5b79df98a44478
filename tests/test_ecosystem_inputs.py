"""Generators and PyDatasets train on the batches, in the order, plain Keras trains on
(issue: "What the Keras ecosystem hands the kit", item 1).

Keras builds a model under a strategy from a batch it takes from `fit`'s own epoch
iterator, then resets it: a Python generator loses what the build prefetched and a
threaded `PyDataset` serves the left-over batch first. Here the same small model (same
first weights) trains on 4 distinct batches given each way a user gives them, plain Keras
without a strategy as the reference, and the kit on 1 and 2 replicas: the weights and the
logged losses agree to 1e-6 after 2 epochs. On 2 replicas TensorFlow also wrote into the
arrays a generator or a PyDataset yields (`workarounds.tf_generator_buffers`), so an input
that yields the same arrays again trained on overwritten labels, differently from run to
run. (A PyDataset with `use_multiprocessing=True` forks worker processes: it runs in a
process of its own, `tests/ecosystem_child.py`, as does plain Keras' own strategy.)
"""

from __future__ import annotations

import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mirror_kit as kmk

pytestmark = pytest.mark.slow  # every test here trains on 1 and 2 replicas or starts a child

ONE, TWO = ["/cpu:0"], ["/cpu:0", "/cpu:1"]
BATCH, BATCHES = 8, 4
TOLERANCE = 1e-6


def _batches() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(3)
    found = []
    for i in range(BATCHES):
        x = rng.normal(size=(BATCH, 5)).astype("float32")
        found.append((x, (x[:, :1] * 0.5 + 0.2 * i).astype("float32")))
    return found


class Batches(keras.utils.PyDataset):
    """The 4 batches, addressable, with Keras' worker options."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.batches = _batches()

    def __len__(self) -> int:
        return BATCHES

    def __getitem__(self, index: int):
        return self.batches[index]


def _generator():
    yield from itertools.cycle(_batches())


def _finite_generator():
    yield from _batches()


INPUTS = {
    "generator, steps_per_epoch": lambda: ((_generator(),), {"steps_per_epoch": BATCHES}),
    "PyDataset": lambda: ((Batches(),), {}),
    "PyDataset, 2 threads": lambda: ((Batches(workers=2),), {}),
    "PyDataset, 4 threads, queue 2": lambda: ((Batches(workers=4, max_queue_size=2),), {}),
    "Dataset.from_generator": lambda: (
        (
            tf.data.Dataset.from_generator(
                _finite_generator,
                output_signature=(
                    tf.TensorSpec((None, 5), tf.float32),
                    tf.TensorSpec((None, 1), tf.float32),
                ),
            ),
        ),
        {},
    ),
}


def _model() -> keras.Model:
    keras.utils.set_random_seed(7)
    model = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


def _kit_model(devices: list[str]) -> keras.Model:
    return kmk.distributed(global_batch_size=BATCH, devices=devices)(_model)()


def _train(model: keras.Model, given: str) -> tuple[list[np.ndarray], list[float]]:
    args, kwargs = INPUTS[given]()
    history = model.fit(*args, epochs=2, verbose=0, **kwargs).history
    return model.get_weights(), history["loss"]


@pytest.fixture(scope="module")
def references() -> dict[str, tuple[list[np.ndarray], list[float]]]:
    """Plain Keras without a strategy, on each input."""
    return {given: _train(_model(), given) for given in INPUTS}


def _close(a: tuple, b: tuple) -> float:
    """The largest difference of the weights, and of the logged losses relative to them."""
    weights = max(float(np.max(np.abs(x - y))) for x, y in zip(a[0], b[0], strict=True))
    losses = np.abs(np.array(a[1]) - np.array(b[1])) / np.maximum(np.abs(np.array(a[1])), 1)
    return max(weights, float(np.max(losses)))


@pytest.mark.parametrize("given", list(INPUTS))
def test_the_kit_trains_on_plain_keras_batches_in_plain_keras_order(
    given: str, references: dict
) -> None:
    reference = references[given]
    assert len(reference[1]) == 2
    for devices in (ONE, TWO):
        gap = _close(reference, _train(_kit_model(devices), given))
        assert gap <= TOLERANCE, (given, len(devices), gap)


class Slices(keras.utils.PyDataset):
    """Keras' documented pattern: each batch a slice (a view) of arrays the dataset holds."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        super().__init__()
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x) // BATCH

    def __getitem__(self, index: int):
        rows = slice(index * BATCH, (index + 1) * BATCH)
        return self.x[rows], self.y[rows]


def _arrays() -> tuple[np.ndarray, np.ndarray]:
    batches = _batches()
    return np.concatenate([b[0] for b in batches]), np.concatenate([b[1] for b in batches])


def _cycle(batches: list) -> object:
    yield from itertools.cycle(batches)


def test_the_arrays_a_generator_or_a_pydataset_yields_are_left_as_they_were() -> None:
    """On 2 replicas TensorFlow may write into the memory of the arrays Keras' adapters hand
    it: the kit copies each batch first (`workarounds.tf_generator_buffers`), so the user's
    arrays (here a PyDataset's slices of them) and a cycled generator's are unchanged, and
    the same arrays train alike run after run."""
    x, y = _arrays()
    kept = (x.copy(), y.copy())
    results = []
    for _ in range(2):
        model = _kit_model(TWO)
        model.fit(Slices(x, y), epochs=3, verbose=0)
        results.append(model.get_weights())
    assert np.array_equal(x, kept[0]) and np.array_equal(y, kept[1])
    assert all(np.array_equal(a, b) for a, b in zip(*results, strict=True))
    batches = _batches()
    model = _kit_model(TWO)
    model.fit(_cycle(batches), steps_per_epoch=BATCHES, epochs=3, verbose=0)
    fresh = _batches()
    assert all(np.array_equal(a[1], b[1]) for a, b in zip(batches, fresh, strict=True))


def _child(mode: str) -> dict:
    """`tests/ecosystem_child.py MODE`'s result, in a process of its own."""
    from tests.subproc import last_json, run_python

    code = f"import sys; sys.argv[1:] = [{mode!r}]; from tests.ecosystem_child import main; main()"
    return last_json(run_python(code))


def test_plain_keras_still_overwrites_a_generators_arrays_on_two_replicas() -> None:
    """Upstream: a generator's label arrays come back changed from a `fit` on 2 replicas
    (in a fresh process; up to `ecosystem_child.FITS` fits, since whether one does depends
    on tf.data's threads). When this fails, `workarounds.tf_generator_buffers` can go."""
    assert _child("overwrite")["overwritten_after"] is not None


def test_a_pydataset_in_worker_processes_trains_as_plain_keras() -> None:
    """`workers=2, use_multiprocessing=True`: Keras forks its pool (in a process of its own
    here: a fork of the test process, which runs other tests' threads, crashed it)."""
    gaps = _child("multiprocessing")
    assert gaps["one"] <= TOLERANCE and gaps["two"] <= TOLERANCE, gaps


def test_plain_keras_still_loses_batches_of_a_generator_under_a_strategy(
    references: dict,
) -> None:
    """Keras' symbolic build under a strategy takes a batch the generator cannot give back:
    when this fails, the kit's build from the element spec
    (`workarounds.keras_uneven_first_batch`) can go."""
    with tf.distribute.MirroredStrategy(ONE).scope():
        model = _model()
    gap = _close(
        references["generator, steps_per_epoch"], _train(model, "generator, steps_per_epoch")
    )
    assert gap > 1e-3, gap


def test_plain_keras_still_lets_a_stale_generator_stop_the_next_epochs_enqueuer() -> None:
    """A generator of Keras' PyDataset adapter that is asked for the element after its last
    batch once the next epoch began stops the new epoch's enqueuer, which then starts again
    with another shuffle: when this fails, `workarounds.keras_pydataset_epochs` can go."""
    from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter

    from keras_mirror_kit.workarounds import keras_pydataset_epochs

    def epochs(data: Batches) -> bool:
        adapter = PyDatasetAdapter(data, shuffle=True)
        adapter.on_epoch_begin()
        first = adapter._get_iterator()
        for _ in range(BATCHES):
            next(first)
        adapter.on_epoch_end()
        adapter.on_epoch_begin()  # the next epoch's run of the enqueuer
        next(first, None)  # the prefetch asks the stale generator for one more
        running = adapter.enqueuer.is_running()
        adapter.on_epoch_end()
        return running

    assert epochs(Batches(workers=2)) is False  # upstream: the new run was stopped
    owned = Batches(workers=2)
    keras_pydataset_epochs.own(owned)
    assert epochs(owned) is True  # the kit's: the new run goes on


def _two_outputs(devices: list[str]) -> keras.Model:
    @kmk.distributed(global_batch_size=16, devices=devices)
    def build() -> keras.Model:
        keras.utils.set_random_seed(5)
        inputs = {"a": keras.Input((4,), name="a"), "b": keras.Input((3,), name="b")}
        hidden = keras.layers.Dense(8, activation="relu")(
            keras.layers.Concatenate()([inputs["a"], inputs["b"]])
        )
        outputs = {
            "cls": keras.layers.Dense(3, activation="softmax", name="cls")(hidden),
            "reg": keras.layers.Dense(1, name="reg")(hidden),
        }
        model = keras.Model(inputs, outputs)
        model.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss={"cls": "sparse_categorical_crossentropy", "reg": "mse"},
            loss_weights={"cls": 1.0, "reg": 0.5},
            metrics={"cls": ["accuracy"], "reg": ["mae"]},
        )
        return model

    return build()


def test_several_outputs_validate_and_evaluate_per_output_as_one_device() -> None:
    rng = np.random.default_rng(8)

    def data(n: int) -> tuple[dict, dict]:
        x = {"a": rng.normal(size=(n, 4)).astype("float32"), "b": rng.normal(size=(n, 3))}
        y = {
            "cls": (x["a"][:, 0] > 0).astype("int32") + (x["b"][:, 0] > 1),
            "reg": x["a"][:, :1] * 2.0,
        }
        return x, y

    (x, y), (vx, vy) = data(61), data(29)  # last batches of 13 (7/6) and 13 (7/6) rows
    runs = []
    for devices in (ONE, TWO):
        model = _two_outputs(devices)
        history = model.fit(
            x, y, validation_data=(vx, vy), epochs=2, shuffle=False, verbose=0
        ).history
        runs.append((history, model.evaluate(vx, vy, return_dict=True, verbose=0)))
    (one, one_eval), (two, two_eval) = runs
    assert {"val_cls_loss", "val_reg_loss"} <= set(one), sorted(one)
    for key in one:
        assert np.allclose(one[key], two[key], rtol=1e-6, atol=1e-6), (key, one[key], two[key])
    assert set(one_eval) == set(two_eval)
    for key in one_eval:
        assert np.isclose(one_eval[key], two_eval[key], rtol=1e-6, atol=1e-6), (
            key,
            one_eval[key],
            two_eval[key],
        )
