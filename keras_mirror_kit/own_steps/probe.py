"""One probe step, before any training step: does the own step train as on one device?

The kit cannot read from a step's code how it reduced its losses. So at the first `fit` of
a model with its own `train_step`, it runs the step twice on a few rows of the first batch
(2 per replica: what the probe costs in memory is little), from the same state, applying
nothing: once on the N replicas as `fit` will run it (under the strategy: a layer the step
builds lazily is built there, mirrored), and once as one device runs it (the same rows,
outside the strategy, in a thread of its own). Each optimizer application of the step is
recorded (which optimizer, which variables, and four numbers of the gradient it would
apply: two fixed random projections, the squared norm and the number of values), and so
is what the step returns. Then every variable the step may write (the model's, its
metrics', its seed generators') is put back as it was.

* Same applications, same gradients (each number within 1e-2 of its own scale) and same
  returned figures: the step trains as on one device.
* A gradient in another proportion (below 0.75 or above 1.33 of one device's: a loss
  divided by the replica count or a fixed global batch size, where the kit already weighs
  each replica by its share): `ValueError` before any training step, naming the
  optimizer, the factor and what to write instead. A smaller difference (batch statistics
  per replica: an unsynchronized `BatchNormalization`) is a WARNING naming the cure.
* Gradients that are not finite in either run (float16's first loss scale) leave the
  comparison undecided (INFO).

The N-replica run also tells which variables each optimizer the step applies is built
with, so that an optimizer not yet built (a GAN's `d_optimizer` before its first step) is
built now and a checkpoint can restore it, and which stateful TensorFlow random ops the
step holds (`stateful_random`). The comparison is left out on several workers (the batch
is on no single process), on one replica, and on a batch made up from the data's spec (a
generator's batches cannot be taken back).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorflow as tf

from keras_mirror_kit.model_parts import metrics_of
from keras_mirror_kit.own_steps.context import StepContext
from keras_mirror_kit.workarounds.keras_uneven_first_batch import first_local_part, spec_batch

__all__ = ["Probe", "ProbeResult", "probe_batch", "run_probe"]

logger = logging.getLogger("keras_mirror_kit")

RELATIVE = 1e-2  # numbers this close are the same (factors of 2 or more are the point)
ROWS_PER_REPLICA = 2  # the probe's batch: this many rows per replica
FAR = (0.75, 1.33)  # a gradient ratio outside this is a loss reduced for another count
_STATEFUL_RANDOM = frozenset(
    {
        "RandomUniform",
        "RandomUniformInt",
        "RandomStandardNormal",
        "TruncatedNormal",
        "ParameterizedTruncatedNormal",
        "RandomShuffle",
        "Multinomial",
        "RandomGamma",
        "RandomPoisson",
        "RandomPoissonV2",
        "StatefulUniform",
        "StatefulUniformInt",
        "StatefulUniformFullInt",
        "StatefulStandardNormalV2",
        "StatefulTruncatedNormal",
        "StatefulRandomBinomial",
    }
)


class Probe:
    """What one probe run of the step applies, per replica (filled while each replica's
    step is traced; a retrace starts its thread's record anew)."""

    def __init__(self) -> None:
        self._traces: dict[int, tuple[list[tuple[Any, list[Any]]], list[list[tf.Tensor]]]] = {}

    def begin(self) -> None:
        """Starts this thread's record (at the start of each trace of the step)."""
        self._traces[threading.get_ident()] = ([], [])

    def numbers(self) -> list[list[tf.Tensor]]:
        """The gradient numbers this thread's trace recorded."""
        return self._traces.get(threading.get_ident(), ([], []))[1]

    @property
    def applications(self) -> list[tuple[Any, list[Any]]]:
        """`(optimizer, variables)` of each application, in order (the same on every replica)."""
        return next((apps for apps, _ in self._traces.values() if apps), [])

    def applied(self, optimizer: Any, grads: list[Any], variables: Any, step: StepContext) -> None:
        """Records one `optimizer.apply` (called by `own_steps.optimizers`)."""
        if variables is None:
            variables = list(getattr(optimizer, "_trainable_variables", []) or [])
        share = step.share
        kept = [g for g in grads if g is not None]
        dense = [tf.convert_to_tensor(g) * tf.cast(share, g.dtype) for g in kept]
        dense = step.all_reduce(dense) if step.replicas > 1 else dense
        numbers = [tf.constant(0.0) for _ in range(4)]
        for i, g in enumerate(dense):
            g = tf.cast(g, tf.float32)
            for j in (0, 1):
                noise = tf.random.stateless_normal(tf.shape(g), seed=[j + 1, i + 1])
                numbers[j] += tf.reduce_sum(g * noise)
            numbers[2] += tf.reduce_sum(tf.square(g))
            numbers[3] += tf.cast(tf.size(g), tf.float32)
        applications, found = self._traces.setdefault(threading.get_ident(), ([], []))
        applications.append((optimizer, list(variables)))  # all of them: Keras builds so
        found.append(numbers)


@dataclass
class ProbeResult:
    """What the probe found: the stateful random ops, the optimizers and their variables."""

    stateful_random: list[str] = field(default_factory=list)
    optimizer_variables: list[tuple[Any, list[Any]]] = field(default_factory=list)


def _synthetic(spec: Any, rows: int) -> Any:
    """A batch of `rows` rows shaped by `spec`: uniform floats, zero integers, empty text."""
    rng = np.random.default_rng(0)

    def leaf(s: Any) -> Any:
        shape = [rows if d is None else d for d in s.shape.as_list()[:1]]
        shape += [1 if d is None else d for d in s.shape.as_list()[1:]]
        if s.dtype.is_floating:
            return tf.constant(rng.uniform(size=shape), s.dtype)
        if s.dtype == tf.string:
            return tf.fill(shape, "")
        return tf.zeros(shape, s.dtype)

    return tf.nest.map_structure(leaf, spec)


def _whole(batch: Any, strategy: Any) -> Any:
    """The batch a single device would get: every local replica's part, in order."""

    def whole(leaf: Any) -> Any:
        if isinstance(leaf, tf.distribute.DistributedValues):
            parts = strategy.experimental_local_results(leaf)
            with tf.device("/cpu:0"):
                return tf.concat([tf.identity(p) for p in parts], axis=0)
        return leaf

    return tf.nest.map_structure(whole, batch)


def probe_batch(iterator: Any, strategy: Any, batch: Any) -> tuple[Any, bool]:
    """`(rows as one device gets them, whether to compare)` for the probe, or `(None, False)`.

    `batch` is the first batch Keras' build took (as distributed), where one was taken.
    Otherwise a `PyDataset`'s first batch (its batches are addressable), or rows made from
    the data's element spec, which are only good to build the optimizers on (a
    generator's batches cannot be taken back).
    """
    if batch is not None:
        return _whole(batch, strategy), True

    adapter = getattr(iterator, "data_adapter", None)
    py_dataset = getattr(adapter, "py_dataset", None)
    if py_dataset is not None and (getattr(py_dataset, "num_batches", None) or 0) > 0:
        return adapter._standardize_batch(py_dataset[0]), True  # noqa: SLF001
    spec = spec_batch(iterator)
    if spec is None:
        return None, False
    return _synthetic(spec, ROWS_PER_REPLICA * int(strategy.num_replicas_in_sync)), False


def _batched(leaf: Any) -> bool:
    return isinstance(leaf, (tf.Tensor, np.ndarray)) and len(leaf.shape) > 0


def _first_rows(whole: Any, rows: int) -> Any:
    """`whole` cut to its first `rows` rows, where every batched tensor has that many."""
    batched = [leaf for leaf in tf.nest.flatten(whole) if _batched(leaf)]
    if not batched or any(leaf.shape[0] is None or leaf.shape[0] < rows for leaf in batched):
        return whole
    return tf.nest.map_structure(lambda leaf: leaf[:rows] if _batched(leaf) else leaf, whole)


def _components(variable: Any, strategy: Any) -> list[Any]:
    value = getattr(variable, "value", variable)
    try:
        return list(strategy.experimental_local_results(value))
    except (AttributeError, ValueError, TypeError):
        return [value]


class _Saved:
    """Every replica's copy of the state a step may write, to put back after the probe: the
    model's variables (a step may move weights itself: an EMA teacher, clipped critic
    weights), its metrics' and `extra` (its own seed generator's)."""

    def __init__(self, model: Any, strategy: Any, extra: list[Any]) -> None:
        variables = [*model.variables, *extra]
        for metric in metrics_of(model):
            variables.extend(metric.variables)
        self.copies = [
            (c, tf.identity(c.read_value())) for v in variables for c in _components(v, strategy)
        ]

    def restore(self) -> None:
        for component, value in self.copies:
            component.assign(value)


def _stateful_random_ops(concrete: Any) -> list[str]:
    if concrete is None:
        return []
    graph_def = concrete.graph.as_graph_def()
    found = {n.op for n in graph_def.node if n.op in _STATEFUL_RANDOM}
    for function in graph_def.library.function:
        found.update(n.op for n in function.node_def if n.op in _STATEFUL_RANDOM)
    return sorted(found)


def _numbers(probe: Probe, values: Any) -> list[tuple[Any, list[Any], np.ndarray]]:
    return [
        (o, v, np.array([float(n) for n in numbers]))
        for (o, v), numbers in zip(probe.applications, values, strict=True)
    ]


def _run(step: Any, argument: Any, probe: Probe, holder: list[Probe | None], eager: bool) -> Any:
    """`(concrete function or None, step outputs, gradient numbers)` of `step(argument)`."""

    def probed(data: Any) -> Any:
        probe.begin()
        outputs = step(data)
        return outputs, probe.numbers()

    holder[0] = probe
    try:
        if eager:  # run_eagerly=True: the step may need eager values
            outputs, numbers = probed(argument)
            return None, outputs, numbers
        concrete = tf.function(probed, autograph=False).get_concrete_function(argument)
        outputs, numbers = concrete(argument)
        return concrete, outputs, numbers
    finally:
        holder[0] = None


def _created_nothing(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("a variable would be created outside the strategy")


def _as_on_one_device(model: Any, call: Any) -> Any:
    """`call()` as on one device: in a thread of its own (no strategy scope of this thread is
    active there), with the model's `distribute_strategy` the default one meanwhile (this
    thread waits), and creating no variable."""
    result: list[Any] = []
    error: list[BaseException] = []

    def target() -> None:
        strategy = model._distribute_strategy  # noqa: SLF001
        object.__setattr__(model, "_distribute_strategy", None)
        try:
            with tf.variable_creator_scope(_created_nothing):
                result.append(call())
        except BaseException as err:  # noqa: BLE001 (re-raised in the caller)
            error.append(err)
        finally:
            object.__setattr__(model, "_distribute_strategy", strategy)

    thread = threading.Thread(target=target, name="kmk-own-step-probe", daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def _logs(outputs: Any) -> dict[str, float]:
    found = {}
    if isinstance(outputs, dict):
        for key, value in outputs.items():
            value = getattr(value, "numpy", lambda v=value: v)()
            if np.ndim(value) == 0 and np.issubdtype(np.asarray(value).dtype, np.floating):
                found[str(key)] = float(value)
    return found


def _name(optimizer: Any) -> str:
    return f"{type(optimizer).__name__} {getattr(optimizer, 'name', '')!r}".strip()


def _refusal(model: Any, index: int, optimizer: Any, factor: float, replicas: int) -> ValueError:
    if np.isclose(factor, 1.0 / replicas, rtol=5e-2):
        cause = (
            f"1/{replicas} of one device's: the step's loss is divided by the number of "
            "replicas or by a fixed global batch size (tf.distribute's convention), while "
            "the kit already weighs each replica's gradients by its share of the batch"
        )
    else:
        cause = f"{factor:.4g} times one device's"
    return ValueError(
        f"The train_step of {type(model).__name__} does not train on {replicas} replicas "
        f"as on one device: in a probe step on the first batch, the gradient of its "
        f"application {index + 1} ({_name(optimizer)}) was {cause}. Nothing was trained. "
        "Write each loss as one device computes it on the batch the step receives: a "
        "Keras Loss object or self.compute_loss(...), keras.ops.mean(...) over the rows, "
        "or keras.ops.sum(...) / keras.ops.shape(x)[0]; not a sum divided by a constant "
        "global batch size, nor a division by num_replicas_in_sync. "
        f"Received: gradient ratio={factor:.4g}, replicas={replicas}"
    )


def run_probe(
    model: Any,
    whole: Any,
    compare: bool,
    strategy: Any,
    holder: list[Probe | None],
    extra: list[Any],
) -> ProbeResult:
    """Runs the probe (module docstring) on `whole`, rows as one device gets them.

    `compare`: whether the one-device run and the comparison take place; `holder[0]` is
    where the model's wrapped step finds the probe under way; `extra` are variables
    besides the model's the step may write (its seed generator's state). Raises the
    `ValueError` of a step that does not train as on one device; puts the state back in
    any case.
    """
    replicas = int(strategy.num_replicas_in_sync)
    local = len(strategy.extended.worker_devices)
    rows = _first_rows(whole, ROWS_PER_REPLICA * local)
    dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors(rows))
    batch = next(iter(dataset))
    eager = bool(getattr(model, "run_eagerly", False))
    saved = _Saved(model, strategy, extra)
    many = Probe()

    def on_replicas(data: Any) -> Any:
        def replica_step(part: Any) -> Any:
            many.begin()
            return model.train_step(part), many.numbers()

        return strategy.run(replica_step, args=(data,))

    try:
        concrete, (many_outputs, many_numbers), _ = _run(on_replicas, batch, many, holder, eager)
        saved.restore()
        result = ProbeResult(stateful_random=_stateful_random_ops(concrete))
        result.optimizer_variables = list(many.applications)
        if compare and replicas > 1 and local == replicas:
            one = Probe()
            _, one_outputs, one_numbers = _as_on_one_device(
                model, lambda: _run(model.train_step, rows, one, holder, eager)
            )
            saved.restore()
            _compare(
                model,
                _numbers(one, one_numbers),
                _numbers(many, first_local_part(many_numbers, strategy)),
                replicas,
            )
            _compare_logs(
                model, _logs(one_outputs), _logs(first_local_part(many_outputs, strategy))
            )
    finally:
        saved.restore()
    return result


def _differ(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two applications' numbers differ (each against its own scale)."""
    norm, values = float(np.sqrt(max(a[2], 0.0))), max(float(a[3]), 1.0)
    projection_scale = norm * np.sqrt(values) + 1e-12  # |g . r| <= |g| |r|, |r| ~ sqrt(n)
    if abs(np.sqrt(max(b[2], 0.0)) - norm) > RELATIVE * norm + 1e-12:
        return True
    return bool(np.max(np.abs(a[:2] - b[:2])) > RELATIVE * projection_scale)


def _compare(model: Any, first: list[Any], second: list[Any], replicas: int) -> None:
    if [(id(o), len(v)) for o, v, _ in first] != [(id(o), len(v)) for o, v, _ in second]:
        raise ValueError(
            f"The train_step of {type(model).__name__} applies other optimizers or other "
            f"variables on {replicas} replicas than on one device ({len(first)} "
            f"application(s) on one device, {len(second)} on {replicas} replicas), in a "
            "probe step on the first batch. Nothing was trained. Make the step's "
            "optimizer calls the same whatever the data's split (no branch on the batch "
            f"size or the replica). Received: replicas={replicas}"
        )
    if not all(np.all(np.isfinite(n)) for _, _, n in [*first, *second]):
        logger.info(
            "keras-mirror-kit: the probe step of %s's train_step gave gradients that are "
            "not finite (float16 loss scaling's first steps): not compared",
            type(model).__name__,
        )
        return
    for index, ((optimizer, _, a), (_, _, b)) in enumerate(zip(first, second, strict=True)):
        if not _differ(a, b):
            continue
        factor = float(np.sqrt(b[2] / a[2])) if a[2] > 0 else float("inf")
        if not FAR[0] < factor < FAR[1]:
            raise _refusal(model, index, optimizer, factor, replicas)
        logger.warning(
            "keras-mirror-kit: in a probe step of %s's train_step, the gradient of "
            "application %d (%s) on %d replicas differs from one device's (ratio of norms "
            "%.4g): batch statistics computed per replica (an unsynchronized "
            "BatchNormalization: distributed(sync_batch_norm=True)) or random numbers "
            "each replica draws itself. keras-mirror-kit doctor --model names the cause.",
            type(model).__name__,
            index + 1,
            _name(optimizer),
            replicas,
            factor,
        )


def _compare_logs(model: Any, one: dict[str, float], many: dict[str, float]) -> None:
    differing = [
        f"{key}: {one[key]:.6g} on one device, {many[key]:.6g} on the replicas"
        for key in sorted(set(one) & set(many))
        if not np.isclose(one[key], many[key], rtol=RELATIVE, atol=1e-6)
    ]
    if differing:
        logger.warning(
            "keras-mirror-kit: in a probe step of %s's train_step, figures it returns differ "
            "from one device's (%s). A figure the step computes itself as a sum over the "
            "replica's part (not a mean) is logged per replica.",
            type(model).__name__,
            "; ".join(differing),
        )
