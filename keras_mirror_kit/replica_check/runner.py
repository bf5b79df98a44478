"""`check_replicas`: does the user's own model train on N replicas as it trains on one?"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np

from keras_mirror_kit import backends
from keras_mirror_kit.named_objects import resolve
from keras_mirror_kit.replica_check import specs
from keras_mirror_kit.replica_check.causes import state_causes
from keras_mirror_kit.replica_check.record import ReplicaCause, ReplicaCheck, compare_variables
from keras_mirror_kit.validation import (
    non_negative_int,
    non_negative_number,
    positive_int,
    positive_number,
)

__all__ = ["DEFAULT_TOLERANCE", "check_replicas"]

logger = logging.getLogger("keras_mirror_kit")

#: The largest absolute difference counted as equal by default (float32 training).
DEFAULT_TOLERANCE = 1e-5
_STDERR_TAIL = 4000


def check_replicas(
    factory: Any,
    data: Any,
    steps: int = 3,
    *,
    replicas: int | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    batch_size: int | None = None,
    seed: int = 0,
    timeout: float = 600.0,
) -> ReplicaCheck:
    """Trains your own model a few steps on one replica and on N, and compares the results.

    Both runs start from the same weights (those the factory built for the 1-replica run)
    and train `steps` optimizer updates on the same global batches, the first samples of
    `data` in order, unshuffled. The result lists the largest difference of every
    variable (the model's and its optimizer's), the first variable that diverges, the loss
    of each step, and the known causes of a difference the kit finds in the model
    (unsynchronized BatchNormalization, random layers, clipping or another optimizer option
    the kit does not make replica-invariant, XLA, low precision, per-replica state).

    The runs take place in a fresh Python process (logical devices are fixed when
    TensorFlow starts): N replicas on N GPUs where there are that many, else N replicas
    simulated on the CPU or the first GPU (`KMK_SIMULATE_REPLICAS`); the 1-replica run on
    the first of those devices. That process finds `factory` (and `data`, when it is a
    function) by name, so define them at the top level of a module or script; a script
    that calls `check_replicas` must do so under `if __name__ == "__main__":`.

    Args:
        factory: A zero-argument function returning a compiled `keras.Model` (what you
            would decorate with `@kmk.distributed`), the decorated factory itself (its
            batch size, `sync_batch_norm`, `mixed_precision`, `steps_per_execution`,
            `gradient_accumulation_steps` and learning-rate rule are used; its devices and
            strategy are the check's), or its name as `"module:function"` (or
            `"path/to/file.py:function"`).
        data: What you give `fit`: arrays as a tuple `(x, y)` or `(x, y, sample_weight)`,
            a `tf.data.Dataset` of batches, a `keras.utils.PyDataset`, a generator of
            batches, a zero-argument function returning one of those, or its name as
            `"module:function"` (or `"file.py:function"`). Only the first `steps x batch`
            samples are used.
        steps: Optimizer updates each run trains (with gradient accumulation, that many
            times `gradient_accumulation_steps` batches).
        replicas: N, at least 2 (default: the number of GPUs when there are 2 or more,
            else 2).
        tolerance: The largest absolute difference that still counts as equal. The default
            fits float32; float16 or bfloat16 models need about 1e-2.
        batch_size: The global batch size of both runs (default: the decorated factory's
            global batch on N replicas, else the size of the data's first batch, else
            Keras' 32, rounded down to a multiple of N).
        seed: The seed set (`keras.utils.set_random_seed`) before each run builds the model.
        timeout: Seconds the child process may take.

    Returns:
        A `ReplicaCheck`: `passed`, `max_difference`, the per-variable `differences`,
        `first_divergent`, `losses`, `causes`, `error` (why the N-replica run failed, if
        it did) and `describe()`, the report as text.

    Raises:
        TypeError: For a `factory` that is not callable or does not return a
            `keras.Model`, or `data` of another kind.
        ValueError: For a bad `"module:function"` name, a factory or data the child
            process cannot find by name, a model that is not compiled, too few samples, a
            batch size the replicas cannot share, or a bad argument.
        RuntimeError: When the 1-replica run fails or the check does not finish within
            `timeout`, when called inside the check's own child process, or on Keras' JAX
            backend (the check simulates TensorFlow replicas; the message says what to do).

    Example:

    ```python
    # train.py
    import keras_mirror_kit as kmk

    @kmk.distributed(per_replica_batch_size=32, sync_batch_norm=True)
    def build_model(): ...

    def training_data(): return x_train, y_train

    if __name__ == "__main__":
        result = kmk.check_replicas(build_model, training_data, steps=3)
        print(result.describe())
        assert result.passed, result.first_divergent
    ```
    """
    if os.environ.get(specs.CHILD_ENV):
        raise RuntimeError(
            "check_replicas() was called inside the check's own child process: the script "
            "that defines the factory calls it when it is loaded. Put the call under "
            '`if __name__ == "__main__":`.'
        )
    steps = positive_int("steps", steps)
    tolerance = non_negative_number("tolerance", tolerance)
    seed = non_negative_int("seed", seed)
    timeout = positive_number("timeout", timeout)
    if batch_size is not None:
        batch_size = positive_int("batch_size", batch_size)
    if replicas is not None and positive_int("replicas", replicas) < 2:
        raise ValueError(
            "`replicas` must be at least 2: the check compares 1 replica with N. "
            f"Received: replicas={replicas}"
        )
    refusal = backends.current().REPLICA_CHECK_REFUSAL
    if refusal:
        raise RuntimeError(f"{refusal} Received: keras.backend.backend()={backends.name()!r}")
    job: dict[str, Any] = {"steps": steps, "batch_size": batch_size, "seed": seed}
    factory_object, job["factory"] = _reference("factory", factory)
    from keras_mirror_kit.replica_check.samples import (
        choose_global_batch,
        factory_settings,
        save_samples,
        take_samples,
    )

    settings = factory_settings(factory_object)
    job["settings"] = settings.to_json()
    data_object, data_reference = _data_reference(data)
    count, layout, env = _layout(replicas)
    job["replicas"] = count
    if batch_size is not None or settings.global_batch_size is not None:
        choose_global_batch(settings, count, batch_size, None)  # refused here, not in the child
    with tempfile.TemporaryDirectory(prefix="kmk-replica-check-") as job_dir:
        if data_reference is None:
            global_batch, samples = take_samples(data_object, settings, count, steps, batch_size)
            save_samples(os.path.join(job_dir, "samples.npz"), samples)
            job.update(samples="samples.npz", global_batch_size=global_batch)
        else:
            job["data"] = data_reference
        with open(os.path.join(job_dir, "job.json"), "w", encoding="utf-8") as f:
            json.dump(job, f)
        stderr = _run_child(job_dir, env, timeout)
        return _result(job_dir, job, layout, tolerance, stderr, timeout)


def _reference(argument: str, value: Any) -> tuple[Any, dict[str, str]]:
    """(the object, how the child finds it) for a spec string or an object with a name."""
    if isinstance(value, str):
        obj = resolve(value, argument)
        module, _, qualname = value.rpartition(":")
        if module.endswith(".py"):  # the child runs the file as it runs a script of yours
            return obj, {"path": os.path.abspath(module), "qualname": qualname}
        return obj, {"module": module, "qualname": qualname}
    return value, specs.reference_of(value, argument)


def _data_reference(data: Any) -> tuple[Any, dict[str, str] | None]:
    """Data taken here (arrays, a dataset), or a name for the child to call or read."""
    if isinstance(data, str):
        return _reference("data", data)
    if callable(data):
        try:
            return data, specs.reference_of(data, "data")
        except ValueError:  # a lambda or local function: its data is taken here
            return data, None
    return data, None


def _layout(replicas: int | None) -> tuple[int, str, dict[str, str]]:
    """(N, where the N replicas run, the child's environment)."""
    import tensorflow as tf

    gpus = len(tf.config.list_physical_devices("GPU"))  # lists; allocates nothing
    count = replicas or (gpus if gpus > 1 else 2)
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env[specs.CHILD_ENV] = "1"
    cwd = os.getcwd()
    paths = [cwd, *(os.path.abspath(p) if p else cwd for p in sys.path)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    if gpus >= count:
        env.pop("KMK_SIMULATE_REPLICAS", None)
        return count, f"{count} GPUs", env
    env["KMK_SIMULATE_REPLICAS"] = str(count)
    return count, f"{count} replicas simulated on the {'GPU' if gpus else 'CPU'}", env


def _run_child(job_dir: str, env: dict[str, str], timeout: float) -> str:
    """Runs the child; its stderr (logged at DEBUG). A timeout is read from its files."""
    command = [sys.executable, "-m", "keras_mirror_kit.replica_check.child", job_dir]
    try:
        proc = subprocess.run(
            command, capture_output=True, text=True, env=env, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as err:
        stderr = err.stderr.decode("utf-8", "replace") if isinstance(err.stderr, bytes) else ""
        return stderr or ""
    logger.debug("keras-mirror-kit: replica check (exit %d): %s", proc.returncode, proc.stderr)
    if proc.returncode not in (0, 3) and not os.path.exists(os.path.join(job_dir, "one.json")):
        raise RuntimeError(
            f"The replica check's process ended with exit status {proc.returncode} before "
            f"the 1-replica run finished. Its last output:\n{proc.stderr[-_STDERR_TAIL:]}"
        )
    return proc.stderr


def _read_json(job_dir: str, name: str) -> Any:
    path = os.path.join(job_dir, name)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _raise_child_error(error: dict[str, Any]) -> None:
    """Raises what the 1-replica run raised: the user's TypeError/ValueError as they were."""
    if error["phase"] == "setup" and error["type"] in ("TypeError", "ValueError"):
        raise (TypeError if error["type"] == "TypeError" else ValueError)(error["message"])
    when = "while training" if error["phase"] == "train" else "before training"
    causes = "".join(
        f"\n  {c['code']}: {c['explanation']}\n    fix: {c['fix']}" for c in error["causes"]
    )
    raise RuntimeError(
        f"The 1-replica run failed {when}, so there is nothing to compare N replicas with: "
        f"{error['type']}: {error['message']}"
        + (f"\nKnown causes found in the model:{causes}" if causes else "")
        + f"\n{error['traceback'][-_STDERR_TAIL:]}"
    )


def _load(job_dir: str, name: str) -> list[np.ndarray]:
    with np.load(os.path.join(job_dir, name), allow_pickle=False) as npz:
        return [npz[f"arr_{i}"] for i in range(len(npz.files))]


def _result(
    job_dir: str, job: dict[str, Any], layout: str, tolerance: float, stderr: str, timeout: float
) -> ReplicaCheck:
    error = _read_json(job_dir, "error.json")
    if error is not None:
        _raise_child_error(error)
    one = _read_json(job_dir, "one.json")
    if one is None:
        raise RuntimeError(
            f"The replica check did not finish the 1-replica run within timeout={timeout:g} "
            f"s. Its last output:\n{stderr[-_STDERR_TAIL:]}"
        )
    count = int(job["replicas"])
    many = _read_json(job_dir, "many.json") or {
        "error": f"did not finish within timeout={timeout:g} s (or the process died: "
        f"{stderr.strip().splitlines()[-1] if stderr.strip() else 'no output'})",
        "losses": [],
        "variables": [],
    }
    causes = [ReplicaCause(**cause) for cause in one["causes"]]
    if many["error"] is None:
        differences, first, largest = compare_variables(
            one["paths"], _load(job_dir, "one.npz"), _load(job_dir, "many.npz"), tolerance
        )
        by_path = {d.path: d.difference for d in differences}
        report = [
            {**v, "path": path, "difference": by_path[path]}
            for path, v in zip(one["paths"], many["variables"])
        ]
        causes += state_causes(report, tolerance, causes)
    else:
        differences, first, largest = (), None, float("inf")
    return ReplicaCheck(
        replicas=count,
        layout=layout,
        steps=int(job["steps"]),
        global_batch_size=int(one["global_batch_size"]),
        tolerance=tolerance,
        max_difference=largest,
        differences=differences,
        first_divergent=first,
        losses={1: tuple(one["losses"]), count: tuple(many["losses"])},
        causes=tuple(causes),
        error=many["error"],
        passed=many["error"] is None and largest <= tolerance,
    )
