"""The variables a checkpoint holds: which they are, collecting, checking and applying them."""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import numpy as np

from keras_mirror_kit.checkpoint_store import CheckpointError, LoadedCheckpoint

__all__ = ["apply_state", "build_optimizer", "check_finite", "state_arrays", "state_variables"]

logger = logging.getLogger("keras_mirror_kit")

# Auto-numbering Keras adds to layer, model and optimizer names ("dense_3", "sequential_1").
_NAME_NUMBER = re.compile(r"_\d+(?=$|/|_)")
# One debug line per process when Keras' private module layout moved.
_KERAS_LAYOUT_LOGGED: list[bool] = []


def _normalized(path: str) -> str:
    return _NAME_NUMBER.sub("", path)


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


def check_finite(
    named: list[tuple[str, Any]], values: list[np.ndarray], allow_non_finite: bool
) -> list[str]:
    """The paths of the variables holding NaN or Inf; refuses them unless allowed.

    Args:
        named: The `(group, variable)` pairs of `state_variables`.
        values: Their values, in the same order.
        allow_non_finite: Return the paths instead of raising.

    Returns:
        The paths of the non-finite variables (empty when all are finite).

    Raises:
        CheckpointError: When a variable is not finite and `allow_non_finite` is False.

    Example:

    ```python
    bad = check_finite(named, [np.asarray(v.numpy()) for _, v in named], False)
    ```
    """
    bad = [
        v.path
        for (_, v), value in zip(named, values)
        if value.dtype.kind in "fc" and not np.isfinite(value).all()
    ]
    if bad and not allow_non_finite:
        raise CheckpointError(
            f"The training state holds NaN or Inf in {len(bad)} variable(s): "
            f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}. Training diverged, so "
            "no checkpoint was written and the earlier ones (finite) are kept: resume "
            "from them with a lower learning rate, or pass allow_non_finite=True to save "
            f"such states anyway. Received: allow_non_finite=False"
        )
    return bad


def state_arrays(
    named: list[tuple[str, Any]], values: list[np.ndarray]
) -> tuple[dict[str, np.ndarray], list[str]]:
    """The arrays a checkpoint file holds for the variables, and their paths for its metadata.

    Args:
        named: The `(group, variable)` pairs of `state_variables`.
        values: Their values, in the same order.

    Returns:
        The arrays by key (`"model/00000"`, `"optimizer/00003"`, and `"random/global"` for
        Keras' global random state where it is used), and the `"group:path"` of each
        variable, in order.

    Example:

    ```python
    arrays, paths = state_arrays(named, values)
    ```
    """
    arrays: dict[str, np.ndarray] = {}
    paths: list[str] = []
    for i, ((group, variable), value) in enumerate(zip(named, values)):
        arrays[f"{group}/{i:05d}"] = value
        paths.append(f"{group}:{variable.path}")
    try:  # private Keras: a layout change must only lose this part of the state
        from keras.src.backend.common import global_state
    except ImportError as err:
        _skip_global_random(err)
        return arrays, paths
    global_seed = global_state.get_global_attribute("global_seed_generator")
    if global_seed is not None:
        arrays["random/global"] = np.asarray(global_seed.state.numpy())
    return arrays, paths


def apply_state(model: Any, loaded: LoadedCheckpoint, directory: str | os.PathLike[str]) -> None:
    """Checks a checkpoint's variables against the model's, then assigns them all.

    Variables are matched by order, group, path (without Keras' auto-numbering) and shape.
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
    named = state_variables(model, legacy=legacy)
    keys = sorted(
        (k for k in loaded.arrays if k.split("/")[0] in ("model", "optimizer")),
        key=lambda k: int(k.split("/")[1]),
    )
    saved_paths = list(loaded.meta.get("variables") or [])
    saved = [
        (
            saved_paths[int(key.split("/")[1])].partition(":")[2]
            if int(key.split("/")[1]) < len(saved_paths)
            else "?",
            key.split("/")[0],
            tuple(loaded.arrays[key].shape),
        )
        for key in keys
    ]
    here = [(v.path, group, tuple(v.shape)) for group, v in named]
    differences = [
        f"#{i} {a[1]}:{a[0]} {a[2]} in the checkpoint, {b[1]}:{b[0]} {b[2]} here"
        for i, (a, b) in enumerate(zip(saved, here))
        if (_normalized(a[0]), a[1], a[2]) != (_normalized(b[0]), b[1], b[2])
    ]
    if differences or len(saved) != len(here):
        count = f"{len(saved)} variables in the checkpoint, {len(here)} here"
        raise CheckpointError(
            f"The checkpoint {str(loaded.path)!r} does not match this model and "
            f"optimizer ({count}; {len(differences)} differ by path or shape"
            f"{', first: ' + '; '.join(differences[:3]) if differences else ''}). It was "
            "written by another model or optimizer; nothing was restored or trained. "
            "Use a new checkpoint directory, or build the model and optimizer the run "
            f"was started with. Received: directory={str(directory)!r}"
        )
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
