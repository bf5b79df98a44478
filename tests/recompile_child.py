"""Scripts that train across a recompile, or with learning-rate callbacks, under
`SyncedCheckpoint`: run whole, killed by a progress marker, and rerun as the same script.

Usage: python -m tests.recompile_child OUT_JSON SPEC_JSON

SPEC_JSON is a list of runs, made one after the other in this process (each with its own
model); each run is a dict:

* `"script"`: `"finetune"` (keras-io's fine-tuning guide: a frozen base and a new head
  trained with Adam for 2 epochs, then `base.trainable = True` and `model.compile(...)`
  again, outside the factory, and 2 more epochs, `fit(epochs=4, initial_epoch=2)`, with
  the same `SyncedCheckpoint` instance and directory) or `"rates"` (one `fit` of 5 epochs
  with `ReduceLROnPlateau` on the compiled float rate and a `LearningRateScheduler` whose
  function reads the rate it is given);
* `"directory"`: the checkpoint directory; `"weights"`: where the final weights go (.npz);
* `"second"`: the optimizer of the fine-tuning's second compile (`"adam"`, default, or
  `"sgd"`); `"unfreeze"`: whether the script sets `base.trainable = True` (default true);
* `"kill_after"` and `"marker"`: after training step `kill_after` of the last `fit` (counted
  in this process), write the marker and wait there to be killed.

A run that raises is recorded with the exception (`"error"`: type, message) and the
optimizer's step count then; the others with their final state. The result is a JSON
dict by directory: `"iterations"`, `"optimizer"` (`{path: values}` of the optimizer's
variables), `"rates"` (`{"epoch/step": learning rate}` of every batch trained, by the
optimizer's step count before it),
`"plateau"` (the ReduceLROnPlateau's `wait`, `best`, `cooldown_counter` at the end),
`"restored"` (the last checkpoint restored, `[epoch, step]`), `"weights"`.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("KMK_SIMULATE_REPLICAS", "2")


def main() -> int:
    import keras
    import numpy as np

    import keras_mirror_kit as kmk
    from tests.ckpt_helpers import BATCH, dataset

    out, specs = sys.argv[1], json.loads(open(sys.argv[2]).read())

    def loss():
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    class Recorder(keras.callbacks.Callback):
        """The learning rate of every batch, by `"epoch/step"` (the step count before it)."""

        def __init__(self) -> None:
            super().__init__()
            self.rates: dict[str, float] = {}
            self.epoch = 0

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            optimizer = self.model.optimizer
            step = int(np.asarray(optimizer.iterations))  # the batch's place, resumed or not
            self.rates[f"{self.epoch}/{step}"] = float(np.asarray(optimizer.learning_rate))

    class KillPoint(keras.callbacks.Callback):
        """Writes `marker` after training step `steps` of its fit, then waits to be killed."""

        def __init__(self, steps: int, marker: str) -> None:
            super().__init__()
            self.steps, self.marker, self.done = steps, marker, 0

        def on_train_batch_end(self, batch, logs=None):
            self.done += 1
            if self.done == self.steps:
                with open(self.marker, "w") as handle:
                    handle.write(str(self.done))
                while True:
                    time.sleep(0.05)

    def finetune(spec, last):
        @kmk.distributed(global_batch_size=BATCH)
        def build():
            keras.utils.set_random_seed(5)
            base = keras.Sequential(
                [keras.Input((6,)), keras.layers.Dense(8, activation="relu")], name="base"
            )
            base.trainable = False
            inputs = keras.Input((6,))
            outputs = keras.layers.Dense(3)(base(inputs, training=False))
            model = keras.Model(inputs, outputs)
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss())
            return model

        model, ds = build(), dataset()
        spec["_model"] = model
        checkpoint = kmk.SyncedCheckpoint(spec["directory"], save_freq=4, dataset=ds)
        model.fit(ds, epochs=2, verbose=0, callbacks=[checkpoint])
        model.get_layer("base").trainable = bool(spec.get("unfreeze", True))
        second = {
            "adam": lambda: keras.optimizers.Adam(1e-3),
            "sgd": lambda: keras.optimizers.SGD(1e-3, momentum=0.9),
        }[spec.get("second", "adam")]
        model.compile(optimizer=second(), loss=loss())  # outside the factory
        recorder = Recorder()
        try:
            model.fit(
                ds, epochs=4, initial_epoch=2, verbose=0, callbacks=[checkpoint, recorder, *last]
            )
        finally:
            spec["_recorder"] = recorder
        return model, checkpoint, None

    def rates(spec, last):
        @kmk.distributed(global_batch_size=BATCH)
        def build():
            keras.utils.set_random_seed(5)
            model = keras.Sequential(
                [
                    keras.Input((6,)),
                    keras.layers.Dense(8, activation="relu"),
                    keras.layers.Dense(3),
                ]
            )
            rate = kmk.current().scale_learning_rate(0.05, base_batch_size=8)  # a float
            model.compile(optimizer=keras.optimizers.SGD(rate, momentum=0.5), loss=loss())
            return model

        model, ds = build(), dataset()
        spec["_model"] = model
        checkpoint = kmk.SyncedCheckpoint(spec["directory"], save_freq=4, dataset=ds)
        # min_delta: no epoch improves enough, so the rate is cut at every chance.
        plateau = keras.callbacks.ReduceLROnPlateau(
            monitor="loss", factor=0.5, patience=1, min_delta=10.0, cooldown=1
        )
        scheduler = keras.callbacks.LearningRateScheduler(
            lambda epoch, lr: lr * 0.9 if epoch >= 1 else lr  # reads the rate it is given
        )
        recorder = Recorder()
        spec["_recorder"] = recorder
        callbacks = [checkpoint, scheduler, plateau, recorder, *last]
        model.fit(ds, epochs=5, verbose=0, callbacks=callbacks)
        return model, checkpoint, plateau

    results = {}
    for i, spec in enumerate(specs):
        last = [KillPoint(spec["kill_after"], spec["marker"])] if spec.get("kill_after") else []
        model = None
        result: dict = {}
        try:
            model, checkpoint, plateau = {"finetune": finetune, "rates": rates}[spec["script"]](
                spec, last
            )
        except Exception as err:  # recorded: the test reads it
            result["error"] = [type(err).__name__, str(err)]
            result["error_mro"] = [c.__name__ for c in type(err).__mro__]
            result["iterations"] = int(np.asarray(spec["_model"].optimizer.iterations))
        else:
            restored = checkpoint.last_restored
            result["restored"] = (
                None if restored is None else [restored.meta.epoch, restored.meta.step]
            )
            optimizer = model.optimizer
            result["iterations"] = int(np.asarray(optimizer.iterations))
            result["optimizer"] = {v.path: np.asarray(v).tolist() for v in optimizer.variables}
            if plateau is not None:
                result["plateau"] = [plateau.wait, float(plateau.best), plateau.cooldown_counter]
            weights = os.path.join(os.path.dirname(spec["directory"]), f"final-{i}.npz")
            np.savez(weights, *model.get_weights())
            result["weights"] = weights
        spec.pop("_model", None)
        recorder = spec.pop("_recorder", None)
        result["rates"] = recorder.rates if recorder is not None else {}
        results[spec["directory"]] = result
    with open(out, "w") as handle:
        json.dump(results, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
