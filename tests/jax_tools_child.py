"""A fresh interpreter on Keras' JAX backend: `python -m tests.jax_tools_child OUT.json`.

Counts FLOPs with XLA's cost analysis (`kmk.count_training_flops`) and trains with
`ThroughputMonitor` on 2 simulated CPU devices; writes what it saw as JSON for
`tests/test_flops_jax.py`.
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
    out = Path(sys.argv[1])
    import numpy as np

    import keras_mirror_kit as kmk

    kmk.simulate_replicas(2)
    import keras

    from keras_mirror_kit.throughput.flops import count_training_flops
    from tests import models
    from tests.flop_models import flop_models

    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("keras_mirror_kit").addHandler(Collect())
    logging.getLogger("keras_mirror_kit").setLevel(logging.INFO)
    result: dict = {"keras_backend": keras.backend.backend(), "counts": {}}
    for name, model in flop_models().items():
        count = count_training_flops(model)
        result["counts"][name] = {
            "flops": count.flops_per_sample,
            "forward": count.forward_flops_per_sample,
            "counter": count.counter,
            "loss": count.loss,
        }

    @kmk.distributed(global_batch_size=32, mixed_precision="mixed_bfloat16")
    def build() -> keras.Model:
        model = kmk.models.tutorial_cnn()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        return model

    model = build()
    count = count_training_flops(model)
    result["distributed_bf16"] = {
        "flops": count.flops_per_sample,
        "cached": count_training_flops(model) is count,
        "dtype": kmk.throughput.flops.model_compute_dtype(model),
    }

    @kmk.distributed(global_batch_size=32)
    def build_dense() -> keras.Model:
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        return model

    model = build_dense()
    result["dense_flops"] = count_training_flops(model).flops_per_sample
    rng = np.random.default_rng(0)
    x = rng.random((96, 64), dtype=np.float32)
    y = rng.integers(0, 10, size=(96,))
    monitor = kmk.ThroughputMonitor(warmup_steps=1, peak_flops=1.0e12)
    history = model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[monitor]).history
    result["history"] = {k: [float(v) for v in values] for k, values in history.items()}
    no_peak = kmk.ThroughputMonitor(warmup_steps=1)
    history = model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[no_peak]).history
    result["history_without_peak"] = sorted(history)
    variable_length = keras.Sequential([keras.Input((None, 64)), keras.layers.Dense(8)])
    variable_length.compile("sgd", "mse")
    result["errors"] = {
        "lazy": _error(lambda: count_training_flops(models.compile_sgd(models.subclassed_lazy()))),
        "unknown_shape": _error(lambda: count_training_flops(variable_length)),
    }
    given = count_training_flops(variable_length, input_specs=[keras.KerasTensor((None, 5, 64))])
    result["given_specs"] = given.flops_per_sample
    result["log"] = records
    out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
