"""Multi-worker training: `TF_CONFIG` validation and `MultiWorkerMirroredStrategy` creation.

`distributed()` calls `create_strategy` when `TF_CONFIG` describes more than one worker, when
`strategy="multi_worker"`, or when a cluster resolver (for example
`tf.distribute.cluster_resolver.SlurmClusterResolver()`) is given. TensorFlow reads
`TF_CONFIG` lazily and reports most mistakes in it late (or blocks forever), so it is
validated here first and every mistake is a `ValueError` raised before any training.

A worker's `MultiWorkerMirroredStrategy` constructor blocks until every worker of the
cluster has started: TensorFlow bounds neither that wait nor a wait on a port another
process holds. This module refuses a local port that is already taken, and the
`keras-mirror-kit launch` command bounds the wait (`--startup-timeout`); when a launcher
asks for it (`KMK_LAUNCH_READY_FILE`), the file is created once the strategy exists, i.e.
once the whole cluster has connected.

Under Slurm, `srun` with more than one task (`SLURM_STEP_NUM_TASKS` > 1) and no
`TF_CONFIG` is a cluster too: `slurm_cluster_resolver` builds TensorFlow's
`SlurmClusterResolver` from the step's variables, keeping the GPUs Slurm gave each task.

Every task's TensorFlow server listens on all interfaces of its host: the chief says so once,
at WARNING, unless `keras-mirror-kit launch` isolated the cluster or warned itself (see
`exposure`).
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import json
import logging
import os
import socket
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from keras_mirror_kit.multi_worker import READY_FILE_ENV
from keras_mirror_kit.multi_worker.exposure import warn_exposed_servers
from keras_mirror_kit.multi_worker.gpus import GPU_ENV, visible_gpus
from keras_mirror_kit.upstream import tensorflow_private
from keras_mirror_kit.validation import non_negative_number

if TYPE_CHECKING:  # imported where a strategy is made: parsing TF_CONFIG needs no TensorFlow
    import tensorflow as tf

__all__ = [
    "COLLECTIVE_TIMEOUT_ENV",
    "READY_FILE_ENV",
    "SLURM_PORT_BASE_ENV",
    "TFConfig",
    "cluster_place",
    "create_strategy",
    "local_replicas",
    "note_local_replicas",
    "parse_tf_config",
    "slurm_cluster_resolver",
    "slurm_num_tasks",
    "strategy_workers",
    "tf_config_num_workers",
]

logger = logging.getLogger("keras_mirror_kit")

TF_CONFIG_ENV = "TF_CONFIG"
COLLECTIVE_TIMEOUT_ENV = "KMK_COLLECTIVE_TIMEOUT"
SLURM_PORT_BASE_ENV = "KMK_SLURM_PORT_BASE"
# Variables SlurmClusterResolver reads (tensorflow/python/distribute/cluster_resolver/
# slurm_cluster_resolver.py, TF 2.21; it expands the node list itself, without scontrol).
_SLURM_STEP_VARS = (
    "SLURM_PROCID",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_STEP_NODELIST",
    "SLURM_STEP_TASKS_PER_NODE",
)
TRAINING_JOBS = ("chief", "worker")
KNOWN_JOBS = ("chief", "worker", "evaluator", "ps")
IMPLEMENTATIONS = ("auto", "ring", "nccl")


@dataclass(frozen=True)
class TFConfig:
    """A validated `TF_CONFIG`: the cluster (job -> `"host:port"` by task index) and this task.

    `task_type` and `task_index` are None when `TF_CONFIG` names no task (one training task).
    """

    cluster: dict[str, tuple[str, ...]]
    task_type: str | None
    task_index: int | None

    @property
    def num_workers(self) -> int:
        """Training tasks in the cluster: its chief plus its workers."""
        return sum(len(self.cluster.get(job, ())) for job in TRAINING_JOBS)

    @property
    def rank(self) -> int | None:
        """This task's position among the training tasks (chief first), or None.

        Rank 0 is the chief (the `chief` task, else worker 0), the task TensorFlow's
        `should_checkpoint` picks; `Distribution.is_chief` is what the kit's callbacks ask.
        """
        if self.task_type is None or self.task_index is None:
            return None
        if self.task_type == "chief":
            return 0
        return len(self.cluster.get("chief", ())) + self.task_index

    @property
    def address(self) -> str | None:
        """This task's `"host:port"`, or None."""
        if self.task_type is None or self.task_index is None:
            return None
        return self.cluster[self.task_type][self.task_index]


