"""`WarmupSchedule`: gradual learning-rate warmup for large global batches.

Goyal et al. 2017 scale the learning rate by k with the batch and, to avoid early
instability, start at the unscaled rate (target / k) and ramp linearly to the target over
the first epochs. The schedule depends only on the optimizer's step counter, so a resumed
run continues exactly where it stopped.

With gradient accumulation (`distributed(gradient_accumulation_steps=N)`), Keras calls a
learning-rate schedule with the count of *micro-batches* (`optimizer._iterations`; see
`BaseOptimizer._get_current_learning_rate` in Keras 3.15), not of updates. `WarmupSchedule`
divides by N, so that `warmup_steps` and the schedule handed over to count optimizer
updates, as without accumulation.
"""

from __future__ import annotations

from typing import Any

import keras
from keras.optimizers.schedules import LearningRateSchedule

from keras_mirror_kit.distribution import current
from keras_mirror_kit.validation import non_negative_number, positive_int, positive_number

__all__ = ["WarmupSchedule", "check_accumulation"]


@keras.saving.register_keras_serializable(package="keras_mirror_kit")
class WarmupSchedule(LearningRateSchedule):
    """Linear warmup from a start value to a target, then a constant or another schedule.

    For update `s < warmup_steps` the learning rate is
    `start + (target - start) * s / warmup_steps`; from `warmup_steps` on it is `target`,
    or `after(s - warmup_steps)` when a schedule is given to hand over to. `s` counts
    optimizer updates: with gradient accumulation over N micro-batches, Keras passes the
    micro-batch count and the schedule uses `count // N`.

    Args:
        target_learning_rate: Learning rate at the end of warmup (typically the scaled one).
        warmup_steps: Number of optimizer steps to ramp over; a positive integer.
        start_learning_rate: Learning rate at step 0. Defaults to
            `target_learning_rate / scale_factor` (Goyal et al.'s gradual warmup starts at
            the unscaled rate), or 0.0 when `scale_factor` is not given either.
        scale_factor: The factor k by which the target was scaled up (global batch / base
            batch under the linear rule); only used for the default start value.
        after: Optional `LearningRateSchedule` to follow warmup; it receives the updates
            counted from the end of warmup.
        name: Optional name.
        gradient_accumulation_steps: Micro-batches per optimizer update. None (the
            default) takes it from the `kmk.distributed()` factory or block the schedule is
            created in, else 1. A model whose optimizer accumulates over another number of
            steps is refused when the kit prepares it.

    Raises:
        TypeError: On non-numeric values or an `after` that is not a schedule.
        ValueError: On non-positive rates, steps, accumulation steps or scale factor.

    Example:

    ```python
    dist = kmk.current()
    target = dist.scale_learning_rate(1e-3, base_batch_size=64)
    k = dist.effective_batch_size / 64
    updates_per_epoch = steps_per_epoch // dist.gradient_accumulation_steps
    schedule = kmk.WarmupSchedule(target, warmup_steps=5 * updates_per_epoch, scale_factor=k)
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
        gradient_accumulation_steps: int | None = None,
    ) -> None:
        super().__init__()
        if gradient_accumulation_steps is None:
            gradient_accumulation_steps = _active_accumulation()
        self.gradient_accumulation_steps = positive_int(
            "gradient_accumulation_steps", gradient_accumulation_steps
        )
        self.target_learning_rate = positive_number("target_learning_rate", target_learning_rate)
        self.warmup_steps = positive_int("warmup_steps", warmup_steps)
        if scale_factor is not None:
            scale_factor = positive_number("scale_factor", scale_factor)
        self.scale_factor = scale_factor
        if start_learning_rate is None:
            start_learning_rate = self.target_learning_rate / scale_factor if scale_factor else 0.0
        self.start_learning_rate = non_negative_number("start_learning_rate", start_learning_rate)
        if after is not None and not isinstance(after, LearningRateSchedule):
            raise TypeError(
                "`after` must be a keras.optimizers.schedules.LearningRateSchedule or None. "
                f"Received: after={after!r}"
            )
        self.after = after
        self.name = name or "WarmupSchedule"

    def __call__(self, step: Any) -> Any:
        ops = keras.ops
        if self.gradient_accumulation_steps > 1:  # Keras passes micro-batches: count updates
            step = ops.floor_divide(step, self.gradient_accumulation_steps)
        step = ops.cast(step, "float32")
        warmup = float(self.warmup_steps)
        progress = ops.minimum(step / warmup, 1.0)
        ramp = (
            self.start_learning_rate
            + (self.target_learning_rate - self.start_learning_rate) * progress
        )
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
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
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


def _active_accumulation() -> int:
    """The accumulation steps of the `distributed()` factory or block running, else 1."""
    try:
        return current().gradient_accumulation_steps
    except RuntimeError:  # outside any distributed() factory or block
        return 1


def check_accumulation(learning_rate: Any, steps: int, name: str = "the model") -> None:
    """Refuses (`ValueError`) a `WarmupSchedule` made for another number of accumulation steps.

    Such a schedule would count micro-batches as updates, or the reverse. `steps` is the
    optimizer's `gradient_accumulation_steps`; `name` names the model in the message.
    """
    if isinstance(learning_rate, WarmupSchedule) and (
        learning_rate.gradient_accumulation_steps != steps
    ):
        raise ValueError(
            f"The WarmupSchedule of `{name}` counts updates of "
            f"{learning_rate.gradient_accumulation_steps} micro-batch(es), but the optimizer "
            f"accumulates gradients over {steps}. Create the schedule inside the "
            "distributed() factory or block (it then takes the value), or pass "
            f"gradient_accumulation_steps={steps}. Received: gradient_accumulation_steps="
            f"{learning_rate.gradient_accumulation_steps}"
        )
