"""Exact resume through the pipelines users write on a kit dataset (issue 34).

`fit(train_ds.map(f).prefetch(n))`: the kit dataset is found upstream of what `fit` got,
with `SyncedCheckpoint(dataset=train_ds)` or without `dataset=`, and a run stopped
mid-epoch resumes to the uninterrupted run's weights. Steps that cannot resume exactly
(`.cache()`, an unordered map) are refused with `dataset=`, and resume at epoch boundaries
without it; a map that draws from shared random state is warned about (`strict`: refused).
The same 2-replica job as tests/test_synced_checkpoint.py: 6 batches an epoch. The
uninterrupted run of the mapped pipeline (`mapped_reference`) and the model that resumes
each crashed one (`resumer`, tests/conftest.py, also for the cache) are made once for the
module; so is the model of the runs from scratch (`fresh`, tests/conftest.py: one
`build("sgd")`, set back to the state it was built in before each run, from which it
trains exactly as a new one would): one trace for the reference, crashed and other runs.
"""

from __future__ import annotations

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_mirror_kit.callbacks.synced_checkpoint import SyncedCheckpoint
from tests.ckpt_helpers import CountBatches, StopAt, build, data, dataset, max_diff

EPOCHS = 3


def double(x, y):
    return x * 2.0 - 0.5, y


def mapped(ds):
    return ds.map(double, num_parallel_calls=tf.data.AUTOTUNE).prefetch(2)


def run(directory, given, model, crash_at=None):
    """One fit() of the mapped pipeline; `given`: what `dataset=` is ("none", "kit", ...)."""
    ds = dataset()
    if given == "prefetched":  # dataset= a kit dataset followed by a prefetch
        ds = ds.prefetch(1)
    options = {} if given == "none" else {"dataset": ds}
    checkpoint, counter = SyncedCheckpoint(directory, save_freq=2, **options), CountBatches()
    callbacks = [checkpoint, counter] + ([StopAt(*crash_at)] if crash_at else [])
    model.fit(mapped(ds), epochs=EPOCHS, verbose=0, callbacks=callbacks)
    return model, checkpoint, counter


@pytest.fixture(scope="module")
def mapped_reference(tmp_path_factory, fresh):
    """The weights of an uninterrupted fit() of the mapped pipeline (checkpointed)."""
    model, _, _ = run(tmp_path_factory.mktemp("reference") / "ckpt", "kit", fresh())
    return model.get_weights()


@pytest.mark.slow
@pytest.mark.parametrize("given", ["none", "kit", "prefetched"])
def test_a_map_and_prefetch_after_the_kit_dataset_resume_mid_epoch_exactly(
    given, tmp_path, mapped_reference, fresh, resumer
):
    with pytest.raises(KeyboardInterrupt):  # newest checkpoint: epoch 1, batch 4
        run(tmp_path / "run", given, fresh(), crash_at=(1, 3))
    model, checkpoint, counter = run(tmp_path / "run", given, resumer)
    assert (checkpoint.last_restored.meta["epoch"], checkpoint.last_restored.meta["step"]) == (
        1,
        4,
    )
    assert counter.batches == 2 + 6  # the rest of epoch 1, then epoch 2
    assert int(model.optimizer.iterations.numpy()) == EPOCHS * 6
    assert max_diff(mapped_reference, model.get_weights()) <= 1e-6


def test_cache_after_the_given_dataset_is_refused_before_any_step_naming_it(tmp_path):
    ds, counter = dataset(), CountBatches()
    with pytest.raises(
        ValueError, match=r"cache\(\) replays .*drop cache\(\).*No step"
    ) as refused:
        build("sgd").fit(
            ds.map(double).cache(),
            epochs=2,
            verbose=0,
            callbacks=[SyncedCheckpoint(tmp_path, dataset=ds), counter],
        )
    assert "kit dataset -> map -> cache" in str(refused.value)
    assert counter.batches == 0
    with pytest.raises(ValueError, match=r"followed by maps and prefetches.*cache\(\) replays"):
        SyncedCheckpoint(tmp_path, dataset=ds.cache())


def test_an_unordered_map_after_the_given_dataset_is_refused_before_any_step(tmp_path):
    ds, counter = dataset(), CountBatches()
    unordered = ds.map(double, num_parallel_calls=2, deterministic=False)
    with pytest.raises(ValueError, match=r"parallel_map\(\.\.\., deterministic=False\)"):
        build("sgd").fit(
            unordered,
            epochs=2,
            verbose=0,
            callbacks=[SyncedCheckpoint(tmp_path, dataset=ds), counter],
        )
    assert counter.batches == 0


