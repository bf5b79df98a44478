"""The training state on JAX: reading variables for a save, comparing replica copies.

The same functions as `backends.tensorflow_state`, for `keras.distribution.DataParallel`:

* A variable's value is one `jax.Array`, replicated over the devices (one copy per device
  in `array.addressable_shards`). Reading it for a save is free; its host copy is that of
  the first copy (a view on CPU devices). The finite check runs on the devices as one
  compiled function over the state (compiled at the first save, cached after), and one
  boolean per variable comes to the host.
* Keras' JAX trainer keeps the state in its own arrays during an epoch and detaches the
  variables' values (`_value` None) until `model.jax_state_sync()`; Keras' `Callback.model`
  syncs on every access, so a callback that reads the state through `self.model` sees the
  current values. A detached variable read here is refused (its `value` would be Keras'
  placeholder, its initializer's values, not the state).
* Under SPMD each copy of a replicated variable is the output of the same program on the
  same (all-reduced) inputs, so copies differ only through a fault (non-deterministic
  kernels, hardware). `differing_copies` compares them anyway, each copy against the first
  on its own device, a slice of at most `chunk_bytes` at a time; only scalars come back.
* There is one process (multi-worker training is refused on JAX), so the workers' exchange
  of their resume points is this process's own row.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "differing_copies",
    "finite_check",
    "finite_flags",
    "gather_rows",
    "host_layout",
    "host_value",
    "read_value",
    "reads_collectively",
    "replica_copies",
]


def read_value(variable: Any) -> Any:
    """The variable's value: its `jax.Array` (replicated over the devices), as it is.

    Raises:
        RuntimeError: For a variable Keras' JAX trainer has detached (mid-epoch, not synced).
    """
    if getattr(variable, "_value", True) is None:  # detached by the trainer, not synced
        raise RuntimeError(
            f"The variable {getattr(variable, 'path', variable)!r} has no value here: Keras' "
            "JAX trainer keeps the training state in its own arrays during an epoch. Read "
            "the state through a callback's `self.model` (which syncs it) or call "
            "model.jax_state_sync() first."
        )
    return getattr(variable, "value", variable)


def reads_collectively(variable: Any) -> bool:
    """No variable is read collectively under SPMD (one process reads every copy)."""
    del variable
    return False


def host_layout(variable: Any) -> tuple[tuple[int, ...], Any]:
    """The shape and NumPy dtype of the variable's host copy (nothing is read)."""
    import jax.numpy as jnp

    return tuple(variable.shape), jnp.dtype(variable.dtype)


def host_value(source: Any) -> np.ndarray:
    """A variable's or an array's value on the host (its first copy; a view on CPU)."""
    return np.asarray(read_value(source))


def finite_check(value: Any) -> Any | None:
    """What `finite_flags` checks: the array itself when floating or complex, else None."""
    import jax.numpy as jnp

    return value if jnp.issubdtype(value.dtype, jnp.inexact) else None


@functools.cache
def _finite_function() -> Any:
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda values: jnp.stack([jnp.all(jnp.isfinite(v)) for v in values]))


def finite_flags(checks: Sequence[Any]) -> np.ndarray:
    """Whether each array is all finite: computed on the devices, one boolean each to the host.

    One compiled call per set of devices the arrays live on (normally one: the mesh).
    """
    flags = np.ones(len(checks), bool)
    groups: dict[Any, list[int]] = {}
    for i, value in enumerate(checks):
        groups.setdefault(frozenset(value.sharding.device_set), []).append(i)
    for indices in groups.values():
        found = np.asarray(_finite_function()([checks[i] for i in indices]))
        flags[indices] = found
    return flags


def replica_copies(model: Any, variable: Any) -> list[Any]:
    """The copies of a replicated variable, one per device (`addressable_shards`); [] when
    it is on one device or sharded (then no copy holds the whole of it)."""
    del model
    value = read_value(variable)
    sharding = getattr(value, "sharding", None)
    if sharding is None or not sharding.is_fully_replicated:
        return []
    shards = value.addressable_shards
    return [shard.data for shard in shards] if len(shards) >= 2 else []


@functools.cache
def _compare_functions() -> tuple[Any, Any]:
    """`flat_slice(x, start, count)` and `stats(here, there)`, compiled per shape."""
    import jax
    import jax.numpy as jnp

    def flat_slice(x: Any, start: Any, count: int) -> Any:
        return jax.lax.dynamic_slice(x.reshape(-1), (start,), (count,))

    def stats(here: Any, there: Any) -> Any:
        """[bit-equal, equal (NaN equals NaN), all finite, max |diff|] of one slice."""
        wide = jnp.result_type(float)  # float64 where JAX has it enabled, else float32
        exact = jnp.all(here == there)
        if jnp.issubdtype(here.dtype, jnp.complexfloating):
            here = jnp.stack([jnp.real(here), jnp.imag(here)])
            there = jnp.stack([jnp.real(there), jnp.imag(there)])
        same = here == there
        finite = jnp.array(True)
        if jnp.issubdtype(here.dtype, jnp.floating):
            same = same | (jnp.isnan(here) & jnp.isnan(there))
            finite = jnp.all(jnp.isfinite(here))
        same = jnp.all(same)
        if here.dtype == jnp.bool_:
            gap = jnp.logical_not(same).astype(wide)
        elif jnp.issubdtype(here.dtype, jnp.floating):  # in its own precision
            gap = jnp.max(jnp.abs(here - there), initial=0).astype(wide)
        else:
            gap = jnp.max(jnp.abs(here.astype(wide) - there.astype(wide)), initial=0)
        return jnp.stack([exact.astype(wide), same.astype(wide), finite.astype(wide), gap])

    return jax.jit(flat_slice, static_argnums=2), jax.jit(stats)


def _copy_stats(first: Any, copy: Any, chunk_bytes: int) -> list[Any]:
    """The stats of `copy` against `first`, on `copy`'s device, slice by slice."""
    import jax

    flat_slice, stats = _compare_functions()
    device = next(iter(copy.devices()))
    size, width = int(first.size), max(1, first.dtype.itemsize)
    length = max(1, chunk_bytes // width)
    if size <= length:  # one slice: the whole variable, as it is
        return [stats(copy, jax.device_put(first, device))]
    found = []
    for start in range(0, size, length):
        count = min(length, size - start)
        there = jax.device_put(flat_slice(first, start, count), device)  # only the slice travels
        found.append(stats(flat_slice(copy, start, count), there))
    return found


def differing_copies(
    mirrored: Sequence[list[Any]], chunk_bytes: int
) -> list[tuple[int, np.ndarray]]:
    """`(index, rows)` of the variables whose copies differ bit for bit: per replica [equal
    (NaN equals NaN), all finite, max |difference|], each copy compared on its device."""
    import jax

    pending = [[_copy_stats(copies[0], c, chunk_bytes) for c in copies] for copies in mirrored]
    fetched = jax.device_get(pending)  # scalars only: four per slice
    differing = []
    for i, per_copy in enumerate(fetched):
        rows = []
        for slices in per_copy:
            table = np.asarray(slices, np.float64).reshape(-1, 4)
            rows.append([*table[:, :3].all(axis=0), table[:, 3].max()])
        table = np.asarray(rows, np.float64)
        if not table[1:, 0].all():  # some copy differs from the first, bit for bit
            differing.append((i, table[:, 1:]))
    return differing


def gather_rows(model: Any, row: list[int]) -> np.ndarray:
    """One process trains on JAX: its own row."""
    del model
    return np.asarray([row], np.int64)
