"""File sources: folders with Keras' signatures, items read by `load`, tables; O(1) resume."""

from __future__ import annotations

import keras
import numpy as np
import pandas as pd
import pytest
import tensorflow as tf

import keras_mirror_kit as kmk
from keras_mirror_kit.callbacks.synced_checkpoint import SyncedCheckpoint
from tests import data_files
from tests.ckpt_helpers import CountBatches, StopAt

SIZE = (12, 10)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return data_files.image_folder(tmp_path_factory.mktemp("images"))


def epoch_by_path(dataset, paths):
    """{path: (image, label)} of one epoch; `paths` in the order the batches' samples come."""
    images, labels = [], []
    for x, y in dataset:
        images += list(x.numpy())
        labels += list(y.numpy())
    assert len(images) == len(paths)
    return images, labels


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {
            "label_mode": "categorical",
            "color_mode": "grayscale",
            "crop_to_aspect_ratio": True,
            "interpolation": "nearest",
        },
        {"label_mode": "binary", "class_names": ["eel", "cat"], "pad_to_aspect_ratio": True},
        {"validation_split": 0.25, "subset": "validation", "label_mode": None},
    ],
    ids=["default", "categorical-gray-crop", "binary-classes-pad", "validation-unlabelled"],
)
def test_image_folder_gives_keras_files_classes_labels_and_pixels(images, kwargs):
    common = dict(image_size=SIZE, batch_size=5, seed=7, verbose=False, **kwargs)
    keras_ds = keras.utils.image_dataset_from_directory(images, **common)
    kit_ds = kmk.image_dataset_from_directory(images, drop_remainder=False, **common)
    assert kit_ds.file_paths == keras_ds.file_paths  # same files, same (seeded) order
    assert kit_ds.class_names == keras_ds.class_names
    assert kit_ds.element_spec == keras_ds.element_spec
    assert kmk.cursor_of(kit_ds) is not None

    def samples(dataset):
        found = []
        for batch in dataset:
            x, y = batch if isinstance(batch, tuple) else (batch, None)
            for i in range(len(x)):
                found.append(
                    (x[i].numpy().tobytes(), None if y is None else y[i].numpy().tobytes())
                )
        return sorted(found)

    ours, theirs = samples(kit_ds), samples(keras_ds)
    assert len(ours) == len(kit_ds.file_paths) and ours == theirs


def _sorted_samples(dataset):
    found = []
    for x, y in dataset:
        found += [(a.tobytes(), int(b)) for a, b in zip(x.numpy(), y.numpy())]
    return sorted(found)


def test_a_validation_subset_keeps_every_sample_whatever_shuffle_says(images):
    common = dict(image_size=SIZE, batch_size=5, seed=7, verbose=False, validation_split=0.5)
    keras_ds = keras.utils.image_dataset_from_directory(images, subset="validation", **common)
    kit_ds = kmk.image_dataset_from_directory(images, subset="validation", **common)
    assert len(keras_ds.file_paths) % 5  # a partial last batch
    assert _sorted_samples(kit_ds) == _sorted_samples(keras_ds)
    # Training keeps every sample too by default, as Keras' does; drop_remainder=True drops
    # its partial last batch.
    train = kmk.image_dataset_from_directory(images, subset="training", **common)
    assert len(train.file_paths) % 5
    assert sum(len(y) for _, y in train) == len(train.file_paths)
    keras_train = keras.utils.image_dataset_from_directory(images, subset="training", **common)
    assert _sorted_samples(train) == _sorted_samples(keras_train)
    dropped = kmk.image_dataset_from_directory(
        images, subset="training", drop_remainder=True, **common
    )
    assert sum(len(y) for _, y in dropped) == len(train.file_paths) // 5 * 5


