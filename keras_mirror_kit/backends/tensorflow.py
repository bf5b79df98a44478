"""The TensorFlow backend: `tf.distribute` strategies and the kit's TensorFlow-side fixes.

`create_engine` chooses the strategy (`MirroredStrategy` over the replica devices with a
working all-reduce, `MultiWorkerMirroredStrategy` from `TF_CONFIG` or a cluster resolver, or
the user's own), and the hooks below give a kit-built model what Keras' TensorFlow trainer
needs under a strategy: the checks that its variables and optimizer are mirrored, the
workarounds of `keras_mirror_kit.workarounds`, and the replica-side preprocessing of
`keras_mirror_kit.backends.tensorflow_preprocess`.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

import keras
import tensorflow as tf

from keras_mirror_kit import own_steps, precision
from keras_mirror_kit.backends import tensorflow_preprocess
from keras_mirror_kit.backends.tensorflow_state import (  # the checkpoints' reads and checks
    differing_copies,
    finite_check,
    finite_flags,
    gather_rows,
    host_layout,
    host_value,
    read_value,
    reads_collectively,
    replica_copies,
)
from keras_mirror_kit.batch_norm import synchronize_batch_norm
from keras_mirror_kit.devices import (
    mirrored_strategy,
    replica_devices,
    warn_if_gpus_unused,
)
from keras_mirror_kit.devices import simulate_replicas as simulate_replicas
from keras_mirror_kit.precision import ReplicaDevice
from keras_mirror_kit.workarounds import (
    keras_activity_regularizer_sum,
    keras_ema_overwrite,
    keras_grad_accumulation,
    keras_gradient_clipping,
    keras_jit_replicas,
    keras_loss_scale,
    keras_pydataset_epochs,
    keras_replica_shares,
    keras_step_fetch,
    keras_uneven_first_batch,
    tf_data_iterator_stall,
    tf_generator_buffers,
)

__all__ = [
    "NAME",
    "Engine",
    "create_engine",
    # the checkpoints' reads and checks (`tensorflow_state`)
    "differing_copies",
    "finite_check",
    "finite_flags",
    "gather_rows",
    "host_layout",
    "host_value",
    "read_value",
    "reads_collectively",
    "replica_copies",
]

#: Whether every batch must split evenly over the devices.
SHARDS_EACH_BATCH = False  # tf.distribute splits a partial batch
NAME = "tensorflow"
OWN_OBJECT = "a tf.distribute.Strategy"  # what `strategy=` may be besides a name
#: `distributed(strategy=)` values this backend takes besides a `tf.distribute.Strategy`.
STRATEGIES = ("auto", "mirrored", "multi_worker")


class Engine:
    """A `tf.distribute.Strategy` behind the kit's engine interface."""

    def __init__(self, strategy: tf.distribute.Strategy, cross_device_ops: str) -> None:
        self.strategy = strategy
        self.cross_device_ops = cross_device_ops

    @property
    def strategy_name(self) -> str:
        if isinstance(self.strategy, tf.distribute.MultiWorkerMirroredStrategy):
            return "MultiWorkerMirroredStrategy"  # not TF's internal CollectiveAllReduce...
        return type(self.strategy).__name__

    @property
    def devices(self) -> tuple[str, ...]:
        try:
            return tuple(self.strategy.extended.worker_devices)
        except (AttributeError, RuntimeError):  # the default strategy has no device list
            gpus = tf.config.list_logical_devices("GPU")
            return ("/device:GPU:0",) if gpus else ("/device:CPU:0",)

    @property
    def num_replicas(self) -> int:
        return int(self.strategy.num_replicas_in_sync)

    @property
    def is_chief(self) -> bool:
        # The strategy decides: right in every cluster shape, an explicit `chief` job too.
        return bool(getattr(self.strategy.extended, "should_checkpoint", True))

    def scope(self) -> AbstractContextManager[Any]:
        return self.strategy.scope()

    def active_elsewhere(self) -> Any:
        if tf.distribute.has_strategy() and tf.distribute.get_strategy() is not self.strategy:
            return tf.distribute.get_strategy()
        return None


def engine_of_model(model: Any) -> Engine:
    """The strategy a model the kit did not build runs under (the default one, outside)."""
    return Engine(getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy(), "")


def is_own_object(strategy: Any) -> bool:
    """Whether `strategy` is a data-parallel object of this backend (a tf.distribute one)."""
    return isinstance(strategy, tf.distribute.Strategy)


def foreign_object_hint(strategy: Any) -> str:
    """Nothing to add: every other backend's object is unknown here."""
    del strategy
    return ""


