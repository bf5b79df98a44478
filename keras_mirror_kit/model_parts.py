"""What a model holds besides its layers: every optimizer and metric reachable from it.

Keras tracks a model's layers, variables and seed generators, and `model.optimizer` and
`model.metrics`; a model that writes its own training step often holds more: a GAN's
`d_optimizer` and `g_optimizer` set in its `compile()`, loss trackers created there or
in `__init__`, kept as attributes, in lists or in dicts. The kit finds them here, once,
for everything that must cover all of a model's state (the checkpoints, the own-step
weighting of `keras_mirror_kit.own_steps`).

Found are the model's `optimizer` first, then the optimizers and metrics held by the model
or by any of its layers (nested models too), as attributes or in a list, tuple or dict
attribute, in the order they were set; each object once.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["has_own_step", "metrics_of", "optimizers_of", "untracked_variables"]


def _holders(model: Any) -> list[Any]:
    """The model and every layer inside it (nested models too), each once."""
    flatten = getattr(model, "_flatten_layers", None)
    layers = list(flatten(include_self=False, recursive=True)) if callable(flatten) else []
    return [model, *layers]


def _held(holder: Any) -> Iterator[Any]:
    """The attribute values of `holder`, and the items of its list, tuple and dict ones."""
    for value in list(vars(holder).values()):
        if isinstance(value, Mapping):
            yield from list(value.values())
        elif isinstance(value, (list, tuple)):
            yield from list(value)
        else:
            yield value


def _reachable(model: Any, kind: type, first: list[Any]) -> list[Any]:
    found: list[Any] = []
    seen: set[int] = set()
    for candidate in [*first, *(v for h in _holders(model) for v in _held(h))]:
        if isinstance(candidate, kind) and id(candidate) not in seen:
            seen.add(id(candidate))
            found.append(candidate)
    return found


def optimizers_of(model: Any) -> list[Any]:
    """Every Keras optimizer reachable from `model`, `model.optimizer` first.

    Args:
        model: A `keras.Model`.

    Returns:
        The optimizers, each once (a `LossScaleOptimizer` as itself, not its inner one).

    Example:

    ```python
    gan.compile(d_optimizer=keras.optimizers.Adam(), g_optimizer=keras.optimizers.Adam(), ...)
    optimizers_of(gan)  # [gan.optimizer, gan.d_optimizer, gan.g_optimizer]
    ```
    """
    import keras

    first = [model.optimizer] if getattr(model, "optimizer", None) is not None else []
    found = _reachable(model, keras.optimizers.Optimizer, first)
    inner = {id(getattr(o, "inner_optimizer", None)) for o in found}
    return [o for o in found if id(o) not in inner]  # a loss scaler's inner one is its part


def metrics_of(model: Any) -> list[Any]:
    """Every Keras metric reachable from `model`: `model.metrics` first, then held ones.

    Args:
        model: A `keras.Model`.

    Returns:
        The metrics, each once (a container such as Keras' compiled metrics as itself).

    Example:

    ```python
    metrics_of(vae)  # [total_loss_tracker, reconstruction_loss_tracker, kl_loss_tracker]
    ```
    """
    import keras

    listed = list(getattr(model, "metrics", None) or [])
    return _reachable(model, keras.metrics.Metric, listed)


def untracked_variables(model: Any) -> list[Any]:
    """The TensorFlow variables `model` or its layers hold that Keras does not track.

    Keras 3 tracks its own `keras.Variable`s; a `tf.Variable` set as an attribute (a step
    counter, an EMA kept by hand) is in no `model.variables`, so in no checkpoint.

    Args:
        model: A `keras.Model`.

    Returns:
        Those variables, each once (none where TensorFlow was never imported).

    Example:

    ```python
    untracked_variables(model)  # [<tf.Variable 'steps_seen:0' ...>]
    ```
    """
    from keras_mirror_kit.tensorflow_objects import tensorflow_if_imported

    tf = tensorflow_if_imported()
    if tf is None:
        return []
    tracked = {id(getattr(v, "value", v)) for v in model.variables}
    for optimizer in optimizers_of(model):
        tracked.update(id(getattr(v, "value", v)) for v in optimizer.variables)
    for metric in metrics_of(model):
        tracked.update(id(getattr(v, "value", v)) for v in metric.variables)
    return [v for v in _reachable(model, tf.Variable, []) if id(v) not in tracked]


def has_own_step(model: Any, name: str = "train_step") -> bool:
    """Whether `model`'s class overrides Keras' `name` (`"train_step"`, ...).

    Args:
        model: A `keras.Model`.
        name: The step method: `"train_step"`, `"test_step"` or `"predict_step"`.

    Returns:
        True when the model's class (or a base class other than Keras') defines `name`.

    Example:

    ```python
    has_own_step(vae)  # True: keras-io's VAE writes its own train_step
    ```
    """
    import keras

    return getattr(type(model), name, None) is not getattr(keras.Model, name, None)
