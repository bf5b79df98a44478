"""One probe step, before any training step: does the own step train as on one device?

The kit cannot read from a step's code how it reduced its losses. So at the first `fit` of
a model with its own `train_step`, it runs the step twice on the first batch, from the same
state, applying nothing: once on one replica (the whole batch, outside the strategy, as on
one device) and once on the N replicas as `fit` will run it. Each optimizer application of
the step is recorded (which optimizer, which variables, and three numbers of the gradient it
would apply: two fixed random projections and the squared norm), and so is what the step
returns. Then every state the step wrote (non-trainable variables, metrics, seed states)
is put back as it was.

* Same applications, same gradients (relative difference <= 1e-2, far below the factor of 2
  or more of a loss reduced for another replica count) and same returned figures: the step
  trains as on one device.
* A gradient in another proportion (a loss divided by the replica count or by a fixed global
  batch size, where the kit already weighs each replica by its share): `ValueError` before
  any training step, naming the optimizer, the factor and what to write instead.

The one-replica run also tells which variables each optimizer the step applies is built
with, so that an optimizer not yet built (a GAN's `d_optimizer` before its first step) is
built now and a checkpoint can restore it, and which stateful TensorFlow random ops the
step holds (`stateful_random`). On several workers the whole batch is on no single
process: only the one-replica run takes place, on this worker's first part.
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

__all__ = ["Probe", "ProbeResult", "probe_batch", "run_probe"]

logger = logging.getLogger("keras_mirror_kit")

RELATIVE = 1e-2  # gradients this close are the same (factors of 2 or more are the point)
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
        kept = [(g, v) for g, v in zip(grads, variables, strict=False) if g is not None]
        dense = [tf.convert_to_tensor(g) * tf.cast(share, g.dtype) for g, _ in kept]
        dense = step.all_reduce(dense) if step.replicas > 1 else dense
        numbers = [tf.constant(0.0), tf.constant(0.0), tf.constant(0.0)]
        for i, g in enumerate(dense):
            g = tf.cast(g, tf.float32)
            for j in (0, 1):
                noise = tf.random.stateless_normal(tf.shape(g), seed=[j + 1, i + 1])
                numbers[j] += tf.reduce_sum(g * noise)
            numbers[2] += tf.reduce_sum(tf.square(g))
        applications, found = self._traces.setdefault(threading.get_ident(), ([], []))
        applications.append((optimizer, [v for _, v in kept]))
        found.append(numbers)


@dataclass
class ProbeResult:
    """What the probe found: the stateful random ops, the optimizers and their variables."""

    stateful_random: list[str] = field(default_factory=list)
    optimizer_variables: list[tuple[Any, list[Any]]] = field(default_factory=list)
    compared: bool = False  # the N-replica run took place and agreed


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


def probe_batch(iterator: Any, strategy: Any) -> Any:
    """A first batch for the probe, as `fit` distributes it, taken from nothing `fit` reads.

    A `PyDataset`'s batch 0 (its batches are addressable), else a batch made from the
    data's element spec (a generator's batches cannot be taken back). None without one.
    """
    from keras_mirror_kit.workarounds.keras_uneven_first_batch import spec_batch

    adapter = getattr(iterator, "data_adapter", None)
    py_dataset = getattr(adapter, "py_dataset", None)
    if py_dataset is not None and len(py_dataset):
        data = adapter._standardize_batch(py_dataset[0])  # noqa: SLF001
    else:
        spec = spec_batch(iterator)
        if spec is None:
            return None
        data = _synthetic(spec, 4 * int(strategy.num_replicas_in_sync))
    dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors(data))
    return next(iter(dataset))


def _components(variable: Any, strategy: Any) -> list[Any]:
    value = getattr(variable, "value", variable)
    try:
        return list(strategy.experimental_local_results(value))
    except (AttributeError, ValueError, TypeError):
        return [value]


class _Saved:
    """Every replica's copy of the state a step may write, to put back after the probe."""

    def __init__(self, model: Any, strategy: Any, extra: list[Any]) -> None:
        variables = [v for v in model.variables if not v.trainable] + list(extra)
        for metric in metrics_of(model):
            variables.extend(metric.variables)
        seed = _global_seed_state()
        if seed is not None:
            variables.append(seed)
        self.copies = [
            (c, tf.identity(c.read_value())) for v in variables for c in _components(v, strategy)
        ]

    def restore(self) -> None:
        for component, value in self.copies:
            component.assign(value)


def _global_seed_state() -> Any:
    try:
        from keras.src.backend.common import global_state
    except ImportError:
        return None
    generator = global_state.get_global_attribute("global_seed_generator")
    return None if generator is None else generator.state


def _stateful_random_ops(concrete: Any) -> list[str]:
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


