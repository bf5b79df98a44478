"""How many batches of an image folder are decoded at once, and how many files in each.

A single-device function (`workarounds.tf_data_function_instantiation`: cheap at each new
iterator) runs a `tf.map_fn` one file at a time; a multi-device one runs its files in
parallel. So a folder's decoding is single-device where a batch per core fits in
`IN_FLIGHT_BYTES` (small images), multi-device where fewer do (large images).
"""

from __future__ import annotations

import os

import tensorflow as tf

__all__ = ["IN_FLIGHT_BYTES", "parallelism"]

#: What the files of one batch may occupy decoded, summed over the batches decoded at once.
IN_FLIGHT_BYTES = 256 * 2**20


def parallelism(spec: tf.TensorSpec, per_batch: int) -> tuple[int, int, bool]:
    """`(batches decoded at once, files decoded at once in each, a batch per core)`: twice
    as many files as cores in flight (one batch's end does not idle a core), at most
    `IN_FLIGHT_BYTES` of decoded batches (at least one). With a batch per core, decoding
    is single-device (a cheap new iterator; its `map_fn` runs a file at a time)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    known = spec.shape.is_fully_defined() and spec.dtype != tf.string
    sample = spec.shape.num_elements() * spec.dtype.size if known else 4096
    calls = max(1, min(cores, IN_FLIGHT_BYTES // max(1, sample * per_batch)))
    return calls, max(2, -(-2 * cores // calls)), calls >= cores
