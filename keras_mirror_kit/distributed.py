"""`distributed()`: one object that is both a decorator for a model factory and a context.

```python
@kmk.distributed(per_replica_batch_size=64)
def build_model(): ...

with kmk.distributed(per_replica_batch_size=64) as dist: ...
```

The strategy is created lazily, the first time the factory runs, the `with` block is
entered or `.distribution` is read, so that decorating a function at import time does not
initialise TensorFlow's devices (and `simulate_replicas` can still run first).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack
from dataclasses import replace
from types import TracebackType
from typing import Any, Generic, ParamSpec, TypeVar

from keras_mirror_kit import backends
from keras_mirror_kit.distribution import Distribution, activate
from keras_mirror_kit.model_setup import ModelOptions, prepare_model
from keras_mirror_kit.precision import (
    AUTO,
    PrecisionChoice,
    choose_policy,
    log_choice,
    policy_scope,
    validate_policy,
)
from keras_mirror_kit.scaling import DEFAULT_RULE, validate_rule
from keras_mirror_kit.scaling import per_replica_batch_size as split_global_batch
from keras_mirror_kit.upstream import versions
from keras_mirror_kit.validation import check_bool, positive_int
from keras_mirror_kit.with_block import block, factory_running

__all__ = ["DistributedFactory", "distributed"]

logger = logging.getLogger("keras_mirror_kit")

P = ParamSpec("P")
R = TypeVar("R")

# steps_per_execution="auto": enough steps per call to amortise Keras' per-step Python
# overhead (benchmarks/knobs.py), few enough that batch-level callbacks stay responsive.
AUTO_STEPS_PER_EXECUTION = 8


class distributed(AbstractContextManager[Distribution]):  # noqa: N801  (reads like a function)
    """Runs a model factory, or a block, under a data-parallel strategy on every replica.

    Both forms give a model the same guarantees (`keras_mirror_kit.model_setup`): it is
    checked (a `keras.Model` whose variables and optimizer were created under this
    strategy; a model built outside silently trains on one device in Keras 3), registered
    for the kit's callbacks, given the knobs below, and its `fit`, `evaluate` and
    `predict` check their data and step counts before any step, run the kit's
    log-producing callbacks first, and run without the end-of-fit stall.

    * Decorator: the factory runs inside the strategy's scope; the model it returns is
      prepared (and a `compile()` called later runs inside the scope).
    * Context manager: the block runs inside the strategy's scope, and every model
      **compiled inside the block** (in this thread) is prepared when `compile()` returns.
      A model built before the block is rejected at that `compile()`; a model built in the
      block but compiled after it trains distributed but without the checks (the kit's
      callbacks log a warning).

    On Keras' TensorFlow backend the strategy is a `tf.distribute.MirroredStrategy` over all
    visible GPUs, or over the logical CPUs when there is no GPU (one, unless
    `simulate_replicas` configured more), or `MultiWorkerMirroredStrategy` for a cluster. On
    its JAX backend it is a `keras.distribution.DataParallel` over this process's GPUs, else
    its CPU devices (`simulate_replicas` makes more); the model's `fit`, `evaluate` and
    `predict` run under it. One INFO log line on the `keras_mirror_kit` logger says what was
    chosen. What has no meaning on JAX (`cross_device_ops`, a multi-worker cluster) is
    refused there before any step.

    Args:
        per_replica_batch_size: Samples per replica per step. Give this or
            `global_batch_size`, not both.
        global_batch_size: Samples per step over all replicas; must divide evenly by the
            number of replicas.
        devices: Device names to use (default: all GPUs, else the CPUs): TensorFlow's
            (`"/gpu:0"`) or, on JAX, also what `keras.distribution.list_devices()` returns
            (`"gpu:0"`, `"cpu:0"`).
        cross_device_ops: `"auto"`, `"nccl"`, `"hierarchical_copy"`,
            `"reduction_to_one_device"`, or a `tf.distribute.CrossDeviceOps` (TensorFlow;
            only `"auto"` on JAX).
        strategy: `"auto"` (TensorFlow: MultiWorkerMirroredStrategy when `TF_CONFIG`
            describes more than one worker or a `cluster_resolver` is given, else
            MirroredStrategy; JAX: DataParallel), `"mirrored"`, `"multi_worker"`, or a
            `tf.distribute.Strategy` you built yourself (JAX: `"data_parallel"` or a
            `keras.distribution.Distribution`).
        cluster_resolver: A `tf.distribute.cluster_resolver.ClusterResolver` (for example
            `SlurmClusterResolver()`) for a multi-worker run; implies `"multi_worker"`.
        sync_batch_norm: Make every `BatchNormalization` of the model compute its batch
            statistics across all replicas.
        mixed_precision: `"auto"`, `"mixed_float16"`, `"mixed_bfloat16"` or None
            (float32, the default): the Keras dtype policy for the layers built in the
            factory or block (the global policy is restored afterwards); output layers stay
            float32; float16 gets loss scaling, whose skip-the-step decision every replica
            takes together (`keras_mirror_kit.workarounds.keras_loss_scale`). `"auto"`
            decides from the devices the strategy uses, when it is created: bfloat16 where
            every one computes it natively (NVIDIA GPUs of compute capability 8.0+; CPUs with
            AVX512-BF16 or AMX-BF16 in `/proc/cpuinfo`, on TensorFlow), float16 on GPUs of
            compute capability 7.x, float32 elsewhere (CPUs without those instructions,
            JAX's CPU devices, devices whose capability or flags are unknown, as on a system
            without `/proc/cpuinfo`). One INFO line says what it chose and why
            (`keras_mirror_kit.precision.choose_policy`). Each worker of a cluster decides
            from its own devices: give a policy by name on unlike hosts.
        steps_per_execution: Steps per compiled call: an integer, or `"auto"` (8); None
            leaves what `compile()` got.
        gradient_accumulation_steps: Micro-batches per optimizer update (default 1: an
            update at every step). With N > 1 the model's optimizer (the inner optimizer of
            a `LossScaleOptimizer`) accumulates the gradients of N steps and applies their
            mean, with Keras' own `gradient_accumulation_steps` mechanism, made to work under
            the strategy (`keras_mirror_kit.workarounds.keras_grad_accumulation`). The batch
            given to
            `fit` stays `global_batch_size`; each update sees `effective_batch_size` =
            per-replica batch x replicas x N samples, which `scale_learning_rate` uses.
        lr_scaling_rule: Default rule of `Distribution.scale_learning_rate`.

    Raises:
        RuntimeError: If Keras runs on another backend than TensorFlow or JAX.
        TypeError: On a wrong argument type, or when the factory returns no `keras.Model`.
        ValueError: On both or neither batch size, a non-positive or indivisible batch
            size, a non-positive `gradient_accumulation_steps`, unknown devices, rule or
            all-reduce, a model or optimizer created outside the strategy's scope, or an
            optimizer given another `gradient_accumulation_steps` than this one.

    Example:

    ```python
    import keras, keras_mirror_kit as kmk

    @kmk.distributed(per_replica_batch_size=64)
    def build_model():
        lr = kmk.current().scale_learning_rate(1e-3, base_batch_size=64)
        model = keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Flatten(),
                                  keras.layers.Dense(10, activation="softmax")])
        model.compile(optimizer=keras.optimizers.Adam(lr),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model

    model = build_model()
    model.fit(kmk.make_dataset(x, y, build_model.distribution.global_batch_size), epochs=10)
    ```
    """

    def __init__(
        self,
        per_replica_batch_size: int | None = None,
        *,
        global_batch_size: int | None = None,
        devices: Sequence[str] | None = None,
        cross_device_ops: Any = "auto",
        strategy: Any = "auto",
        lr_scaling_rule: str = DEFAULT_RULE,
        cluster_resolver: Any = None,
        sync_batch_norm: bool = False,
        mixed_precision: str | None = None,
        steps_per_execution: int | str | None = None,
        gradient_accumulation_steps: int = 1,
    ) -> None:
        backend = backends.current()  # RuntimeError on a backend the kit cannot distribute on
        versions.notice_untested("distributed()")  # once per version set
        if per_replica_batch_size is None and global_batch_size is None:
            raise ValueError(
                "distributed() needs a batch size: pass `per_replica_batch_size` (samples "
                "per replica per step) or `global_batch_size` (samples per step over all "
                "replicas). Received: per_replica_batch_size=None, global_batch_size=None"
            )
        if per_replica_batch_size is not None and global_batch_size is not None:
            raise ValueError(
                "Pass either `per_replica_batch_size` or `global_batch_size`, not both. "
                f"Received: per_replica_batch_size={per_replica_batch_size}, "
                f"global_batch_size={global_batch_size}"
            )
        if per_replica_batch_size is not None:
            positive_int("per_replica_batch_size", per_replica_batch_size)
        if global_batch_size is not None:
            positive_int("global_batch_size", global_batch_size)
        ready_made = backend.is_own_object(strategy)
        if not ready_made and strategy not in backend.STRATEGIES:
            raise ValueError(
                "Unknown `strategy`. Expected one of "
                f"{', '.join(map(repr, backend.STRATEGIES))} or the backend's own object "
                f"({backend.OWN_OBJECT}).{backend.foreign_object_hint(strategy)} "
                f"Received: strategy={strategy!r}"
            )
        if ready_made and devices is not None:
            raise ValueError(
                "`devices` cannot be combined with a ready-made `strategy` (its devices are "
                f"fixed). Received: devices={devices!r}"
            )
        if isinstance(devices, str):
            raise TypeError(
                "`devices` must be a list of device names such as ['/gpu:0', '/gpu:1']. "
                f"Received: devices={devices!r}"
            )
        check_bool("sync_batch_norm", sync_batch_norm)
        if steps_per_execution == "auto":
            steps_per_execution = AUTO_STEPS_PER_EXECUTION
        elif steps_per_execution is not None:
            if isinstance(steps_per_execution, str):
                raise ValueError(
                    "`steps_per_execution` must be a positive integer, 'auto' or None. "
                    f"Received: steps_per_execution={steps_per_execution!r}"
                )
            positive_int("steps_per_execution", steps_per_execution)
        self._accumulation = positive_int(
            "gradient_accumulation_steps", gradient_accumulation_steps
        )
        self._options = ModelOptions(
            mixed_precision=validate_policy(mixed_precision),
            sync_batch_norm=sync_batch_norm,
            steps_per_execution=steps_per_execution,
        )
        self._per_replica_batch_size = per_replica_batch_size
        self._global_batch_size = global_batch_size
        self._devices = list(devices) if devices is not None else None
        self._cross_device_ops = cross_device_ops
        self._strategy_arg = strategy
        self._cluster_resolver = cluster_resolver
        self._lr_scaling_rule = validate_rule(lr_scaling_rule)
        self._precision_choice: PrecisionChoice | None = None  # what "auto" chose
        self._distribution: Distribution | None = None
        self._lock = threading.Lock()
        self._local = threading.local()  # each thread's open `with` blocks

    @property
    def distribution(self) -> Distribution:
        """The `Distribution`, created (with its strategy) on first access."""
        with self._lock:
            if self._distribution is None:
                self._distribution = self._create()
            return self._distribution

    def _create(self) -> Distribution:
        backends.configure_from_environment()
        engine = backends.current().create_engine(
            devices=self._devices,
            cross_device_ops=self._cross_device_ops,
            strategy=self._strategy_arg,
            cluster_resolver=self._cluster_resolver,
            multi_worker=self._wants_multi_worker(),
        )
        replicas = engine.num_replicas
        if self._global_batch_size is not None:
            per_replica = split_global_batch(self._global_batch_size, replicas)
        else:
            per_replica = int(self._per_replica_batch_size)  # type: ignore[arg-type]
        dist = Distribution(
            engine.strategy,
            per_replica,
            engine.cross_device_ops,
            self._lr_scaling_rule,
            gradient_accumulation_steps=self._accumulation,
        )
        logger.info(dist.describe())
        if self._options.mixed_precision == AUTO:
            choice = choose_policy(backends.current().precision_devices(engine))
            log_choice(choice)
            self._precision_choice = choice
        return dist

    def _model_options(self) -> ModelOptions:
        """The knobs for a model, `mixed_precision="auto"` decided (the distribution exists)."""
        if self._precision_choice is None:
            return self._options
        return replace(self._options, mixed_precision=self._precision_choice.policy)

    def _wants_multi_worker(self) -> bool:
        if isinstance(self._strategy_arg, str) and self._strategy_arg == "multi_worker":
            return True
        if self._cluster_resolver is not None:
            return True
        if not isinstance(self._strategy_arg, str) or self._strategy_arg != "auto":
            return False
        from keras_mirror_kit.multi_worker import cluster

        return cluster.tf_config_num_workers() > 1

    def __call__(self, factory: Callable[P, R]) -> DistributedFactory[P, R]:
        if not callable(factory):
            raise TypeError(
                "@kmk.distributed(...) decorates a model factory (a function returning a "
                f"keras.Model). Received: {factory!r}"
            )
        return DistributedFactory(self, factory)

    def __enter__(self) -> Distribution:
        dist = self.distribution
        with ExitStack() as stack:
            stack.enter_context(block(dist, self._model_options()))
            self._open_blocks().append(stack.pop_all())
        return dist

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._open_blocks().pop().close()

    def _open_blocks(self) -> list[ExitStack]:
        if not hasattr(self._local, "blocks"):
            self._local.blocks = []
        return self._local.blocks


class DistributedFactory(Generic[P, R]):
    """A model factory wrapped by `@kmk.distributed(...)`.

    Calling it runs the factory under the strategy and checks the model it returns. It
    keeps the factory's name and docstring, and passes all arguments through.

    Args:
        config: The `distributed` object that decorated the factory.
        factory: The user's function returning a `keras.Model`.

    Returns:
        Calling the instance returns the factory's model.

    Raises:
        TypeError: If the factory returns something other than a `keras.Model`.
        ValueError: If the model or its optimizer was created outside the strategy's scope.

    Example:

    ```python
    @kmk.distributed(per_replica_batch_size=32)
    def build_model(depth=2): ...

    model = build_model(depth=3)
    build_model.distribution.global_batch_size
    ```
    """

    def __init__(self, config: distributed, factory: Callable[P, R]) -> None:
        self._config = config
        self._factory = factory
        functools.update_wrapper(self, factory)

    @property
    def distribution(self) -> Distribution:
        """The `Distribution` the factory builds under (created on first access)."""
        return self._config.distribution

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        dist = self.distribution
        options = self._config._model_options()  # noqa: SLF001
        strategy = f"{getattr(self._factory, '__name__', 'build_model')}.distribution.strategy"
        with activate(dist, strategy), policy_scope(options.mixed_precision), factory_running():
            model = self._factory(*args, **kwargs)
        prepare_model(model, dist, options, name=getattr(self._factory, "__name__", "factory"))
        return model

    def __repr__(self) -> str:
        return f"<distributed factory {getattr(self._factory, '__qualname__', self._factory)!r}>"