@pytest.mark.slow
def test_cache_without_dataset_resumes_at_the_epoch_boundary_and_says_why(
    tmp_path, caplog, fresh, resumer
):
    def cached(directory, model, crash_at=None):
        counter = CountBatches()
        callbacks = [SyncedCheckpoint(directory, save_freq=2), counter]
        model.fit(
            dataset().cache(),
            epochs=EPOCHS,
            verbose=0,
            callbacks=callbacks + ([StopAt(*crash_at)] if crash_at else []),
        )
        return counter

    with pytest.raises(KeyboardInterrupt):
        cached(tmp_path, fresh(), crash_at=(1, 3))
    with caplog.at_level(logging.INFO, logger="keras_mirror_kit"):
        counter = cached(tmp_path, resumer)
    assert counter.batches == 2 * 6  # epoch 1 again from its start, then epoch 2
    assert "resumes at epoch boundaries: fit() trains on cache after a kit dataset" in caplog.text


def noisy(x, y):
    return x + tf.random.uniform(tf.shape(x)), y


_GENERATORS: list[keras.random.SeedGenerator] = []  # made at the first call, not on import


def keras_noisy(x, y):
    if not _GENERATORS:
        _GENERATORS.append(keras.random.SeedGenerator(1))
    return x + keras.random.normal(tf.shape(x), seed=_GENERATORS[0]), y


@pytest.mark.parametrize("function, op", [(noisy, "RandomUniform"), (keras_noisy, "Assign")])
def test_a_map_with_shared_random_state_is_warned_about_or_refused_with_strict(
    function, op, tmp_path, caplog, fresh
):
    ds, model = dataset(), fresh()
    with caplog.at_level(logging.WARNING, logger="keras_mirror_kit"):
        model.fit(
            ds.map(function), epochs=1, verbose=0, callbacks=[SyncedCheckpoint(tmp_path / "a")]
        )
    warned = [r.getMessage() for r in caplog.records if "after the kit dataset" in r.getMessage()]
    assert len(warned) == 1 and op in warned[0] and function.__name__ in warned[0]
    assert "make_dataset(preprocess=...)" in warned[0]

    counter = CountBatches()
    with pytest.raises(ValueError, match=rf"\.map\({function.__name__}\).*strict=True"):
        model.fit(
            ds.map(function),
            epochs=1,
            verbose=0,
            callbacks=[SyncedCheckpoint(tmp_path / "b", strict=True), counter],
        )
    assert counter.batches == 0


# -- arrays as Keras takes them: fit(x, y, batch_size, validation_split, shuffle) ---------


def fit_arrays(directory, model, shuffle=True, crash_at=None, checkpoint=True, epochs=EPOCHS):
    """72 training samples (4 batches of 16, one of 8) and Keras' last 24 to validate."""
    (x, y), counter = data(), CountBatches()
    synced = SyncedCheckpoint(directory, save_freq=2) if checkpoint else None
    callbacks = [
        counter,
        *([synced] if synced else []),
        *([StopAt(*crash_at)] if crash_at else []),
    ]
    history = model.fit(
        x,
        y,
        batch_size=16,
        validation_split=0.25,
        shuffle=shuffle,
        epochs=epochs,
        verbose=0,
        callbacks=callbacks,
    )
    return model, history, counter, synced


@pytest.mark.slow
def test_arrays_with_validation_split_and_shuffle_resume_mid_epoch_exactly(
    tmp_path, fresh, resumer
):
    reference, reference_history, counted, _ = fit_arrays(tmp_path / "reference", fresh())
    assert counted.batches == EPOCHS * 5
    reference_weights = reference.get_weights()  # before `fresh` is set back for the crash
    with pytest.raises(KeyboardInterrupt):
        fit_arrays(tmp_path / "run", fresh(), crash_at=(1, 2))
    model, history, counter, checkpoint = fit_arrays(tmp_path / "run", resumer)
    restored = checkpoint.last_restored.meta
    assert restored["epoch"] == 1 and restored["step"] > 0  # mid-epoch, not a boundary
    assert counter.batches == (5 - restored["step"]) + 5
    assert max_diff(reference_weights, model.get_weights()) <= 1e-6
    assert history.history["val_loss"][-1] == pytest.approx(
        reference_history.history["val_loss"][-1], abs=1e-6
    )


