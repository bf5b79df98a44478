"""The samples both runs of a replica check train on, and the batch size they train with.

Both runs must see the same global batches in the same order, so the check takes the first
`steps x global batch` samples of the user's data once, unshuffled, and keeps them as NumPy
arrays (in an `.npz` file, read without pickle, when they cross to the child process).
Data given as a dataset is taken as Keras' `fit` takes it: each element is a batch.
"""

from __future__ import annotations

import json
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "FactorySettings",
    "choose_global_batch",
    "factory_settings",
    "load_samples",
    "save_samples",
    "take_samples",
]

#: Keras' default batch size for arrays, the default global batch without any other hint.
KERAS_DEFAULT_BATCH = 32
_DATA_KINDS = (
    "arrays (x, y) or (x, y, sample_weight), a tf.data.Dataset of batches, a "
    "keras.utils.PyDataset, a generator of batches, or a zero-argument function returning "
    "one of those"
)


@dataclass(frozen=True)
class FactorySettings:
    """The user's factory without its decorator, and what its `distributed()` asked for."""

    inner: Callable[[], Any]
    per_replica_batch_size: int | None = None
    global_batch_size: int | None = None
    options: dict[str, Any] = field(default_factory=dict)  # distributed() keyword arguments

    def to_json(self) -> dict[str, Any]:
        """Everything but the function, for the child (which finds the function by name)."""
        return {
            "per_replica_batch_size": self.per_replica_batch_size,
            "global_batch_size": self.global_batch_size,
            "options": self.options,
        }

    @property
    def accumulation(self) -> int:
        """Micro-batches per optimizer update."""
        return int(self.options.get("gradient_accumulation_steps", 1))


def factory_settings(factory: Any) -> FactorySettings:
    """Splits a `DistributedFactory` into its function and options; a function stays as is.

    The options kept are those that change what trains (batch size, sync_batch_norm,
    mixed_precision, steps_per_execution, gradient_accumulation_steps, lr_scaling_rule, a
    named all-reduce); devices, strategy and cluster are the check's own.
    """
    from keras_mirror_kit.distributed import DistributedFactory

    if not isinstance(factory, DistributedFactory):
        if not callable(factory):
            raise TypeError(
                "`factory` must be a zero-argument function returning a compiled keras.Model "
                "(what you decorate with @kmk.distributed), or the decorated factory. "
                f"Received: factory={factory!r}"
            )
        return FactorySettings(inner=factory)
    config = factory._config  # noqa: SLF001  (the kit's own classes)
    model_options = config._options  # noqa: SLF001
    options: dict[str, Any] = {
        "sync_batch_norm": model_options.sync_batch_norm,
        "mixed_precision": model_options.mixed_precision,
        "steps_per_execution": model_options.steps_per_execution,
        "gradient_accumulation_steps": config._accumulation,  # noqa: SLF001
        "lr_scaling_rule": config._lr_scaling_rule,  # noqa: SLF001
    }
    if isinstance(config._cross_device_ops, str):  # noqa: SLF001
        options["cross_device_ops"] = config._cross_device_ops  # noqa: SLF001
    return FactorySettings(
        inner=factory._factory,  # noqa: SLF001
        per_replica_batch_size=config._per_replica_batch_size,  # noqa: SLF001
        global_batch_size=config._global_batch_size,  # noqa: SLF001
        options=options,
    )