def _fail(problem: str, raw: str) -> ValueError:
    shown = raw if len(raw) <= 300 else raw[:300] + "..."
    return ValueError(
        f"The environment variable TF_CONFIG is invalid: {problem}. It must be JSON like "
        '{"cluster": {"worker": ["host1:2222", "host2:2222"]}, "task": {"type": "worker", '
        f'"index": 0}}}}. Received: TF_CONFIG={shown!r}'
    )


def _check_address(job: str, index: int, address: Any, raw: str) -> str:
    if not isinstance(address, str) or not address.strip():
        raise _fail(
            f"cluster[{job!r}][{index}] must be a 'host:port' string, not {address!r}", raw
        )
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host:
        raise _fail(f"cluster[{job!r}][{index}] = {address!r} has no 'host:port' form", raw)
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise _fail(
            f"the port of cluster[{job!r}][{index}] = {address!r} must be an integer "
            f"from 1 to 65535, not {port!r}",
            raw,
        )
    return address.strip()


def _task_list(job: str, tasks: Any, raw: str) -> tuple[str, ...]:
    if isinstance(tasks, str):
        raise _fail(f"cluster[{job!r}] must be a list of 'host:port' strings, not a string", raw)
    if isinstance(tasks, Mapping):  # TensorFlow's sparse form: {index: address}
        try:
            indexed = {int(k): v for k, v in tasks.items()}
        except (TypeError, ValueError):
            raise _fail(f"cluster[{job!r}] maps non-integer task indices", raw) from None
        if sorted(indexed) != list(range(len(indexed))):
            raise _fail(
                f"cluster[{job!r}] must number its tasks 0..n-1; it has {sorted(indexed)}",
                raw,
            )
        tasks = [indexed[i] for i in range(len(indexed))]
    if not isinstance(tasks, list) or not tasks:
        raise _fail(f"cluster[{job!r}] must be a non-empty list of 'host:port' strings", raw)
    return tuple(_check_address(job, i, address, raw) for i, address in enumerate(tasks))


