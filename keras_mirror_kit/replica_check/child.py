"""The replica check's child process: the user's model trained on 1 replica, then on N.

Run as `python -m keras_mirror_kit.replica_check.child JOB_DIR` by `check_replicas`, with
the replica layout already in the environment (`KMK_SIMULATE_REPLICAS=N` where there are
not N GPUs), since logical devices are fixed when TensorFlow starts. One process holds
both runs: the 1-replica run on the first of the N devices, then the N-replica run from
the 1-replica run's initial weights, on the same kernels, so nothing but the replica count
differs (and TensorFlow starts once). It writes what each run found as it ends
(`one.json` and `one.npz`, then `many.json` and `many.npz`: losses, variables), or
`error.json` when the 1-replica run cannot be set up or trained; a failure of the
N-replica run is part of its `many.json`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import traceback
from typing import Any

__all__ = ["main"]

_SETUP, _TRAIN = "setup", "train"
_ERROR_CHARS = 1500  # of the N-replica run's error, in the report


class _Failure(Exception):
    """An error of one phase of the 1-replica run, to report as `error.json`."""

    def __init__(self, phase: str, error: BaseException, causes: list[Any] | None = None) -> None:
        super().__init__(phase)
        self.phase = phase
        self.error = error
        self.causes = causes or []  # what the model shows, when it was built


def _write_json(path: str, value: Any) -> None:
    from pathlib import Path

    from keras_mirror_kit.atomic_files import atomic_write_bytes

    atomic_write_bytes(Path(path), json.dumps(value, default=str).encode("utf-8"))


def _loss_recorder() -> Any:
    import keras

    class LossPerStep(keras.callbacks.Callback):
        """Each step's loss, from the running mean Keras logs after each step (or execution)."""

        def __init__(self) -> None:
            super().__init__()
            self.losses: list[float] = []
            self._steps = 0
            self._mean = 0.0

        def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
            if not logs or "loss" not in logs:
                return
            from keras_mirror_kit.upstream import keras_private

            spe = getattr(self.model, "steps_per_execution", 1)
            steps = keras_private.last_step_of_execution(batch, spe) + 1
            mean = float(logs["loss"])
            if steps <= self._steps:
                return
            total = steps * mean - self._steps * self._mean
            self.losses.append(total / (steps - self._steps))
            self._steps, self._mean = steps, mean

    return LossPerStep()


def _build(settings: Any, global_batch: int, devices: list[str], seed: int) -> Any:
    """The user's model, built by the kit on `devices`, compiled, with its weights created."""
    import keras

    from keras_mirror_kit.distributed import distributed

    options = dict(settings.options)
    if not any("GPU" in d.upper() for d in devices):
        options.pop("cross_device_ops", None)  # a GPU all-reduce named for the user's GPUs
    config = distributed(
        global_batch_size=global_batch, devices=devices, strategy="mirrored", **options
    )
    factory = config(settings.inner)
    keras.utils.set_random_seed(seed)
    model = factory()
    if not model.compiled or getattr(model, "optimizer", None) is None:
        raise ValueError(
            "The factory must return a compiled keras.Model: call model.compile(optimizer=..., "
            f"loss=...) in it. Received: a model that is not compiled ({model.name!r})"
        )
    return model, factory.distribution


def _ensure_built(model: Any, dist: Any, structure: Any, global_batch: int) -> None:
    """Builds a model whose layers have no weights yet (a subclassed model) on a first batch.

    A model with weights is left as it is (a GAN without `call()` holds built sub-models).
    """
    if model.weights:
        return
    import keras

    first = keras.tree.map_structure(lambda a: a[:global_batch], structure)
    x = first[0] if isinstance(first, tuple) else first
    with dist.strategy.scope():
        model(x, training=False)


def _variables(model: Any) -> list[tuple[str, str, Any]]:
    """(path, "model" or "optimizer", variable), each variable once, paths made unique: the
    model's, then every optimizer's it holds (`model_parts.optimizers_of`)."""
    from keras_mirror_kit.model_parts import optimizers_of

    seen: set[int] = set()
    found = []
    counts: dict[str, int] = {}
    groups = [("model", model.variables)]
    groups += [("optimizer", optimizer.variables) for optimizer in optimizers_of(model)]
    for kind, variables in groups:
        for variable in variables:
            if id(variable) in seen:
                continue
            seen.add(id(variable))
            path = str(getattr(variable, "path", None) or variable.name)
            counts[path] = counts.get(path, 0) + 1
            found.append((path if counts[path] == 1 else f"{path}#{counts[path]}", kind, variable))
    return found


def _copies_differ(variable: Any) -> bool:
    import numpy as np
    import tensorflow as tf

    value = getattr(variable, "value", variable)
    if not isinstance(value, tf.distribute.DistributedValues):
        return False
    copies = [np.asarray(c.numpy()) for c in value.values]
    return any(not np.array_equal(copies[0], c, equal_nan=True) for c in copies[1:])


def _train(model: Any, structure: Any, global_batch: int) -> list[float]:
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices(structure).batch(
        global_batch, drop_remainder=True
    )
    recorder = _loss_recorder()
    model.fit(dataset, epochs=1, verbose=0, callbacks=[recorder])
    return recorder.losses


