"""Image folders and TFRecords: the kit's loaders against Keras' own, and resume latency.

Three measurements, on folders of JPEG files this script writes into a temporary
directory (or `--dir`; 10 class subdirectories; smooth gradients with noise, quality 90):

1. **Images per second**, steady state (`--epochs` epochs per round of the same dataset
   objects, `--rounds` rounds, the pipelines' order rotating and reversing from round to
   round), batch 64, seed 1, at 224x224 from `--files` JPEGs of 224 to 288 pixels a side
   (about 256) and at 48x48 from `--files` JPEGs of 40 to 90 pixels, of three pipelines:
   `kmk.image_dataset_from_directory`, `keras.utils.image_dataset_from_directory`, and the
   tf.data pipeline an expert writes (`list_files`, a parallel `map` of read, decode and
   resize with `num_parallel_calls=AUTOTUNE` and `deterministic=False`, `batch`,
   `prefetch(AUTOTUNE)`). And the same three with random crop and flip: the kit's
   `augment=kmk.random_crop_flip(crop_fraction=s / S)`; Keras' loader at S x S (S = s /
   0.875, rounded: 256 for 224, 55 for 48) with `.map(lambda x, y: (augmentation(x), y))`
   of `keras.layers.RandomCrop(s, s)` and `RandomFlip("horizontal")`; the expert's
   `tf.io.decode_and_crop_jpeg` of a random window of the same fraction, flipped. Each
   epoch is timed from its iterator's creation to its last batch; the build time of each
   dataset (after one throwaway build per loader, which pays the imports) is printed too.
   Targets: kit >= 1.3x Keras at 224, >= 1.0x Keras at 48, >= 1.0x the expert at both, and
   the same three with augmentation.
2. **Peak RSS** of a fresh process while it builds the dataset and reads one epoch at
   64x64 (`/proc/self/statm` sampled every 5 ms; `ru_maxrss` is TensorFlow's start-up
   peak, the same for every run), for `--rss-files` folders (default 5,000 and 20,000
   files of 160 to 480 pixels a side): each loader one process per folder. Target: the
   kit's peak with 20,000 files under 100 MB above its peak with 5,000.
3. **Time to the first batch** of an epoch resumed at 0%, 50% and 90% (the cursor set to
   that batch, then `next(iter(ds))`, median of `--repeats`, the three fractions
   interleaved in a rotating order), for a folder of `--files` JPEGs of 160 to 480 pixels
   (224x224) and for the same JPEGs in 16 TFRecord shards (`kmk.tfrecord_dataset`,
   `shuffle_window=256`); for contrast, Keras' loader positioned with `ds.skip(k)` (which
   decodes every batch it skips; and Keras' shuffle buffer would not give the same order
   anyway). Target (folder): 90% within 1.5x of 0%.

4. **The start of every epoch** (`--skip` it with `small`): a small folder, 480 JPEGs of 40
   to 90 pixels read at 48x48, batch 32, seed 1, where an epoch's start dominates; and the
   same 480 images as a table and as TFRecord shards. Per round (`--small-rounds`, the
   loaders alternating, the order reversed every other round), one whole epoch of each:
   the time from the iterator's creation to its first batch, the CPU time of creating
   the iterator (`time.process_time`: what a loaded host does not inflate), and the
   images/s of the whole epoch (creation to last batch); medians, and the median of the
   per-round ratios. Folder: the kit's `image_dataset_from_directory` against Keras'
   `keras.utils.image_dataset_from_directory` (targets: first batch <= Keras', epoch
   images/s >= 1.0x Keras'). Table: `kmk.make_dataset` of a pandas DataFrame of 480 rows (16
   float32 columns and a string column, as keras-io's structured-data examples) against
   their pipeline, `from_tensor_slices((dict(df), labels)).shuffle(len(df)).batch(32)`.
   Records: `kmk.tfrecord_dataset` of the 480 JPEGs in 16 shards against
   `TFRecordDataset(files).shuffle(256).map(parse, AUTOTUNE).batch(32).prefetch(AUTOTUNE)`.
   The machine it ran on is printed first (`lscpu`).

Usage:

    python benchmarks/image_folder.py                     # 5,000 files; RSS 5,000 and 20,000
    python benchmarks/image_folder.py --skip rss,resume --rounds 6   # throughput only
    python benchmarks/image_folder.py --files 2000 --rss-files 2000,8000 --rounds 2

This is a script, not a test: it prints its figures and asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _fresh import ROOT, child_env  # benchmarks/_fresh.py (scripts run from benchmarks/)
from _report import say  # benchmarks/_report.py

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
sys.path.insert(0, str(ROOT))  # run from a checkout

BATCH, CLASSES = 64, 10


def write_folder(
    root: Path, count: int, seed: int = 0, sides: tuple[int, int] = (160, 480)
) -> Path:
    """`count` JPEG files of mixed sizes in CLASSES subdirectories (kept if already there)."""
    import numpy as np
    import tensorflow as tf

    done = root / f".complete-{count}"
    if done.exists():
        return root
    rng = np.random.default_rng(seed)
    for c in range(CLASSES):
        (root / f"class_{c:02d}").mkdir(parents=True, exist_ok=True)
    for i in range(count):
        height, width = (int(v) for v in rng.integers(sides[0], sides[1] + 1, 2))
        ys = np.linspace(0, 1, height, dtype=np.float32)[:, None, None]
        xs = np.linspace(0, 1, width, dtype=np.float32)[None, :, None]
        tint = rng.uniform(0, 1, (1, 1, 3)).astype(np.float32)
        image = 255 * (0.5 * ys + 0.3 * xs * tint + 0.2 * tint)
        image = image + rng.normal(0, 12, (height, width, 3))
        data = tf.io.encode_jpeg(np.clip(image, 0, 255).astype(np.uint8), quality=90)
        (root / f"class_{i % CLASSES:02d}" / f"{i:06d}.jpg").write_bytes(data.numpy())
    done.write_text("")
    return root


def make(which: str, folder: Path, size: int):
    """The loader's dataset of (images, labels) batches."""
    common = dict(image_size=(size, size), batch_size=BATCH, seed=1, verbose=False)
    if which == "keras":
        import keras

        return keras.utils.image_dataset_from_directory(str(folder), **common)
    import keras_mirror_kit as kmk

    return kmk.image_dataset_from_directory(str(folder), **common)


