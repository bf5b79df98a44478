"""CIFAR-10 CNN on every replica of this host: the classic MirroredStrategy tutorial, via the kit.

The model is the tutorial's, unchanged (Conv2D 32 3x3 relu, MaxPool 2x2, Flatten, Dense 64
relu, Dense 10 softmax; Adam; sparse categorical cross-entropy; per-replica batch 64; 10
epochs). What the kit adds: the strategy and devices are chosen for you, the global batch and
learning rate are scaled, the input pipeline keeps images uint8 in memory, the fastest recipe
is used (`mixed_precision="auto"`: bfloat16 only where the devices compute it natively;
`steps_per_execution="auto"`), throughput is reported per replica, and training resumes from
crash-safe checkpoints.

    python examples/cifar10_cnn.py                        # all GPUs (or the CPU)
    python examples/cifar10_cnn.py --simulate-replicas 2  # 2 replicas on a laptop / CI
    python examples/cifar10_cnn.py --help
    KERAS_BACKEND=jax python examples/cifar10_cnn.py --simulate-replicas 2  # the same on JAX

On Keras' JAX backend the same script trains with `keras.distribution.DataParallel` over the
local devices (the input pipeline still uses tf.data, so TensorFlow must be installed).

With no local copy and no usable download (offline, or behind a proxy or captive portal that
answers with a web page, which is discarded), `--data auto` (the default) trains on synthetic
CIFAR-shaped data and says so in one WARNING line with the reason. `--data synthetic` uses
synthetic data outright; `--data cifar10` never falls back.

The checkpoint directory records the data it was trained on (`data_source.json`): a rerun
resumes only on the same data (real CIFAR-10, or synthetic data of the same seed) and
otherwise exits with an error before training.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

TUTORIAL_LEARNING_RATE = 1e-3  # Keras' Adam default, which the tutorial uses
TUTORIAL_BATCH_SIZE = 64  # the tutorial's per-replica batch, at which 1e-3 was tuned
DATA_RECORD = "data_source.json"  # in --checkpoint-dir: the data the checkpoints were trained on


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train the tutorial's CIFAR-10 CNN data-parallel with keras-mirror-kit.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--per-replica-batch-size", type=int, default=TUTORIAL_BATCH_SIZE)
    parser.add_argument(
        "--learning-rate",
        type=float,
        default=TUTORIAL_LEARNING_RATE,
        help=f"base learning rate, tuned at batch size {TUTORIAL_BATCH_SIZE}",
    )
    parser.add_argument(
        "--lr-rule",
        choices=["linear", "sqrt", "none"],
        default="linear",
        help="how the learning rate grows with the global batch",
    )
    parser.add_argument(
        "--warmup-epochs",
        type=float,
        default=0.0,
        help="ramp the learning rate up from the base over this many epochs",
    )
    parser.add_argument(
        "--data",
        choices=["auto", "cifar10", "synthetic"],
        default="auto",
        help="auto: real CIFAR-10 if it can be had, else synthetic (loudly)",
    )
    parser.add_argument(
        "--data-dir",
        default=None,
        help="a cifar-10-python.tar.gz or its extracted folder "
        "(default: the Keras cache, ~/.keras/datasets)",
    )
    parser.add_argument(
        "--data-url",
        default=None,
        help="download CIFAR-10 from this mirror when there is no local copy "
        "(default: the official URL); still checked against the "
        "official SHA-256",
    )
    parser.add_argument(
        "--train-samples",
        type=int,
        default=None,
        help="use only the first N training samples (quick runs)",
    )
    parser.add_argument(
        "--checkpoint-dir",
        default="cifar10_checkpoints",
        help="SyncedCheckpoint directory; a rerun on the same data resumes from it",
    )
    parser.add_argument("--no-checkpoint", action="store_true", help="do not checkpoint")
    parser.add_argument(
        "--simulate-replicas",
        type=int,
        default=None,
        metavar="N",
        help="split the CPU (or one GPU) into N replicas",
    )
    parser.add_argument(
        "--mixed-precision",
        choices=["auto", "float32", "mixed_bfloat16", "mixed_float16"],
        default="auto",
        help="auto: bfloat16 where the devices compute it natively (GPUs of compute "
        "capability 8.0+, CPUs with AVX512-BF16 or AMX), float16 on older GPUs, else float32",
    )
    parser.add_argument(
        "--steps-per-execution",
        default="auto",
        metavar="N",
        help="training steps per compiled call: a positive integer, or auto (8)",
    )
    parser.add_argument(
        "--wandb",
        action="store_true",
        help="log to Weights & Biases (needs keras-mirror-kit[wandb])",
    )
    parser.add_argument("--wandb-project", default="keras-mirror-kit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--output", default="cifar10_cnn.keras", help="where to save the trained model (.keras)"
    )
    parser.add_argument(
        "--verbose", type=int, default=2, choices=[0, 1, 2], help="Keras fit verbosity"
    )
    args = parser.parse_args(argv)
    for name in ("epochs", "per_replica_batch_size"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.steps_per_execution != "auto":
        if not args.steps_per_execution.isdigit() or int(args.steps_per_execution) <= 0:
            parser.error("--steps-per-execution must be a positive integer or auto")
        args.steps_per_execution = int(args.steps_per_execution)
    if not args.output.endswith(".keras"):
        parser.error("--output must end in .keras (the native Keras format)")
    return args


def load_data(args: argparse.Namespace):
    """Real CIFAR-10 when it can be had; otherwise synthetic data, said loudly.

    `--data auto` falls back when there is no local copy and the download fails, or brings
    something that is not CIFAR-10 (a proxy's or captive portal's web page): the loader has
    discarded it, nothing is kept. A local copy that fails its check is the user's file: that
    error is raised, never papered over. `--data cifar10` never falls back.
    """
    from keras_mirror_kit.datasets import (
        CIFAR10_URL,
        CIFAR10ChecksumError,
        CIFAR10FormatError,
        CIFAR10NotAvailableError,
        load_cifar10,
        make_synthetic_cifar10,
    )

    def unavailable(err: Exception):
        if args.data == "cifar10":
            raise SystemExit(f"error: --data cifar10, but CIFAR-10 cannot be had: {err}") from None
        reason = str(err).split(" Looked for")[0]
        logging.getLogger("cifar10_cnn").warning(
            "TRAINING ON SYNTHETIC CIFAR-SHAPED DATA, NOT CIFAR-10 "
            "(real data unavailable: %s: %s)",
            type(err).__name__,
            reason,
        )
        return make_synthetic_cifar10(seed=args.seed), "synthetic"

    if args.data == "synthetic":
        return make_synthetic_cifar10(seed=args.seed), "synthetic"
    if args.data_dir:
        try:
            return load_cifar10(args.data_dir), "cifar10"  # an explicit path: no download
        except CIFAR10NotAvailableError as err:
            return unavailable(err)
    try:
        return load_cifar10(download=False), "cifar10"  # a local copy: its errors are raised
    except CIFAR10NotAvailableError:
        pass  # no local copy: download it
    try:
        return load_cifar10(url=args.data_url or CIFAR10_URL, timeout=20), "cifar10"
    except (CIFAR10NotAvailableError, CIFAR10ChecksumError, CIFAR10FormatError) as err:
        return unavailable(err)  # the download failed or was not CIFAR-10; nothing was kept


def data_source(source: str, args: argparse.Namespace) -> dict[str, object]:
    """What the checkpoints of this run are trained on (synthetic data depends on its seed)."""
    return {"data": source, "seed": args.seed} if source == "synthetic" else {"data": source}


def check_data_source(checkpoint_dir: str, source: dict[str, object], *, write: bool) -> None:
    """Refuses a checkpoint directory trained on other data; records the data otherwise.

    Without this, a rerun with `--data auto` that gets real CIFAR-10 (or, offline, synthetic
    data) would silently resume checkpoints trained on the other.
    """
    path = Path(checkpoint_dir) / DATA_RECORD
    if path.exists():
        recorded = json.loads(path.read_text(encoding="utf-8"))
        if recorded != source:
            raise SystemExit(
                f"error: --checkpoint-dir {checkpoint_dir} holds checkpoints trained on "
                f"{_describe(recorded)}, but this run uses {_describe(source)}; resuming would "
                "continue that training on other data. Use another --checkpoint-dir, or "
                f"delete {checkpoint_dir} to start over. Received: data={source}, "
                f"recorded={recorded}"
            )
    elif write:  # the chief, before any checkpoint exists in a new directory
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{DATA_RECORD}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(source), encoding="utf-8")
        os.replace(tmp, path)


def _describe(source: dict[str, object]) -> str:
    if source.get("data") == "synthetic":
        return f"synthetic CIFAR-shaped data (--seed {source.get('seed')})"
    return "real CIFAR-10"


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("tensorflow").setLevel(logging.WARNING)  # its per-step INFO chatter

    from keras_mirror_kit.cli.tf_start import start_tensorflow

    start_tensorflow()  # without TensorFlow's start-up lines (TF_CPP_MIN_LOG_LEVEL=0 shows them)
    import keras_mirror_kit as kmk

    if args.simulate_replicas:
        kmk.simulate_replicas(args.simulate_replicas)  # before the backend starts

    import keras

    data, source = load_data(args)
    (x_train, y_train), (x_test, y_test) = data
    if args.train_samples:
        x_train, y_train = x_train[: args.train_samples], y_train[: args.train_samples]

    # The recommended recipe (docs/performance.md): the 16-bit type the devices compute
    # natively, else float32 (one INFO line says which and why), and 8 steps per call.
    @kmk.distributed(
        per_replica_batch_size=args.per_replica_batch_size,
        lr_scaling_rule=args.lr_rule,
        mixed_precision=None if args.mixed_precision == "float32" else args.mixed_precision,
        steps_per_execution=args.steps_per_execution,
    )
    def build_model(steps_per_epoch: int) -> keras.Model:
        dist = kmk.current()
        learning_rate = dist.scale_learning_rate(args.learning_rate, TUTORIAL_BATCH_SIZE)
        if args.warmup_epochs > 0:
            learning_rate = kmk.WarmupSchedule(
                learning_rate,
                warmup_steps=max(1, round(args.warmup_epochs * steps_per_epoch)),
                start_learning_rate=args.learning_rate,
            )
        model = kmk.models.tutorial_cnn()
        model.compile(
            optimizer=keras.optimizers.Adam(learning_rate),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
        return model

    dist = build_model.distribution
    steps_per_epoch = -(-len(x_train) // dist.global_batch_size)  # the last partial one too
    model = build_model(steps_per_epoch)
    train_ds = kmk.make_dataset(
        x_train, y_train, dist.global_batch_size, seed=args.seed, preprocess=kmk.rescale()
    )
    # Evaluate on every test image, unless the last partial batch cannot be split evenly.
    remainder = len(x_test) % dist.global_batch_size
    test_ds = kmk.make_dataset(
        x_test,
        y_test,
        dist.global_batch_size,
        shuffle=False,
        drop_remainder=remainder % dist.num_replicas != 0,
        preprocess=kmk.rescale(),
    )

    callbacks: list[keras.callbacks.Callback] = [kmk.ThroughputMonitor()]
    if not args.no_checkpoint:
        check_data_source(args.checkpoint_dir, data_source(source, args), write=dist.is_chief)
        callbacks.append(kmk.SyncedCheckpoint(args.checkpoint_dir, dataset=train_ds))
    if args.wandb:
        from keras_mirror_kit.integrations.wandb import WandbLogger

        callbacks.append(WandbLogger(project=args.wandb_project, config=vars(args)))

    model.fit(
        train_ds,
        validation_data=test_ds,
        epochs=args.epochs,
        callbacks=callbacks,
        verbose=args.verbose,
    )
    loss, accuracy = model.evaluate(test_ds, verbose=0)
    print(f"Test accuracy: {accuracy * 100:.2f}% (loss {loss:.4f})")
    if dist.is_chief:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        model.save(args.output)
        print(f"Saved the model to {args.output}")
    return float(accuracy)


if __name__ == "__main__":
    main()
    sys.exit(0)
