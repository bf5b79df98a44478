"""Image folders and TFRecords: the kit's loaders against Keras' own, and resume latency.

Three measurements on a folder of JPEG files of mixed sizes (written by this script into a
temporary directory, or `--dir`; 10 class subdirectories; sides 160 to 480 pixels,
smooth gradients with noise, quality 90):

1. **Images per second** of one epoch read, decoded, resized and batched (batch 64,
   `shuffle=True`, seed 1), at 224x224 and at 64x64: `kmk.image_dataset_from_directory`
   against `keras.utils.image_dataset_from_directory` on the same files, alternating in
   one process (`--rounds` rounds, each round both loaders at both sizes, the order of the
   two loaders swapped every round). The datasets are built before the clock starts; an
   epoch is timed from its iterator's creation to its last batch. Target: at least 1.0x.
2. **Peak RSS** of a fresh process while it builds the dataset and reads one epoch at
   64x64 (`/proc/self/statm` sampled every 5 ms; `ru_maxrss` is TensorFlow's start-up
   peak, the same for every run), for `--rss-files` folders (default 5,000 and 20,000
   files): each loader one process per folder. Target: the kit's peak with 20,000 files
   under 100 MB above its peak with 5,000.
3. **Time to the first batch** of an epoch resumed at 0%, 50% and 90% (the cursor set to
   that batch, then `next(iter(ds))`, median of `--repeats`, the three fractions
   interleaved in a rotating order), for the image folder (224x224)
   and for the same JPEGs in 16 TFRecord shards (`kmk.tfrecord_dataset`,
   `shuffle_window=256`); for contrast, Keras' loader positioned with `ds.skip(k)` (which
   decodes every batch it skips; and Keras' shuffle buffer would not give the same order
   anyway). Target (folder): 90% within 1.5x of 0%.

Usage:

    python benchmarks/image_folder.py                     # 5,000 files; RSS 5,000 and 20,000
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


def write_folder(root: Path, count: int, seed: int = 0) -> Path:
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
        height, width = (int(v) for v in rng.integers(160, 481, 2))
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


def one_epoch(dataset) -> tuple[int, float]:
    """Images read in one epoch, and its seconds (iterator creation to last batch)."""
    start = time.perf_counter()
    images = 0
    for x, _ in dataset:
        images += int(x.shape[0])
    return images, time.perf_counter() - start


def throughput(folder: Path, rounds: int) -> None:
    say("## images/s, one epoch, batch 64 (kit vs Keras, alternating in one process)")
    datasets = {(w, s): make(w, folder, s) for w in ("keras", "kit") for s in (224, 64)}
    for dataset in datasets.values():  # warm up: trace, first file reads
        for _ in dataset.take(2):
            pass
    rates: dict[tuple[str, int], list[float]] = {key: [] for key in datasets}
    for r in range(rounds):
        order = ("keras", "kit") if r % 2 == 0 else ("kit", "keras")
        for size in (224, 64):
            for which in order:
                images, seconds = one_epoch(datasets[(which, size)])
                rates[(which, size)].append(images / seconds)
                say(f"round {r} {size}x{size} {which:>5}: {images} images, {seconds:.1f} s, "
                    f"{images / seconds:.0f} images/s")  # fmt: skip
    say()
    say("| size | Keras images/s, median (min-max) | kit images/s, median (min-max) | kit/Keras |")
    say("|---|---:|---:|---:|")
    for size in (224, 64):
        keras_rates, kit_rates = rates[("keras", size)], rates[("kit", size)]
        ratio = statistics.median(kit_rates) / statistics.median(keras_rates)
        say(f"| {size}x{size} | {statistics.median(keras_rates):.0f} ({min(keras_rates):.0f}-"
            f"{max(keras_rates):.0f}) | {statistics.median(kit_rates):.0f} ({min(kit_rates):.0f}-"
            f"{max(kit_rates):.0f}) | {ratio:.2f}x |")  # fmt: skip
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


def parse_jpeg(record):
    import tensorflow as tf

    spec = {
        "image": tf.io.FixedLenFeature([], tf.string),
        "label": tf.io.FixedLenFeature([], tf.int64),
    }
    example = tf.io.parse_single_example(record, spec)
    image = tf.io.decode_jpeg(example["image"], channels=3)
    return tf.image.resize(image, (224, 224)), example["label"]


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


def main() -> int:
    """Runs the three measurements and prints their tables (0 unless a child failed)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=5000)
    parser.add_argument("--rss-files", default="5000,20000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--dir", help="where to write (and keep) the folders")
    parser.add_argument("--skip", default="", help="comma list of: throughput,rss,resume")
    parser.add_argument("--plot", help="draw the resume latencies into this PNG file")
    parser.add_argument("--child-rss", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_rss:
        rss_child(*args.child_rss)
        return 0
    import tensorflow as tf

    base = Path(args.dir or tempfile.mkdtemp(prefix="kmk-images-"))
    skip = set(filter(None, args.skip.split(",")))
    say(f"command: python benchmarks/image_folder.py --files {args.files} --rss-files "
        f"{args.rss_files} --rounds {args.rounds}; TensorFlow {tf.__version__}; "
        f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}; files in {base}")  # fmt: skip
    folder = write_folder(base / f"folder-{args.files}", args.files)
    if "throughput" not in skip:
        throughput(folder, args.rounds)
    if "resume" not in skip:
        resume_latency(folder, base, args.repeats, args.plot)
    if "rss" not in skip:
        rss(base, [int(v) for v in args.rss_files.split(",")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
