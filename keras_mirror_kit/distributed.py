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
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack
from types import TracebackType
from typing import Any, Generic, ParamSpec, TypeVar

import keras
import tensorflow as tf

from keras_mirror_kit import keras_fit_stall
from keras_mirror_kit.batch_norm import synchronize_batch_norm
from keras_mirror_kit.batching import per_replica_batch_size as split_global_batch
from keras_mirror_kit.batching import validate_positive_int
from keras_mirror_kit.devices import (
    configure_from_environment,
    make_cross_device_ops,
    replica_devices,
)
from keras_mirror_kit.distribution import Distribution, activate, register_model
from keras_mirror_kit.keras_epoch_rounding import install_fit_guard
from keras_mirror_kit.lr_scaling import DEFAULT_RULE, validate_rule
from keras_mirror_kit.precision import keep_outputs_float32, policy_scope, validate_policy

__all__ = ["distributed", "DistributedFactory"]

logger = logging.getLogger("keras_mirror_kit")

P = ParamSpec("P")
R = TypeVar("R")

STRATEGIES = ("auto", "mirrored", "multi_worker")
# steps_per_execution="auto": enough steps per call to amortise Keras' per-step Python
# overhead (benchmarks/knobs.py), few enough that batch-level callbacks stay responsive.
AUTO_STEPS_PER_EXECUTION = 8


