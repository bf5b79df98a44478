"""Pairing a checkpoint's saved variables with a model's by variable path, never by position.

Paths are compared exactly when the checkpoint and the model hold the same set of paths
(in any order). Otherwise only Keras' auto-numbering is ignored: a `_N` suffix on a name
Keras generates for the layers, models and optimizer of this model (`dense_3`,
`sequential_1`, `adam_2`, `seed_generator_1`), so the same model built again in another
process, or after other models in this one, still matches. Names a user chose (`block_1`
against `block_2`) must be equal, so a model of another architecture whose variables have
the same shapes is refused instead of being filled by position.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from itertools import zip_longest
from typing import Any, NamedTuple

from keras_mirror_kit.checkpoint_store import CheckpointError, LoadedCheckpoint

__all__ = ["Pairing", "auto_name_prefixes", "match_state", "pair_by_path"]


class Pairing(NamedTuple):
    """The result of `pair_by_path`.

    Attributes:
        pairs: `(saved index, model index)` for every matched variable.
        differences: Readable descriptions of the mismatches, in model order (empty when
            every variable is matched with the same shape).
    """

    pairs: list[tuple[int, int]]
    differences: list[str]


def _snake_case(name: str) -> str:
    """Keras' `to_snake_case` (keras.src.utils.naming), which auto-names derive from."""
    name = re.sub(r"\W+", "", name)
    name = re.sub("(.)([A-Z][a-z]+)", r"\1_\2", name)
    name = re.sub("([a-z])([A-Z])", r"\1_\2", name)
    return name.lower()


def auto_name_prefixes(model: Any) -> set[str]:
    """The names Keras may have auto-numbered in `model`'s variable paths.

    Args:
        model: A Keras model.

    Returns:
        The snake-case class names of the model, its layers (nested too) and its
        optimizer, and `"seed_generator"`.

    Example:

    ```python
    assert "dense" in auto_name_prefixes(keras.Sequential([keras.layers.Dense(2)]))
    ```
    """
    objects: list[Any] = [model]
    flatten = getattr(model, "_flatten_layers", None)
    if callable(flatten):
        objects += list(flatten(include_self=False, recursive=True))
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
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

    Args:
        saved: `(group, path, shape)` of each variable in the checkpoint.
        here: `(group, path, shape)` of each variable of the model.
        prefixes: Auto-generated names whose `_N` suffix may differ (`auto_name_prefixes`).
        roots: Model names that may lead the paths on one side only (Keras names a
            variable `model/layer/kernel` or `layer/kernel` depending on how the model was
            built, e.g. deserialized from its config); ignored when paths match exactly.

    Returns:
        The pairs and the differences (unmatched paths on either side, shape mismatches).

    Example:

    ```python
    pairing = pair_by_path([("model", "d/kernel", (2, 2))], [("model", "d/kernel", (2, 2))],
                           {"dense"})
    assert pairing.pairs == [(0, 0)] and not pairing.differences
    ```
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


def match_state(
    named: Sequence[tuple[str, Any]],
    loaded: LoadedCheckpoint,
    directory: str | os.PathLike[str],
    prefixes: Iterable[str],
    groups: Sequence[str] = ("model", "optimizer"),
    roots: Iterable[str] = (),
) -> list[tuple[str, tuple[str, Any]]]:
    """Pairs a checkpoint's arrays with the variables to restore, or refuses the checkpoint.

    Args:
        named: `(group, variable)` pairs to restore (`state_variables`, maybe filtered).
        loaded: The checkpoint.
        directory: The checkpoint directory, for messages.
        prefixes: Auto-generated names (`auto_name_prefixes(model)`).
        groups: The saved groups to restore (`("model",)`: weights only).
        roots: Model names that may lead the paths on one side only (`pair_by_path`).

    Returns:
        `(array key, (group, variable))` for every variable, in the order of `named`.

    Raises:
        CheckpointError: When a path or shape differs; nothing is assigned then.

    Example:

    ```python
    for key, (_, variable) in match_state(named, loaded, "ckpts", auto_name_prefixes(model)):
        variable.assign(loaded.arrays[key])
    ```
    """
    saved_paths = list(loaded.meta.get("variables") or [])
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