CROP = 0.875  # Keras' loader at S = round(s / CROP) a side, then RandomCrop(s, s)


def loaded_side(size: int) -> int:
    """The side Keras' loader reads at before its `RandomCrop(size, size)`."""
    return round(size / CROP)


def expert(folder: Path, size: int, augment: bool):
    """The tf.data pipeline an expert writes: nondeterministic parallel map, autotuned."""
    import tensorflow as tf

    names = sorted(p.name for p in folder.iterdir() if p.is_dir())
    table = tf.lookup.StaticHashTable(
        tf.lookup.KeyValueTensorInitializer(tf.constant(names), tf.range(len(names))), -1
    )
    fraction = size / loaded_side(size)

    def load(path):
        data = tf.io.read_file(path)
        if augment:  # decode only a random window of `fraction` of each side, flip it
            shape = tf.cast(tf.io.extract_jpeg_shape(data), tf.float32)
            height = tf.cast(tf.round(fraction * shape[0]), tf.int32)
            width = tf.cast(tf.round(fraction * shape[1]), tf.int32)
            top = tf.random.uniform([], 0, tf.cast(shape[0], tf.int32) - height + 1, tf.int32)
            left = tf.random.uniform([], 0, tf.cast(shape[1], tf.int32) - width + 1, tf.int32)
            window = tf.stack([top, left, height, width])
            image = tf.io.decode_and_crop_jpeg(data, window, channels=3)
            image = tf.image.random_flip_left_right(image)
        else:
            image = tf.io.decode_jpeg(data, channels=3)
        label = table.lookup(tf.strings.split(path, os.sep)[-2])
        return tf.image.resize(image, (size, size)), label

    files = tf.data.Dataset.list_files(str(folder / "*" / "*.jpg"), shuffle=True, seed=1)
    files = files.map(load, num_parallel_calls=tf.data.AUTOTUNE, deterministic=False)
    return files.batch(BATCH).prefetch(tf.data.AUTOTUNE)


