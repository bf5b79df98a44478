"""A `make_dataset` dataset's `preprocess`, run on each replica for models the kit built.

`kmk.make_dataset(..., preprocess=kmk.rescale())` keeps uint8 images in memory, but casting
them in the input pipeline means float32 batches (four times the bytes) are what the
`MultiDeviceIterator` copies to each device, over PCIe on a GPU host. For a model the kit
prepared (`keras_mirror_kit.model_setup`), `fit`, `evaluate` and `predict` instead iterate
the dataset's stored-dtype twin (`keras_mirror_kit.data.preprocess.ReplicaVariant`: same
cursor, same order, batches before `preprocess`) and the model's replica steps apply
`preprocess` first, inside `strategy.run`, so each replica casts its own slice on its own
device. A per-sample function gives exactly the values the host gave
(`tests/test_replica_preprocess.py`).

How, on the model instance only (its class and other models are untouched):

* `train_step`, `test_step` and `predict_step` are wrapped. The wrapper reads, when Keras
  traces the step, which `preprocess` the call in progress asked for; outside such a call
  it is the original step.
* Keras caches its compiled `train_function`, `test_function` and `predict_function`. A
  call with a replica `preprocess` swaps in the function compiled for it (or none, so Keras
  compiles one) and swaps Keras' own back when it returns, so outside a kit call the model
  runs exactly what Keras compiled (`train_on_batch`, a direct `make_train_function`), and
  repeated `fit` calls do not recompile. A `compile()` (or a change of
  `steps_per_execution`, `jit_compile`, `run_eagerly`) drops the kept functions.
* Keras builds an unbuilt model from the first batch's shapes and dtypes
  (`_maybe_symbolic_build` -> `_symbolic_build`), which would now be the stored dtype; the
  instance's `_symbolic_build` is given the specs that `preprocess` returns instead (traced,
  not run), so the model, its metrics and its loss are built for what the steps feed them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import tensorflow as tf

from keras_mirror_kit.data.preprocess import ReplicaVariant, replica_variant

__all__ = ["applied", "install", "is_installed"]

logger = logging.getLogger("keras_mirror_kit")

_STEPS = {"train": "train_step", "test": "test_step", "predict": "predict_step"}
_FUNCTIONS = {"train": "train_function", "test": "test_function", "predict": "predict_function"}
# The data arguments of each method, and the step that consumes them.
_SLOTS = {
    "fit": (("x", "train"), ("validation_data", "test")),
    "evaluate": (("x", "test"),),
    "predict": (("x", "predict"),),
}
_KEPT_PER_STEP = 4  # compiled functions kept per step kind (besides Keras' own)


class _State:
    """Per model: the variant each step applies now, and the compiled functions kept."""

    def __init__(self) -> None:
        self.active: dict[str, ReplicaVariant | None] = dict.fromkeys(_STEPS)
        self.build: ReplicaVariant | None = None
        self.kept: dict[tuple[str, Any], Any] = {}
        self.validity: tuple[Any, ...] = ()
        self.specs: dict[tuple[Any, ...], Any] = {}  # preprocess's output specs, by input


class _ReplicaStep:
    """A model's `train_step`/`test_step`/`predict_step`, applying the active variant first.

    The state travels with the wrappers the model already holds (not in a map beside the
    model: it keeps the model's compiled functions, which reference the model, so a weak
    map would never let the model go)."""

    def __init__(self, original: Callable[[Any], Any], kind: str, state: _State) -> None:
        functools.update_wrapper(self, original)
        self.original, self.kind, self.state = original, kind, state

    def __call__(self, data: Any) -> Any:
        variant = self.state.active[self.kind]
        return self.original(data if variant is None else _preprocessed(data, variant))


class _SymbolicBuild:
    """The model's `_symbolic_build`, given the specs `preprocess` returns (traced, not run)."""

    def __init__(self, original: Callable[..., Any], state: _State) -> None:
        functools.update_wrapper(self, original)
        self.original, self.state = original, state

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        batch = kwargs.get("data_batch")
        if self.state.build is not None and batch is not None:
            kwargs["data_batch"] = _built_batch(batch, self.state.build, self.state)
        return self.original(*args, **kwargs)


def _state_of(model: Any) -> _State | None:
    build = vars(model).get("_symbolic_build") if hasattr(model, "__dict__") else None
    return build.state if isinstance(build, _SymbolicBuild) else None


def is_installed(model: Any) -> bool:
    """Whether `install` ran on `model` (its steps can apply a replica `preprocess`)."""
    return _state_of(model) is not None


def _preprocessed(data: Any, variant: ReplicaVariant) -> Any:
    """`data` (one step's element) with `preprocess` applied to its features."""
    if not variant.has_y:
        return variant.preprocess(data)
    if not isinstance(data, (tuple, list)) or not data:
        raise ValueError(
            "A replica step expected (features, labels) from a kmk.make_dataset dataset "
            "built with `y`, but got another structure. Received: "
            f"data={type(data).__name__}"
        )
    return type(data)([variant.preprocess(data[0]), *data[1:]])


def _spec_of(value: Any) -> tf.TensorSpec:
    return tf.TensorSpec(value.shape, value.dtype)