def version() -> str:
    """TensorFlow's version."""
    return str(tf.__version__)


def create_engine(
    *,
    devices: Sequence[str] | None,
    cross_device_ops: Any,
    strategy: Any,
    cluster_resolver: Any,
    multi_worker: bool,
) -> Engine:
    """The strategy `distributed()` asked for, behind an `Engine`."""
    if isinstance(strategy, tf.distribute.Strategy):
        ops_name = type(getattr(strategy.extended, "_cross_device_ops", None)).__name__
        return Engine(strategy, ops_name)
    if multi_worker:
        from keras_mirror_kit.multi_worker import cluster

        if devices is not None:  # MultiWorkerMirroredStrategy takes no device list
            raise ValueError(
                "`devices` cannot be used with a multi-worker strategy: each worker "
                "trains on all the GPUs it sees (or its CPU). Choose a worker's devices "
                "with CUDA_VISIBLE_DEVICES (`keras-mirror-kit launch --gpus-per-worker "
                "K` sets it per worker), or drop TF_CONFIG/strategy='multi_worker' for "
                f"one process. Received: devices={list(devices)!r}"
            )
        made, ops_name = cluster.create_strategy(
            cluster_resolver=cluster_resolver, cross_device_ops=cross_device_ops
        )
    else:
        made, ops_name = mirrored_strategy(replica_devices(devices), cross_device_ops)
    warn_if_gpus_unused()  # a CUDA build that found no GPU on a GPU machine
    return Engine(made, ops_name)


def _strategy_of_variable(variable: Any) -> tf.distribute.Strategy | None:
    value = getattr(variable, "value", variable)
    if isinstance(value, tf.distribute.DistributedValues):
        return value._distribute_strategy  # noqa: SLF001
    return None


def check_placement(model: Any, engine: Engine, origin: str) -> None:
    """`ValueError` when the model, a variable or the optimizer was made outside the scope."""
    strategy = engine.strategy
    if getattr(model, "_distribute_strategy", None) is not strategy:
        raise ValueError(
            f"The model {origin} was created outside the strategy's scope, so it would "
            "silently train on one device. Create the model inside the decorated "
            "factory (or inside `with kmk.distributed(...)`), not before it. "
            f"Received: model={model.name!r}"
        )
    if engine.num_replicas > 1 or isinstance(strategy, tf.distribute.MirroredStrategy):
        outside = [v.path for v in model.variables if _strategy_of_variable(v) is not strategy]
        if outside:
            raise ValueError(
                f"{len(outside)} variable(s) of the model {origin} were created outside the "
                "strategy's scope (for example a layer built before the factory "
                "or block ran). Create and build every layer inside the decorated factory "
                "or the `with` block. "
                f"Received: variables={outside[:5]}{' ...' if len(outside) > 5 else ''}"
            )
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        opt_strategy = getattr(optimizer, "_distribution_strategy", strategy)
        if opt_strategy is not strategy:
            raise ValueError(
                f"The optimizer of the model {origin} was created outside the strategy's "
                "scope; its updates would not be mirrored. Create the optimizer "
                "inside the decorated factory or the `with` block, e.g. "
                "`model.compile(optimizer=keras.optimizers.Adam(lr), ...)` there. "
                f"Received: optimizer={type(optimizer).__name__}"
            )


def sync_batch_norm(model: Any) -> None:
    """BatchNormalization with statistics over the whole global batch (`synchronized=True`)."""
    synchronize_batch_norm(model)


def after_compile(model: Any, engine: Engine, name: str) -> None:
    """A compiled model's optimizer fixes (accumulation, clipping, EMA) and the XLA check."""
    optimizer = getattr(model, "optimizer", None)
    inner = keras_grad_accumulation.accumulating_optimizer(optimizer)
    if inner is not None:
        keras_grad_accumulation.apply(inner)  # runs under the strategy: see that module
    keras_gradient_clipping.apply(optimizer, engine.num_replicas)  # clip the reduced gradient
    keras_ema_overwrite.apply(optimizer)  # no merge call inside Keras' overwrite conditional
    keras_jit_replicas.check(model, len(engine.devices), name)
    has_gpus = any("GPU" in d.upper() for d in engine.devices)
    keras_jit_replicas.note_auto(model, has_gpus=has_gpus)


def after_prepare(model: Any, engine: Engine) -> None:
    """At every preparation: float16 loss scaling that every replica agrees on; activity
    regularizers refused where Keras sums them over each replica's part."""
    keras_activity_regularizer_sum.check(model, engine.num_replicas, repr(model.name))
    keras_loss_scale.apply(model, engine.strategy)


