"""Whether a checkpoint's optimizer state is this `fit()`'s, across a recompile.

A script may compile a model again between two `fit()` calls, as keras-io's fine-tuning
guide does (`base.trainable = True`, then `model.compile(optimizer=...)` with a small
learning rate): the second `fit()` trains with another optimizer, built for other
variables. A checkpoint records, for each optimizer, the model variables it was built to
train (`CheckpointMeta.trained`, written by `trained_numbers`). Before a resume assigns
anything, `check_optimizer_state` compares the checkpoint's optimizer with this `fit()`'s:
its kind (the first part of its variables' paths: `adam`, `sgd`, Keras' numbering
ignored) and the variables it trains. A difference is refused with
`OptimizerMismatchError`, naming it and what to write; a resume that passes restores the
optimizer's state exactly (iterations, learning rate, moments), as the variables' paths
and shapes are compared afterwards (`state.match_state`). Without an optimizer with
per-variable state (plain `SGD`), the recorded variables are what tells a checkpoint
written with other trainable flags.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import Any

from keras_mirror_kit.checkpoint.state import match_state, state_differences, state_variables
from keras_mirror_kit.checkpoint.store import CheckpointError, LoadedCheckpoint
from keras_mirror_kit.model_parts import optimizers_of
from keras_mirror_kit.upstream import keras_private

__all__ = ["OptimizerMismatchError", "check_optimizer_state", "trained_numbers"]

_NUMBERED = re.compile(r"_\d+$")


class OptimizerMismatchError(CheckpointError, ValueError):
    """A checkpoint holds the state of another optimizer than this `fit()`'s, or of one
    built to train other variables (a `compile()` or trainable flags unlike those of the
    run that wrote it). Raised before anything is restored or trained."""


def _built_for(optimizer: Any) -> list[Any] | None:
    """The variables `optimizer` was built to train (a loss scaler's: its inner one's)."""
    inner = getattr(optimizer, "inner_optimizer", None)
    return keras_private.optimizer_built_for(inner if inner is not None else optimizer)


def trained_numbers(model: Any) -> tuple[tuple[int, ...], ...]:
    """For each optimizer of `model` (`optimizers_of`' order), the numbers of the model's
    variables it was built to train among those a checkpoint holds (`state_variables`'
    order, which numbers its arrays); `()` for an optimizer not built yet."""
    numbers = {id(v): i for i, (group, v) in enumerate(state_variables(model)) if group == "model"}
    trained = []
    for optimizer in optimizers_of(model):
        built = _built_for(optimizer) or []
        trained.append(tuple(sorted(numbers[id(v)] for v in built if id(v) in numbers)))
    return tuple(trained)


def _kinds(paths: Iterable[str]) -> list[str]:
    """The optimizers' names in variable paths (`adam_1/iteration` -> `adam`), in order."""
    kinds: list[str] = []
    for path in paths:
        kind = _NUMBERED.sub("", path.partition("/")[0])
        if kind not in kinds:
            kinds.append(kind)
    return kinds


def check_optimizer_state(
    model: Any,
    loaded: LoadedCheckpoint,
    directory: str | os.PathLike[str],
    prefixes: Iterable[str],
) -> None:
    """Refuses a checkpoint whose optimizer state is not this `fit()`'s optimizer's.

    Args:
        model: The model being resumed, its optimizer built.
        loaded: The checkpoint about to be restored.
        directory: The checkpoint directory, for messages.
        prefixes: The auto-numbered names of the model (`state.auto_name_prefixes`).

    Raises:
        OptimizerMismatchError: When the checkpoint's optimizer is of another kind, or was
            built to train other variables of the model (its trainable flags differed).
            A checkpoint of another model is left to `state.match_state`'s refusal.
    """
    if loaded.meta.legacy_state:
        return
    named = state_variables(model)
    here_paths = [v.path for group, v in named if group == "optimizer"]
    saved_paths = [
        p.partition(":")[2] for p in loaded.meta.variables if p.startswith("optimizer:")
    ]
    saved, here = _kinds(saved_paths), _kinds(here_paths)
    name = type(getattr(model, "optimizer", None)).__name__
    where = f"The checkpoint {str(loaded.path)!r}"
    if saved and here and saved != here:
        differences = state_differences(named, loaded, prefixes, ("optimizer",))
        raise OptimizerMismatchError(
            f"{where} does not match this model's optimizer: it holds the state of another "
            f"optimizer than this fit()'s, {', '.join(saved)} in the checkpoint, "
            f"{', '.join(here)} ({name}) here (first differences: "
            f"{'; '.join(differences[:6])}). The run that wrote it had compiled another "
            "optimizer before this fit() (a compile() added, moved or changed since, such "
            "as a fine-tuning phase's second compile), so its state cannot be restored into "
            "this one; nothing was restored or trained. Compile the optimizer the "
            "checkpoint was written with before this fit(), as the script that wrote it "
            "did; or, to go on from its weights with this optimizer, load them with "
            "kmk.restore(model, directory, optimizer=False) and give this fit() a new "
            "checkpoint directory. "
            f"Received: optimizer={name} ({', '.join(here)}), the checkpoint's "
            f"optimizer={', '.join(saved)}"
        )
    if loaded.meta.trained is None:  # written before it was recorded
        return
    weights = [pair for pair in named if pair[0] == "model"]
    try:
        matched = match_state(weights, loaded, directory, prefixes, groups=("model",))
    except CheckpointError:
        return  # another model: match_state refuses it with its own message
    by_number = {int(key.split("/")[1]): variable for key, (_, variable) in matched}
    for optimizer, numbers in zip(optimizers_of(model), loaded.meta.trained):
        built = _built_for(optimizer)
        if built is None:
            continue
        trains_here = {id(v) for v in built}
        trained = {id(by_number[n]) for n in numbers if n in by_number}
        ordered = [by_number[n] for n in sorted(by_number)]
        only_saved = [v.path for v in ordered if id(v) in trained and id(v) not in trains_here]
        only_here = [v.path for v in ordered if id(v) in trains_here and id(v) not in trained]
        if not (only_saved or only_here):
            continue
        differences = []
        if only_saved:
            differences.append(f"trained in the checkpoint, frozen here: {_listed(only_saved)}")
        if only_here:
            differences.append(f"trainable here, frozen in the checkpoint: {_listed(only_here)}")
        raise OptimizerMismatchError(
            f"{where} does not match this model's optimizer: it holds the state of an "
            "optimizer built to train other variables than this fit()'s "
            f"{type(optimizer).__name__} ({'; '.join(differences)}). The "
            "layers' trainable flags differ from those of the run that wrote it (as when "
            "a fine-tuning script sets base.trainable = True and compiles again before "
            "its second fit()), so training would go on unlike that run; nothing was "
            "restored or trained. Set the same layers trainable as the run that wrote it, "
            "then compile, before this fit(); or, to train with these flags from its "
            "weights, load them with kmk.restore(model, directory, optimizer=False) and "
            "give this fit() a new checkpoint directory. Received: trainable variables="
            f"{len(trains_here)} here, {len(trained)} in the checkpoint"
        )


def _listed(paths: list[str], limit: int = 6) -> str:
    """At most `limit` paths, then how many more."""
    more = f" and {len(paths) - limit} more" if len(paths) > limit else ""
    return ", ".join(paths[:limit]) + more