def _run(step: Any, argument: Any, probe: Probe, holder: list[Probe | None]) -> Any:
    """`(concrete function, step outputs, gradient numbers)` of `step(argument)` probed."""

    def probed(data: Any) -> Any:
        probe.begin()
        outputs = step(data)
        return outputs, probe.numbers()

    holder[0] = probe
    try:
        concrete = tf.function(probed, autograph=False).get_concrete_function(argument)
        outputs, numbers = concrete(argument)
        return concrete, outputs, numbers
    finally:
        holder[0] = None


def _as_on_one_device(model: Any, call: Any) -> Any:
    """`call()` as on one device: in a thread of its own (no strategy scope of this thread is
    active there) and with the model's `distribute_strategy` the default one meanwhile
    (this thread waits)."""
    result: list[Any] = []
    error: list[BaseException] = []

    def target() -> None:
        strategy = model._distribute_strategy  # noqa: SLF001
        object.__setattr__(model, "_distribute_strategy", None)
        try:
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


def _whole(batch: Any, strategy: Any) -> Any:
    """The batch a single device would get: every local replica's part, in order."""

    def whole(leaf: Any) -> Any:
        if isinstance(leaf, tf.distribute.DistributedValues):
            parts = strategy.experimental_local_results(leaf)
            with tf.device("/cpu:0"):
                return tf.concat([tf.identity(p) for p in parts], axis=0)
        return leaf

    return tf.nest.map_structure(whole, batch)


def _logs(outputs: Any) -> dict[str, float]:
    found = {}
    if isinstance(outputs, dict):
        for key, value in outputs.items():
            value = getattr(value, "numpy", lambda v=value: v)()
            if np.ndim(value) == 0 and np.issubdtype(np.asarray(value).dtype, np.floating):
                found[str(key)] = float(value)
    return found


def _first(outputs: Any, strategy: Any) -> Any:
    return tf.nest.map_structure(
        lambda v: (
            strategy.experimental_local_results(v)[0]
            if isinstance(v, tf.distribute.DistributedValues)
            else v
        ),
        outputs,
    )


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
    model: Any, batch: Any, strategy: Any, holder: list[Probe | None], extra: list[Any]
) -> ProbeResult:
    """Runs the probe (module docstring) on `batch`, a first batch as `fit` distributes it.

    `holder[0]` is where the model's wrapped step finds the probe under way; `extra` are
    variables besides the model's the step may write (its seed generator's state). Raises
    the `ValueError` of a step that does not train as on one device; puts the state back
    in any case.
    """
    replicas = int(strategy.num_replicas_in_sync)
    local = len(strategy.extended.worker_devices)
    whole = _whole(batch, strategy)
    saved = _Saved(model, strategy, extra)
    one, many = Probe(), Probe()
    try:
        concrete, one_outputs, one_numbers = _as_on_one_device(
            model, lambda: _run(model.train_step, whole, one, holder)
        )
        saved.restore()
        result = ProbeResult(stateful_random=_stateful_random_ops(concrete))
        result.optimizer_variables = list(one.applications)
        if replicas > 1 and local == replicas:

            def on_replicas(data: Any) -> Any:
                def replica_step(part: Any) -> Any:
                    many.begin()
                    return model.train_step(part), many.numbers()

                return strategy.run(replica_step, args=(data,))

            _, (many_outputs, many_numbers), _ = _run(on_replicas, batch, many, holder)
            saved.restore()
            _compare(
                model,
                _numbers(one, one_numbers),
                _numbers(many, _first(many_numbers, strategy)),
                replicas,
            )
            _compare_logs(model, _logs(one_outputs), _logs(_first(many_outputs, strategy)))
            result.compared = True
    finally:
        saved.restore()
    return result


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
    for index, ((optimizer, _, a), (_, _, b)) in enumerate(zip(first, second, strict=True)):
        scale = max(float(np.max(np.abs(a))), 1e-12)
        if np.max(np.abs(a - b)) <= RELATIVE * scale:
            continue
        factor = float(np.sqrt(b[2] / a[2])) if a[2] > 0 else float("inf")
        raise _refusal(model, index, optimizer, factor, replicas)


def _compare_logs(model: Any, one: dict[str, float], many: dict[str, float]) -> None:
    differing = [
        f"{key}: {one[key]:.6g} on one device, {many[key]:.6g} on the replicas"
        for key in sorted(set(one) & set(many))
        if not np.isclose(one[key], many[key], rtol=RELATIVE, atol=1e-6)
    ]
    if differing:
        logger.warning(
            "keras-mirror-kit: in a probe step of %s's train_step, figures it returns differ "
            "from one device's (%s); its gradients agree. A figure the step computes "
            "itself as a sum over the replica's part (not a mean) is logged per replica.",
            type(model).__name__,
            "; ".join(differing),
        )