class distributed(AbstractContextManager[Distribution]):  # noqa: N801  (reads like a function)
    """Runs a model factory, or a block, under a data-parallel strategy on every replica.

    Used as a decorator, the factory's model is built and compiled inside the strategy's
    scope, then checked: it must be a `keras.Model` whose variables and optimizer were
    created under this strategy (a model built outside silently trains on one device in
    Keras 3). Used as a context manager, it enters the scope and binds the `Distribution`.

    The strategy is a `tf.distribute.MirroredStrategy` over all visible GPUs, or over the
    logical CPUs when there is no GPU (one, unless `simulate_replicas` configured more).
    One INFO log line on the `keras_mirror_kit` logger says what was chosen.

    Args:
        per_replica_batch_size: Samples per replica per step. Give this or
            `global_batch_size`, not both.
        global_batch_size: Samples per step over all replicas; must divide evenly by the
            number of replicas.
        devices: Device names to use (default: all GPUs, else the CPUs).
        cross_device_ops: `"auto"`, `"nccl"`, `"hierarchical_copy"`,
            `"reduction_to_one_device"`, or a `tf.distribute.CrossDeviceOps`.
        strategy: `"auto"` (MultiWorkerMirroredStrategy when `TF_CONFIG` describes more than
            one worker or a `cluster_resolver` is given, else MirroredStrategy),
            `"mirrored"`, `"multi_worker"`, or a `tf.distribute.Strategy` you built yourself.
        cluster_resolver: A `tf.distribute.cluster_resolver.ClusterResolver` (for example
            `SlurmClusterResolver()`) for a multi-worker run; implies `"multi_worker"`.
        sync_batch_norm: Make every `BatchNormalization` the factory builds compute its
            batch statistics across all replicas (decorator form only).
        mixed_precision: `"mixed_float16"`, `"mixed_bfloat16"` or None: the Keras dtype
            policy for the layers the factory builds (the global policy is restored
            afterwards); output layers stay float32; float16 gets loss scaling.
        steps_per_execution: Steps per compiled call for the factory's `compile()`: an
            integer, or `"auto"` (8); None leaves what `compile()` got (decorator form
            only).
        lr_scaling_rule: Default rule of `Distribution.scale_learning_rate`.

    Raises:
        TypeError: On a wrong argument type, or when the factory returns no `keras.Model`.
        ValueError: On both or neither batch size, a non-positive or indivisible batch
            size, unknown devices, rule or all-reduce, or a model or optimizer created
            outside the strategy's scope.

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
    model.fit(train_ds.batch(build_model.distribution.global_batch_size), epochs=10)
    ```
    """

    def __init__(
        self,
        per_replica_batch_size: int | None = None,
        *,
        global_batch_size: int | None = None,
        devices: Sequence[str] | None = None,
        cross_device_ops: str | tf.distribute.CrossDeviceOps = "auto",
        strategy: str | tf.distribute.Strategy = "auto",
        lr_scaling_rule: str = DEFAULT_RULE,
        cluster_resolver: Any = None,
        sync_batch_norm: bool = False,
        mixed_precision: str | None = None,
        steps_per_execution: int | str | None = None,
    ) -> None:
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
            validate_positive_int("per_replica_batch_size", per_replica_batch_size)
        if global_batch_size is not None:
            validate_positive_int("global_batch_size", global_batch_size)
        if not isinstance(strategy, tf.distribute.Strategy) and strategy not in STRATEGIES:
            raise ValueError(
                f"Unknown `strategy`. Expected one of {', '.join(map(repr, STRATEGIES))} or a "
                f"tf.distribute.Strategy. Received: strategy={strategy!r}"
            )
        if isinstance(strategy, tf.distribute.Strategy) and devices is not None:
            raise ValueError(
                "`devices` cannot be combined with a ready-made `strategy` (its devices are "
                f"fixed). Received: devices={devices!r}"
            )
        if isinstance(devices, str):
            raise TypeError(
                "`devices` must be a list of device names such as ['/gpu:0', '/gpu:1']. "
                f"Received: devices={devices!r}"
            )
        if not isinstance(sync_batch_norm, bool):
            raise TypeError(
                f"`sync_batch_norm` must be True or False. Received: sync_batch_norm="
                f"{sync_batch_norm!r}"
            )
        if steps_per_execution == "auto":
            steps_per_execution = AUTO_STEPS_PER_EXECUTION
        elif steps_per_execution is not None:
            if isinstance(steps_per_execution, str):
                raise ValueError(
                    "`steps_per_execution` must be a positive integer, 'auto' or None. "
                    f"Received: steps_per_execution={steps_per_execution!r}"
                )
            validate_positive_int("steps_per_execution", steps_per_execution)
        self._sync_batch_norm = sync_batch_norm
        self._mixed_precision = validate_policy(mixed_precision)
        self._steps_per_execution = steps_per_execution
        self._per_replica_batch_size = per_replica_batch_size
        self._global_batch_size = global_batch_size
        self._devices = list(devices) if devices is not None else None
        self._cross_device_ops = cross_device_ops
        self._strategy_arg = strategy
        self._cluster_resolver = cluster_resolver
        self._lr_scaling_rule = validate_rule(lr_scaling_rule)
        self._distribution: Distribution | None = None
        self._contexts: list[ExitStack] = []

    @property
    def distribution(self) -> Distribution:
        """The `Distribution`, created (with its strategy) on first access."""
        if self._distribution is None:
            self._distribution = self._create()
        return self._distribution

    def _create(self) -> Distribution:
        configure_from_environment()
        if isinstance(self._strategy_arg, tf.distribute.Strategy):
            strategy = self._strategy_arg
            ops_name = type(getattr(strategy.extended, "_cross_device_ops", None)).__name__
        elif self._wants_multi_worker():
            from keras_mirror_kit import multi_worker

            strategy, ops_name = multi_worker.create_strategy(
                cluster_resolver=self._cluster_resolver,
                cross_device_ops=self._cross_device_ops,
            )
        else:
            devices = replica_devices(self._devices)
            ops, ops_name = make_cross_device_ops(self._cross_device_ops, devices)
            strategy = tf.distribute.MirroredStrategy(devices=devices, cross_device_ops=ops)
        replicas = int(strategy.num_replicas_in_sync)
        if self._global_batch_size is not None:
            per_replica = split_global_batch(self._global_batch_size, replicas)
        else:
            per_replica = int(self._per_replica_batch_size)  # type: ignore[arg-type]
        dist = Distribution(strategy, per_replica, ops_name, self._lr_scaling_rule)
        logger.info(dist.describe())
        return dist

    def _wants_multi_worker(self) -> bool:
        if self._strategy_arg == "multi_worker" or self._cluster_resolver is not None:
            return True
        if self._strategy_arg != "auto":
            return False
        from keras_mirror_kit import multi_worker

        return multi_worker.tf_config_num_workers() > 1

    def __call__(self, factory: Callable[P, R]) -> DistributedFactory[P, R]:
        if not callable(factory):
            raise TypeError(
                "@kmk.distributed(...) decorates a model factory (a function returning a "
                f"keras.Model). Received: {factory!r}"
            )
        return DistributedFactory(self, factory)

    def __enter__(self) -> Distribution:
        if self._sync_batch_norm or self._steps_per_execution is not None:
            raise ValueError(
                "`sync_batch_norm` and `steps_per_execution` apply to the model a decorated "
                "factory returns; use @kmk.distributed(...) on a factory, or inside a `with` "
                "block call kmk.synchronize_batch_norm(model) and pass steps_per_execution "
                "to compile(). Received: sync_batch_norm="
                f"{self._sync_batch_norm}, steps_per_execution={self._steps_per_execution}"
            )
        dist = self.distribution
        stack = ExitStack()
        stack.enter_context(activate(dist))
        stack.enter_context(policy_scope(self._mixed_precision))
        stack.enter_context(keras_fit_stall.per_device_autotune_disabled())
        self._contexts.append(stack)
        return dist

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._contexts.pop().close()


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
        config = self._config
        dist = self.distribution
        with activate(dist), policy_scope(config._mixed_precision):  # noqa: SLF001
            model = self._factory(*args, **kwargs)
        name = getattr(self._factory, "__name__", "factory")
        check_model(model, dist, factory_name=name)
        register_model(model, dist)
        if config._mixed_precision:  # noqa: SLF001
            keep_outputs_float32(model)  # type: ignore[arg-type]
        if config._sync_batch_norm:  # noqa: SLF001
            synchronize_batch_norm(model)  # type: ignore[arg-type]
        steps = config._steps_per_execution  # noqa: SLF001
        if model.compiled:  # type: ignore[attr-defined]
            _apply_steps_per_execution(model, steps, name)
        else:
            _compile_inside_scope(model, dist, steps)  # type: ignore[arg-type]
        install_fit_guard(model)  # type: ignore[arg-type]
        keras_fit_stall.apply(model)  # no tf.data autotuning thread: see keras_fit_stall
        return model

    def __repr__(self) -> str:
        return f"<distributed factory {getattr(self._factory, '__qualname__', self._factory)!r}>"