def install(model: Any) -> None:
    """Once per model: exact steps on any split (Keras' own steps, or the model's own),
    replica steps, no tf.data autotuning thread, uneven first batches."""
    own_steps.apply(model, model.distribute_strategy)  # before: Keras' steps it leaves
    keras_replica_shares.apply(model)  # first of the rest: the replica steps wrap these
    tensorflow_preprocess.install(model)  # make_dataset's preprocess on the replicas
    tf_data_iterator_stall.apply(model)  # no tf.data autotuning thread: see that module
    keras_uneven_first_batch.apply(  # evaluation on batches that split unevenly
        model, before_build=own_steps.before_build, after_build=own_steps.after_build
    )
    keras_step_fetch.apply(model)  # Keras 3.16: one-step executions read in the graph


@contextlib.contextmanager
def call(model: Any, engine: Engine, method: str, arguments: dict[str, Any]) -> Iterator[None]:
    """Around one `fit`/`evaluate`/`predict` of a kit-built model, after its checks."""
    keras_jit_replicas.check(model, len(engine.devices), f"{method}()")
    whole = not (arguments.get("steps_per_epoch") or keras.config.max_steps_per_epoch())
    keras_pydataset_epochs.own(arguments.get("x"), whole if method == "fit" else None)
    if engine.num_replicas > 1:  # batches copied: TensorFlow may write into them there
        for name in ("x", "validation_data"):
            keras_uneven_first_batch.require(arguments.get(name), method)  # where refused
            tf_generator_buffers.own(arguments.get(name))
    try:
        with tensorflow_preprocess.applied(model, method, arguments):
            yield
    finally:  # a fit that raised before Keras read x leaves no claim on its cursor
        keras_pydataset_epochs.own(arguments.get("x"), False if method == "fit" else None)


def trains_exactly(model: Any) -> bool:
    """Whether a training batch that splits unevenly over the replicas trains as on one."""
    return keras_replica_shares.trains_exactly(model) or own_steps.is_applied(model)


def py_dataset_cursor(x: Any) -> Any:
    """The cursor `SyncedCheckpoint` resumes a `PyDataset` by, mid-epoch (None: not one, or
    Keras is not a version its ordering was tested on)."""
    from keras_mirror_kit.data.py_dataset_cursor import PyDatasetCursor

    if not isinstance(x, keras.utils.PyDataset) or x.num_batches is None:
        return None
    cursor = keras_pydataset_epochs.cursor_of(x)
    if cursor is None:  # made once per PyDataset, kept (weakly) by the workaround module
        cursor = PyDatasetCursor(x)
        if not keras_pydataset_epochs.order_by(x, cursor):
            return None
    return cursor


def stop_agreement(strategy: Any, wake: Any) -> Any:
    """The workers' agreement on the step to stop at on a signal (`tensorflow_agreement`)."""
    from keras_mirror_kit.backends.tensorflow_agreement import StopAgreement

    return StopAgreement(strategy, wake)


def block_contexts() -> list[AbstractContextManager[Any]]:
    """What a `with kmk.distributed(...)` block enters besides the strategy's scope."""
    return [tf_data_iterator_stall.per_device_autotune_disabled()]


def count_training_flops(model: Any, input_specs: Any, label_spec: Any) -> Any:
    """TensorFlow's FLOP statistics of the traced training graph (`tensorflow_flops`)."""
    from keras_mirror_kit.backends import tensorflow_flops

    return tensorflow_flops.count_training_flops(model, input_specs, label_spec)


def _logical_gpu_owners(physical: Sequence[Any]) -> list[int]:
    """Logical GPU index -> the position in `physical` of the GPU it was split from."""
    owner: list[int] = []
    for position, device in enumerate(physical):
        configs = tf.config.get_logical_device_configuration(device) or [None]
        owner.extend([position] * len(configs))
    return owner


def gpu_identity(gpu_indices: Sequence[int]) -> tuple[str, bool, int]:
    """The first replica GPU's name, whether float32 matmuls run as TF32 on it, and how many
    physical GPUs the replicas' (logical) GPUs `gpu_indices` are on."""
    physical = tf.config.get_visible_devices("GPU")
    owner = _logical_gpu_owners(physical)
    used = sorted({owner[i] for i in gpu_indices if i < len(owner)}) or [0]
    name = "unknown GPU"
    tf32 = False
    if physical:
        details = tf.config.experimental.get_device_details(physical[used[0]])
        name = str(details.get("device_name") or name)
        capability = details.get("compute_capability") or (0, 0)
        tf32 = (
            tuple(capability) >= (8, 0)
            and tf.config.experimental.tensor_float_32_execution_enabled()
        )
    return name, tf32, len(used)


