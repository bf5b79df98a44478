"""The `with kmk.distributed(...)` form: models compiled inside the block get prepared.

While a block is active in a thread, `keras.Model.compile` prepares the model it compiled
(`keras_mirror_kit.model_setup.prepare_model`). The hook is a class-level wrapper installed
the first time a block is entered, on Keras' `Trainer` base class so that `load_model`
still sees an unmodified `compile`; outside a block, and in every other thread, it is
Keras' own `compile` plus one thread-local lookup.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import keras

from keras_mirror_kit import backends
from keras_mirror_kit.distribution import Distribution, activate, known_replica_counts
from keras_mirror_kit.model_record import distribution_of, record_of
from keras_mirror_kit.model_setup import ModelOptions, prepare_model
from keras_mirror_kit.precision import policy_scope
from keras_mirror_kit.upstream import keras_private

__all__ = ["block", "check_callback_model", "factory_running"]

logger = logging.getLogger("keras_mirror_kit")

_local = threading.local()
_hook_lock = threading.Lock()
_hook_installed = False


def _blocks() -> list[tuple[Distribution, ModelOptions]]:
    if not hasattr(_local, "blocks"):
        _local.blocks = []
    return _local.blocks


@contextmanager
def factory_running() -> Iterator[None]:
    """While a decorated factory runs, `compile()` leaves preparing to the factory."""
    _local.factories = getattr(_local, "factories", 0) + 1
    try:
        yield
    finally:
        _local.factories -= 1


def _install_compile_hook() -> bool:
    """Wraps Keras' trainer base class's `compile` once.

    Raises `RuntimeError`, as the block is entered, when this Keras has no trainer base
    class the kit knows (models compiled in the block would get none of the kit's
    preparation: never silently)."""
    global _hook_installed
    with _hook_lock:
        if _hook_installed:
            return True
        try:  # The base class, not keras.Model: Keras compares the two on `load_model`.
            Trainer = keras_private.base_trainer()  # noqa: N806
        except ImportError as err:
            raise RuntimeError(
                f"keras-mirror-kit: Keras {keras.__version__} has no trainer base class the "
                "kit knows, so models compiled inside `with kmk.distributed(...)` could not "
                "be prepared for the replicas. Use the decorator form (@kmk.distributed on "
                "the function that builds and compiles the model), or a Keras the kit was "
                f"tested on (docs/support.md). Received: keras=={keras.__version__} ({err})"
            ) from err
        original = Trainer.compile

        @functools.wraps(original)
        def compile(self: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: A001
            result = original(self, *args, **kwargs)
            blocks = _blocks()
            if blocks and not getattr(_local, "factories", 0):
                dist, options = blocks[-1]
                origin = f"{self.name!r} compiled inside `with kmk.distributed(...)`"
                prepare_model(self, dist, options, name=self.name, origin=origin)
            return result

        Trainer.compile = compile  # type: ignore[method-assign]
        _hook_installed = True
        return True


@contextmanager
def _compiled_models_prepared(dist: Distribution, options: ModelOptions) -> Iterator[None]:
    _install_compile_hook()
    blocks = _blocks()
    blocks.append((dist, options))
    try:
        yield
    finally:
        blocks.pop()


@contextmanager
def block(dist: Distribution, options: ModelOptions) -> Iterator[Distribution]:
    """The body of `with kmk.distributed(...)`: strategy scope, dtype policy, compile hook."""
    with ExitStack() as stack:  # a context that fails to enter closes those before it
        stack.enter_context(activate(dist, "dist.strategy"))  # `with ... as dist`
        stack.enter_context(policy_scope(options.mixed_precision))
        for context in backends.current().block_contexts():
            stack.enter_context(context)
        stack.enter_context(_compiled_models_prepared(dist, options))
        yield dist


def check_callback_model(model: Any, callback_name: str) -> Distribution | None:
    """At `on_train_begin`: the model's `Distribution` (None for one the kit did not build).

    Raises `ValueError` when `fit` runs inside `with kmk.distributed(...)` on a model not
    built under that block's strategy (it would train on one device); warns for a model
    built under a kit strategy but compiled outside the block (no checks, no workarounds).
    """
    dist = distribution_of(model)
    if dist is None:
        blocks = _blocks()
        if blocks:
            raise ValueError(
                f"{callback_name}: the model {model.name!r} is trained inside `with "
                "kmk.distributed(...)` but was not built under its strategy, so it would "
                f"train on one device instead of {blocks[-1][0].num_replicas} replicas. "
                "Build and compile the model inside the block (or in a decorated factory). "
                f"Received: model={model.name!r}"
            )
        if getattr(model, "_distribute_strategy", None) is None and any(
            count > 1 for count in known_replica_counts()
        ):
            logger.warning(
                "keras-mirror-kit: %s: the model %r was not built under any "
                "kmk.distributed() strategy, so it trains on one device although this "
                "process has a multi-replica distribution; build it in a decorated factory "
                "or inside `with kmk.distributed(...)`",
                callback_name,
                model.name,
            )
        return None
    record = record_of(model)
    if record is None or not record.prepared:
        logger.warning(
            "keras-mirror-kit: %s: the model %r was built under a kmk.distributed() strategy "
            "but compiled outside its `with` block, so its fit() runs without the kit's "
            "checks and workarounds; call compile() inside the block",
            callback_name,
            model.name,
        )
    return dist
