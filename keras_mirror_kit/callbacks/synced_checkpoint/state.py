"""The variables a checkpoint holds: which they are and applying them (saving: `snapshot`)."""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from keras_mirror_kit.callbacks.synced_checkpoint.paths import auto_name_prefixes, match_state
from keras_mirror_kit.checkpoint_store import LoadedCheckpoint

__all__ = ["apply_state", "build_optimizer", "global_random_state", "state_variables"]

logger = logging.getLogger("keras_mirror_kit")

# One debug line per process when Keras' private module layout moved.
_KERAS_LAYOUT_LOGGED: list[bool] = []


def _skip_global_random(err: ImportError) -> None:
    """Logs once that Keras' global random state (private modules) is not saved or restored."""
    if not _KERAS_LAYOUT_LOGGED:
        _KERAS_LAYOUT_LOGGED.append(True)
        logger.debug(
            "keras-mirror-kit: Keras' global random state is not saved or restored (its "
            "private module moved: %s)",
            err,
        )


def state_variables(model: Any, legacy: bool = False) -> list[tuple[str, Any]]:
    """The variables a checkpoint of `model` holds, in their saved order, with their group.

    Args:
        model: The model being fit.
        legacy: List what files of format v1 hold (`model.weights`, without the random
            layers' seed-generator state).

    Returns:
        `("model", variable)` for `model.variables` (weights and the random layers' state;
        no metrics), then `("optimizer", variable)` for the optimizer's variables.

    Example:

    ```python
    paths = [f"{group}:{v.path}" for group, v in state_variables(model)]
    ```
    """
    # model.variables = weights + the random layers' seed-generator state (no metrics).
    model_variables = model.weights if legacy else model.variables
    named = [("model", v) for v in model_variables]
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        named += [("optimizer", v) for v in optimizer.variables]
    return named


def build_optimizer(model: Any) -> None:
    """Builds the optimizer of `model` if needed, so that its variables can be restored.

    Args:
        model: The model being fit.

    Returns:
        None.

    Example:

    ```python
    build_optimizer(model)  # before apply_state
    ```
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not optimizer.built:
        with model.distribute_strategy.scope():
            optimizer.build(model.trainable_variables)


def global_random_state() -> np.ndarray | None:
    """Keras' global seed-generator state, where it is used (saved as `"random/global"`).

    Returns:
        The state (two integers), or None when Keras' global seed generator was never
        created or its private module moved (logged once at DEBUG).

    Example:

    ```python
    state = global_random_state()
    ```
    """
    try:  # private Keras: a layout change must only lose this part of the state
        from keras.src.backend.common import global_state
    except ImportError as err:
        _skip_global_random(err)
        return None
    global_seed = global_state.get_global_attribute("global_seed_generator")
    if global_seed is None:
        return None
    return np.asarray(global_seed.state.numpy())


def apply_state(model: Any, loaded: LoadedCheckpoint, directory: str | os.PathLike[str]) -> None:
    """Checks a checkpoint's variables against the model's, then assigns them all.

    Variables are matched by group and path (exactly, or up to Keras' auto-numbering of
    generated names; see `paths`), never by position, and must have the saved shapes.
    A learning rate that differs from the saved one is replaced, with a warning.

    Args:
        model: The model being fit (its optimizer built).
        loaded: The checkpoint.
        directory: The checkpoint directory, for messages.

    Returns:
        None.

    Raises:
        CheckpointError: When the checkpoint was written by another model or optimizer;
            nothing is assigned then.

    Example:

    ```python
    apply_state(model, store.load_latest(), store.directory)
    ```
    """
    legacy = loaded.meta.get("state") != "variables"
    # Matched by path, never by position (paths.match_state); model order from here on.
    matched = match_state(
        state_variables(model, legacy=legacy), loaded, directory, auto_name_prefixes(model)
    )
    keys = [key for key, _ in matched]
    named = [pair for _, pair in matched]
    if legacy:
        logger.info(
            "keras-mirror-kit: %s predates random-state saving; the random layers' "
            "seeds are not restored",
            loaded.path,
        )
    _log_learning_rate_change(named, keys, loaded)
    for key, (_, variable) in zip(keys, named):
        variable.assign(loaded.arrays[key])
    if "random/global" in loaded.arrays:
        try:
            from keras.src.random.seed_generator import global_seed_generator
        except ImportError as err:
            _skip_global_random(err)
        else:
            global_seed_generator().state.assign(loaded.arrays["random/global"])


def _log_learning_rate_change(
    named: list[tuple[str, Any]], keys: list[str], loaded: LoadedCheckpoint
) -> None:
    """Warns when the checkpoint's learning rate replaces another one."""
    for key, (group, variable) in zip(keys, named):
        if group != "optimizer" or not variable.path.endswith("/learning_rate"):
            continue
        now, saved = float(variable.numpy()), float(loaded.arrays[key])
        if not np.isclose(now, saved, rtol=1e-6, atol=0.0):
            logger.warning(
                "keras-mirror-kit: the optimizer's learning rate %g is replaced by the "
                "checkpoint's %g (the saved optimizer state is restored). To go on with "
                "another rate, set model.optimizer.learning_rate in on_train_begin of a "
                "callback listed after SyncedCheckpoint, or use a LearningRateScheduler.",
                now,
                saved,
            )