def pipeline(which: str, folder: Path, size: int):
    """One of the six pipelines: `keras`, `expert`, `kit`, each with ` aug` or not."""
    import keras
    import tensorflow as tf

    import keras_mirror_kit as kmk

    loader, _, augment = which.partition(" ")
    if loader == "expert":
        return expert(folder, size, bool(augment))
    if not augment:
        return make(loader, folder, size)
    common = dict(batch_size=BATCH, seed=1, verbose=False)
    side = loaded_side(size)
    if loader == "kit":
        crop = kmk.random_crop_flip(crop_fraction=size / side, flip="horizontal")
        return kmk.image_dataset_from_directory(
            str(folder), image_size=(size, size), augment=crop, **common
        )
    augmentation = keras.Sequential(
        [
            keras.layers.RandomCrop(size, size, seed=1),
            keras.layers.RandomFlip("horizontal", seed=2),
        ]
    )
    dataset = keras.utils.image_dataset_from_directory(
        str(folder), image_size=(side, side), **common
    )
    dataset = dataset.map(lambda x, y: (augmentation(x), y), num_parallel_calls=tf.data.AUTOTUNE)
    return dataset.prefetch(tf.data.AUTOTUNE)


def one_epoch(dataset) -> tuple[int, float]:
    """Images read in one epoch, and its seconds (iterator creation to last batch)."""
    start = time.perf_counter()
    images = 0
    for x, _ in dataset:
        images += int(x.shape[0])
    return images, time.perf_counter() - start


PIPELINES = ("kit", "keras", "expert", "kit aug", "keras aug", "expert aug")
TARGETS = {  # (size, pipeline, against): the least kit / against
    (224, "kit", "keras"): 1.3,
    (48, "kit", "keras"): 1.0,
    (224, "kit", "expert"): 1.0,
    (48, "kit", "expert"): 1.0,
}
TARGETS.update({(s, f"{a} aug", f"{b} aug"): v for (s, a, b), v in list(TARGETS.items())})