def choose_global_batch(
    settings: FactorySettings, replicas: int, batch_size: int | None, data_batch: int | None
) -> int:
    """The global batch both runs train with: `batch_size`, else the factory's, else the data's.

    Without either, the first batch of a dataset, or Keras' 32 for arrays, rounded down to a
    multiple of the replica count. `ValueError` for a given size the replicas cannot share.
    """
    if batch_size is not None:
        given, source = batch_size, "batch_size"
    elif settings.global_batch_size is not None:
        given, source = settings.global_batch_size, "the factory's global_batch_size"
    elif settings.per_replica_batch_size is not None:
        return settings.per_replica_batch_size * replicas
    else:
        base = data_batch or KERAS_DEFAULT_BATCH
        return max(replicas, base // replicas * replicas)
    if given % replicas:
        raise ValueError(
            f"The global batch size ({source}: {given}) must divide evenly by the "
            f"{replicas} replicas of the check. Pass batch_size= (--batch-size) a multiple "
            f"of {replicas}, or check another replica count. Received: batch_size={given}, "
            f"replicas={replicas}"
        )
    return given


def _to_numpy(value: Any) -> Any:
    """A nested tuple/list/dict of arrays as tuples, dicts and NumPy arrays."""
    if isinstance(value, dict):
        return {key: _to_numpy(item) for key, item in value.items()}
    if isinstance(value, (tuple, list)):
        return tuple(_to_numpy(item) for item in value)
    array = np.asarray(value)
    if array.dtype.kind == "O":  # strings from tf.data (bytes) or Python
        array = np.asarray(array.tolist())
    if array.ndim == 0:
        raise ValueError(
            "Every array of the data needs a first (sample) dimension. Received: an array of "
            f"shape () ({value!r:.60})"
        )
    return array


def _leaves(structure: Any) -> list[np.ndarray]:
    if isinstance(structure, dict):
        return [leaf for key in structure for leaf in _leaves(structure[key])]
    if isinstance(structure, tuple):
        return [leaf for item in structure for leaf in _leaves(item)]
    return [structure]


def _map(structure: Any, fn: Callable[[np.ndarray], np.ndarray]) -> Any:
    if isinstance(structure, dict):
        return {key: _map(item, fn) for key, item in structure.items()}
    if isinstance(structure, tuple):
        return tuple(_map(item, fn) for item in structure)
    return fn(structure)


def _length(structure: Any, what: str) -> int:
    lengths = {int(leaf.shape[0]) for leaf in _leaves(structure)}
    if len(lengths) != 1:
        raise ValueError(
            f"The arrays of {what} must have the same number of samples (first dimension). "
            f"Received: first dimensions {sorted(lengths)}"
        )
    return lengths.pop()


def _batches(data: Any) -> Iterator[Any] | None:
    """The batches of a dataset-like `data`, or None when it is not one."""
    import keras
    import tensorflow as tf

    if isinstance(data, tf.data.Dataset):
        return iter(data.as_numpy_iterator())
    if isinstance(data, keras.utils.PyDataset):
        return (data[i] for i in range(len(data)))
    if isinstance(data, (types.GeneratorType, Iterator)):
        return iter(data)
    return None


def _too_few(have: int, needed: int, batches: int, global_batch: int) -> ValueError:
    return ValueError(
        f"The data holds {have} samples, but the check trains {batches} step(s) of "
        f"{global_batch} samples ({needed} samples). Give more data, fewer steps or a "
        f"smaller batch_size. Received: {have} samples"
    )


def take_samples(
    data: Any,
    settings: FactorySettings,
    replicas: int,
    steps: int,
    batch_size: int | None,
) -> tuple[int, Any]:
    """(the global batch, the first `steps x accumulation x global batch` samples).

    `TypeError` for data of another kind, `ValueError` for too few or inconsistent samples.
    """
    if callable(data):
        data = data()
        if callable(data):
            raise TypeError(
                f"The data function must return the data itself: {_DATA_KINDS}. "
                f"Received: a function returning {data!r:.80}"
            )
    batches = steps * settings.accumulation
    if isinstance(data, (tuple, list)):
        parts = tuple(data)
        while parts and parts[-1] is None:  # (x, None): no labels
            parts = parts[:-1]
        if not 1 <= len(parts) <= 3 or any(
            p is None or isinstance(p, (str, bytes)) for p in parts
        ):
            raise TypeError(
                f"Arrays must come as a tuple (x, y) or (x, y, sample_weight), as fit takes "
                f"them. Received: a {type(data).__name__} of {len(data)} item(s)"
            )
        structure = _to_numpy(parts)
        global_batch = choose_global_batch(settings, replicas, batch_size, None)
        needed = batches * global_batch
        have = _length(structure, "the data")
        if have < needed:
            raise _too_few(have, needed, batches, global_batch)
        return global_batch, _map(structure, lambda a: a[:needed])
    iterator = _batches(data)
    if iterator is None:
        raise TypeError(f"`data` must be {_DATA_KINDS}. Received: data={data!r:.100}")
    taken: list[Any] = []
    global_batch = needed = have = 0
    for element in iterator:
        element = _to_numpy(element)
        size = _length(element, "a batch of the data")
        if not taken:
            global_batch = choose_global_batch(settings, replicas, batch_size, size)
            needed = batches * global_batch
        taken.append(element)
        have += size
        if have >= needed:
            break
    if not taken:
        raise ValueError("The data yields no batch. Received: an empty dataset")
    if have < needed:
        raise _too_few(have, needed, batches, global_batch)
    joined = _map_many(taken)
    return global_batch, _map(joined, lambda a: a[:needed])


def _map_many(elements: list[Any]) -> Any:
    """The batches' arrays joined along the sample dimension (the structure of the first)."""
    first = elements[0]
    if isinstance(first, dict):
        return {key: _map_many([e[key] for e in elements]) for key in first}
    if isinstance(first, tuple):
        return tuple(_map_many([e[i] for e in elements]) for i in range(len(first)))
    return np.concatenate(elements, axis=0)


def _encode(value: Any, leaves: list[np.ndarray]) -> Any:
    if isinstance(value, dict):
        return {"dict": {str(key): _encode(item, leaves) for key, item in value.items()}}
    if isinstance(value, tuple):
        return {"tuple": [_encode(item, leaves) for item in value]}
    leaves.append(value)
    return {"leaf": len(leaves) - 1}


def _decode(spec: Any, leaves: list[np.ndarray]) -> Any:
    if "dict" in spec:
        return {key: _decode(item, leaves) for key, item in spec["dict"].items()}
    if "tuple" in spec:
        return tuple(_decode(item, leaves) for item in spec["tuple"])
    return leaves[spec["leaf"]]


def save_samples(path: str, structure: Any) -> None:
    """Writes a nested tuple/dict of arrays to an `.npz` (its structure as JSON inside)."""
    leaves: list[np.ndarray] = []
    spec = _encode(structure, leaves)
    arrays = {f"leaf_{i}": leaf for i, leaf in enumerate(leaves)}
    np.savez(path, structure=np.array(json.dumps(spec)), **arrays)


def load_samples(path: str) -> Any:
    """What `save_samples` wrote."""
    with np.load(path, allow_pickle=False) as npz:
        spec = json.loads(str(npz["structure"]))
        count = sum(1 for name in npz.files if name.startswith("leaf_"))
        leaves = [npz[f"leaf_{i}"] for i in range(count)]
    return _decode(spec, leaves)