def parse_tf_config(raw: str | None = None) -> TFConfig | None:
    """The validated `TF_CONFIG` (default: the environment variable), or None when unset or blank.

    Every mistake TensorFlow would report late, or block on, is a `ValueError` here: malformed
    JSON; a missing or empty `cluster`; an unknown job, a `ps` job (parameter-server training is
    not mirrored training), more than one chief, an address without an integer port, two tasks
    on one address; a missing `task` with more than one training task, a `task.type` that is not
    `chief`/`worker` of the cluster, a `task.index` that is not an integer in range.
    """
    if raw is None:
        raw = os.environ.get(TF_CONFIG_ENV, "")
    if not raw.strip():
        return None
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as err:
        raise _fail(f"it is not valid JSON ({err})", raw) from None
    if not isinstance(config, Mapping):
        raise _fail(f"it must be a JSON object, not {type(config).__name__}", raw)
    cluster_raw = config.get("cluster")
    if not isinstance(cluster_raw, Mapping) or not cluster_raw:
        raise _fail("it has no 'cluster' object naming the tasks", raw)
    cluster: dict[str, tuple[str, ...]] = {}
    for job, tasks in cluster_raw.items():
        if job == "ps":
            raise _fail(
                "it has a 'ps' job: parameter-server training uses "
                "tf.distribute.ParameterServerStrategy, which this kit does not support; "
                "mirrored training needs only 'chief' and 'worker' tasks",
                raw,
            )
        if job not in KNOWN_JOBS:
            raise _fail(
                f"unknown job {job!r} in 'cluster'; expected {', '.join(map(repr, KNOWN_JOBS))}",
                raw,
            )
        cluster[job] = _task_list(job, tasks, raw)
    if len(cluster.get("chief", ())) > 1:
        raise _fail(f"there can be at most one chief; it lists {len(cluster['chief'])}", raw)
    if not any(cluster.get(job) for job in TRAINING_JOBS):
        raise _fail("the cluster has no 'chief' or 'worker' task", raw)
    seen: dict[str, str] = {}
    for job, tasks in cluster.items():
        for index, address in enumerate(tasks):
            name = f"{job}:{index}"
            if address in seen:
                raise _fail(f"{seen[address]} and {name} share the address {address!r}", raw)
            seen[address] = name

    task = config.get("task")
    if task is None:
        if sum(len(cluster.get(job, ())) for job in TRAINING_JOBS) > 1:
            raise _fail(
                "it has no 'task' saying which task this process is, e.g. "
                '"task": {"type": "worker", "index": 0}',
                raw,
            )
        return TFConfig(cluster, None, None)
    if not isinstance(task, Mapping):
        raise _fail(f"'task' must be an object, not {type(task).__name__}", raw)
    task_type = task.get("type")
    if not isinstance(task_type, str) or not task_type:
        raise _fail(f"'task.type' must name a job, not {task_type!r}", raw)
    if task_type not in TRAINING_JOBS:
        raise _fail(
            f"unknown task type {task_type!r}; a process training with "
            "MultiWorkerMirroredStrategy is a 'chief' or a 'worker' (an 'evaluator' "
            "side-car is not supported)",
            raw,
        )
    if task_type not in cluster:
        raise _fail(f"task type {task_type!r} is not a job of the cluster", raw)
    index = task.get("index", 0)
    if isinstance(index, bool) or not isinstance(index, int):
        raise _fail(f"'task.index' must be an integer, not {index!r}", raw)
    if not 0 <= index < len(cluster[task_type]):
        raise _fail(
            f"task index {index} is out of range: job {task_type!r} has "
            f"{len(cluster[task_type])} task(s), indices 0 to {len(cluster[task_type]) - 1}",
            raw,
        )
    return TFConfig(cluster, task_type, index)


def cluster_place() -> tuple[int, int | None]:
    """`(training tasks, this task's rank)` per `TF_CONFIG`, else the Slurm job step.

    `(0, None)` outside a cluster; the rank is None when `TF_CONFIG` names no task. A set but
    invalid `TF_CONFIG` raises `ValueError` (see `parse_tf_config`).
    """
    config = parse_tf_config()
    if config is not None:
        return config.num_workers, config.rank
    tasks = slurm_num_tasks()
    return (tasks, int(os.environ.get("SLURM_PROCID", "0"))) if tasks else (0, None)


def tf_config_num_workers() -> int:
    """Training tasks (chief + workers) in `TF_CONFIG`, else in the Slurm job step, else 0."""
    return cluster_place()[0]


def strategy_workers(strategy: Any) -> int:
    """Worker processes of a `tf.distribute` strategy (1 unless multi-worker; None: 1)."""
    extended = getattr(strategy, "extended", None)
    return int(getattr(extended, "_num_workers", 1) or 1)


# Replicas per worker of the kit's live setups (`Distribution`s, by weak reference), for
# the input pipeline, which sits below them (`data.sharding`).
_LOCAL_REPLICAS: weakref.WeakKeyDictionary[Any, tuple[int, int]] = weakref.WeakKeyDictionary()


def note_local_replicas(owner: Any, num_workers: int, replicas_per_worker: int) -> None:
    """Records that `owner` (while alive) trains on `num_workers` x `replicas_per_worker`."""
    _LOCAL_REPLICAS[owner] = (num_workers, replicas_per_worker)


def local_replicas(num_workers: int) -> int | None:
    """Replicas per worker of a live setup over `num_workers` workers, or None."""
    for workers, replicas in list(_LOCAL_REPLICAS.values()):
        if workers == num_workers:
            return replicas
    return None


def slurm_num_tasks(environ: Mapping[str, str] | None = None) -> int:
    """Tasks of the Slurm job step this process is a task of (`srun`), or 0 outside one.

    `SLURM_STEP_NUM_TASKS` counts only when every variable `SlurmClusterResolver` needs is set
    (`_SLURM_STEP_VARS`); a batch script outside `srun` gets 0.
    """
    environ = os.environ if environ is None else environ
    if not all(environ.get(name, "").strip() for name in _SLURM_STEP_VARS):
        return 0
    try:
        return int(environ["SLURM_STEP_NUM_TASKS"])
    except ValueError:
        return 0