def precision_devices(engine: Engine) -> list[ReplicaDevice]:
    """The replicas' devices as `mixed_precision="auto"` sees them (`precision.choose_policy`):
    a GPU's name and compute capability (`get_device_details`; a logical GPU is its physical
    one's), this host's CPU with its `/proc/cpuinfo` flags (TensorFlow's oneDNN kernels use
    AVX512-BF16 and AMX, unless `TF_ENABLE_ONEDNN_OPTS=0`)."""
    physical = tf.config.get_visible_devices("GPU")
    owner = _logical_gpu_owners(physical)
    found: list[ReplicaDevice] = []
    for name in engine.devices:
        match = re.search(r"(GPU|CPU|TPU):(\d+)$", name, re.I)
        kind = match.group(1).lower() if match else "other"
        if kind == "cpu":
            cpu = precision.this_cpu()
            if os.environ.get("TF_ENABLE_ONEDNN_OPTS", "").strip().lower() in ("0", "false"):
                cpu = replace(cpu, no_native_bfloat16="TF_ENABLE_ONEDNN_OPTS=0 turns off oneDNN")
            found.append(cpu)
        elif kind == "gpu":
            index = int(match.group(2))  # type: ignore[union-attr]
            details: dict[str, Any] = {}
            if index < len(owner):
                details = tf.config.experimental.get_device_details(physical[owner[index]])
            capability = details.get("compute_capability")  # absent on ROCm: float32
            name_of = str(details.get("device_name") or f"GPU:{index}")
            cc = (int(capability[0]), int(capability[1])) if capability else None
            found.append(ReplicaDevice("gpu", name_of, compute_capability=cc))
        else:
            found.append(ReplicaDevice(kind, name))
    return found


#: Why `check_replicas` (`doctor --model`) does not run on this backend; None: it does.
REPLICA_CHECK_REFUSAL = None

#: What `doctor` says the kit runs on here.
SUMMARY = "tf.distribute (MirroredStrategy; MultiWorkerMirroredStrategy beyond one host)"
#: The framework this backend runs on, as `doctor` checks its version.
FRAMEWORK = "tensorflow"


def framework_version() -> str:
    """TensorFlow's version."""
    return str(tf.__version__)


def device_report() -> dict[str, Any]:
    """What `info` and `doctor` show of TensorFlow's devices: GPUs, CPUs, CUDA build, NCCL."""
    from keras_mirror_kit.devices import gpu_report, nccl_available, warn_if_gpus_unused

    build, gpus, warnings = gpu_report()
    unused = warn_if_gpus_unused()
    return {
        "framework": "TensorFlow",
        "physical_gpus": [d.name for d in tf.config.list_physical_devices("GPU")],
        "physical_cpus": [d.name for d in tf.config.list_physical_devices("CPU")],
        "nccl_usable": nccl_available(),
        "all_reduce_note": None,  # NCCL is the kit's choice here (cross_device_ops="auto")
        "cuda_build": build,
        "gpu_details": gpus,
        "warnings": ([unused] if unused else []) + warnings,
    }


def multi_worker_choice(workers: int) -> dict[str, Any]:
    """What `distributed()` chooses with `TF_CONFIG` of `workers` workers (not connecting)."""
    return {
        "strategy": "MultiWorkerMirroredStrategy",
        "workers": workers,
        "all_reduce": "collective (NCCL on GPUs, ring on CPUs)",
    }


def logical_devices() -> list[str]:
    """TensorFlow's logical devices (a split GPU or CPU shows each part)."""
    return [d.name for d in tf.config.list_logical_devices()]


def time_all_reduce(engine: Engine, floats: int, repeats: int) -> tuple[float, bool]:
    """Seconds per SUM all-reduce of `floats` float32 values over the replicas (after two
    untimed), and whether the sum was right."""
    strategy, n = engine.strategy, engine.num_replicas
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.fill([floats], float(ctx.replica_id_in_sync_group + 1))
    )

    @tf.function
    def all_reduce(t: Any) -> Any:
        return strategy.run(
            lambda v: tf.distribute.get_replica_context().all_reduce("SUM", v), (t,)
        )

    def first(out: Any) -> float:
        return float(strategy.experimental_local_results(out)[0][0].numpy())

    for _ in range(2):
        first(all_reduce(values))
    start = time.perf_counter()
    for _ in range(repeats):
        out = all_reduce(values)
    correct = first(out) == n * (n + 1) / 2
    return (time.perf_counter() - start) / repeats, correct
