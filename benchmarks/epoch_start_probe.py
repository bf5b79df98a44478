"""Where the start of an epoch goes, and what one iterator across epochs would give.

Evidence for a design choice (issue #47, item 2), beside the shipped loader. On the
small folder of `image_folder.py` (480 JPEGs of 40 to 90 pixels, read at 48x48, batch
32, seed 1), in one process, `--rounds` alternating rounds:

1. **The CPU time of `iter(dataset)`** (`time.process_time`; what a loaded host does not
   inflate) for pipelines of increasing size: `Dataset.range(15)` alone, one trivial
   `map`, a `scan` with a `tf.cond` (the kit's cursor read), a `map` with a
   `tf.while_loop` (as `tf.map_fn` makes), the kit's `image_dataset_from_directory` with
   its own functions multi-device (as before `workarounds.tf_data_function_instantiation`)
   and as it is, Keras' `image_dataset_from_directory`. In TensorFlow
   2.21 every tf.data function of a new iterator is instantiated as a multi-device
   function (Grappler's meta-optimizer and the TFG/MLIR passes run on each, nested
   functions included), and Keras' `fit` makes a new iterator every epoch; the kit builds
   its own functions single-device.
2. **One iterator across epochs** (a prototype, not the kit's code; on the kit's loader
   with its functions multi-device, the alternative that was weighed): each epoch is
   `Dataset.range(15).map(pull)`, where `pull` takes the next batch from one iterator,
   made once, over `Dataset.zip((range(15), kit_dataset)).take_while(step == the
   epoch's step).repeat()`. `repeat` makes the kit's pipeline anew for each epoch (its
   cursor read at that epoch's first batch, as now) but inside the same iterator, whose
   function instantiations are reused; the `take_while` ends an epoch abandoned
   part-way, so the next one starts at its first batch. Its epochs are checked against
   the kit's own (same orders, a resume at batch 5). First batch and images/s against
   Keras' loader, median of the per-round ratios. The epochs are pulled on demand only
   (no prefetch, injected or not): an epoch abandoned with a pull in flight cancels
   that pull, and the shared iterator then fails every later epoch with
   `CancelledError` (seen with TensorFlow's injected prefetch; `MultiDeviceIterator`,
   which `MirroredStrategy` uses, always pulls ahead).

Usage:

    python benchmarks/epoch_start_probe.py --rounds 9 --dir /tmp/kmk-images
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _fresh import ROOT  # benchmarks/_fresh.py (scripts run from benchmarks/)
from _report import say  # benchmarks/_report.py

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
sys.path.insert(0, str(ROOT))  # run from a checkout

from image_folder import SMALL, machine, write_folder  # noqa: E402 (after the path)

BATCHES = SMALL // 32


@contextlib.contextmanager
def multi_device():
    """Builds the kit's datasets with their functions multi-device, as before the workaround."""
    from keras_mirror_kit.data import folders, sources

    saved = folders.host_functions, sources.host_functions
    folders.host_functions = sources.host_functions = contextlib.nullcontext
    try:
        yield
    finally:
        folders.host_functions, sources.host_functions = saved


def iterator_cpu(dataset) -> float:
    """CPU seconds of `iter(dataset)`."""
    cpu = time.process_time()
    iter(dataset)
    return time.process_time() - cpu


def first_and_rate(dataset) -> tuple[float, float]:
    """`(seconds to the first batch, images/s)` of one epoch, from the iterator's creation."""
    start = time.perf_counter()
    iterator = iter(dataset)
    images = int(next(iterator)[0].shape[0])
    first = time.perf_counter() - start
    for batch in iterator:
        images += int(batch[0].shape[0])
    return first, images / (time.perf_counter() - start)


def one_iterator(kit):
    """The prototype: epochs pulled from one iterator over the kit dataset, repeated."""
    import tensorflow as tf
    from tensorflow.python.ops import gen_dataset_ops

    with tf.device("/cpu:0"):
        step_now = tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, 0)
    key = tf.constant([0], tf.int64)
    inner = tf.data.Dataset.zip((tf.data.Dataset.range(BATCHES), kit))
    inner = inner.take_while(lambda step, _: tf.equal(step, step_now.lookup(key)[0]))
    shared = iter(inner.repeat())
    flat = tf.nest.flatten(shared.element_spec)

    def pull(step):
        with tf.control_dependencies([step_now.insert(key, tf.reshape(step, [1]))]):
            out = gen_dataset_ops.iterator_get_next(
                shared._iterator_resource,  # noqa: SLF001
                output_types=[s.dtype for s in flat],
                output_shapes=[s.shape for s in flat],
            )
        return tf.nest.pack_sequence_as(shared.element_spec, out)[1]

    # Pulled on demand only: an injected prefetch would pull ahead from the shared
    # iterator, and destroying an epoch abandoned with a pull in flight cancels that pull
    # and leaves the shared iterator failing with CancelledError from then on.
    options = tf.data.Options()
    options.autotune.enabled = False
    options.experimental_optimization.inject_prefetch = False
    epochs = tf.data.Dataset.range(BATCHES).map(pull).with_options(options)
    epochs.keep_alive = shared  # the shared iterator lives as long as the dataset
    return epochs