def throughput(folders: dict[int, Path], rounds: int, epochs: int) -> None:
    say(f"## images/s, batch 64, steady state: {epochs} epochs per round, {rounds} rounds")
    keys = [(size, which) for size in folders for which in PIPELINES]
    for size, which in keys[: len(PIPELINES)]:  # throwaway builds: imports, first traces
        pipeline(which, folders[size], size)
    datasets, built = {}, {}
    for size, which in keys:
        start = time.perf_counter()
        datasets[(size, which)] = pipeline(which, folders[size], size)
        built[(size, which)] = time.perf_counter() - start
        for _ in datasets[(size, which)].take(2):  # warm up: trace, first file reads
            pass
    rates: dict[tuple[int, str], list[float]] = {key: [] for key in keys}
    for r in range(rounds):
        order = keys[r % len(keys) :] + keys[: r % len(keys)]
        for size, which in order[::-1] if r % 2 else order:
            for _ in range(epochs):
                images, seconds = one_epoch(datasets[(size, which)])
                rates[(size, which)].append(images / seconds)
        done = [f"{s} {w} {statistics.median(rates[(s, w)][-epochs:]):.0f}" for s, w in keys]
        say(f"round {r} (images/s): " + ", ".join(done))
    say()
    say("| size | pipeline | images/s, median (min-max) | build | kit / it |")
    say("|---|---|---:|---:|---:|")
    for size, which in keys:
        values = rates[(size, which)]
        mine = "kit aug" if which.endswith("aug") else "kit"
        ratio = statistics.median(rates[(size, mine)]) / statistics.median(values)
        say(f"| {size}x{size} | {which} | {statistics.median(values):.0f} ({min(values):.0f}-"
            f"{max(values):.0f}) | {built[(size, which)]:.2f} s | {ratio:.2f}x |")  # fmt: skip
    say()
    for (size, mine, other), target in TARGETS.items():
        # Per round: the ratio of the two pipelines' medians in that round (same load).
        per_round = [
            statistics.median(rates[(size, mine)][r * epochs : (r + 1) * epochs])
            / statistics.median(rates[(size, other)][r * epochs : (r + 1) * epochs])
            for r in range(rounds)
        ]
        ratio = statistics.median(rates[(size, mine)]) / statistics.median(rates[(size, other)])
        verdict = "PASS" if ratio >= target else "NOT MET"
        say(f"{size}x{size} {mine} / {other}: {ratio:.2f}x (per round: median "
            f"{statistics.median(per_round):.2f}, {min(per_round):.2f}-{max(per_round):.2f}), "
            f"target >= {target}: {verdict}")  # fmt: skip
    say()