def test_augment_changes_the_training_subset_only(images):
    common = dict(image_size=SIZE, batch_size=4, seed=7, verbose=False, validation_split=0.5)
    keras_train, keras_val = keras.utils.image_dataset_from_directory(
        images, subset="both", **common
    )
    flip = keras.layers.RandomFlip("horizontal_and_vertical", seed=1)
    train, val = kmk.image_dataset_from_directory(
        images, subset="both", augment=flip, drop_remainder=False, **common
    )
    # The validation subset is Keras' own: same images, labels and (unshuffled) order.
    ours = [(x.numpy(), y.numpy()) for x, y in val]
    theirs = [(x.numpy(), y.numpy()) for x, y in keras_val]
    assert len(ours) == len(theirs)
    for (x1, y1), (x2, y2) in zip(ours, theirs):
        np.testing.assert_array_equal(x1, x2)
        np.testing.assert_array_equal(y1, y2)
    # The training subset is flipped: the same labels, other pixels for some images.
    assert sorted(int(v) for _, y in train for v in y) == sorted(
        int(v) for _, y in keras_train for v in y
    )
    assert _sorted_samples(train) != _sorted_samples(keras_train)


def test_then_chains_two_functions_and_keys_each_seeded_part():
    from keras_mirror_kit.data.preprocess import then

    double = then(lambda x: x + 1, lambda x: x * 2)
    assert int(double(tf.constant(3))) == 8
    seeds = []

    def seeded(x, seed):
        seeds.append(seed.numpy().tolist())
        return x

    chained = then(seeded, seeded)
    assert int(chained(tf.constant(1), seed=tf.constant([4, 5], tf.int64))) == 1
    assert len(seeds) == 2 and seeds[0] != seeds[1]  # a key of its own for each part
    with pytest.raises(TypeError, match="Received: second=3"):
        then(double, 3)


@pytest.mark.parametrize(
    ("kwargs", "exc", "fragment"),
    [
        ({"subset": "validation", "augment": abs}, ValueError, "training subset only"),
        ({"subset": "validation", "drop_remainder": True}, ValueError, "drop_remainder=True"),
        ({"subset": "both", "augment": "flip"}, TypeError, "Received: augment='flip'"),
        ({"augment": abs, "preprocess_on": "replica"}, ValueError, "preprocess_on='replica'"),
    ],
)
def test_augment_and_drop_remainder_of_a_validation_subset_are_refused(
    images, kwargs, exc, fragment
):
    with pytest.raises(exc, match=fragment):
        kmk.image_dataset_from_directory(
            images, verbose=False, seed=1, validation_split=0.5, **kwargs
        )


def test_a_preprocess_of_features_and_labels_is_refused_when_the_dataset_is_built(images):
    x, y = np.zeros((8, 4, 4, 3), "float32"), np.zeros(8, "int32")
    with pytest.raises(TypeError, match=r"\(features, labels\).*preprocess=data_augmentation"):
        kmk.make_dataset(x, y, 4, seed=0, preprocess=lambda x, y: (x, y))
    with pytest.raises(TypeError, match="Received: augment=.*lambda"):
        kmk.image_dataset_from_directory(
            images, verbose=False, seed=1, augment=lambda image, label: (image, label)
        )
    # What Dataset.map-free code passes stays accepted: layers, x -> x, (x, seed), *args.
    accepted = (keras.layers.RandomFlip(seed=1), lambda x: x, lambda x, seed: x, lambda *b: b[0])
    for function in accepted:
        kmk.make_dataset(x, y, 4, seed=0, preprocess=function)


@pytest.mark.slow
def test_text_folder_and_subset_both_match_keras(tmp_path):
    root = data_files.text_folder(tmp_path)
    common = dict(batch_size=4, seed=3, validation_split=0.3, subset="both", verbose=False)
    keras_sets = keras.utils.text_dataset_from_directory(root, max_length=9, **common)
    kit_sets = kmk.text_dataset_from_directory(root, max_length=9, drop_remainder=False, **common)
    assert len(kit_sets) == 2
    for kit_ds, keras_ds in zip(kit_sets, keras_sets):
        assert kit_ds.class_names == keras_ds.class_names

        def pairs(ds):
            return sorted(
                (t, int(v)) for x, y in ds for t, v in zip(x.numpy().tolist(), y.numpy())
            )

        assert pairs(kit_ds) == pairs(keras_ds)
    # The validation part is not shuffled (as Keras'); the training part is, per epoch.
    train = kit_sets[0]
    first, second = [list(y.numpy()) for _, y in train], [list(y.numpy()) for _, y in train]
    assert first != second or len(train.file_paths) < 4