@pytest.mark.slow
def test_arrays_through_the_kit_train_and_validate_as_keras_own_fit(tmp_path, fresh):
    # shuffle=False: the kit's order is the arrays' order, Keras' too, so the runs agree.
    kit, kit_history, _, _ = fit_arrays(tmp_path / "kit", fresh(), shuffle=False, epochs=2)
    kit_weights = kit.get_weights()  # before `fresh` is set back for Keras' own fit
    keras_own, keras_history, _, _ = fit_arrays(
        tmp_path / "k", fresh(), shuffle=False, checkpoint=False, epochs=2
    )
    assert max_diff(kit_weights, keras_own.get_weights()) <= 1e-6
    np.testing.assert_allclose(
        kit_history.history["val_loss"], keras_history.history["val_loss"], atol=1e-6
    )


@pytest.mark.parametrize(
    "steps, named",
    [
        (lambda ds: ds.shuffle(3), "shuffle"),
        (lambda ds: ds.repeat(), "repeat"),
        (lambda ds: ds.filter(lambda x, y: True), "filter"),
    ],
)
def test_steps_that_reorder_or_repeat_the_given_dataset_are_refused(steps, named, tmp_path):
    ds, counter = dataset(), CountBatches()
    with pytest.raises(ValueError, match=rf"{named} after it.*No step was trained"):
        build("sgd").fit(
            steps(ds),
            epochs=1,
            steps_per_epoch=6,
            verbose=0,
            callbacks=[SyncedCheckpoint(tmp_path, dataset=ds), counter],
        )
    assert counter.batches == 0


def test_a_sequential_map_under_unordered_options_keeps_its_order(tmp_path):
    options = tf.data.Options()
    options.deterministic = False
    ds = dataset()
    pipeline = ds.map(double).with_options(options)
    from keras_mirror_kit.fit_inputs import kit_pipeline

    found = kit_pipeline(pipeline)
    assert found.exact and found.breaks is None
    unordered = kit_pipeline(ds.map(double, num_parallel_calls=2).with_options(options))
    assert not unordered.exact and "deterministic=False" in unordered.breaks


def _given(**arguments):
    from keras_mirror_kit.model_record import distribution_of

    return arguments, distribution_of(build("sgd"))  # 2 replicas, global batch 16


@pytest.mark.parametrize(
    "arguments",
    [
        {"x": [data()[0], data()[0]], "y": data()[1]},  # two inputs
        {"x": data()[0], "y": [data()[1], data()[1]]},  # two outputs
        {"x": data()[0], "y": data()[1], "sample_weight": np.ones(96)},
        {"x": data()[0], "y": data()[1], "shuffle": "batch"},
        {"x": data()[0], "y": data()[1], "steps_per_epoch": 3},
        {"x": data()[0][:1], "y": data()[1][:1], "validation_split": 0.5},  # Keras refuses
    ],
    ids=["inputs", "outputs", "sample_weight", "batch-shuffle", "steps", "too-few"],
)
def test_arrays_the_kit_cannot_stand_in_for_are_left_to_keras(arguments):
    from keras_mirror_kit.fit_inputs import arrays_as_dataset

    given, dist = _given(**arguments)
    before = dict(given)
    assert not arrays_as_dataset(given, dist)
    assert given == before


def test_arrays_become_a_kit_dataset_of_keras_split_in_floatx():
    from keras_mirror_kit import cursor_of
    from keras_mirror_kit.fit_inputs import arrays_as_dataset

    x, y = data()
    given, dist = _given(x=x.astype("float64"), y=None, validation_split=0.25, batch_size=8)
    assert arrays_as_dataset(given, dist)
    assert set(given) == {"x", "validation_data", "validation_batch_size", "shuffle"}
    (x_val,) = given["validation_data"]
    np.testing.assert_array_equal(x_val, x[72:].astype("float32"))  # the last quarter
    assert cursor_of(given["x"]).num_batches == 9 and not cursor_of(given["x"]).seed_given
    assert given["x"].element_spec.dtype == tf.float32 and given["validation_batch_size"] == 8


def test_a_list_of_strings_is_one_text_input_as_keras_hub_reads_it():
    from keras_mirror_kit import cursor_of
    from keras_mirror_kit.fit_inputs import arrays_as_dataset, is_array_data

    texts = [f"sample {i}" for i in range(40)]
    assert is_array_data(texts) and is_array_data([b"a", b"b"])
    given, dist = _given(x=texts, y=[i % 2 for i in range(40)], validation_split=0.25)
    assert arrays_as_dataset(given, dist)
    assert given["validation_data"][0].tolist() == texts[30:]  # Keras' cut, in order
    assert cursor_of(given["x"]).num_batches == 2  # 30 samples at the global batch of 16
    x_spec, y_spec = given["x"].element_spec
    assert x_spec.dtype == tf.string and y_spec.dtype.is_integer
