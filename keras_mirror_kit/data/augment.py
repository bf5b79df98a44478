"""Deterministic randomness in a kit dataset's `preprocess` and `load`.

Both run in a parallel `map`: random ops that draw from shared state (a Keras
`SeedGenerator`'s variable, `tf.random.uniform`, `tf.image.random_*`) then draw in whatever
order the parallel calls happen to run, so two runs differ and a resumed run matches
neither. The kit keys every draw on the dataset's seed, the epoch and the batch's position
in the epoch (or the sample's index, for `load`):

* Keras: while the kit traces its map function, `SeedGenerator.next` (patched once at class
  level, inert outside that context) returns a stateless seed folded from that key, the
  generator's own seed and the number of draws traced before it, instead of advancing its
  state variable. Keras' random preprocessing layers and `keras.random.*` (seeded with a
  `SeedGenerator`, or unseeded: the global generator) draw through it.
* A function with a `seed` parameter (without a default) receives the key itself (an
  int64 tensor of shape [2]), for `tf.random.stateless_*` and `tf.image.stateless_random_*`.
* Stateful TensorFlow random ops and variable writes are found by walking the traced
  function (nested functions included): a WARNING names them, or `strict=True` refuses.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import tensorflow as tf

__all__ = [
    "STATEFUL_RANDOM_OPS",
    "check_deterministic",
    "describe",
    "fold_key",
    "stateful_ops",
    "stateless_draws",
    "takes_seed",
]

logger = logging.getLogger("keras_mirror_kit")

#: Op types whose output depends on state shared by every call of the traced function.
STATEFUL_RANDOM_OPS = frozenset(
    {
        "Multinomial",
        "NonDeterministicInts",
        "ParameterizedTruncatedNormal",
        "RandomCrop",
        "RandomGamma",
        "RandomPoisson",
        "RandomPoissonV2",
        "RandomShuffle",
        "RandomStandardNormal",
        "RandomUniform",
        "RandomUniformInt",
        "RngReadAndSkip",
        "RngSkip",
        "SampleDistortedBoundingBox",
        "SampleDistortedBoundingBoxV2",
        "StatefulRandomBinomial",
        "StatefulStandardNormal",
        "StatefulStandardNormalV2",
        "StatefulTruncatedNormal",
        "StatefulUniform",
        "StatefulUniformFullInt",
        "StatefulUniformInt",
        "TruncatedNormal",
    }
)
# Writes whose result depends on the order of the calls (a counter, a generator's state).
_VARIABLE_WRITES = frozenset({"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"})

_local = threading.local()
_installed = False
_install_lock = threading.Lock()


def fold_key(key: tf.Tensor, *data: Any) -> tf.Tensor:
    """`key` (int64, shape [2]) folded with each of `data` in turn: a new stateless seed."""
    key = tf.reshape(key, [2])
    for value in data:
        key = tf.random.experimental.stateless_fold_in(key, tf.cast(value, tf.int64))
    return key


class _Draws:
    """The stateless seeds handed out while one map function is traced."""

    def __init__(self, key: tf.Tensor) -> None:
        self.key = key
        self.count = 0

    def seed(self, generator: Any) -> tf.Tensor:
        self.count += 1
        own = generator._initial_seed  # noqa: SLF001 (None: a seed drawn at random)
        value = fold_key(self.key, int(own or 0) % (2**31), self.count)
        return tf.cast(value, generator.state.dtype)


def _install() -> None:
    """Patches `SeedGenerator.next` once (a no-op outside `stateless_draws`)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        from keras.src.random.seed_generator import SeedGenerator, global_seed_generator

        # Unseeded draws use Keras' global generator: create it eagerly, not in a trace.
        with tf.init_scope():
            global_seed_generator()
        original = SeedGenerator.next

        def next_seed(self: Any, ordered: bool = True) -> Any:
            draws = getattr(_local, "draws", None)
            if draws is None:
                return original(self, ordered=ordered)
            return draws.seed(self)

        next_seed.__wrapped__ = original  # type: ignore[attr-defined]
        SeedGenerator.next = next_seed
        _installed = True


@contextmanager
def stateless_draws(key: tf.Tensor) -> Iterator[None]:
    """While tracing inside: Keras `SeedGenerator`s draw stateless seeds folded from `key`."""
    _install()
    previous = getattr(_local, "draws", None)
    _local.draws = _Draws(key)
    try:
        yield
    finally:
        _local.draws = previous


def takes_seed(function: Callable[..., Any]) -> bool:
    """Whether `function` has a parameter `seed` without a default (it gets the key).

    A `seed=None` default is TensorFlow's op-level seed of a stateful op
    (`tf.image.random_flip_left_right(image, seed=None)`): such a function is not given
    the key, and its stateful draws are named by `check_deterministic`.
    """
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
    seed = parameters.get("seed")
    return seed is not None and seed.default is inspect.Parameter.empty


def describe(function: Any) -> str:
    """A function's name (`random_flip_left_right`, `load.<locals>.<lambda>`), else its repr."""
    if inspect.isfunction(function) or inspect.ismethod(function):
        return function.__qualname__
    return repr(function)


def _op_types(graph_def: Any) -> Iterator[tuple[str, str]]:
    for node in graph_def.node:
        yield node.op, node.name
    for function in graph_def.library.function:
        for node in function.node_def:
            yield node.op, f"{function.signature.name}/{node.name}"


def stateful_ops(graph: tf.Graph) -> list[str]:
    """The stateful random ops and variable writes in `graph` and its nested functions."""
    found: list[str] = []
    for op_type, name in _op_types(graph.as_graph_def()):
        if op_type in STATEFUL_RANDOM_OPS or op_type in _VARIABLE_WRITES:
            label = f"{op_type} ({name.rsplit('/', 1)[-1]})"
            if label not in found:
                found.append(label)
    return found


def check_deterministic(graph: tf.Graph, what: str, strict: bool) -> None:
    """Warns (or, with `strict`, raises) when `graph` draws from shared random state."""
    found = stateful_ops(graph)
    if not found:
        return
    message = (
        f"{what} uses random ops or variable writes that draw from state shared by all "
        "parallel calls, so its results differ from run to run and a resumed run cannot "
        f"match: {', '.join(found[:8])}{' ...' if len(found) > 8 else ''}. Use Keras' "
        "random preprocessing layers or keras.random with a SeedGenerator (the kit makes "
        "them deterministic), or give the function a `seed` parameter (without a default) "
        "and use tf.random.stateless_* / tf.image.stateless_random_* with it."
    )
    if strict:
        raise ValueError(f"{message} Received: strict=True")
    logger.warning("keras-mirror-kit: %s Pass strict=True to refuse it.", message)