@pytest.mark.parametrize(
    ("kwargs", "exc", "fragment"),
    [
        ({"batch_size": None}, TypeError, "Received: batch_size=None"),
        ({"format": "grain"}, ValueError, "Received: format='grain'"),
        ({"color_mode": "cmyk"}, ValueError, "color_mode='cmyk'"),
        ({"validation_split": 0.2, "subset": "training"}, ValueError, "seed"),
        ({"label_mode": "binary"}, ValueError, "exactly 2 classes"),
        ({"crop_to_aspect_ratio": True, "pad_to_aspect_ratio": True}, ValueError, "Only one"),
    ],
)
def test_image_folder_bad_arguments(images, kwargs, exc, fragment):
    with pytest.raises(exc, match=fragment):
        kmk.image_dataset_from_directory(images, verbose=False, **kwargs)


def test_items_read_by_load_shuffle_per_epoch_and_resume_at_any_batch():
    items = [f"item-{i:02d}" for i in range(50)]

    def load(item):
        return tf.strings.to_number(tf.strings.substr(item, 5, 2), tf.int64)

    ds = kmk.make_dataset(items, None, 8, seed=4, load=load, drop_remainder=False)
    assert int(ds.cardinality()) == 7

    def ids(dataset):
        return [b.numpy().tolist() for b in dataset]

    epoch0, epoch1 = ids(ds), ids(ds)
    assert sorted(sum(epoch0, [])) == list(range(50)) == sorted(sum(epoch1, []))
    assert epoch0 != epoch1 and [len(b) for b in epoch0] == [8] * 6 + [2]
    again = kmk.make_dataset(items, None, 8, seed=4, load=load, drop_remainder=False)
    kmk.cursor_of(again).set(epoch=1, skip_batches=3)
    resumed = ids(again)
    # The remaining batches exactly (the short last one too), then the wrap-around.
    assert resumed[:4] == epoch1[3:] and resumed[4:] == epoch1[:3]


def test_npy_files_through_numpy_function(tmp_path):
    paths = []
    for i in range(6):
        np.save(tmp_path / f"{i}.npy", np.full((2, 3), i, "float32"))
        paths.append(str(tmp_path / f"{i}.npy"))

    def load(path):
        array = tf.numpy_function(lambda p: np.load(p.decode()), [path], tf.float32)
        return tf.ensure_shape(array, (2, 3))

    ds = kmk.make_dataset(paths, np.arange(6), 3, shuffle=False, load=load)
    x, y = next(iter(ds))
    assert x.shape == (3, 2, 3) and x.numpy()[:, 0, 0].tolist() == [0, 1, 2] == y.numpy().tolist()


def test_a_resumed_epoch_loads_nothing_before_its_first_batch():
    loaded: list[int] = []

    def record(index):
        loaded.append(int(index))
        return np.int64(index)

    def load(item):
        value = tf.numpy_function(record, [item], tf.int64, stateful=True)
        return tf.reshape(value, [])

    ds = kmk.make_dataset(np.arange(80), None, 4, seed=1, load=load)
    full = [b.numpy().tolist() for b in ds]  # epoch 0
    options = tf.data.Options()
    options.threading.private_threadpool_size = 1  # map calls in input order, one by one
    for skip in (2, 10, 18):
        loaded.clear()
        kmk.cursor_of(ds).set(epoch=0, skip_batches=skip)
        assert next(iter(ds.with_options(options))).numpy().tolist() == full[skip]
        remaining, before = sum(full[skip:], []), set(sum(full[:skip], []))
        assert loaded[: min(len(loaded), len(remaining))] == remaining[: len(loaded)]
        assert all(place >= len(remaining) for place, i in enumerate(loaded) if i in before)