def _slurm_port_base(environ: Mapping[str, str]) -> int:
    """The first port of this node's tasks: KMK_SLURM_PORT_BASE, srun --resv-ports, job id."""
    raw = environ.get(SLURM_PORT_BASE_ENV, "").strip()
    if raw:
        if not raw.isdigit() or not 0 < int(raw) < 65536:
            raise ValueError(
                f"The environment variable {SLURM_PORT_BASE_ENV} must be a port number "
                f"(1-65535). Received: {SLURM_PORT_BASE_ENV}={raw!r}"
            )
        return int(raw)
    reserved = environ.get("SLURM_STEP_RESV_PORTS", "").strip()  # srun --resv-ports: "a-b"
    if reserved and reserved.split("-")[0].isdigit():
        return int(reserved.split("-")[0])
    job = environ.get("SLURM_JOB_ID", "").strip()
    # Jobs sharing a node get different ports (8 per job, as many tasks as a node holds).
    return 20000 + (int(job) % 5000) * 8 if job.isdigit() else 8888


def slurm_cluster_resolver(environ: Mapping[str, str] | None = None) -> Any:
    """TensorFlow's `SlurmClusterResolver` for this task, keeping Slurm's GPU allocation.

    When Slurm set `CUDA_VISIBLE_DEVICES` for the task (`--gpus-per-task`, `--gres`), the
    task keeps exactly those GPUs (TensorFlow's default would divide the task's own list
    among the tasks of the node and could leave it none). Otherwise the node's GPUs
    (`nvidia-smi -L`; none without it) are split evenly among its tasks, as
    `SlurmClusterResolver` does. Ports: `KMK_SLURM_PORT_BASE`, else the start of
    `SLURM_STEP_RESV_PORTS` (`srun --resv-ports`), else 20000 + 8 x (job id mod 5000); the
    tasks of a node use consecutive ports from there. Outside a Slurm job step, or with a bad
    `KMK_SLURM_PORT_BASE`, raises `ValueError`.
    """
    environ = os.environ if environ is None else environ
    if not slurm_num_tasks(environ):
        missing = [name for name in _SLURM_STEP_VARS if not environ.get(name, "").strip()]
        raise ValueError(
            "This process is not a task of a Slurm job step (run it with srun): "
            f"{', '.join(missing) or 'SLURM_STEP_NUM_TASKS'} is missing or invalid. "
            f"Received: {', '.join(f'{n}={environ.get(n)!r}' for n in _SLURM_STEP_VARS)}"
        )
    slurm = tensorflow_private.slurm_cluster_resolver()
    per_node = slurm.expand_tasks_per_node(environ["SLURM_STEP_TASKS_PER_NODE"])
    max_tasks = max(per_node)
    port_base = _slurm_port_base(environ)
    allocated = GPU_ENV in environ  # by Slurm for this task; else the node's (nvidia-smi)
    gpus = len(visible_gpus(environ))
    if not allocated and gpus >= max_tasks:  # the node's GPUs, split by TensorFlow
        return slurm.SlurmClusterResolver(
            port_base=port_base, gpus_per_node=gpus, gpus_per_task=gpus // max_tasks
        )
    # Slurm's allocation for this task, left as it is (none: -1, or no GPU on the node).
    return _slurm_task_resolver(gpus if allocated else 0, max_tasks, port_base)


def _slurm_task_resolver(gpus: int, max_tasks_per_node: int, port_base: int) -> Any:
    """`SlurmClusterResolver` with this task's GPUs as given (none included).

    TensorFlow's resolver places tasks by stepping through the node's GPUs by
    `gpus_per_task` (`range(0, gpus_per_node, gpus_per_task)`), which fails for tasks
    without a GPU; here every task counts one GPU for that placement and reports its own
    number of GPUs to the strategy. `CUDA_VISIBLE_DEVICES` is not changed.
    """
    slurm = tensorflow_private.slurm_cluster_resolver()

    class SlurmTaskResolver(slurm.SlurmClusterResolver):
        def __init__(self) -> None:
            placed = max(gpus, 1)
            super().__init__(
                port_base=port_base,
                gpus_per_node=placed * max_tasks_per_node,
                gpus_per_task=placed,
                auto_set_gpu=False,
            )
            self._task_gpus = gpus

        def num_accelerators(
            self, task_type: Any = None, task_id: Any = None, config_proto: Any = None
        ) -> dict[str, int]:
            """This task's GPUs, as Slurm allocated them."""
            return {"GPU": self._task_gpus}

    return SlurmTaskResolver()


