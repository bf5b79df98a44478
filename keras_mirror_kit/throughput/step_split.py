"""Where a training step's time goes: the arithmetic of the step split, free of any framework.

A span of training (one epoch, or a whole `fit()`) is measured as `StepTimes`:

* `wall`: the measured wall time of its steps (`ThroughputMeter`'s, warm-up and
  validation left out);
* `in_call`: the part of `wall` spent inside Keras' compiled step function (`train_function`),
  as the host sees it; the rest is host overhead between steps (Keras' loop, callbacks);
* inside the calls, what the backend measured: `input_wait` (the time spent reading the
  batches) and `busy` (TensorFlow: the steps' own time on the replicas, from their batch
  being ready to their last update), each None where unmeasured.

`split()` turns them into shares of `wall` that add up to 1 (`SPLIT_KEYS`):

* `input_wait_share`: `input_wait`, the reads of the batches (TensorFlow: timed inside the
  compiled function, around its `get_next`; JAX: around the loop's `next()`);
* `compute_share`: the replicas' forward and backward pass, gradient all-reduce and
  update: `busy` (TensorFlow); JAX: `in_call - input_wait` (the step's dispatch and run);
* `host_share`: the rest of `wall`: Keras' loop and the callbacks between the calls, and
  (TensorFlow) launching each compiled call and returning from it.

`find_limit()` names the share that limits the step, if one dominates, with what usually
helps in the kit's own terms. `keras_mirror_kit.callbacks.ThroughputMonitor` measures and
reports them; the tests drive this module with made-up figures.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "LIMITS",
    "SPLIT_KEYS",
    "SPLIT_NAMES",
    "Limit",
    "StepTimes",
    "describe",
    "find_limit",
    "split",
]

#: Keys of the split, in the order they are reported.
SPLIT_KEYS = ("input_wait_share", "compute_share", "host_share")


@dataclass(frozen=True)
class StepTimes:
    """Seconds of a span of measured training steps (module docstring); None: not measured."""

    wall: float
    in_call: float
    busy: float | None = None
    input_wait: float | None = None

    def __add__(self, other: StepTimes) -> StepTimes:
        def plus(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else a + b

        return StepTimes(
            self.wall + other.wall,
            self.in_call + other.in_call,
            plus(self.busy, other.busy),
            plus(self.input_wait, other.input_wait),
        )


def _clip(value: float, high: float) -> float:
    return min(max(value, 0.0), high)


def split(times: StepTimes) -> dict[str, float] | None:
    """The shares of `times.wall` (module docstring), or None when there is nothing to split.

    Each figure is clipped to what is left of `wall` before dividing (clocks read at
    different points may disagree by microseconds), so the shares add up to 1.

    Args:
        times: What was measured.

    Returns:
        `{"input_wait_share", "compute_share", "host_share"}`, or None
        when `wall` is not positive or the input wait was not measured.

    Raises:
        Nothing: figures outside their range are clipped.

    Example:

    ```python
    split(StepTimes(wall=1.0, in_call=0.95, input_wait=0.6, busy=0.3))
    # {'input_wait_share': 0.6, 'compute_share': 0.3, 'host_share': 0.1}
    ```
    """
    wall = times.wall
    if wall <= 0 or times.input_wait is None:
        return None
    waited = _clip(times.input_wait, wall)
    if times.busy is not None:  # TensorFlow: the replicas' own time, timed in the step
        inside = _clip(times.busy, wall - waited)
    else:  # JAX: the rest of the call (dispatch and the device's run)
        inside = _clip(times.in_call - waited, wall - waited)
    return {
        "input_wait_share": waited / wall,
        "compute_share": inside / wall,
        "host_share": (wall - waited - inside) / wall,
    }


#: Each share in words, as `describe()` and `keras-mirror-kit bench` write it.
SPLIT_NAMES = {
    "input_wait_share": "input wait",
    "compute_share": "compute",
    "host_share": "host",
}


def describe(figures: dict[str, float]) -> str:
    """The split in words, e.g. `"input wait 61%, compute 32%, host 7%"`."""
    return ", ".join(f"{SPLIT_NAMES[k]} {figures[k]:.0%}" for k in SPLIT_KEYS if k in figures)


@dataclass(frozen=True)
class Limit:
    """The share that limits the step: its key, its figure, and what usually helps."""

    key: str
    share: float
    what: str
    advice: str

    def describe(self) -> str:
        """One sentence: the limit, its figure, and what usually helps."""
        return f"{self.what} takes {self.share:.0%} of each training step. {self.advice}"


#: The shares that name a limit when they reach their threshold, in the order checked.
LIMITS: tuple[tuple[str, float, str, str], ...] = (
    (
        "input_wait_share",
        0.5,
        "Waiting for the input pipeline",
        "The replicas are idle until their batch is ready: decode in parallel "
        "(Dataset.map(..., num_parallel_calls=tf.data.AUTOTUNE)), cache() what does not "
        "change between epochs, prefetch (kmk.make_dataset does both), and move per-sample "
        "preprocessing onto the replicas (kmk.make_dataset(..., preprocess=..., "
        "preprocess_on='replica')). More GPUs will not train faster until this is fixed.",
    ),
    (
        "host_share",
        0.3,
        "Host work between steps (Keras' loop and callbacks)",
        "Run several steps per call (kmk.distributed(steps_per_execution=...)) and keep "
        "per-batch callbacks light (log every N steps, not every step).",
    ),
)


def find_limit(figures: dict[str, float]) -> Limit | None:
    """The share in `figures` that dominates the step (`LIMITS`), or None.

    Args:
        figures: A split, as `split()` returns it (other keys are ignored).

    Returns:
        The first `Limit` of `LIMITS` whose share reaches its threshold, or None.

    Raises:
        Nothing.

    Example:

    ```python
    limit = find_limit({"input_wait_share": 0.7, "compute_share": 0.3, "host_share": 0.0})
    limit.key  # 'input_wait_share'
    ```
    """
    for key, threshold, what, advice in LIMITS:
        share = figures.get(key)
        if share is not None and share >= threshold:
            return Limit(key, share, what, advice)
    return None
