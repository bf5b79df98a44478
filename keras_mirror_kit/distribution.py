"""The `Distribution`: what `distributed()` chose, and how to reach it.

A `Distribution` is the kit's read-only description of one data-parallel setup: the
backend's data-parallel object (a `tf.distribute.Strategy` on TensorFlow, a
`keras.distribution.DataParallel` on JAX; `keras_mirror_kit.backends`), its devices and
replica count, the per-replica and global batch sizes, the gradient accumulation steps and
the effective batch size (samples per optimizer update), and the learning-rate scaling
rule. `distributed()` creates it; everything above the core (callbacks, integrations, the
command line) reads it from here, either through `current()` while a factory or `with`
block runs, or through `distribution_of(model)` (`keras_mirror_kit.model_record`) for a
model the kit built.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from keras_mirror_kit import backends
from keras_mirror_kit.multi_worker.cluster import note_local_replicas
from keras_mirror_kit.scaling import DEFAULT_RULE, scale_learning_rate, validate_rule
from keras_mirror_kit.validation import positive_int

__all__ = ["Distribution", "activate", "current", "distributions_alive", "known_replica_counts"]


class Distribution:
    """A data-parallel setup chosen by `distributed()`.

    Read it inside a decorated factory with `kmk.current()`, from the decorated function's
    `.distribution` attribute, or from the value bound by `with kmk.distributed(...) as dist`.

    Args:
        strategy: What the model is built under: a `tf.distribute.Strategy` on the
            TensorFlow backend, a `keras.distribution.DataParallel` on the JAX backend.
        per_replica_batch_size: Samples each replica processes per step.
        cross_device_ops: Name of the all-reduce implementation in use (for example
            `"nccl"`, `"hierarchical_copy"`, `"reduction_to_one_device"` or `"collective"`;
            `"xla-spmd"` on JAX, where XLA's SPMD program does the reduction).
        lr_scaling_rule: Default rule for `scale_learning_rate` (`"linear"`, `"sqrt"` or
            `"none"`).
        gradient_accumulation_steps: Micro-batches (training steps) whose gradients make
            one optimizer update; 1 updates at every step.

    Raises:
        TypeError: If a count is not an integer.
        ValueError: If `per_replica_batch_size` or `gradient_accumulation_steps` is not a
            positive integer or the rule is unknown.

    Example:

    ```python
    @kmk.distributed(per_replica_batch_size=64)
    def build_model():
        dist = kmk.current()
        lr = dist.scale_learning_rate(1e-3, base_batch_size=64)
        ...
    ```
    """

    def __init__(
        self,
        strategy: Any,
        per_replica_batch_size: int,
        cross_device_ops: str,
        lr_scaling_rule: str = DEFAULT_RULE,
        gradient_accumulation_steps: int = 1,
    ) -> None:
        positive_int("per_replica_batch_size", per_replica_batch_size)
        self._accumulation = positive_int(
            "gradient_accumulation_steps", gradient_accumulation_steps
        )
        self._backend = backends.check_supported()
        self._engine = backends.engine_for(strategy, cross_device_ops)
        self._per_replica_batch_size = per_replica_batch_size
        self._cross_device_ops = cross_device_ops
        self._lr_scaling_rule = validate_rule(lr_scaling_rule)
        self.learning_rate_scaling: dict[str, Any] | None = None
        _ALL_DISTRIBUTIONS.add(self)
        note_local_replicas(self, self.num_workers, self.num_replicas // self.num_workers)

    @property
    def strategy(self) -> Any:
        """What models are built under: the `tf.distribute.Strategy` (TensorFlow backend) or
        the `keras.distribution.DataParallel` (JAX backend)."""
        return self._engine.strategy

    @property
    def backend(self) -> str:
        """The Keras backend this distribution runs on: `"tensorflow"` or `"jax"`."""
        return self._backend

    @property
    def engine(self) -> backends.Engine:
        """The backend's data-parallel object behind the kit's engine interface."""
        return self._engine

    @property
    def strategy_name(self) -> str:
        """The strategy's public class name, e.g. `"MirroredStrategy"` or `"DataParallel"`."""
        return self._engine.strategy_name

    @property
    def num_replicas(self) -> int:
        """Replicas in sync across all workers (`strategy.num_replicas_in_sync`)."""
        return self._engine.num_replicas

    @property
    def devices(self) -> tuple[str, ...]:
        """The devices of this process that hold a replica."""
        return self._engine.devices

    @property
    def num_workers(self) -> int:
        """How many processes (workers) take part; 1 on a single host."""
        return max(1, self.num_replicas // max(1, len(self.devices)))

    @property
    def cross_device_ops(self) -> str:
        """Name of the all-reduce implementation."""
        return self._cross_device_ops

    @property
    def per_replica_batch_size(self) -> int:
        """Samples per replica per step."""
        return self._per_replica_batch_size

    @property
    def global_batch_size(self) -> int:
        """Samples per step over all replicas: per-replica batch x replicas.

        With gradient accumulation a step is one micro-batch: the batch to give `fit`."""
        return self._per_replica_batch_size * self.num_replicas

    @property
    def gradient_accumulation_steps(self) -> int:
        """Training steps (micro-batches) per optimizer update; 1 without accumulation."""
        return self._accumulation

    @property
    def effective_batch_size(self) -> int:
        """Samples per optimizer update: per-replica batch x replicas x accumulation steps.

        The batch size the optimizer sees, and the one learning-rate scaling uses."""
        return self.global_batch_size * self._accumulation

    @property
    def lr_scaling_rule(self) -> str:
        """The default learning-rate scaling rule."""
        return self._lr_scaling_rule

    @property
    def is_chief(self) -> bool:
        """Whether this process should write checkpoints, logs and other side effects.

        Decided by the strategy (`strategy.extended.should_checkpoint` on TensorFlow, which
        is right in every cluster shape, including one with an explicit `chief` job; process
        0 on JAX).
        """
        return self._engine.is_chief

    def scale_learning_rate(
        self,
        base_learning_rate: float,
        base_batch_size: int,
        rule: str | None = None,
    ) -> float:
        """Scales a learning rate tuned at `base_batch_size` to this effective batch size.

        The effective batch size (`effective_batch_size`: samples per optimizer update) is
        the global batch size times `gradient_accumulation_steps`.

        The values are recorded in `learning_rate_scaling` so that integrations (W&B) can
        report them.

        Args:
            base_learning_rate: Learning rate that works at `base_batch_size`.
            base_batch_size: Batch size the base learning rate was tuned for.
            rule: `"linear"`, `"sqrt"` or `"none"`; defaults to this distribution's
                `lr_scaling_rule`.

        Returns:
            The scaled learning rate as a float.

        Raises:
            ValueError: On a non-positive learning rate or batch size, or an unknown rule.

        Example:

        ```python
        lr = kmk.current().scale_learning_rate(1e-3, base_batch_size=64)
        ```
        """
        rule = self._lr_scaling_rule if rule is None else rule
        scaled = scale_learning_rate(
            base_learning_rate, base_batch_size, self.effective_batch_size, rule=rule
        )
        self.learning_rate_scaling = {
            "base_learning_rate": float(base_learning_rate),
            "base_batch_size": int(base_batch_size),
            "scaled_learning_rate": scaled,
            "rule": rule,
        }
        return scaled

    def describe(self) -> str:
        """A one-line summary: strategy, devices, replicas, all-reduce, global batch and,
        with gradient accumulation, the effective batch.

        Returns:
            The summary string that `distributed()` logs at INFO level.

        Example:

        ```python
        logging.info(dist.describe())
        ```
        """
        return (
            f"keras-mirror-kit: {self.strategy_name} on {', '.join(self.devices)} "
            f"({self.num_replicas} replica{'s' if self.num_replicas != 1 else ''}"
            f"{f' over {self.num_workers} workers' if self.num_workers > 1 else ''}), "
            f"all-reduce={self.cross_device_ops}, global batch {self.global_batch_size} "
            f"= {self.per_replica_batch_size} per replica x {self.num_replicas}"
            + (
                f", effective batch {self.effective_batch_size} = {self.global_batch_size} x "
                f"{self._accumulation} accumulation steps"
                if self._accumulation > 1
                else ""
            )
        )

    def as_config(self) -> dict[str, Any]:
        """The distribution as a flat, JSON-friendly dict (for run configs and logs).

        Returns:
            A dict of strategy, devices, replicas, workers, batch sizes, accumulation steps
            and learning rate.

        Example:

        ```python
        wandb.config.update(dist.as_config())
        ```
        """
        config: dict[str, Any] = {
            "strategy": self.strategy_name,
            "devices": list(self.devices),
            "num_replicas": self.num_replicas,
            "num_workers": self.num_workers,
            "cross_device_ops": self.cross_device_ops,
            "per_replica_batch_size": self.per_replica_batch_size,
            "global_batch_size": self.global_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "effective_batch_size": self.effective_batch_size,
            "lr_scaling_rule": self.lr_scaling_rule,
        }
        if self.learning_rate_scaling:
            config.update(self.learning_rate_scaling)
        return config

    def __repr__(self) -> str:
        return (
            f"Distribution(strategy={self.strategy_name}, devices={list(self.devices)}, "
            f"num_replicas={self.num_replicas}, per_replica_batch_size="
            f"{self.per_replica_batch_size}, global_batch_size={self.global_batch_size}"
            + (
                f", gradient_accumulation_steps={self._accumulation}, effective_batch_size="
                f"{self.effective_batch_size}"
                if self._accumulation > 1
                else ""
            )
            + ")"
        )


_ALL_DISTRIBUTIONS: weakref.WeakSet[Distribution] = weakref.WeakSet()
_local = threading.local()


def _stack() -> list[Distribution]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def _scope_error(message: str) -> RuntimeError:
    """A `RuntimeError`; KerasTuner's `FatalRuntimeError` (one) once KerasTuner is imported.

    KerasTuner enters its `distribution_strategy`'s scope around the build function, and
    marks a trial whose build raised an ordinary error FAILED and goes on with the next:
    every trial would fail the same way, and `search` would return with nothing trained.
    Its fatal error ends `search` with this message instead.
    """
    tuner_errors = getattr(sys.modules.get("keras_tuner"), "errors", None)
    fatal = getattr(tuner_errors, "FatalRuntimeError", None)
    if isinstance(fatal, type) and issubclass(fatal, RuntimeError):
        return fatal(message)
    return RuntimeError(message)


@contextmanager
def activate(
    distribution: Distribution, reached_as: str = "build_model.distribution.strategy"
) -> Iterator[Distribution]:
    """Makes `distribution` the one `current()` returns, inside its strategy's scope
    (`reached_as`: how the user's code names its strategy, for the error below)."""
    other = distribution.engine.active_elsewhere()
    if other is not None:
        raise _scope_error(
            "A distributed() factory or block was entered inside the scope of another "
            "data-parallel strategy, and the backend cannot mix strategies. Build each "
            "model under one distributed() at a time: the kit distributes the model "
            "itself, so call the factory outside other strategies' scopes. With "
            "KerasTuner, pass the kit's own strategy, "
            f"`distribution_strategy={reached_as}`, to the tuner or "
            "leave `distribution_strategy` out. "
            f"Received: active={other!r}, new={distribution.strategy!r}"
        )
    stack = _stack()
    stack.append(distribution)
    try:
        with distribution.engine.scope():
            yield distribution
    finally:
        stack.pop()


def distributions_alive() -> list[Distribution]:
    """The `Distribution`s alive in this process."""
    return list(_ALL_DISTRIBUTIONS)


def known_replica_counts() -> list[int]:
    """Replica counts of the `Distribution`s alive in this process (for input checks)."""
    return [d.num_replicas for d in distributions_alive()]


def current() -> Distribution:
    """Returns the `Distribution` active in this thread.

    Like `tf.distribute.get_strategy()`, but for the kit: inside a factory decorated with
    `@kmk.distributed(...)` or inside `with kmk.distributed(...)`.

    Returns:
        The innermost active `Distribution`.

    Raises:
        RuntimeError: When called outside any `distributed()` factory or block.

    Example:

    ```python
    @kmk.distributed(per_replica_batch_size=64)
    def build_model():
        lr = kmk.current().scale_learning_rate(1e-3, base_batch_size=64)
        ...
    ```
    """
    stack = _stack()
    if not stack:
        raise RuntimeError(
            "kmk.current() was called outside a distributed() context. Call it inside a "
            "factory decorated with @kmk.distributed(...) or inside a "
            "`with kmk.distributed(...) as dist:` block (or use the decorated factory's "
            "`.distribution` attribute)."
        )
    return stack[-1]
