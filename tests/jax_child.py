"""A fresh interpreter on Keras' JAX backend: `python -m tests.jax_child OUT.json N WEIGHTS`.

Runs with `KERAS_BACKEND=jax` and `kmk.simulate_replicas(N)` (XLA's host-platform device
count), trains the cases below from the initial weights in WEIGHTS (an `.npz` the N=1 run
writes when it is missing), and writes what it saw as JSON for `tests/test_jax_backend.py`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

os.environ["KERAS_BACKEND"] = "jax"


def _error(call) -> list[str] | None:
    try:
        call()
    except Exception as err:  # noqa: BLE001 - reported, compared by the test
        return [type(err).__name__, str(err)]
    return None


def main() -> int:
    out, n, weights_path = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    import numpy as np

    import keras_mirror_kit as kmk

    kmk.simulate_replicas(n)
    import keras

    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("keras_mirror_kit").addHandler(Collect())
    logging.getLogger("keras_mirror_kit").setLevel(logging.INFO)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1)) + np.sin(2 * x[:, :1])).astype("float32")
    result: dict = {"keras_backend": keras.backend.backend()}

    def factory(optimizer, **options):
        @kmk.distributed(global_batch_size=16, **options)
        def build():
            keras.utils.set_random_seed(1)
            model = keras.Sequential(
                [
                    keras.Input((5,)),
                    keras.layers.Dense(8, activation="tanh"),
                    keras.layers.BatchNormalization(),
                    keras.layers.Dense(1),
                ]
            )
            model.compile(optimizer=optimizer(), loss="mse", metrics=["mae"])
            return model

        return build

    start = None
    cases = {
        "sgd": (lambda: keras.optimizers.SGD(0.05), {}),
        "adam": (lambda: keras.optimizers.Adam(1e-2), {}),
        "accumulate": (lambda: keras.optimizers.SGD(0.05), {"gradient_accumulation_steps": 2}),
        "bfloat16": (lambda: keras.optimizers.Adam(1e-2), {"mixed_precision": "mixed_bfloat16"}),
        "sync_bn": (lambda: keras.optimizers.SGD(0.05), {"sync_batch_norm": True}),
    }
    trained = {}
    for name, (optimizer, options) in cases.items():
        build = factory(optimizer, **options)
        model = build()
        if start is None:
            if not weights_path.exists():
                np.savez(weights_path, *model.get_weights())
            with np.load(weights_path) as saved:
                start = [saved[f"arr_{i}"] for i in range(len(saved.files))]
        model.set_weights(start)
        ds = kmk.make_dataset(x, y, 16, seed=3)
        monitor = kmk.ThroughputMonitor(warmup_steps=1)
        history = model.fit(ds, epochs=2, verbose=0, callbacks=[monitor]).history
        trained[name] = [w.tolist() for w in model.get_weights()]
        if name == "sgd":
            dist = build.distribution
            result["distribution"] = {
                "backend": dist.backend,
                "strategy": dist.strategy_name,
                "devices": list(dist.devices),
                "replicas": dist.num_replicas,
                "per_replica": dist.per_replica_batch_size,
                "global": dist.global_batch_size,
                "describe": dist.describe(),
                "config": dist.as_config(),
            }
            result["history_keys"] = sorted(history)
            result["samples_per_sec"] = history.get("samples_per_sec")
            result["evaluate"] = model.evaluate(
                kmk.make_dataset(x[:64], y[:64], 16, shuffle=False), verbose=0
            )
            result["predict"] = model.predict(x[:6], batch_size=16, verbose=0).tolist()
            result["uneven_evaluate"] = _error(
                lambda model=model: model.evaluate(x[:29], y[:29], verbose=0)
            )
            variables = {v.path: v for v in model.variables}
            moving = [p for p in variables if "moving" in p]
            result["moving_statistics"] = {p: np.asarray(variables[p]).tolist() for p in moving}
    # The `with` form: the same model and data as the decorator's "sgd" case.
    with kmk.distributed(global_batch_size=16) as block:
        keras.utils.set_random_seed(1)
        model = keras.Sequential(
            [
                keras.Input((5,)),
                keras.layers.Dense(8, activation="tanh"),
                keras.layers.BatchNormalization(),
                keras.layers.Dense(1),
            ]
        )
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
        model.set_weights(start)
        model.fit(kmk.make_dataset(x, y, 16, seed=3), epochs=2, verbose=0)
    trained["with_form"] = [w.tolist() for w in model.get_weights()]
    result["with_form_replicas"] = block.num_replicas
    # A file source feeds it too: an image folder (24 files), 1 device against 2.
    from tests.data_files import image_folder

    folder = image_folder(weights_path.parent / f"images-{n}", per_class=8)
    images = kmk.image_dataset_from_directory(
        folder, batch_size=16, image_size=(8, 8), seed=5, preprocess=kmk.rescale()
    )

    @kmk.distributed(global_batch_size=16)
    def image_model():
        keras.utils.set_random_seed(2)
        model = keras.Sequential(
            [keras.Input((8, 8, 3)), keras.layers.Flatten(), keras.layers.Dense(3)]
        )
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return model

    model = image_model()
    trained["image_folder_start"] = [w.tolist() for w in model.get_weights()]
    model.fit(images, epochs=2, verbose=0)
    trained["image_folder"] = [w.tolist() for w in model.get_weights()]
    result["trained"] = trained
    result["warmup"] = float(kmk.WarmupSchedule(1e-2, warmup_steps=10, start_learning_rate=0.0)(5))

    def outside_then_block():
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
        with kmk.distributed(global_batch_size=16):
            model.compile("sgd", "mse")

    result["errors"] = {
        "nccl": _error(lambda: kmk.distributed(16, cross_device_ops="nccl").distribution),
        "multi_worker": _error(lambda: kmk.distributed(16, strategy="multi_worker").distribution),
        "unknown_device": _error(lambda: kmk.distributed(16, devices=["gpu:7"]).distribution),
        "simulate_late": _error(lambda: kmk.simulate_replicas(n + 1)),
        "outside": _error(outside_then_block) if n > 1 else None,
    }
    os.environ["TF_CONFIG"] = json.dumps(
        {
            "cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
            "task": {"type": "worker", "index": 0},
        }
    )
    result["errors"]["tf_config"] = _error(lambda: kmk.distributed(16).distribution)
    del os.environ["TF_CONFIG"]
    one_device = kmk.distributed(16, devices=["cpu:0"]).distribution
    result["one_device"] = [list(one_device.devices), one_device.num_replicas]
    if n > 1:  # TensorFlow-style names, as the kit takes them on TensorFlow
        tf_names = ["/cpu:0", "/job:localhost/replica:0/task:0/device:CPU:1"]
        result["tf_style_devices"] = list(
            kmk.distributed(16, devices=tf_names).distribution.devices
        )
        import tensorflow as tf

        strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
        result["errors"]["tf_strategy"] = _error(
            lambda: kmk.distributed(16, strategy=strategy).distribution
        )
    result["log"] = records
    out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