def _rss_mb() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def rss_child(which: str, folder: str, out: str) -> None:
    """One epoch at 64x64; the process's RSS sampled every 5 ms while it runs."""
    import threading

    import tensorflow as tf

    tf.constant(0)  # TensorFlow's runtime started before the baseline
    before = _rss_mb()
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            peak[0] = max(peak[0], _rss_mb())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    dataset = make(which, Path(folder), 64)
    images, seconds = one_epoch(dataset)
    done.set()
    sampler.join()
    peak[0] = max(peak[0], _rss_mb())
    result = {
        "images": images,
        "seconds": seconds,
        "before_mb": before,
        "peak_mb": peak[0],
        "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    Path(out).write_text(json.dumps(result))


def rss(base: Path, counts: list[int]) -> None:
    say("## peak RSS while a fresh process builds the dataset and reads one epoch at 64x64")
    say("(sampled every 5 ms; in brackets: the RSS before the dataset was built)")
    say("| files | Keras peak RSS | kit peak RSS |")
    say("|---:|---:|---:|")
    peaks: dict[tuple[str, int], float] = {}
    for count in counts:
        folder = write_folder(base / f"rss-{count}", count, seed=count)
        row = []
        for which in ("keras", "kit"):
            out = base / f"rss-{which}-{count}.json"
            command = [sys.executable, __file__, "--child-rss", which, str(folder), str(out)]
            proc = subprocess.run(command, env=child_env(), cwd=ROOT, capture_output=True,
                                  text=True, check=False)  # fmt: skip
            if proc.returncode or not out.exists():
                say(f"{which} {count}: failed: {proc.stderr.strip().splitlines()[-3:]}")
                row.append("failed")
                continue
            result = json.loads(out.read_text())
            peaks[(which, count)] = result["peak_mb"]
            row.append(f"{result['peak_mb']:.0f} MB (from {result['before_mb']:.0f} MB; "
                       f"{result['images']} images, {result['seconds']:.0f} s)")  # fmt: skip
        say(f"| {count:,} | {row[0]} | {row[1]} |")
    if len(counts) >= 2:
        low, high = counts[0], counts[-1]
        for which in ("keras", "kit"):
            if (which, low) in peaks and (which, high) in peaks:
                growth = peaks[(which, high)] - peaks[(which, low)]
                say(f"{which}: {high:,} files vs {low:,}: {growth:+.0f} MB")
    say()


def write_shards(folder: Path, root: Path, shards: int = 16) -> list[str]:
    """The folder's JPEG bytes and labels in `shards` TFRecord files (kept if there)."""
    import tensorflow as tf

    files = sorted(folder.glob("class_*/*.jpg"))
    paths = [str(root / f"part-{s:03d}.tfrecord") for s in range(shards)]
    if all(os.path.exists(p) for p in paths):
        return paths
    root.mkdir(parents=True, exist_ok=True)
    writers = [tf.io.TFRecordWriter(p) for p in paths]
    for i, path in enumerate(files):
        label = int(path.parent.name.split("_")[1])
        feature = {
            "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[path.read_bytes()])),
            "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
        }
        example = tf.train.Example(features=tf.train.Features(feature=feature))
        writers[i % shards].write(example.SerializeToString())
    for writer in writers:
        writer.close()
    return paths


def parse_jpeg(record, size: int = 224):
    """A record's JPEG decoded and resized to `size` x `size`, and its label."""
    import tensorflow as tf

    spec = {
        "image": tf.io.FixedLenFeature([], tf.string),
        "label": tf.io.FixedLenFeature([], tf.int64),
    }
    example = tf.io.parse_single_example(record, spec)
    image = tf.io.decode_jpeg(example["image"], channels=3)
    return tf.image.resize(image, (size, size)), example["label"]


def resume_latency(folder: Path, base: Path, repeats: int, plot: str | None = None) -> None:
    import keras_mirror_kit as kmk

    say("## time to the first batch of an epoch resumed at 0%, 50%, 90% (224x224, batch 64)")
    sources = {
        "image folder": make("kit", folder, 224),
        "TFRecord shards (16)": kmk.tfrecord_dataset(
            write_shards(folder, base / "shards"), parse_jpeg, BATCH, seed=1, shuffle_window=256
        ),
    }
    keras_ds = make("keras", folder, 224)
    say("| source | 0% | 50% | 90% | 90% / 0% |")
    say("|---|---:|---:|---:|---:|")
    drawn: dict[str, list[float]] = {}
    for name, dataset in [*sources.items(), ("Keras' loader, `ds.skip(k)`", keras_ds)]:
        cursor = kmk.cursor_of(dataset)
        num_batches = cursor.num_batches if cursor else int(dataset.cardinality())
        for _ in dataset.take(1):  # trace once
            pass
        fractions = (0.0, 0.5, 0.9)
        times: dict[float, list[float]] = {fraction: [] for fraction in fractions}
        for r in range(repeats if cursor else min(repeats, 3)):  # interleaved, rotating
            for fraction in fractions[r % 3 :] + fractions[: r % 3]:
                skip = int(fraction * num_batches)
                start = time.perf_counter()
                if cursor is not None:
                    cursor.set(epoch=r, skip_batches=skip)
                    next(iter(dataset))
                else:  # the batches before it decoded and dropped
                    next(iter(dataset.skip(skip)))
                times[fraction].append(time.perf_counter() - start)
        medians = [statistics.median(times[fraction]) for fraction in fractions]
        cells = " | ".join(f"{m * 1000:.0f} ms" for m in medians)
        say(f"| {name} | {cells} | {medians[2] / medians[0]:.2f}x |")
        drawn[name] = medians
    say()
    if plot:
        _plot_resume(drawn, plot, num_files=sum(1 for _ in folder.rglob("*.jpg")))
        say(f"wrote {plot}")


def _plot_resume(medians: dict[str, list[float]], path: str, num_files: int) -> None:
    """A bar chart of the time to the first batch at 0%, 50% and 90% of an epoch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.6), dpi=120)
    width = 0.8 / len(medians)
    colors = ["#2f6db5", "#6aa84f", "#b7b7b7"]
    for i, (name, values) in enumerate(medians.items()):
        xs = [x + (i - (len(medians) - 1) / 2) * width for x in range(3)]
        label = name.replace("`", "") if name.startswith("Keras") else f"kit: {name}"
        bars = ax.bar(xs, [v * 1000 for v in values], width, label=label, color=colors[i % 3])
        ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=2)
    ax.set_xticks(range(3), ["resumed at 0%", "at 50%", "at 90% of the epoch"])
    ax.set_ylabel("ms to the first batch")
    ax.set_title(
        f"Resuming mid-epoch: time to the first batch ({num_files} JPEGs, 224x224, batch 64)",
        fontsize=9,
    )
    ax.legend(fontsize=8, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


SMALL = 480  # files of the small folder (40 to 90 pixels a side), read at 48x48


def machine() -> str:
    """This host as `lscpu` describes it (model, CPUs, threads per core, L3)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return f"{os.cpu_count()} CPUs (no lscpu)"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    wanted = ("Model name", "CPU(s)", "Thread(s) per core", "L3 cache", "Hypervisor vendor")
    return "; ".join(f"{k} {fields[k].strip()}" for k in wanted if k in fields)


def small_pipelines(base: Path) -> dict[str, tuple[object, object]]:
    """(kit, baseline) per source: the small folder, a table, TFRecord shards."""
    import keras
    import numpy as np
    import pandas as pd
    import tensorflow as tf

    import keras_mirror_kit as kmk

    folder = write_folder(base / f"small-{SMALL}", SMALL, 2, (40, 90))
    common = dict(image_size=(48, 48), batch_size=32, seed=1, verbose=False)
    rng = np.random.default_rng(0)
    frame = pd.DataFrame({f"f{i}": rng.normal(size=SMALL).astype("float32") for i in range(16)})
    frame["kind"] = rng.choice(["fixed", "normal", "reversible"], SMALL)
    labels = rng.integers(0, 2, SMALL)
    keras_io = tf.data.Dataset.from_tensor_slices((dict(frame), labels))
    shards = write_shards(folder, base / f"small-{SMALL}-shards")

    def parse(record):  # the JPEG at 48x48
        return parse_jpeg(record, 48)

    records = tf.data.TFRecordDataset(shards).shuffle(256, seed=1)
    records = records.map(parse, num_parallel_calls=tf.data.AUTOTUNE).batch(32)
    return {
        "folder": (
            kmk.image_dataset_from_directory(str(folder), **common),
            keras.utils.image_dataset_from_directory(str(folder), **common),
        ),
        "table": (
            kmk.make_dataset(frame, labels, 32, seed=1),
            keras_io.shuffle(SMALL, seed=1).batch(32),
        ),
        "records": (
            kmk.tfrecord_dataset(shards, parse, 32, seed=1, shuffle_window=256),
            records.prefetch(tf.data.AUTOTUNE),
        ),
    }


def one_epoch_started(dataset) -> tuple[float, float, float]:
    """`(seconds to the first batch, CPU seconds creating the iterator, images/s)` of one
    whole epoch, each from the iterator's creation."""
    cpu, start = time.process_time(), time.perf_counter()
    iterator = iter(dataset)
    created = time.process_time() - cpu
    images = _count(next(iterator))
    first = time.perf_counter() - start
    for batch in iterator:
        images += _count(batch)
    return first, created, images / (time.perf_counter() - start)


def _count(batch) -> int:
    import tensorflow as tf

    return int(tf.nest.flatten(batch)[0].shape[0])


def small_folder(base: Path, rounds: int) -> None:
    say(f"## the start of every epoch: {SMALL} small JPEGs at 48x48, batch 32, {rounds} rounds")
    pairs = small_pipelines(base)
    names = {"folder": ("kit", "Keras' loader"), "table": ("kit", "keras-io"),
             "records": ("kit", "tf.data")}  # fmt: skip
    runs = {(source, i): [] for source in pairs for i in (0, 1)}
    for pair in pairs.values():
        for dataset in pair:  # warm up: an epoch each (traces, page cache)
            one_epoch_started(dataset)
    for r in range(rounds):
        for source, pair in pairs.items():
            for i in (1, 0) if r % 2 else (0, 1):
                runs[(source, i)].append(one_epoch_started(pair[i]))
    say("| source | pipeline | first batch, median (min-max) | iterator's CPU | images/s | "
        "first batch, kit / it (per round) | images/s, kit / it (per round) |")  # fmt: skip
    say("|---|---|---:|---:|---:|---:|---:|")
    for source in pairs:
        for i in (0, 1):
            firsts, cpus, rates = (list(column) for column in zip(*runs[(source, i)]))
            cells = (f"{statistics.median(firsts) * 1e3:.1f} ms ({min(firsts) * 1e3:.1f}-"
                     f"{max(firsts) * 1e3:.1f}) | {statistics.median(cpus) * 1e3:.1f} ms | "
                     f"{statistics.median(rates):.0f}")  # fmt: skip
            ratios = " | |"
            if i == 1:
                kit = runs[(source, 0)]
                first_ratio = [k[0] / o[0] for k, o in zip(kit, runs[(source, 1)])]
                rate_ratio = [k[2] / o[2] for k, o in zip(kit, runs[(source, 1)])]
                ratios = (f" | {statistics.median(first_ratio):.2f}x ({min(first_ratio):.2f}-"
                          f"{max(first_ratio):.2f}) | {statistics.median(rate_ratio):.2f}x "
                          f"({min(rate_ratio):.2f}-{max(rate_ratio):.2f}) |")  # fmt: skip
            say(f"| {source} | {names[source][i]} | {cells}{ratios}")
    kit, keras_runs = runs[("folder", 0)], runs[("folder", 1)]
    first = statistics.median(k[0] / o[0] for k, o in zip(kit, keras_runs))
    rate = statistics.median(k[2] / o[2] for k, o in zip(kit, keras_runs))
    say(f"folder: first batch kit / Keras {first:.2f}x (target <= 1.0: "
        f"{'PASS' if first <= 1.0 else 'NOT MET'}); epoch images/s kit / Keras {rate:.2f}x "
        f"(target >= 1.0: {'PASS' if rate >= 1.0 else 'NOT MET'})")  # fmt: skip
    say()


def main() -> int:
    """Runs the four measurements and prints their tables (0 unless a child failed)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=5000)
    parser.add_argument("--rss-files", default="5000,20000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2, help="epochs per round (throughput)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--small-rounds", type=int, default=15, help="rounds (epoch start)")
    parser.add_argument("--dir", help="where to write (and keep) the folders")
    parser.add_argument("--skip", default="", help="comma list of: throughput,rss,resume,small")
    parser.add_argument("--plot", help="draw the resume latencies into this PNG file")
    parser.add_argument("--child-rss", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_rss:
        rss_child(*args.child_rss)
        return 0
    import tensorflow as tf

    base = Path(args.dir or tempfile.mkdtemp(prefix="kmk-images-"))
    skip = set(filter(None, args.skip.split(",")))
    say(f"command: python benchmarks/image_folder.py {' '.join(sys.argv[1:])}; TensorFlow "
        f"{tf.__version__}; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}; "
        f"files in {base}")  # fmt: skip
    say(f"machine: {machine()}")
    if "small" not in skip:
        small_folder(base, args.small_rounds)
    if "throughput" not in skip:
        folders = {
            224: write_folder(base / f"large-{args.files}", args.files, 1, (224, 288)),
            48: write_folder(base / f"small-{args.files}", args.files, 2, (40, 90)),
        }
        throughput(folders, args.rounds, args.epochs)
    if "resume" not in skip:
        folder = write_folder(base / f"folder-{args.files}", args.files)
        resume_latency(folder, base, args.repeats, args.plot)
    if "rss" not in skip:
        rss(base, [int(v) for v in args.rss_files.split(",")])
    say(f"load at the end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