def test_tables_go_in_as_they_are():
    frame = pd.DataFrame(
        {
            "age": np.arange(12),
            "thal": ["fixed", "normal", "reversible"] * 4,
            "chol": np.linspace(0, 1, 12, dtype="float32"),
        }
    )
    target = frame.pop("age") % 2
    ds = kmk.make_dataset(frame, target, 4, shuffle=False)
    x, y = next(iter(ds))
    assert set(x) == {"thal", "chol"} and x["thal"].dtype == tf.string
    assert x["thal"].numpy().tolist() == [b"fixed", b"normal", b"reversible", b"fixed"]
    assert y.numpy().tolist() == [0, 1, 0, 1]
    columns = kmk.make_dataset({"a": [1, 2, 3], "s": ["x", "y", "z"]}, batch_size=3, shuffle=False)
    assert next(iter(columns))["s"].numpy().tolist() == [b"x", b"y", b"z"]
    with pytest.raises(TypeError, match="'bad' holds Python objects"):
        kmk.make_dataset(pd.DataFrame({"bad": [1, None, "x"]}), batch_size=2)


def small_model(seed=3):
    @kmk.distributed(global_batch_size=8)
    def factory():
        keras.utils.set_random_seed(seed)
        model = keras.Sequential(
            [
                keras.Input((*SIZE, 3)),
                keras.layers.Rescaling(1 / 255),
                keras.layers.Flatten(),
                keras.layers.Dense(3),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return model

    return factory()


def augment():
    return keras.Sequential(
        [keras.layers.RandomFlip("horizontal"), keras.layers.RandomRotation(0.2, seed=1)]
    )


@pytest.mark.slow
def test_a_folder_job_without_a_seed_resumes_in_its_own_order(images, tmp_path):
    """No seed: files indexed in sorted order, the drawn seed saved and adopted on resume.

    (With a seed, tests/test_data_kill_trials.py kills and resumes folder jobs exactly.)
    """

    def folder():
        return kmk.image_dataset_from_directory(
            images, image_size=SIZE, batch_size=8, verbose=False, preprocess=augment()
        )

    model, ds = small_model(), folder()
    assert ds.file_paths == sorted(ds.file_paths)
    crashed_seed = kmk.cursor_of(ds).seed
    with pytest.raises(KeyboardInterrupt):
        model.fit(
            ds,
            epochs=2,
            verbose=0,
            callbacks=[SyncedCheckpoint(tmp_path / "run", 2, dataset=ds), StopAt(1, 0)],
        )
    fresh, ds = small_model(seed=99), folder()
    assert kmk.cursor_of(ds).seed != crashed_seed
    counter = CountBatches()
    fresh.fit(
        ds,
        epochs=2,
        verbose=0,
        callbacks=[SyncedCheckpoint(tmp_path / "run", 2, dataset=ds), counter],
    )
    assert counter.batches == 2  # 3 batches per epoch; resumed after batch 1 of epoch 1
    assert kmk.cursor_of(ds).seed == crashed_seed  # the interrupted run's order


def keras_loader_is_no_kit_dataset(images, tmp_path):
    keras_ds = keras.utils.image_dataset_from_directory(images, verbose=False)
    kmk.SyncedCheckpoint(tmp_path / "ckpt", dataset=keras_ds)


def truncated_record_file(tmp_path):
    shard = data_files.record_shards(tmp_path / "records", counts=(3,))[0]
    broken = tmp_path / "broken.tfrecord"
    broken.write_bytes(open(shard, "rb").read()[:-7])
    kmk.tfrecord_dataset([str(broken)], data_files.parse, 4)


def part_for_another_layout(images, tmp_path):
    from keras_mirror_kit.data.sharding import WorkerSlice, record_part

    model = small_model()
    ds = kmk.image_dataset_from_directory(images, image_size=SIZE, batch_size=8, seed=1)
    # As if built on worker 1 of 2 that counted 2 replicas per worker (this model: 2 in all).
    record_part(kmk.cursor_of(ds), WorkerSlice(rank=1, num_workers=2, replicas_per_worker=2))
    model.fit(ds, epochs=1, verbose=0)


# Misuse of the file sources: docs/reliability.md's "Files, tables and records" table.
FILE_SOURCE_ERRORS = {
    "image folder without a batch size": (
        TypeError,
        lambda images, tmp: kmk.image_dataset_from_directory(images, batch_size=None),
    ),
    "image folder with format='grain'": (
        ValueError,
        lambda images, tmp: kmk.image_dataset_from_directory(images, format="grain"),
    ),
    "stateful random preprocess with strict=True": (
        ValueError,
        lambda images, tmp: kmk.make_dataset(
            np.zeros((8, 2, 2, 3), "uint8"),
            None,
            4,
            seed=0,
            preprocess=tf.image.random_flip_left_right,
            strict=True,
        ),
    ),
    "a preprocess taking a seed placed on the replicas": (
        ValueError,
        lambda images, tmp: kmk.make_dataset(
            np.zeros((8, 2)), None, 4, preprocess=lambda x, seed: x, preprocess_on="replica"
        ),
    ),
    "table column of mixed objects": (
        TypeError,
        lambda images, tmp: kmk.make_dataset(pd.DataFrame({"thal": ["fixed", None, 3]}), None, 2),
    ),
    "truncated TFRecord file": (ValueError, lambda images, tmp: truncated_record_file(tmp)),
    "TFRecord pattern that matches nothing": (
        ValueError,
        lambda images, tmp: kmk.tfrecord_dataset(
            str(tmp / "none-*.tfrecord"), data_files.parse, 4
        ),
    ),
    "a worker's part computed for another layout than the model's": (
        ValueError,
        part_for_another_layout,
    ),
    "a Keras loader as SyncedCheckpoint(dataset=)": (
        ValueError,
        lambda images, tmp: keras_loader_is_no_kit_dataset(images, tmp),
    ),
}


def test_file_source_misuse_gives_the_documented_errors(images, tmp_path):
    import re

    from tests.subproc import REPO

    doc = (REPO / "docs" / "reliability.md").read_text()
    section = doc.split("## Files, tables and records", 1)[1].split("\n## ", 1)[0]
    table = {
        m.group(1).strip(): m.group(2).strip()
        for m in re.finditer(r"^\| ([^|]+) \| ([^|]+)", section, re.M)
    }
    for name, (error, trigger) in FILE_SOURCE_ERRORS.items():
        with pytest.raises(error) as raised:
            trigger(images, tmp_path)
        assert type(raised.value) is error, name
        row = table.get(name)
        assert row is not None, f"docs/reliability.md lacks: {name}"
        assert row.startswith(f"{error.__name__}: "), (name, row)
        shown = str(raised.value).replace(str(tmp_path), "<dir>").replace(str(images), "<dir>")
        assert row[len(error.__name__) + 2 :][:60] == shown[:60], (name, row, shown)


# --------------------------------------------------------------------------------------
# kmk.random_crop_flip: cropped while the folder's files are decoded, keyed, resumable.
# --------------------------------------------------------------------------------------


def _by_label(dataset):
    return [(x.numpy(), y.numpy()) for x, y in dataset]


def test_random_crop_flip_crops_while_decoding_the_training_subset_only(images):
    common = dict(image_size=SIZE, batch_size=4, seed=7, verbose=False, validation_split=0.5)
    crop = kmk.random_crop_flip(crop_fraction=(0.5, 0.9), flip="horizontal_and_vertical")
    train, val = kmk.image_dataset_from_directory(images, subset="both", augment=crop, **common)
    _, keras_val = keras.utils.image_dataset_from_directory(images, subset="both", **common)
    assert train.element_spec == val.element_spec  # the training images stay image_size
    for (x1, y1), (x2, y2) in zip(_by_label(val), _by_label(keras_val), strict=True):
        np.testing.assert_array_equal(x1, x2)  # validation: Keras' own images
        np.testing.assert_array_equal(y1, y2)
    # The same seed crops alike (the header sizes or each file's own header: alike too);
    # each epoch anew; a resumed iteration as the uninterrupted one.
    again = kmk.image_dataset_from_directory(
        images, subset="training", augment=crop, max_image_pixels=None, **common
    )
    epoch0, epoch1 = _by_label(train), _by_label(train)
    for (x1, y1), (x2, y2) in zip(epoch0, _by_label(again), strict=True):
        np.testing.assert_array_equal(x1, x2)
        np.testing.assert_array_equal(y1, y2)
    assert not all(np.array_equal(a[0], b[0]) for a, b in zip(epoch0, epoch1))
    kmk.cursor_of(again).set(epoch=1, skip_batches=1)
    np.testing.assert_array_equal(next(iter(again))[0].numpy(), epoch1[1][0])


@pytest.mark.parametrize("formats", ["jpeg and png", "jpeg only", "headers unread"])
def test_random_crop_flip_of_the_whole_image_is_keras_image_or_its_mirror(
    images, tmp_path, formats
):
    """crop_fraction=1: the window is the file, flipped or not (each decode path)."""
    import shutil

    if formats == "jpeg only":
        for path in images.rglob("*.jpg"):
            (tmp_path / path.parent.name).mkdir(exist_ok=True)
            shutil.copy(path, tmp_path / path.parent.name / path.name)
        images = tmp_path
    extra = {"max_image_pixels": None} if formats == "headers unread" else {}
    common = dict(image_size=(16, 14), batch_size=6, seed=3, verbose=False, shuffle=False)
    keras_ds = keras.utils.image_dataset_from_directory(images, **common)
    kit_ds = kmk.image_dataset_from_directory(
        images, augment=kmk.random_crop_flip(1.0), drop_remainder=False, **common, **extra
    )
    flipped = 0
    for (x1, _), (x2, _) in zip(_by_label(kit_ds), _by_label(keras_ds), strict=True):
        for ours, theirs in zip(x1, x2, strict=True):
            if np.allclose(ours, theirs, atol=1e-3):
                continue
            np.testing.assert_allclose(ours, theirs[:, ::-1], atol=1e-3)
            flipped += 1
    assert 0 < flipped < len(kit_ds.file_paths)


def test_random_crop_flip_is_a_seeded_function_of_a_batch_anywhere_else():
    x = np.arange(2 * 5 * 6 * 1, dtype="uint8").reshape(2, 5, 6, 1).repeat(8, axis=0)
    whole = kmk.random_crop_flip(1.0, flip="horizontal")
    seed = tf.constant([3, 4], tf.int64)
    out = whole(x, seed=seed).numpy()
    assert out.dtype == np.float32 and out.shape == x.shape
    mirrored = [not np.array_equal(o, i) for o, i in zip(out, x)]
    for o, i, m in zip(out, x, mirrored):
        np.testing.assert_allclose(o, i[:, ::-1] if m else i, atol=1e-4)
    assert 0 < sum(mirrored) < len(x)
    np.testing.assert_array_equal(whole(x, seed=seed).numpy(), out)  # keyed, not stateful
    half = kmk.random_crop_flip(0.5, flip=None)(x[0], seed=seed).numpy()
    assert half.shape == x[0].shape
    ds = kmk.make_dataset(x, None, 4, seed=0, preprocess=kmk.random_crop_flip(0.6))
    assert next(iter(ds)).shape == (4, 5, 6, 1)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"crop_fraction": 0}, "crop_fraction=0"),
        ({"crop_fraction": 1.5}, "crop_fraction=1.5"),
        ({"crop_fraction": (0.9, 0.5)}, r"crop_fraction=\(0.9, 0.5\)"),
        ({"crop_fraction": "big"}, "crop_fraction='big'"),
        ({"flip": "sideways"}, "flip='sideways'"),
    ],
)
def test_random_crop_flip_bad_arguments(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        kmk.random_crop_flip(**kwargs)


def test_image_headers_are_checked_in_threads_in_order_when_reading_is_slow(
    images, monkeypatch, tmp_path
):
    from keras_mirror_kit.data import image_headers

    paths = sorted(str(p) for p in images.rglob("*") if p.suffix in (".jpg", ".png"))
    serial = image_headers.check_image_files(paths, 10**6)
    monkeypatch.setattr(image_headers, "_SLOW_READ_S", 0.0)  # every read counts as slow
    monkeypatch.setattr(image_headers, "_FILES_PER_TASK", 2)
    assert image_headers.check_image_files(paths, 10**6) == serial
    bad = [tmp_path / "a.jpg", tmp_path / "b.jpg"]
    bad[0].write_bytes(b"not an image")
    bad[1].write_bytes(b"\x89PNG nor this")
    with pytest.raises(image_headers.ImageHeaderError, match="a.jpg"):
        image_headers.check_image_files([*paths, *map(str, bad)], 10**6)
