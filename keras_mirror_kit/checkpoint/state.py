"""The variables a checkpoint holds: which they are, pairing them by path, applying them.

Saving reads them (`snapshot`); restoring pairs the saved variables with a model's by
variable path, never by position. Paths are compared exactly when the checkpoint and the
model hold the same set of paths (in any order). Otherwise only Keras' auto-numbering is
ignored: a `_N` suffix on a name Keras generates for the layers, models and optimizer of
this model (`dense_3`, `sequential_1`, `adam_2`, `seed_generator_1`), so the same model
built again in another process, or after other models in this one, still matches. Names a
user chose (`block_1` against `block_2`) must be equal, so a model of another architecture
whose variables have the same shapes is refused instead of being filled by position.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from collections import defaultdict
from collections.abc import Iterable, Sequence
from itertools import zip_longest
from typing import Any, NamedTuple

import numpy as np

from keras_mirror_kit import backends
from keras_mirror_kit.checkpoint.store import CheckpointError, LoadedCheckpoint
from keras_mirror_kit.model_parts import metrics_of, optimizers_of, untracked_variables
from keras_mirror_kit.model_record import engine_of
from keras_mirror_kit.upstream import keras_private

__all__ = [
    "Pairing",
    "apply_state",
    "assign_state",
    "auto_name_prefixes",
    "build_optimizer",
    "check_reachable",
    "RESTORED_GROUPS",
    "assign_metrics",
    "global_random_state",
    "global_seed_variable",
    "match_state",
    "pair_by_path",
    "saved_metrics",
    "state_differences",
    "state_variables",
]

logger = logging.getLogger("keras_mirror_kit")

#: The groups a restore puts back when it starts a `fit()`; the `"metrics"` group is put
#: back at the start of a resumed epoch (`saved_metrics`, `assign_metrics`).
RESTORED_GROUPS = ("model", "optimizer")

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
    """`(group, variable)` of what a checkpoint of `model` holds, in the saved order.

    `("model", v)` for `model.variables` (weights and the random layers' state) and, for a
    model with its own training step, the kit's seed generator of that step
    (`own_steps.own_state`); then `("optimizer", v)` for every optimizer the model holds
    (`model_parts.optimizers_of`: `model.optimizer` first, then a GAN's `d_optimizer`,
    `g_optimizer`, ...); then `("metrics", v)` for every metric it holds
    (`model_parts.metrics_of`: the loss tracker, compiled metrics, a GAN's trackers), which
    a resumed epoch starts from. `legacy`: what files without `"state"` hold
    (`model.weights` and `model.optimizer`'s, without any seed-generator state or metric).
    """
    # model.variables = weights + the random layers' seed-generator state (no metrics).
    if legacy:
        named = [("model", v) for v in model.weights]
        optimizer = getattr(model, "optimizer", None)
        optimizers = [optimizer] if optimizer is not None else []
    else:
        named = [("model", v) for v in [*model.variables, *_own_step_state(model)]]
        optimizers = optimizers_of(model)
    for optimizer in optimizers:
        named += [("optimizer", v) for v in optimizer.variables]
    if not legacy:
        seen: set[int] = set()
        for metric in metrics_of(model):  # a container (compiled metrics) holds its parts'
            for variable in metric.variables:
                if id(variable) not in seen:
                    seen.add(id(variable))
                    named.append(("metrics", variable))
    return named


def _own_step_state(model: Any) -> list[Any]:
    """`own_steps.own_state(model)`; none where that TensorFlow-side module was never used."""
    module = sys.modules.get("keras_mirror_kit.own_steps")
    return list(module.own_state(model)) if module is not None else []


def check_reachable(model: Any) -> None:
    """Names, before any step, the state of a model that no checkpoint holds.

    A stateful TensorFlow random op in the model's own training step that the kit does not
    draw from the model's saved generator (found by the probe of `own_steps`) is refused: a
    resumed run would draw other numbers and go on unlike the interrupted one. A
    `tf.Variable` the model or a layer holds outside Keras' tracking
    (`model_parts.untracked_variables`) is named in a WARNING: it may be a constant, or
    state a resumed run starts afresh.

    Raises:
        CheckpointError: For such random ops, naming them and what to write instead.
    """
    untracked = untracked_variables(model)
    if untracked:
        logger.warning(
            "keras-mirror-kit: %s holds %d tf.Variable(s) Keras does not track (%s): no "
            "checkpoint holds them, so a resumed run starts them afresh. Create them with "
            "keras.Variable(...) as attributes of the model or a layer to have them saved.",
            type(model).__name__,
            len(untracked),
            ", ".join(str(getattr(v, "name", "?")) for v in untracked[:5]),
        )
    module = sys.modules.get("keras_mirror_kit.own_steps")
    record = module.record_of(model) if module is not None else None
    ops = list(record.result.stateful_random) if record is not None and record.result else []
    if ops:
        raise CheckpointError(
            f"{type(model).__name__}'s train_step draws random numbers with stateful "
            f"TensorFlow ops ({', '.join(ops)}) whose state lives in the ops: no checkpoint "
            "holds it, so a resumed run would draw other numbers and go on unlike the "
            "interrupted one; nothing was trained. Draw with keras.random.* and a "
            "keras.random.SeedGenerator created in __init__ (seed=self.seed_generator), or "
            "with tf.random.normal, uniform or truncated_normal, which the kit draws from "
            f"the model's saved generator. Received: model={model.name!r}"
        )


def build_optimizer(model: Any) -> None:
    """Builds the optimizer of `model` if needed, so that its variables can be restored.

    The other optimizers the model holds are built by the probe of its own training step
    (`own_steps`), which knows the variables each one applies.
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not optimizer.built:
        with engine_of(model).scope():
            optimizer.build(model.trainable_variables)


def global_seed_variable() -> Any:
    """Keras' global seed generator's state variable, or None when it was never created or
    its private module moved (logged once at DEBUG)."""
    try:  # private Keras: a layout change must only lose this part of the state
        global_state = keras_private.global_state()
    except ImportError as err:
        _skip_global_random(err)
        return None
    global_seed = global_state.get_global_attribute("global_seed_generator")
    return None if global_seed is None else global_seed.state


def global_random_state() -> np.ndarray | None:
    """Keras' global seed-generator state (saved as `"random/global"`), where it is used.

    None when Keras' global seed generator was never created or its private module moved
    (logged once at DEBUG).
    """
    state = global_seed_variable()
    return None if state is None else np.asarray(state.numpy())


def apply_state(model: Any, loaded: LoadedCheckpoint, directory: str | os.PathLike[str]) -> None:
    """Checks a checkpoint's variables against the model's (its optimizer built), then
    assigns them all; a learning rate that differs from the saved one is replaced, with a
    warning.

    Raises:
        CheckpointError: When the checkpoint was written by another model or optimizer;
            nothing is assigned then.
    """
    legacy = loaded.meta.legacy_state
    # Matched by path, never by position (match_state); model order from here on.
    named = [p for p in state_variables(model, legacy=legacy) if p[0] in RESTORED_GROUPS]
    matched = match_state(named, loaded, directory, auto_name_prefixes(model))
    keys = [key for key, _ in matched]
    named = [pair for _, pair in matched]
    if legacy:
        logger.info(
            "keras-mirror-kit: %s predates random-state saving; the random layers' "
            "seeds are not restored",
            loaded.path,
        )
    _log_learning_rate_change(named, keys, loaded)
    if "random/global" in loaded.arrays:
        try:
            global_seed = keras_private.global_seed_generator()
        except ImportError as err:
            _skip_global_random(err)
        else:
            state = global_seed.state
            saved = tuple(loaded.shapes.get("random/global", ()))
            if saved != tuple(state.shape):  # checked before anything is assigned
                raise CheckpointError(
                    f"The checkpoint {str(loaded.path)!r} holds Keras' global random state "
                    f"of shape {saved}, but this Keras keeps it as {tuple(state.shape)}; "
                    "nothing was restored. Restore it with the Keras version that wrote it. "
                    f"Received: directory={str(directory)!r}"
                )
            matched.append(("random/global", ("random", state)))
    assign_state(matched, loaded, directory)


def _converted(saved: np.ndarray, dtype: np.dtype) -> np.ndarray | None:
    """`saved` as `dtype` when every value converts exactly (both ways), else None."""
    if saved.dtype == dtype:
        return saved
    raw = saved.dtype.type is np.void and saved.dtype.names is None
    if raw and dtype.type is not np.void and saved.dtype.itemsize == dtype.itemsize:
        return saved.view(dtype)  # a dtype NumPy cannot name (bfloat16): stored as its bytes
    try:
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # NumPy's ComplexWarning and the like
            converted = saved.astype(dtype)
            back = converted.astype(saved.dtype)
    except (TypeError, ValueError):
        return None
    exact = np.array_equal(back, saved, equal_nan=saved.dtype.kind in "fc")
    return converted if exact else None


def _conversions(
    matched: Sequence[tuple[str, tuple[str, Any]]], loaded: LoadedCheckpoint, directory: Any
) -> dict[str, np.dtype]:
    """The dtype each saved array of another dtype converts to; a refusal when one does not.

    Another backend writes some variables with other dtypes (TensorFlow's int64 optimizer
    step and seed states are int32 and uint32 on JAX): their values are read (they are
    small) and converted when every value is representable, before anything is assigned.

    Raises:
        CheckpointError: Naming each variable whose saved values do not convert exactly.
    """
    host_layout = backends.current().host_layout
    saved_dtypes = loaded.dtypes
    targets: dict[str, np.dtype] = {}
    refused: list[str] = []
    for key, (group, variable) in matched:
        dtype = np.dtype(host_layout(variable)[1])
        saved = saved_dtypes.get(key)
        if saved is None or saved == dtype:
            continue
        if _converted(loaded.arrays[key], dtype) is None:
            refused.append(
                f"{group}:{variable.path} ({saved.name} in the checkpoint, {dtype.name} here)"
            )
        else:
            targets[key] = dtype
    if refused:
        written = loaded.meta.backend
        origin = f" on the {written} backend" if written and written != backends.name() else ""
        wide = any("int64 in" in r and "int32 here" in r for r in refused)
        raise CheckpointError(
            f"The checkpoint {str(loaded.path)!r} was written{origin} with values that do not "
            f"convert exactly to this model's variables on the {backends.name()} backend: "
            f"{'; '.join(refused[:6])}{' ...' if len(refused) > 6 else ''}. Nothing was "
            "restored. Restore it on the backend that wrote it"
            + (" (or, on JAX, enable 64-bit integers: JAX_ENABLE_X64=1)" if wide else "")
            + f". Received: directory={str(directory)!r}"
        )
    return targets


def assign_state(
    matched: Sequence[tuple[str, tuple[str, Any]]],
    loaded: LoadedCheckpoint,
    directory: str | os.PathLike[str],
) -> None:
    """Assigns each matched variable its saved array, converted where its dtype differs.

    `matched` is what `match_state` returns (and `("random/global", ("random", state))`).

    Raises:
        CheckpointError: When a saved value does not convert exactly; nothing is assigned.
    """
    targets = _conversions(matched, loaded, directory)
    written, here = loaded.meta.backend, backends.name()
    if written is not None and written != here:
        logger.info(
            "keras-mirror-kit: restoring %s, written on the %s backend, on the %s backend "
            "(%d value(s) converted exactly to this backend's dtypes: %s); the random "
            "layers' draws from here on follow this backend's generator",
            loaded.path,
            written,
            here,
            len(targets),
            ", ".join(sorted(targets)) or "none",
        )
    for key, (_, variable) in matched:
        value = loaded.arrays[key]
        if key in targets:
            value = _converted(value, targets[key])
        variable.assign(value)


def saved_metrics(model: Any, loaded: LoadedCheckpoint) -> tuple[list[tuple[Any, Any]], str]:
    """The metric values a checkpoint holds, each paired with `model`'s metric variable.

    A checkpoint written mid-epoch holds what the model's metrics had summed up to its
    batch; put back at the start of the resumed epoch (`assign_metrics`), the epoch's logs
    are those of the uninterrupted run. Paired by path as the weights are (`pair_by_path`).

    Args:
        model: The model being resumed.
        loaded: The checkpoint restored into it.

    Returns:
        `(pairs, "")`: `(variable, saved array)` for every metric variable of the model;
        `([], why)` when the checkpoint holds no metrics or others than the model's.
    """
    keys, saved = _saved_entries(loaded, ("metrics",))
    here = [v for group, v in state_variables(model) if group == "metrics"]
    if not keys:
        return [], "the checkpoint holds no metric values (written by an earlier version)"
    prefixes = auto_name_prefixes(model) | {
        _snake_case(type(m).__name__) for m in metrics_of(model)
    }
    pairing = pair_by_path(saved, [("metrics", v.path, tuple(v.shape)) for v in here], prefixes)
    if pairing.differences:
        first = "; ".join(pairing.differences[:3])
        return [], f"the checkpoint holds other metrics than this model ({first})"
    host_layout = backends.current().host_layout
    pairs: list[tuple[Any, Any]] = []
    for i, j in sorted(pairing.pairs, key=lambda pair: pair[1]):
        value = _converted(np.asarray(loaded.arrays[keys[i]]), np.dtype(host_layout(here[j])[1]))
        if value is None:
            return [], f"the saved value of metric variable {here[j].path} does not convert"
        pairs.append((here[j], value))
    return pairs, ""


def assign_metrics(pairs: Sequence[tuple[Any, Any]]) -> None:
    """Assigns each metric variable its saved value (`saved_metrics`' pairs).

    Under a strategy a metric's variables are per replica and summed on read: assigned
    outside the step, each replica's copy takes its part, so the sum is the saved value.
    """
    for variable, value in pairs:
        variable.assign(value)


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


class Pairing(NamedTuple):
    """`(saved index, model index)` of every matched variable, and the mismatches in words."""

    pairs: list[tuple[int, int]]
    differences: list[str]


def _snake_case(name: str) -> str:
    """Keras' `to_snake_case` (Keras' utils.naming), which auto-names derive from."""
    name = re.sub(r"\W+", "", name)
    name = re.sub("(.)([A-Z][a-z]+)", r"\1_\2", name)
    name = re.sub("([a-z])([A-Z])", r"\1_\2", name)
    return name.lower()


def auto_name_prefixes(model: Any) -> set[str]:
    """The names Keras may have auto-numbered in `model`'s variable paths.

    The snake-case class names of the model, its layers (nested too) and every optimizer it
    holds, and `"seed_generator"`.
    """
    objects: list[Any] = [model]
    flatten = getattr(model, "_flatten_layers", None)
    if callable(flatten):
        objects += list(flatten(include_self=False, recursive=True))
    for optimizer in optimizers_of(model):
        objects.append(optimizer)
        inner = getattr(optimizer, "inner_optimizer", None)  # LossScaleOptimizer
        if inner is not None:
            objects.append(inner)
    prefixes = {_snake_case(type(obj).__name__) for obj in objects}
    prefixes.add("seed_generator")
    return {p for p in prefixes if p}


def _normalizer(prefixes: Iterable[str], flattened: bool) -> re.Pattern[str] | None:
    """Matches `prefix_N`; after `_` too only in flattened optimizer paths (`adam/model_1_x`)."""
    names = sorted(prefixes, key=len, reverse=True)
    if not names:
        return None
    alternatives = "|".join(re.escape(n) for n in names)
    left = "[/_:]" if flattened else "[/:]"
    return re.compile(rf"(^|{left})({alternatives})_\d+(?=$|/|_)")


def pair_by_path(
    saved: Sequence[tuple[str, str, tuple[int, ...]]],
    here: Sequence[tuple[str, str, tuple[int, ...]]],
    prefixes: Iterable[str],
    roots: Iterable[str] = (),
) -> Pairing:
    """Pairs saved variables with a model's by `(group, path)`, then compares shapes.

    `saved` and `here` hold `(group, path, shape)` of each variable; `prefixes` are the
    auto-generated names whose `_N` suffix may differ (`auto_name_prefixes`); `roots`,
    model names that may lead the paths on one side only (Keras names a variable
    `model/layer/kernel` or `layer/kernel` depending on how the model was built, e.g.
    deserialized from its config), ignored when the paths match exactly.
    """
    exact = sorted((g, p) for g, p, _ in saved) == sorted((g, p) for g, p, _ in here)
    prefixes = list(prefixes)
    patterns = {flat: None if exact else _normalizer(prefixes, flat) for flat in (False, True)}

    def norm(path: str, group: str = "") -> str:
        pattern = patterns[group == "optimizer"]
        return pattern.sub(r"\1\2", path) if pattern is not None else path

    tops = [] if exact else [norm(root) for root in roots]

    def key(group: str, path: str) -> tuple[str, str]:
        path = norm(path, group)
        for top in tops:
            head, _, rest = path.partition("/")
            if head == top and rest:  # model/layer/kernel -> layer/kernel
                path = rest
            elif group == "optimizer" and rest.startswith(f"{top}_"):  # adam/model_layer_...
                path = f"{head}/{rest[len(top) + 1 :]}"
        return (group, path)

    waiting: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, (group, path, _) in enumerate(saved):
        waiting[key(group, path)].append(i)
    pairs: list[tuple[int, int]] = []
    shapes: list[str] = []
    missing: list[str] = []
    for j, (group, path, shape) in enumerate(here):
        queue = waiting.get(key(group, path))
        if not queue:
            missing.append(f"{group}:{path} {tuple(shape)} here is not in the checkpoint")
            continue
        i = queue.pop(0)  # same (normalized) path: in order, as Keras numbers them
        pairs.append((i, j))
        if tuple(saved[i][2]) != tuple(shape):
            shapes.append(
                f"{group}:{path} is {tuple(saved[i][2])} in the checkpoint, {tuple(shape)} here"
            )
    extra = [
        f"{saved[i][0]}:{saved[i][1]} {tuple(saved[i][2])} in the checkpoint is not here"
        for i in sorted(i for queue in waiting.values() for i in queue)
    ]
    # Shape mismatches first, then the unmatched paths of both sides, alternately.
    differences = shapes + [
        d for both in zip_longest(missing, extra) for d in both if d is not None
    ]
    return Pairing(pairs=pairs, differences=differences)


def _saved_entries(
    loaded: LoadedCheckpoint, groups: Sequence[str]
) -> tuple[list[str], list[tuple[str, str, tuple[int, ...]]]]:
    """The array keys of `groups` in the saved order, and `(group, path, shape)` of each."""
    saved_paths = list(loaded.meta.variables)
    keys = sorted(
        (k for k in loaded.arrays if k.split("/")[0] in groups),
        key=lambda k: int(k.split("/")[1]),
    )
    shapes = loaded.shapes  # from the file's array headers: no array is read here
    saved = []
    for key in keys:
        group, number = key.split("/")[0], int(key.split("/")[1])
        path = saved_paths[number].partition(":")[2] if number < len(saved_paths) else "?"
        saved.append((group, path, tuple(shapes[key])))
    return keys, saved


def state_differences(
    named: Sequence[tuple[str, Any]],
    loaded: LoadedCheckpoint,
    prefixes: Iterable[str],
    groups: Sequence[str],
) -> list[str]:
    """How `named` and the checkpoint's variables of `groups` differ by path or shape, in
    words (`pair_by_path`'s differences); empty when they match."""
    _, saved = _saved_entries(loaded, groups)
    here = [(group, v.path, tuple(v.shape)) for group, v in named if group in groups]
    return pair_by_path(saved, here, prefixes).differences


def match_state(
    named: Sequence[tuple[str, Any]],
    loaded: LoadedCheckpoint,
    directory: str | os.PathLike[str],
    prefixes: Iterable[str],
    groups: Sequence[str] = ("model", "optimizer"),
    roots: Iterable[str] = (),
) -> list[tuple[str, tuple[str, Any]]]:
    """`(array key, (group, variable))` for each of `named`, in its order, or a refusal.

    `groups` are the saved groups to restore (`("model",)`: weights only); `roots` as for
    `pair_by_path`.

    Raises:
        CheckpointError: When a path or shape differs; nothing is assigned then.
    """
    keys, saved = _saved_entries(loaded, groups)
    here = [(group, v.path, tuple(v.shape)) for group, v in named]
    pairing = pair_by_path(saved, here, prefixes, roots)
    if pairing.differences:
        differences = pairing.differences
        count = f"{len(saved)} variables in the checkpoint, {len(here)} here"
        what = "this model and optimizer" if "optimizer" in groups else "this model"
        raise CheckpointError(
            f"The checkpoint {str(loaded.path)!r} does not match {what} ({count}; "
            f"{len(differences)} difference(s) by path or shape, first: "
            f"{'; '.join(differences[:6])}). It was written by another model or optimizer "
            "(variables are matched by path, never by position); nothing was restored or "
            "trained. Use a new checkpoint directory, or build the model and optimizer the "
            f"checkpoint was written with. Received: directory={str(directory)!r}"
        )
    by_model = sorted(pairing.pairs, key=lambda pair: pair[1])
    return [(keys[i], tuple(named[j])) for i, j in by_model]  # type: ignore[misc]