def _built_batch(data_batch: Any, variant: ReplicaVariant, state: _State) -> Any:
    """Specs of `data_batch` after `preprocess`: the batch's shapes, the stored dtypes."""
    features = data_batch[0] if variant.has_y else data_batch
    stored = tf.nest.map_structure(
        lambda value, spec: tf.TensorSpec(value.shape, spec.dtype), features, variant.stored
    )
    key = (variant.preprocess, tuple(tf.nest.flatten(stored)))
    if key not in state.specs:  # traced, not run; once per preprocess and batch shape
        traced = tf.function(variant.preprocess, autograph=False).get_concrete_function(stored)
        state.specs[key] = tf.nest.map_structure(_spec_of, traced.structured_outputs)
    after = state.specs[key]
    if not variant.has_y:
        return after
    return type(data_batch)([after, *data_batch[1:]])


def install(model: Any) -> None:
    """Wraps this model's steps and symbolic build so they can apply a replica `preprocess`.

    Idempotent. Until a call inside `applied` asks for a `preprocess`, every wrapper calls
    the original with the same arguments.
    """
    if is_installed(model):
        return
    state = _State()
    for kind, name in _STEPS.items():
        object.__setattr__(model, name, _ReplicaStep(getattr(model, name), kind, state))
    build = _SymbolicBuild(model._symbolic_build, state)  # noqa: SLF001
    object.__setattr__(model, "_symbolic_build", build)


def _validity(model: Any) -> tuple[Any, ...]:
    """What Keras' compiled functions depend on besides the step."""
    return (
        getattr(model, "_compile_config", None),  # a new object at every compile()
        getattr(model, "steps_per_execution", None),
        getattr(model, "jit_compile", None),
        getattr(model, "run_eagerly", None),
    )


def _switch(model: Any, state: _State, kind: str, variant: ReplicaVariant | None) -> None:
    """Makes `kind`'s step apply `variant`, with the compiled function kept for it."""
    validity = _validity(model)
    if not state.validity or not (
        state.validity[0] is validity[0] and state.validity[1:] == validity[1:]
    ):
        state.kept.clear()  # recompiled (or a knob changed): nothing kept is valid
        state.validity = validity
    current = state.active[kind]
    key_now = None if current is None else current.key
    key_next = None if variant is None else variant.key
    state.active[kind] = variant
    if key_now == key_next:
        return
    attribute = _FUNCTIONS[kind]
    function = getattr(model, attribute, None)
    if function is not None:
        state.kept[(kind, key_now)] = function
    object.__setattr__(model, attribute, state.kept.pop((kind, key_next), None))
    ours = [key for key in state.kept if key[0] == kind and key[1] is not None]
    for stale in ours[: max(0, len(ours) - _KEPT_PER_STEP)]:
        del state.kept[stale]


def _can_apply(model: Any, method: str, argument: str, kind: str, variant: ReplicaVariant) -> bool:
    """Whether the model's step is still the wrapper `install` set (not replaced since)."""
    name = _STEPS[kind]
    step = getattr(model, name, None)
    if isinstance(step, _ReplicaStep):
        return True
    if variant.requested:
        raise ValueError(
            f"{method}() cannot run the `preprocess` of {argument}=make_dataset(..., "
            f"preprocess_on='replica') on the replicas: the model's `{name}` was replaced "
            "after the kit prepared the model, so it would receive the stored "
            f"{_dtypes(variant)} batches without `preprocess`. Set `{name}` in the model's "
            "class (or before the factory returns it), or build the dataset with "
            f"preprocess_on='host'. Received: {name}={step!r:.80}"
        )
    logger.warning(
        "keras-mirror-kit: %s(): the model's `%s` was replaced after the kit prepared the "
        "model, so the `preprocess` of %s runs on the host (float batches are copied to the "
        "devices); set `%s` in the model's class to run it on the replicas",
        method,
        name,
        argument,
        name,
    )
    return False


def _dtypes(variant: ReplicaVariant) -> str:
    return "/".join(sorted({spec.dtype.name for spec in tf.nest.flatten(variant.stored)}))


@contextmanager
def applied(model: Any, method: str, arguments: dict[str, Any]) -> Iterator[None]:
    """During one `fit`/`evaluate`/`predict` call: twin datasets in, steps preprocessing.

    Each data argument in `arguments` (the call's bound arguments, changed in place) that is a
    `make_dataset` dataset placed on the replicas is replaced by its stored-dtype twin, and the
    step consuming it applies its `preprocess`; on exit the steps and Keras' compiled functions
    are as before. For a model `install` did not run on it does nothing. If the model's step
    was replaced after `install`, the `preprocess` runs on the host (a WARNING), or, for
    `preprocess_on="replica"` asked for explicitly, `ValueError`.
    """
    state = _state_of(model)
    if state is None:
        yield
        return
    wanted: dict[str, ReplicaVariant | None] = {}
    for argument, kind in _SLOTS[method]:
        data = arguments.get(argument)
        variant = replica_variant(data)
        if variant is not None and not variant.is_twin(data):
            if not _can_apply(model, method, argument, kind, variant):
                variant = None  # the dataset as given: preprocessed on the host
            else:
                arguments[argument] = variant.dataset()
        wanted[kind] = variant
    previous = {kind: state.active[kind] for kind in wanted}
    previous_build = state.build
    state.build = wanted.get("train") if method == "fit" else wanted.get("test")
    try:
        for kind, variant in wanted.items():
            _switch(model, state, kind, variant)
        yield
    finally:
        for kind, variant in previous.items():
            _switch(model, state, kind, variant)
        state.build = previous_build
