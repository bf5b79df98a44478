"""The known causes of N replicas training differently from one, found by looking at a model.

`model_causes` inspects the model the factory built (in the check's child process): layers
with per-replica batch statistics or random numbers, optimizer options the kit does not
make replica-invariant, a loss reduced over each replica's part, XLA, low precision.
`state_causes` reads what the N-replica run did to the variables (in the calling process):
non-trainable state updated per replica, replica copies that disagree. Each cause is
reported only where the model has it.

Not a cause: `reduction="sum"`. Each replica sums its part and the all-reduce sums the
parts' gradients, which is the whole batch's sum (measured equal to 3e-8).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from keras_mirror_kit.replica_check.record import ReplicaCause

__all__ = ["model_causes", "state_causes", "trained_causes", "variable_roles"]

_CLIP_OPTIONS = ("clipnorm", "global_clipnorm", "clipvalue")
_LOW_PRECISION = ("float16", "bfloat16")
_NAMES_SHOWN = 5


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_NAMES_SHOWN])
    return shown + (f" and {len(names) - _NAMES_SHOWN} more" if len(names) > _NAMES_SHOWN else "")


def _layers(model: Any) -> list[Any]:
    return list(model._flatten_layers(include_self=False, recursive=True))  # noqa: SLF001


def _seed_generators(layer: Any) -> list[Any]:
    import keras

    found = [v for v in vars(layer).values() if isinstance(v, keras.random.SeedGenerator)]
    found += [g for g in getattr(layer, "_seed_generators", None) or [] if g not in found]
    return found


def variable_roles(model: Any) -> dict[int, str]:
    """`id(variable)` -> `"batch_norm"` or `"seed"` for the variables those causes explain."""
    import keras

    roles: dict[int, str] = {}
    for layer in _layers(model):
        if isinstance(layer, keras.layers.BatchNormalization):
            for variable in layer.non_trainable_variables:
                roles[id(variable)] = "batch_norm"
        for generator in _seed_generators(layer):
            state = getattr(generator, "state", None)
            if state is not None:
                roles[id(state)] = "seed"
    return roles


def _workaround_status(name: str) -> str | None:
    """`status()` of a kit workaround module (None where this version has no such module)."""
    try:
        module = importlib.import_module(f"keras_mirror_kit.workarounds.{name}")
    except ModuleNotFoundError:
        return None
    status = getattr(module, "status", None)
    return str(status()) if callable(status) else None


def _batch_norm(model: Any) -> list[ReplicaCause]:
    import keras

    names = [
        layer.name
        for layer in _layers(model)
        if isinstance(layer, keras.layers.BatchNormalization) and not layer.synchronized
    ]
    if not names:
        return []
    return [
        ReplicaCause(
            "batch_norm_unsynchronized",
            f"{len(names)} BatchNormalization layer(s) ({_names(names)}) normalize each "
            "replica's part of the batch with that part's own mean and variance, so the "
            "outputs and gradients differ from one replica on the whole batch; each replica "
            "also keeps its own moving_mean and moving_variance (the first replica's copy is "
            "what is read and saved).",
            "distributed(sync_batch_norm=True), or BatchNormalization(synchronized=True): "
            "the batch moments are all-reduced over the replicas.",
        )
    ]


def _random_layers(model: Any) -> list[ReplicaCause]:
    names = [
        layer.name
        for layer in _layers(model)
        if _seed_generators(layer) and getattr(layer, "rate", None) != 0
    ]
    if not names:
        return []
    return [
        ReplicaCause(
            "random_layers",
            f"{len(names)} layer(s) draw random numbers in training ({_names(names)}: "
            "dropout masks, noise, augmentation). Each replica draws its own numbers for its "
            "part of the batch, so N replicas cannot draw what one replica draws: a "
            "difference is expected here and is no error.",
            "Nothing to fix. To check the rest of the model, check a factory that builds it "
            "with these layers inactive (rate 0, no augmentation).",
        )
    ]


def _inner_optimizer(model: Any) -> Any:
    from keras_mirror_kit.workarounds import inner_optimizer

    return inner_optimizer(getattr(model, "optimizer", None))


def _clipping(optimizer: Any) -> list[ReplicaCause]:
    given = {n: getattr(optimizer, n, None) for n in _CLIP_OPTIONS}
    given = {n: v for n, v in given.items() if v}
    if not given:
        return []
    options = ", ".join(f"{n}={v:g}" for n, v in given.items())
    status = _workaround_status("keras_gradient_clipping")
    if status in ("tested", "fixed-upstream"):
        return []  # the kit (or Keras) clips the all-reduced gradient
    if status == "refused":
        return [
            ReplicaCause(
                "gradient_clipping",
                f"The optimizer clips ({options}), which the kit refuses on several replicas "
                "with this Keras version: Keras clips each replica's share of the gradient "
                "before the all-reduce (tensorflow/tensorflow#33929).",
                "Use a Keras version the kit's clipping workaround was tested on "
                "(keras_mirror_kit.workarounds.keras_gradient_clipping), or drop the option.",
            )
        ]
    return [
        ReplicaCause(
            "gradient_clipping",
            f"The optimizer clips ({options}). Keras 3 clips each replica's share of the "
            "gradient before the all-reduce sums the shares, so on N replicas the applied "
            "gradient can be up to N times the threshold (tensorflow/tensorflow#33929; "
            "tf.keras 2 refused the combination). This version of the kit does not correct "
            "it.",
            "Train without the clipping option on several replicas, or on one replica.",
        )
    ]


def _ema_overwrite(optimizer: Any) -> list[ReplicaCause]:
    frequency = getattr(optimizer, "ema_overwrite_frequency", None)
    if not getattr(optimizer, "use_ema", False) or not frequency:
        return []
    if _workaround_status("keras_ema_overwrite") in ("tested", "fixed-upstream"):
        return []
    return [
        ReplicaCause(
            "ema_overwrite",
            f"The optimizer keeps an EMA of the weights and overwrites them with it every "
            f"{frequency} steps (use_ema=True, ema_overwrite_frequency={frequency}): Keras "
            "does the overwrite in a merge_call inside a tf.cond, which fails at the first "
            "step under tf.distribute.",
            "Leave ema_overwrite_frequency=None and copy the EMA into the model after "
            "training: model.optimizer.finalize_variable_values(model.trainable_variables).",
        )
    ]


def _loss_reduction(model: Any) -> list[ReplicaCause]:
    import keras

    losses = [
        loss
        for loss in keras.tree.flatten(getattr(model, "loss", None))
        if isinstance(loss, keras.losses.Loss) and loss.reduction == "mean_with_sample_weight"
    ]
    if not losses:
        return []
    return [
        ReplicaCause(
            "loss_reduction",
            f"{len(losses)} loss(es) ({_names([loss.name for loss in losses])}) use "
            "reduction='mean_with_sample_weight': each replica divides its part's weighted "
            "loss by that part's own sum of sample weights, not by the whole batch's, so "
            "with uneven sample weights the gradient differs from one replica.",
            "Use reduction='sum_over_batch_size' (Keras' default), with the sample weights "
            "normalized over the dataset if the mean is wanted.",
        )
    ]


def _jit(model: Any, replicas: int) -> list[ReplicaCause]:
    if getattr(model, "jit_compile", False) is not True:
        return []
    from keras_mirror_kit.workarounds.keras_jit_replicas import UPSTREAM

    return [
        ReplicaCause(
            "jit_compile",
            f"The model is compiled with jit_compile=True: XLA cannot compile Keras' train "
            f"step over {replicas} replicas in one process ({UPSTREAM}); the kit refuses it.",
            "Compile with jit_compile=False, or Keras' default 'auto' (no XLA under "
            "tf.distribute).",
        )
    ]


def _low_precision(model: Any) -> list[ReplicaCause]:
    dtypes = {getattr(layer, "compute_dtype", None) for layer in [model, *_layers(model)]}
    low = sorted(d for d in dtypes if d in _LOW_PRECISION)
    if not low:
        return []
    return [
        ReplicaCause(
            "low_precision",
            f"The model computes in {' and '.join(low)}: the replicas round their partial "
            "gradients before the all-reduce sums them, so results differ from one replica "
            "by the precision's rounding (about 1e-3 for float16, 1e-2 for bfloat16), "
            "growing with the steps.",
            "Check with a tolerance that fits the precision (tolerance=1e-2, --tolerance "
            "1e-2), or check the model in float32.",
        )
    ]


def _own_train_step(model: Any, replicas: int) -> list[ReplicaCause]:
    from keras_mirror_kit.model_parts import has_own_step, optimizers_of

    if not has_own_step(model, "train_step"):
        return []
    held = [o for o in optimizers_of(model) if o is not getattr(model, "optimizer", None)]
    status = _workaround_status("keras_own_step_losses")
    extra = (
        f" It holds {len(held)} optimizer(s) besides model.optimizer "
        f"({_names([o.name for o in held])}): each is weighed the same way and saved with "
        "every checkpoint."
        if held
        else ""
    )
    if status == "tested":
        return [
            ReplicaCause(
                "own_train_step",
                f"{type(model).__name__} writes its own train_step. Under plain Keras, a "
                "loss it computes itself as a mean (keras.ops.mean, keras.losses "
                "functions) is not divided by the number of replicas while Keras' Loss "
                f"objects and compute_loss are, and the replicas' gradients are summed: "
                f"{replicas} replicas would apply {replicas} times one device's gradient "
                "for such a loss, and log the others divided. The kit computes every loss "
                "as one device does on each replica's part and weighs each replica's "
                "gradients by its share of the batch (keras_mirror_kit.own_steps); a "
                "probe step at the first fit() checks this against one replica." + extra,
                "Nothing to fix: write each loss as one device computes it on the batch "
                "the step receives (docs: 'Writing your own train_step'). A loss divided "
                "by the number of replicas or by a fixed global batch size is refused "
                "before any step.",
            )
        ]
    return [
        ReplicaCause(
            "own_train_step",
            f"{type(model).__name__} writes its own train_step, which the kit makes train "
            "as on one device only on the Keras versions its workaround was tested on "
            "(keras_mirror_kit.workarounds.keras_own_step_losses); on several replicas the "
            "kit refuses it here.",
            "Train it on one replica, or use a Keras version the workaround was tested on.",
        )
    ]


def _untracked(model: Any) -> list[ReplicaCause]:
    from keras_mirror_kit.model_parts import untracked_variables

    names = [str(getattr(v, "name", "?")) for v in untracked_variables(model)]
    if not names:
        return []
    return [
        ReplicaCause(
            "state_outside_checkpoint",
            f"The model holds {len(names)} tf.Variable(s) Keras does not track "
            f"({_names(names)}): they are in no model.variables, so no checkpoint holds "
            "them (SyncedCheckpoint refuses the model), and a replica updates its own copy "
            "unless the variable was made with an aggregation.",
            "Create them with keras.Variable(...) as attributes of the model or a layer "
            "(tracked, mirrored and saved), with aggregation='sum' or 'mean' where every "
            "replica updates them.",
        )
    ]


def trained_causes(model: Any) -> list[ReplicaCause]:
    """The causes a first `fit` of the model revealed: its own step's stateful random ops."""
    import sys

    own_steps = sys.modules.get("keras_mirror_kit.own_steps")
    record = own_steps.record_of(model) if own_steps is not None else None
    found = record.result.stateful_random if record is not None and record.result else []
    if not found:
        return []
    return [
        ReplicaCause(
            "stateful_random",
            "The train_step draws random numbers with stateful TensorFlow ops "
            f"({', '.join(found)}) that the kit does not replace: each replica draws its "
            "own numbers, unlike one device, and no checkpoint holds their state, so a "
            "resumed run draws others.",
            "Draw with keras.random.* given a keras.random.SeedGenerator created in "
            "__init__ (seed=self.seed_generator), or with tf.random.normal, uniform or "
            "truncated_normal, which the kit draws from the model's saved generator.",
        )
    ]