def _local_host_names() -> set[str]:
    names = {"localhost", "127.0.0.1", "::1", "0.0.0.0", "::"}
    with contextlib.suppress(OSError):
        names.add(socket.gethostname())
        names.add(socket.getfqdn())
    return {n.lower() for n in names}


def _check_port_free(address: str) -> None:
    """Raises if this task's own port, on this host, is already held by another process."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]").lower()
    if host not in _local_host_names():
        return
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        family = socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", int(port)))
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                return
            raise ValueError(
                f"This task's port {port} is already in use on this host, so TensorFlow "
                "would wait forever for the cluster. Stop the process holding it (an "
                "earlier run?) or give this task another port in TF_CONFIG. "
                f"Received: address={address!r}"
            ) from None


def _collective_timeout(value: float | None) -> float | None:
    if value is None:
        raw = os.environ.get(COLLECTIVE_TIMEOUT_ENV, "").strip()
        if not raw:
            return None
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(
                f"The environment variable {COLLECTIVE_TIMEOUT_ENV} must be a number of "
                f"seconds. Received: {COLLECTIVE_TIMEOUT_ENV}={raw!r}"
            ) from None
    seconds = non_negative_number("collective_timeout_s", value, "seconds; 0 or None: no limit")
    return seconds or None


def _implementation(cross_device_ops: Any) -> Any:
    import tensorflow as tf

    impl = tf.distribute.experimental.CommunicationImplementation
    if isinstance(cross_device_ops, impl):
        return cross_device_ops
    if isinstance(cross_device_ops, tf.distribute.CrossDeviceOps):
        raise ValueError(
            "MultiWorkerMirroredStrategy all-reduces with collective ops; a "
            "tf.distribute.CrossDeviceOps instance only works with MirroredStrategy. Use "
            "cross_device_ops='auto', 'ring' or 'nccl'. "
            f"Received: cross_device_ops={type(cross_device_ops).__name__}"
        )
    name = str(cross_device_ops).lower() if isinstance(cross_device_ops, str) else None
    if name not in IMPLEMENTATIONS:
        raise ValueError(
            "Unknown `cross_device_ops` for multi-worker training. Expected one of "
            f"{', '.join(map(repr, IMPLEMENTATIONS))} ('hierarchical_copy' and "
            "'reduction_to_one_device' are single-host MirroredStrategy choices). "
            f"Received: cross_device_ops={cross_device_ops!r}"
        )
    if name == "auto":
        from keras_mirror_kit.devices import nccl_available

        gpus = tf.config.list_physical_devices("GPU")
        return impl.NCCL if gpus and nccl_available() else impl.RING
    if name == "nccl":
        from keras_mirror_kit.devices import nccl_available

        if not (tf.config.list_physical_devices("GPU") and nccl_available()):
            raise ValueError(
                "`cross_device_ops='nccl'` needs GPUs and a CUDA build of TensorFlow on "
                "Linux; this worker has none. Use cross_device_ops='auto' or 'ring'. "
                f"Received: cross_device_ops={cross_device_ops!r}"
            )
        return impl.NCCL
    return impl.RING


def _describe_resolver(resolver: Any) -> TFConfig | None:
    """Validates a cluster resolver's view of the cluster like TF_CONFIG's."""
    try:
        spec = resolver.cluster_spec().as_dict()
    except Exception as err:  # a resolver that cannot answer (e.g. not under Slurm)
        raise ValueError(
            f"The cluster resolver {type(resolver).__name__} could not describe the "
            f"cluster: {err}. Received: cluster_resolver={resolver!r}"
        ) from err
    if not spec:
        return None
    payload: dict[str, Any] = {"cluster": spec}
    if resolver.task_type is not None:
        payload["task"] = {"type": resolver.task_type, "index": resolver.task_id}
    text = json.dumps(payload, default=str)
    try:
        return parse_tf_config(text)
    except ValueError as err:
        raise ValueError(
            str(err).replace("The environment variable TF_CONFIG", "The cluster resolver's view")
        ) from None


def create_strategy(
    cluster_resolver: Any = None,
    cross_device_ops: Any = "auto",
    *,
    collective_timeout_s: float | None = None,
) -> tuple[tf.distribute.Strategy, str]:
    """`(MultiWorkerMirroredStrategy, name)` for this worker, `name` like `"collective-ring"`.

    The cluster comes from `cluster_resolver`, else `TF_CONFIG`, else a Slurm step with several
    tasks (without any, a single-worker strategy over this host). Everything that can be
    checked is checked before connecting (`ValueError`: `TF_CONFIG` or the resolver's view,
    `cross_device_ops`, the timeout, `KMK_KERAS_WORKAROUND`, this task's local port already in
    use; `TypeError`: not a `ClusterResolver`), because the constructor then blocks until every
    worker has started. With more than one worker it installs the `model.fit` workaround
    (`workarounds.keras_multi_worker_fit`). `cross_device_ops="auto"` is NCCL when this worker
    has GPUs and a CUDA build, else ring. `collective_timeout_s` (default
    `KMK_COLLECTIVE_TIMEOUT`, else none) makes a stuck all-reduce fail instead of hanging; a
    dead peer is detected by TensorFlow's heartbeat (about 10 s) either way.
    """
    import tensorflow as tf

    resolver_cls = tf.distribute.cluster_resolver.ClusterResolver
    if cluster_resolver is not None and not isinstance(cluster_resolver, resolver_cls):
        raise TypeError(
            "`cluster_resolver` must be a tf.distribute.cluster_resolver.ClusterResolver "
            "(for example SlurmClusterResolver()). "
            f"Received: cluster_resolver={cluster_resolver!r}"
        )
    from keras_mirror_kit.workarounds import keras_multi_worker_fit

    implementation = _implementation(cross_device_ops)
    timeout = _collective_timeout(collective_timeout_s)
    keras_multi_worker_fit.mode()  # a bad KMK_KERAS_WORKAROUND fails now, not after connecting
    if cluster_resolver is None and parse_tf_config() is None and slurm_num_tasks() > 1:
        cluster_resolver = slurm_cluster_resolver()  # srun with several tasks
        logger.info("keras-mirror-kit: a Slurm job step: using SlurmClusterResolver")
    if cluster_resolver is None:
        config = parse_tf_config()
        source = "TF_CONFIG"
    else:
        config = _describe_resolver(cluster_resolver)
        source = type(cluster_resolver).__name__
    if config is not None and config.address is not None and config.num_workers > 1:
        _check_port_free(config.address)
        warn_exposed_servers(config.cluster, chief=config.rank == 0)
    if config is None or config.num_workers <= 1:
        logger.info(
            "keras-mirror-kit: MultiWorkerMirroredStrategy with a single worker (%s "
            "describes no cluster)",
            source,
        )
    else:
        logger.info(
            "keras-mirror-kit: joining a %d-worker cluster from %s as %s:%s (%s%s); "
            "waiting for every worker to start",
            config.num_workers,
            source,
            config.task_type,
            config.task_index,
            config.address,
            ", chief" if config.rank == 0 else "",
        )
    options = tf.distribute.experimental.CommunicationOptions(
        timeout_seconds=timeout, implementation=implementation
    )
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        cluster_resolver=cluster_resolver, communication_options=options
    )
    keras_multi_worker_fit.apply(strategy)
    _signal_ready()
    return strategy, f"collective-{implementation.name.lower()}"


def _signal_ready() -> None:
    """Creates the launcher's readiness file, if a launcher asked for one."""
    path = os.environ.get(READY_FILE_ENV, "").strip()
    if not path:
        return
    try:
        Path(path).touch()
    except OSError as err:
        logger.warning("keras-mirror-kit: could not create %s=%s: %s", READY_FILE_ENV, path, err)