def _strategy_of_variable(variable: Any) -> tf.distribute.Strategy | None:
    value = getattr(variable, "value", variable)
    if isinstance(value, tf.distribute.DistributedValues):
        return value._distribute_strategy  # noqa: SLF001
    return None


def check_model(model: Any, dist: Distribution, factory_name: str = "factory") -> None:
    """Checks that a factory's model was built (and compiled) under `dist`'s strategy.

    Args:
        model: What the factory returned.
        dist: The distribution the factory ran under.
        factory_name: Used in error messages.

    Returns:
        None.

    Raises:
        TypeError: If `model` is not a `keras.Model`.
        ValueError: If the model, one of its variables or its optimizer was created
            outside the strategy's scope.

    Example:

    ```python
    check_model(model, build_model.distribution)
    ```
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"The factory `{factory_name}` decorated with @kmk.distributed must return a "
            f"keras.Model. Received: {type(model).__name__} ({model!r:.80})"
        )
    strategy = dist.strategy
    if getattr(model, "_distribute_strategy", None) is not strategy:
        raise ValueError(
            f"The model returned by `{factory_name}` was created outside the strategy's "
            "scope, so it would silently train on one device. Create the model inside the "
            "decorated factory (or inside `with kmk.distributed(...)`), not before it. "
            f"Received: model={model.name!r}"
        )
    if dist.num_replicas > 1 or isinstance(strategy, tf.distribute.MirroredStrategy):
        outside = [
            v.path for v in model.variables if _strategy_of_variable(v) is not strategy
        ]
        if outside:
            raise ValueError(
                f"{len(outside)} variable(s) of the model returned by `{factory_name}` were "
                "created outside the strategy's scope (for example a layer built before the "
                "factory ran). Create and build every layer inside the decorated factory. "
                f"Received: variables={outside[:5]}{' ...' if len(outside) > 5 else ''}"
            )
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        opt_strategy = getattr(optimizer, "_distribution_strategy", strategy)
        if opt_strategy is not strategy:
            raise ValueError(
                f"The optimizer of the model returned by `{factory_name}` was created "
                "outside the strategy's scope; its updates would not be mirrored. Create "
                "the optimizer inside the decorated factory, e.g. "
                "`model.compile(optimizer=keras.optimizers.Adam(lr), ...)` there. "
                f"Received: optimizer={type(optimizer).__name__}"
            )


def _apply_steps_per_execution(model: Any, steps: int | None, name: str) -> None:
    if steps is None or model.steps_per_execution == steps:
        return
    if model.steps_per_execution != 1:
        raise ValueError(
            f"The factory `{name}` compiled with steps_per_execution="
            f"{model.steps_per_execution}, but distributed(steps_per_execution={steps}) asks "
            "for another value. Pass it in one place only. "
            f"Received: steps_per_execution={steps}"
        )
    model.steps_per_execution = steps
    config = getattr(model, "_compile_config", None)
    if config is not None and isinstance(getattr(config, "config", None), dict):
        config.config["steps_per_execution"] = steps  # so a saved model keeps it


def _compile_inside_scope(model: keras.Model, dist: Distribution, steps: int | None) -> None:
    """Makes a later `model.compile(...)` run inside the strategy's scope, then checks it."""
    original = model.compile

    @functools.wraps(original)
    def compile_in_scope(*args: Any, **kwargs: Any) -> None:
        with activate(dist):
            original(*args, **kwargs)
        check_model(model, dist, factory_name=f"compile() of {model.name!r}")
        _apply_steps_per_execution(model, steps, f"compile() of {model.name!r}")

    object.__setattr__(model, "compile", compile_in_scope)
