"""Using `SyncedCheckpoint` checkpoints outside `fit`: load into a model, export to Keras.

`restore(model, directory)` puts the newest good (or a named, or the best) checkpoint's
weights, and optionally its optimizer state, into a model for evaluation, prediction or
export. `export_checkpoint(directory, to)` writes a checkpoint in Keras' own formats
(`.keras` or `.weights.h5`), which load with plain Keras, without the kit. The model's
architecture comes from the checkpoint (each save records `keras.saving.
serialize_keras_object(model)` when the model serializes) or from a factory you name.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras

from keras_mirror_kit.atomic_files import atomic_path
from keras_mirror_kit.checkpoint.best import best_entries
from keras_mirror_kit.checkpoint.meta import ManifestEntry
from keras_mirror_kit.checkpoint.state import (
    assign_state,
    auto_name_prefixes,
    build_optimizer,
    match_state,
    state_variables,
)
from keras_mirror_kit.checkpoint.store import CheckpointError, CheckpointStore, LoadedCheckpoint
from keras_mirror_kit.named_objects import resolve

__all__ = ["export_checkpoint", "load_checkpoint", "model_config", "restore"]

logger = logging.getLogger("keras_mirror_kit")

_EXPORT_SUFFIXES = (".keras", ".weights.h5")


def model_config(model: Any) -> dict[str, Any] | None:
    """The model's architecture as Keras serializes it (JSON-able), or None when it does not
    serialize (a subclassed model without `get_config`, a layer that cannot be)."""
    try:
        config = keras.saving.serialize_keras_object(model)
        json.dumps(config)
    except Exception as err:  # any layer's get_config may fail: the checkpoint goes on
        logger.debug("keras-mirror-kit: the model's architecture is not recorded (%s)", err)
        return None
    return config


def _first_line(err: BaseException) -> str:
    """The first line of an error's message, cut to 300 characters."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return text if len(text) <= 300 else f"{text[:297]}..."


def _directory_store(directory: str | os.PathLike[str]) -> CheckpointStore:
    path = Path(directory)
    if not path.is_dir():
        raise CheckpointError(
            f"There is no checkpoint directory {str(path)!r}. Pass the directory given to "
            f"SyncedCheckpoint. Received: directory={str(directory)!r}"
        )
    return CheckpointStore(path)


def load_checkpoint(
    directory: str | os.PathLike[str], name: str | None = None
) -> LoadedCheckpoint:
    """Reads and verifies a checkpoint of a directory, without a model.

    `name`: None for the newest good checkpoint (a corrupt newer one is skipped with a
    `CorruptCheckpointWarning`), `"best"` for the best by the metric of `keep_best`, or a
    file name (`"ckpt-00000004.npz"`, `"ckpt-00000004"`) or number (`"4"`).

    Raises:
        CheckpointError: No such directory or checkpoint, none usable, or a named one that
            fails verification.
    """
    store = _directory_store(directory)
    entries = store.entries()
    if name is None:
        loaded = store.load_latest()
        if loaded is None:
            raise CheckpointError(
                f"The checkpoint directory {str(directory)!r} holds no usable checkpoint "
                f"({len(entries)} file(s), none readable). Pass the directory a "
                f"SyncedCheckpoint wrote to. Received: directory={str(directory)!r}"
            )
        return loaded
    if name == "best":
        scored = [e.score for e in entries if e.score is not None and e.score.value is not None]
        if not scored:
            raise CheckpointError(
                f"No checkpoint in {str(directory)!r} records a score: write them with "
                "SyncedCheckpoint(keep_best=..., monitor=...), or pass name=None for the "
                f"newest. Received: name='best'"
            )
        entry = best_entries(entries, scored[-1].monitor)[0]
    else:
        entry = _named_entry(entries, name, directory)
    try:
        return store.read(entry)
    except ValueError as err:
        raise CheckpointError(
            f"The checkpoint {entry.file!r} in {str(directory)!r} fails verification: "
            f"{err}. Choose another one (keras-mirror-kit ckpt ls), or pass name=None for "
            f"the newest good one. Received: name={name!r}"
        ) from err


def _named_entry(entries: list[ManifestEntry], name: str, directory: Any) -> ManifestEntry:
    """The entry called `name` (file name, with or without `.npz`, or number)."""
    wanted = str(name)
    for entry in entries:
        if wanted in (entry.file, entry.file.removesuffix(".npz")) or (
            wanted.isdigit() and int(wanted) == entry.index
        ):
            return entry
    names = ", ".join(e.file for e in entries) or "none"
    raise CheckpointError(
        f"There is no checkpoint {wanted!r} in {str(directory)!r} (checkpoints: {names}). "
        f"Received: name={name!r}"
    )