def same_orders(kit, epochs) -> bool:
    """Whether the prototype's epochs (whole, abandoned, resumed) are the kit's."""
    import keras_mirror_kit as kmk

    cursor = kmk.cursor_of(kit)

    def labels(dataset) -> list[list[int]]:
        return [batch[1].numpy().tolist() for batch in dataset]

    def kit_epoch(epoch: int, skip: int = 0) -> list[list[int]]:
        cursor.set(epoch=epoch, skip_batches=skip)
        return labels(kit)

    cursor.set(epoch=0)
    got = [labels(epochs)]
    iterator = iter(epochs)  # epoch 1, abandoned after two batches
    next(iterator), next(iterator)
    del iterator
    got.append(labels(epochs))  # epoch 2
    cursor.set(epoch=4, skip_batches=5)
    got.append(labels(epochs))
    return got == [kit_epoch(0), kit_epoch(2), kit_epoch(4, 5)]


def main() -> int:
    """Prints the two tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--dir", help="where to write (and keep) the folder")
    args = parser.parse_args()
    import keras
    import tensorflow as tf

    import keras_mirror_kit as kmk

    base = Path(args.dir or tempfile.mkdtemp(prefix="kmk-images-"))
    folder = str(write_folder(base / f"small-{SMALL}", SMALL, 2, (40, 90)))
    say(f"command: python benchmarks/epoch_start_probe.py {' '.join(sys.argv[1:])}; "
        f"TensorFlow {tf.__version__}; load {os.getloadavg()[0]:.2f}")  # fmt: skip
    say(f"machine: {machine()}")
    common = dict(image_size=(48, 48), batch_size=32, seed=1, verbose=False)
    kit = kmk.image_dataset_from_directory(folder, **common)
    with multi_device():
        before = kmk.image_dataset_from_directory(folder, **common)
    loader = keras.utils.image_dataset_from_directory(folder, **common)
    pieces = {
        "range(15)": tf.data.Dataset.range(BATCHES),
        "range(15).map(x + 1)": tf.data.Dataset.range(BATCHES).map(lambda i: i + 1),
        "range(15).scan with a tf.cond": tf.data.Dataset.range(BATCHES).scan(
            tf.constant(-1, tf.int64),
            lambda s, i: (lambda v: (v, v))(tf.cond(s < 0, lambda: i * 2, lambda: s)),
        ),
        "range(15).map with a tf.while_loop": tf.data.Dataset.range(BATCHES).map(
            lambda i: tf.while_loop(lambda j: j < i, lambda j: (j + 1,), (i * 0,))[0]
        ),
        "kit image_dataset_from_directory, its functions multi-device": before,
        "kit image_dataset_from_directory": kit,
        "Keras' image_dataset_from_directory": loader,
    }
    for dataset in pieces.values():
        iterator_cpu(dataset)
    cpus = {name: [] for name in pieces}
    for r in range(args.rounds):
        for name in list(pieces)[:: 1 if r % 2 else -1]:
            cpus[name].append(iterator_cpu(pieces[name]))
    say(f"## CPU time of iter(dataset), median of {args.rounds} rounds")
    say("| pipeline | iter() CPU |")
    say("|---|---:|")
    for name, values in cpus.items():
        say(f"| {name} | {statistics.median(values) * 1e3:.1f} ms |")
    say()
    epochs = one_iterator(before)
    say(f"one iterator across epochs gives the kit's epochs: {same_orders(before, epochs)}")
    runs = {
        "kit, functions multi-device": before,
        "kit": kit,
        "Keras' loader": loader,
        "kit multi-device, one iterator (prototype)": epochs,
    }
    for dataset in runs.values():
        first_and_rate(dataset)
    results = {name: [] for name in runs}
    for r in range(args.rounds):
        for name in list(runs)[:: 1 if r % 2 else -1]:
            results[name].append(first_and_rate(runs[name]))
    say(f"## one epoch from a new iterator, {args.rounds} alternating rounds")
    say("| pipeline | first batch | images/s | first batch / Keras' | images/s / Keras' |")
    say("|---|---:|---:|---:|---:|")
    keras_runs = results["Keras' loader"]
    for name, values in results.items():
        first = statistics.median(v[0] for v in values) * 1e3
        rate = statistics.median(v[1] for v in values)
        first_ratio = statistics.median(v[0] / k[0] for v, k in zip(values, keras_runs))
        rate_ratio = statistics.median(v[1] / k[1] for v, k in zip(values, keras_runs))
        say(f"| {name} | {first:.1f} ms | {rate:.0f} | {first_ratio:.2f}x | {rate_ratio:.2f}x |")
    say(f"load at the end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
