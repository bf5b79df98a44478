"""`WarmupSchedule`: gradual learning-rate warmup for large global batches.

Goyal et al. 2017 scale the learning rate by k with the batch and, to avoid early
instability, start at the unscaled rate (target / k) and ramp linearly to the target over
the first epochs. The schedule depends only on the optimizer's step counter
(`optimizer.iterations`), so a resumed run continues exactly where it stopped.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import keras
from keras.optimizers.schedules import LearningRateSchedule

from keras_mirror_kit.batching import validate_positive_int

__all__ = ["WarmupSchedule"]


def _positive_float(name: str, value: object, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be a number. Received: {name}={value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        kind = "non-negative" if allow_zero else "positive"
        raise ValueError(f"`{name}` must be a {kind}, finite number. Received: {name}={value}")
    return value


@keras.saving.register_keras_serializable(package="keras_mirror_kit")
class WarmupSchedule(LearningRateSchedule):
    """Linear warmup from a start value to a target, then a constant or another schedule.

    For step `s < warmup_steps` the learning rate is
    `start + (target - start) * s / warmup_steps`; from `warmup_steps` on it is `target`,
    or `after(s - warmup_steps)` when a schedule is given to hand over to.

    Args:
        target_learning_rate: Learning rate at the end of warmup (typically the scaled one).
        warmup_steps: Number of optimizer steps to ramp over; a positive integer.
        start_learning_rate: Learning rate at step 0. Defaults to
            `target_learning_rate / scale_factor` (Goyal et al.'s gradual warmup starts at
            the unscaled rate), or 0.0 when `scale_factor` is not given either.
        scale_factor: The factor k by which the target was scaled up (global batch / base
            batch under the linear rule); only used for the default start value.
        after: Optional `LearningRateSchedule` to follow warmup; it receives the steps
            counted from the end of warmup.
        name: Optional name.

    Raises:
        TypeError: On non-numeric values or an `after` that is not a schedule.
        ValueError: On non-positive rates, steps or scale factor.

    Example:

    ```python
    dist = kmk.current()
    target = dist.scale_learning_rate(1e-3, base_batch_size=64)
    k = dist.global_batch_size / 64
    schedule = kmk.WarmupSchedule(target, warmup_steps=5 * steps_per_epoch, scale_factor=k)
    optimizer = keras.optimizers.Adam(schedule)
    ```
    """

    def __init__(
        self,
        target_learning_rate: float,
        warmup_steps: int,
        start_learning_rate: float | None = None,
        scale_factor: float | None = None,
        after: LearningRateSchedule | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__()
        self.target_learning_rate = _positive_float("target_learning_rate", target_learning_rate)
        self.warmup_steps = validate_positive_int("warmup_steps", warmup_steps)
        if scale_factor is not None:
            scale_factor = _positive_float("scale_factor", scale_factor)
        self.scale_factor = scale_factor
        if start_learning_rate is None:
            start_learning_rate = (
                self.target_learning_rate / scale_factor if scale_factor else 0.0
            )
        self.start_learning_rate = _positive_float(
            "start_learning_rate", start_learning_rate, allow_zero=True
        )
        if after is not None and not isinstance(after, LearningRateSchedule):
            raise TypeError(
                "`after` must be a keras.optimizers.schedules.LearningRateSchedule or None. "
                f"Received: after={after!r}"
            )
        self.after = after
        self.name = name or "WarmupSchedule"

    def __call__(self, step: Any) -> Any:
        ops = keras.ops
        step = ops.cast(step, "float32")
        warmup = float(self.warmup_steps)
        progress = ops.minimum(step / warmup, 1.0)
        ramp = self.start_learning_rate + (
            self.target_learning_rate - self.start_learning_rate
        ) * progress
        if self.after is None:
            return ramp
        later = ops.cast(self.after(ops.maximum(step - warmup, 0.0)), "float32")
        return ops.where(step < warmup, ramp, later)

    def get_config(self) -> dict[str, Any]:
        """Returns the schedule's configuration (for `.keras` saving).

        Returns:
            A JSON-serializable dict; `after` is serialized with Keras' serializer.

        Example:

        ```python
        WarmupSchedule.from_config(schedule.get_config())
        ```
        """
        return {
            "target_learning_rate": self.target_learning_rate,
            "warmup_steps": self.warmup_steps,
            "start_learning_rate": self.start_learning_rate,
            "scale_factor": self.scale_factor,
            "after": (
                keras.saving.serialize_keras_object(self.after) if self.after is not None else None
            ),
            "name": self.name,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> WarmupSchedule:
        """Rebuilds a schedule from `get_config()`'s output.

        Args:
            config: The dict returned by `get_config()`.

        Returns:
            A new `WarmupSchedule`.

        Example:

        ```python
        clone = WarmupSchedule.from_config(schedule.get_config())
        ```
        """
        config = dict(config)
        if config.get("after") is not None:
            config["after"] = keras.saving.deserialize_keras_object(config["after"])
        return cls(**config)