def model_causes(model: Any, replicas: int) -> list[ReplicaCause]:
    """The causes the built, compiled model shows, for a run on `replicas` replicas."""
    optimizer = _inner_optimizer(model)
    return [
        *_own_train_step(model, replicas),
        *_untracked(model),
        *_batch_norm(model),
        *_random_layers(model),
        *_clipping(optimizer),
        *_ema_overwrite(optimizer),
        *_loss_reduction(model),
        *_jit(model, replicas),
        *_low_precision(model),
    ]


def state_causes(
    variables: Sequence[dict[str, Any]], tolerance: float, known: Sequence[ReplicaCause] = ()
) -> list[ReplicaCause]:
    """Causes in what the N-replica run did to its variables (`variables`: the child's report).

    Each entry has `path`, `kind` ("model" or "optimizer"), `trainable`, `aggregation`,
    `role` (None, "batch_norm", "seed"), `changed` (by the N-replica training),
    `copies_differ` (the replicas' copies at the end) and `difference` (against one replica).
    What a `known` cause already explains (unsynchronized BatchNormalization keeps a moving
    mean and variance per replica) is not reported again.
    """
    explained = (
        {"batch_norm"} if any(c.code == "batch_norm_unsynchronized" for c in known) else set()
    )
    causes = []
    state = [
        v
        for v in variables
        if v["kind"] == "model"
        and not v["trainable"]
        and v["role"] is None
        and v["changed"]
        and v["difference"] > tolerance
    ]
    if state:
        aggregations = sorted({str(v["aggregation"]) for v in state})
        causes.append(
            ReplicaCause(
                "per_replica_state",
                f"{len(state)} non-trainable variable(s) updated in training "
                f"({_names([v['path'] for v in state])}; aggregation "
                f"{', '.join(aggregations)}) are updated by each replica from its own part "
                "of the batch, not from the whole batch as on one replica.",
                "Update such state from values all-reduced over the replicas "
                "(tf.distribute.get_replica_context().all_reduce), as synchronized "
                "BatchNormalization does, or keep it out of the comparison.",
            )
        )
    apart = [v["path"] for v in variables if v["copies_differ"] and v["role"] not in explained]
    if apart:
        causes.append(
            ReplicaCause(
                "replica_copies_differ",
                f"The replicas ended with different copies of {len(apart)} variable(s) "
                f"({_names(apart)}): what is read and saved is the first replica's copy.",
                "Give such variables a synchronized update (an aggregation other than "
                "'none' and an all-reduced value), or create them outside the replicas' "
                "train step.",
            )
        )
    return causes