def _save(path: str, values: list[Any]) -> None:
    import numpy as np

    np.savez(path, *values)


def _one_replica(job: dict[str, Any], job_dir: str) -> dict[str, Any]:
    import numpy as np

    from keras_mirror_kit.backends import configure_from_environment
    from keras_mirror_kit.devices import replica_devices
    from keras_mirror_kit.replica_check import causes, specs
    from keras_mirror_kit.replica_check.samples import (
        FactorySettings,
        factory_settings,
        load_samples,
        take_samples,
    )

    replicas, steps = int(job["replicas"]), int(job["steps"])
    try:
        configure_from_environment()
        devices = replica_devices()[:replicas]
        if len(devices) != replicas:
            raise RuntimeError(
                f"The check's process has {len(devices)} device(s) for {replicas} replicas: "
                f"{devices}"
            )
        inner = factory_settings(specs.load(job["factory"], "factory")).inner
        settings = FactorySettings(inner=inner, **job["settings"])
        if "samples" in job:
            global_batch = int(job["global_batch_size"])
            structure = load_samples(os.path.join(job_dir, job["samples"]))
        else:
            data = specs.load(job["data"], "data")
            global_batch, structure = take_samples(
                data, settings, replicas, steps, job.get("batch_size")
            )
        model, dist = _build(settings, global_batch, devices[:1], int(job["seed"]))
        _ensure_built(model, dist, structure, global_batch)
        initial = model.get_weights()
        found = causes.model_causes(model, replicas)
    except Exception as err:
        raise _Failure(_SETUP, err) from err
    try:
        losses = _train(model, structure, global_batch)
    except Exception as err:
        raise _Failure(_TRAIN, err, found) from err
    found += causes.trained_causes(model)
    variables = _variables(model)
    _save(os.path.join(job_dir, "one.npz"), [np.asarray(v.numpy()) for _, _, v in variables])
    summary = {
        "global_batch_size": global_batch,
        "paths": [path for path, _, _ in variables],
        "losses": losses,
        "causes": [dataclasses.asdict(cause) for cause in found],
    }
    _write_json(os.path.join(job_dir, "one.json"), summary)  # what a hang of N replicas keeps
    return {
        **summary,
        "settings": settings,
        "devices": devices,
        "structure": structure,
        "initial": initial,
    }


def _many_replicas(job: dict[str, Any], job_dir: str, one: dict[str, Any]) -> dict[str, Any]:
    """The N-replica run from the 1-replica run's initial weights; its error, if any, told."""
    import keras
    import numpy as np

    from keras_mirror_kit.replica_check.causes import variable_roles

    keras.backend.clear_session()  # the same layer names (and variable paths) again
    try:
        model, dist = _build(
            one["settings"], one["global_batch_size"], one["devices"], int(job["seed"])
        )
        _ensure_built(model, dist, one["structure"], one["global_batch_size"])
        model.set_weights(one["initial"])
        before = {id(v): np.asarray(v.numpy()) for v in model.variables}
        losses = _train(model, one["structure"], one["global_batch_size"])
    except Exception as err:
        message = f"{type(err).__name__}: {err}"
        if len(message) > _ERROR_CHARS:
            message = message[:_ERROR_CHARS] + " ..."
        return {"error": message, "losses": [], "variables": []}
    variables = _variables(model)
    if len(variables) != len(one["paths"]):
        return {
            "error": f"the {len(one['devices'])}-replica model has {len(variables)} variables "
            f"(its optimizer's included), the 1-replica model {len(one['paths'])}: the "
            "factory does not build the same model twice",
            "losses": losses,
            "variables": [],
        }
    roles = variable_roles(model)
    values = [np.asarray(v.numpy()) for _, _, v in variables]
    _save(os.path.join(job_dir, "many.npz"), values)
    report = []
    for (_, kind, variable), value in zip(variables, values):
        old = before.get(id(variable))
        report.append(
            {
                "kind": kind,
                "trainable": bool(getattr(variable, "trainable", False)),
                "aggregation": str(getattr(variable, "aggregation", None)),
                "role": roles.get(id(variable)),
                "changed": old is not None and not np.array_equal(old, value, equal_nan=True),
                "copies_differ": _copies_differ(variable),
            }
        )
    return {"error": None, "losses": losses, "variables": report}


def _error_report(failure: _Failure) -> dict[str, Any]:
    err = failure.error
    return {
        "phase": failure.phase,
        "type": type(err).__name__,
        "message": str(err),
        "traceback": "".join(traceback.format_exception(err)),
        "causes": [dataclasses.asdict(cause) for cause in failure.causes],
    }


def main(argv: list[str]) -> int:
    """Runs the check described by `JOB_DIR/job.json`; 0 with results, 3 with `error.json`."""
    job_dir = argv[0]
    with open(os.path.join(job_dir, "job.json"), encoding="utf-8") as f:
        job = json.load(f)
    try:
        one = _one_replica(job, job_dir)
    except _Failure as failure:
        _write_json(os.path.join(job_dir, "error.json"), _error_report(failure))
        return 3
    _write_json(os.path.join(job_dir, "many.json"), _many_replicas(job, job_dir, one))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