def restore(
    model: Any,
    directory: str | os.PathLike[str],
    name: str | None = None,
    *,
    optimizer: bool | str = "auto",
) -> LoadedCheckpoint:
    """Loads a `SyncedCheckpoint` checkpoint into a model, outside `fit`.

    Variables are matched by path (as when `fit` resumes), never by position: a
    checkpoint of another architecture is refused and nothing is assigned.

    Args:
        model: A built Keras model of the architecture that wrote the checkpoint.
        directory: The checkpoint directory.
        name: None for the newest good checkpoint, `"best"` for the best by the metric of
            `keep_best`, or a checkpoint's file name or number (`keras-mirror-kit ckpt ls`).
        optimizer: `"auto"`: restore the optimizer's state too when the model is compiled
            and its optimizer built; True: restore it (building the optimizer of a
            compiled model); False: weights only.

    Returns:
        The checkpoint restored (`.meta` holds its epoch, step, ...).

    Raises:
        ValueError: When the model is not built, or `optimizer=True` without a compiled
            model, or `optimizer` is not a bool or `"auto"`.
        CheckpointError: No usable checkpoint, or one of another model or optimizer.

    Example:

    ```python
    model = build_model()
    kmk.restore(model, "ckpts")          # the newest good checkpoint's weights
    model.evaluate(test_ds)
    ```
    """
    if optimizer not in (True, False, "auto"):
        raise ValueError(
            f"`optimizer` must be True, False or 'auto'. Received: optimizer={optimizer!r}"
        )
    if not getattr(model, "built", False):
        raise ValueError(
            "restore() needs a built model, so that its variables exist: build it first "
            "(a keras.Input in the model, model.build(input_shape), or a call on a batch). "
            f"Received: model={type(model).__name__} (not built)"
        )
    opt = getattr(model, "optimizer", None)
    if optimizer is True:
        if opt is None:
            raise ValueError(
                "restore(optimizer=True) needs a compiled model (its optimizer receives the "
                "saved state). Compile the model first, or pass optimizer=False. "
                "Received: optimizer=True"
            )
        build_optimizer(model)
    with_optimizer = opt is not None and bool(opt.built) and optimizer is not False
    loaded = load_checkpoint(directory, name)
    groups = ("model", "optimizer") if with_optimizer else ("model",)
    named = [p for p in state_variables(model, legacy=loaded.meta.legacy_state) if p[0] in groups]
    roots = [model.name] if isinstance(getattr(model, "name", None), str) else []
    matched = match_state(named, loaded, directory, auto_name_prefixes(model), groups, roots)
    opened = loaded.arrays if hasattr(loaded.arrays, "__enter__") else contextlib.nullcontext()
    with opened:  # type: ignore[attr-defined]
        assign_state(matched, loaded, directory)  # converted exactly where dtypes differ
    logger.info(
        "keras-mirror-kit: restored %s (epoch %s, step %s%s) into %s",
        loaded.path.name,
        loaded.meta.epoch,
        loaded.meta.step,
        ", with the optimizer state" if with_optimizer else "",
        getattr(model, "name", type(model).__name__),
    )
    return loaded


def export_checkpoint(
    directory: str | os.PathLike[str],
    to: str | os.PathLike[str],
    name: str | None = None,
    model: str | Callable[[], Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Writes a checkpoint as a Keras `.keras` model or `.weights.h5` weights file.

    The file loads with plain Keras (`keras.saving.load_model(path)`, or
    `model.load_weights(path)` on the same architecture), without the kit; it is written
    atomically. The architecture comes from the checkpoint (`model=None`) or from a
    factory (a callable, or `"module:function"`) returning the model.

    Raises:
        ValueError: A bad file name or factory.
        FileExistsError: `to` exists and `overwrite` is False.
        CheckpointError: No usable checkpoint, no recorded architecture and no factory, a
            recorded architecture that cannot be rebuilt (a class nobody registered) or is
            not a model, or a checkpoint of another model.
    """
    target = Path(to)
    if not target.name.endswith(_EXPORT_SUFFIXES) or target.name in _EXPORT_SUFFIXES:
        raise ValueError(
            "The export file's name must end in '.keras' (the whole model) or "
            f"'.weights.h5' (its weights). Received: to={str(to)!r}"
        )
    if target.exists() and not overwrite:
        raise FileExistsError(
            f"{str(target)!r} exists; it is left as it is. Choose another file name, or "
            f"pass overwrite=True (--overwrite). Received: to={str(to)!r}"
        )
    loaded = load_checkpoint(directory, name)
    if model is None:
        config = loaded.meta.model_config
        if not config:
            raise CheckpointError(
                f"The checkpoint {loaded.path.name!r} does not record the model's "
                "architecture (a model that does not serialize, or a checkpoint of an older "
                "kit). Pass the function that builds the model: --model module:function "
                "(or model=build_model). Received: model=None"
            )
        try:
            built = keras.saving.deserialize_keras_object(config)
        except Exception as err:  # any layer's from_config may fail on a config it did not write
            raise CheckpointError(
                f"The architecture recorded in {loaded.path.name!r} cannot be rebuilt "
                f"({type(err).__name__}: {_first_line(err)}). A custom layer or model must be "
                "registered (keras.saving.register_keras_serializable) in the process that "
                "exports; or pass the function that builds the model: --model "
                "module:function (or model=build_model). Received: model=None"
            ) from err
        if not isinstance(built, keras.Model):
            raise CheckpointError(
                f"The architecture recorded in {loaded.path.name!r} is a "
                f"{type(built).__name__}, not a Keras model. Pass the function that builds "
                "the model: --model module:function (or model=build_model). "
                "Received: model=None"
            )
    else:
        factory = resolve(model, "model", callable_only=True) if isinstance(model, str) else model
        built = factory()
    restore(built, directory, loaded.path.name, optimizer=False)
    with atomic_path(target) as tmp:
        if target.name.endswith(".keras"):
            built.save(tmp)
        else:
            built.save_weights(tmp)
    logger.info("keras-mirror-kit: exported %s to %s", loaded.path.name, target)
    return target
