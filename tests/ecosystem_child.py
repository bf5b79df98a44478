"""Runs in a process of its own what the test process cannot: Usage:
`python -m tests.ecosystem_child MODE` with MODE

* `multiprocessing`: a `PyDataset` with `workers=2, use_multiprocessing=True` (Keras forks
  its worker pool: not from the test process, whose other threads the fork would copy),
  plain Keras without a strategy against the kit on 1 and 2 replicas;
* `overwrite`: plain Keras under `MirroredStrategy` on 2 devices (its own collectives,
  in a process no other strategy used), a cycled generator, up to `FITS` fits: after which
  fit its label arrays first came back changed (None: never). Whether a fit overwrites
  depends on tf.data's threads: measured, the first fit in 7 of 10 runs, at the latest the
  6th; one CI run (2 busy cores) saw none in 5.

Prints one line `RESULT {json}`.
"""

from __future__ import annotations

import json
import os
import sys

FITS = 25  # fits before the child reports that plain Keras overwrote nothing


def main() -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import numpy as np

    from tests import test_ecosystem_inputs as inputs

    result: dict[str, object] = {}
    if sys.argv[1] == "multiprocessing":

        def trained(model):
            data = inputs.Batches(workers=2, use_multiprocessing=True)
            history = model.fit(data, epochs=2, verbose=0).history
            return model.get_weights(), history["loss"]

        reference = trained(inputs._model())
        for name, devices in (("one", inputs.ONE), ("two", inputs.TWO)):
            result[name] = inputs._close(reference, trained(inputs._kit_model(devices)))
    else:
        result["overwritten_after"] = None
        for fit in range(1, FITS + 1):
            batches = inputs._batches()
            with tf.distribute.MirroredStrategy(inputs.TWO).scope():
                model = inputs._model()
            steps = inputs.BATCHES
            model.fit(inputs._cycle(batches), steps_per_epoch=steps, epochs=3, verbose=0)
            fresh = inputs._batches()
            if any(not np.array_equal(a[1], b[1]) for a, b in zip(batches, fresh, strict=True)):
                result["overwritten_after"] = fit
                break
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
