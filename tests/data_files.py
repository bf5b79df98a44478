"""Little image and text folders and TFRecord shards for the data-source tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tensorflow as tf

CLASSES = ("cat", "dog", "eel")


def image_folder(root: Path, per_class: int = 8, seed: int = 0, sizes=(8, 21)) -> Path:
    """`root/<class>/<i>.jpg|png`: images of mixed sizes whose pixels depend on the class."""
    rng = np.random.default_rng(seed)
    for label, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            height, width = (int(v) for v in rng.integers(sizes[0], sizes[1], 2))
            image = rng.integers(0, 120, (height, width, 3)) + 60 * label
            image = tf.constant(np.clip(image, 0, 255).astype("uint8"))
            if i % 2:
                data = tf.io.encode_png(image)
                path = root / name / f"{i:03d}.png"
            else:
                data = tf.io.encode_jpeg(image, quality=90)
                path = root / name / f"{i:03d}.jpg"
            path.write_bytes(data.numpy())
    (root / CLASSES[0] / "notes.md").write_text("not an image")  # skipped, as by Keras
    return root


def text_folder(root: Path, per_class: int = 6) -> Path:
    """`root/<class>/<i>.txt`: short texts of different lengths."""
    for name in CLASSES:
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            (root / name / f"{i:02d}.txt").write_text(f"{name} says {'ha ' * i}.")
    return root


def example(image: np.ndarray, label: int, index: int) -> bytes:
    """One `tf.train.Example`: a PNG-encoded image, its label and its index."""
    features = {
        "image": tf.train.Feature(
            bytes_list=tf.train.BytesList(value=[tf.io.encode_png(image).numpy()])
        ),
        "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
        "index": tf.train.Feature(int64_list=tf.train.Int64List(value=[index])),
    }
    return tf.train.Example(features=tf.train.Features(feature=features)).SerializeToString()


def record_shards(root: Path, counts=(10, 7, 13), size: int = 8, seed: int = 0) -> list[str]:
    """TFRecord shards holding `counts` examples (indices numbered across the shards)."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    paths, index = [], 0
    for shard, count in enumerate(counts):
        path = root / f"part-{shard:03d}.tfrecord"
        with tf.io.TFRecordWriter(str(path)) as writer:
            for _ in range(count):
                label = index % len(CLASSES)
                image = rng.integers(0, 120, (size, size, 3)) + 60 * label
                writer.write(example(image.astype("uint8"), label, index))
                index += 1
        paths.append(str(path))
    return paths


def parse(record: tf.Tensor) -> dict[str, tf.Tensor]:
    """Parses one `example`: the decoded image (uint8), label and index."""
    spec = {
        "image": tf.io.FixedLenFeature([], tf.string),
        "label": tf.io.FixedLenFeature([], tf.int64),
        "index": tf.io.FixedLenFeature([], tf.int64),
    }
    parsed = tf.io.parse_single_example(record, spec)
    parsed["image"] = tf.io.decode_png(parsed["image"], channels=3)
    return parsed
