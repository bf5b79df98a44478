"""What each worker is told: its cluster's ports and `TF_CONFIG`, its GPUs, its variables."""

from __future__ import annotations

import json
import socket
from collections.abc import Sequence

from keras_mirror_kit.multi_worker import NETWORK_ENV, READY_FILE_ENV
from keras_mirror_kit.multi_worker.gpus import GPU_ENV
from keras_mirror_kit.multi_worker.launch.errors import LaunchError

RANK_ENV = "KMK_LAUNCH_RANK"
WORLD_SIZE_ENV = "KMK_LAUNCH_WORLD_SIZE"
RESTART_ENV = "KMK_LAUNCH_RESTART_COUNT"  # 0 in the first attempt, then 1, 2, ...
MEMORY_GROWTH_ENV = "TF_FORCE_GPU_ALLOW_GROWTH"  # read by TensorFlow's GPU allocator


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """Finds `n` distinct free TCP ports on `host` by binding port 0.

    All `n` sockets are held open together (so the ports differ) and closed just before
    returning; the workers bind them moments later.

    Args:
        n: How many ports (>= 1).
        host: Interface to bind.

    Returns:
        A list of `n` port numbers.

    Raises:
        ValueError: If `n` < 1.
        LaunchError: If the ports cannot be bound.

    Example:

    ```python
    free_ports(2)   # e.g. [40017, 40125]
    ```
    """
    if n < 1:
        raise ValueError(f"`n` must be >= 1. Received: n={n}")
    sockets: list[socket.socket] = []
    try:
        for _ in range(n):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    except OSError as err:
        raise LaunchError(f"could not find {n} free ports on {host}: {err}") from err
    finally:
        for sock in sockets:
            sock.close()


def tf_config_for(ports: Sequence[int], index: int, host: str = "127.0.0.1") -> str:
    """The `TF_CONFIG` JSON of worker `index` in a worker-only cluster on `host`.

    Args:
        ports: One port per worker.
        index: This worker's index, `0 <= index < len(ports)`.
        host: Host of every worker.

    Returns:
        The JSON string.

    Raises:
        ValueError: If `index` is out of range.

    Example:

    ```python
    tf_config_for([2222, 2223], 1)
    # '{"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}, "task": ...}'
    ```
    """
    if not 0 <= index < len(ports):
        raise ValueError(
            f"`index` must be in [0, {len(ports)}). Received: index={index}, ports={ports}"
        )
    cluster = {"worker": [f"{host}:{port}" for port in ports]}
    return json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})


def assign_gpus(
    nproc: int, gpus: Sequence[str], gpus_per_worker: int | None = None
) -> list[list[str]] | None:
    """Which GPUs each of `nproc` workers gets: consecutive, disjoint slices of `gpus`.

    Args:
        nproc: Number of workers.
        gpus: The visible GPUs (see `visible_gpus`).
        gpus_per_worker: GPUs per worker; 0 runs every worker without a GPU. None (the
            default) splits `gpus` evenly, and leaves the workers' environment alone
            when there is no GPU.

    Returns:
        One list of GPU entries per worker (an empty list: no GPU), or None when nothing
        is to be set.

    Raises:
        LaunchError: If `gpus_per_worker` is None and `nproc` does not divide the number
            of GPUs, if `gpus_per_worker` is negative, or if `nproc * gpus_per_worker`
            exceeds the number of GPUs.

    Example:

    ```python
    assign_gpus(2, ["0", "1", "2", "3"])      # [["0", "1"], ["2", "3"]]
    assign_gpus(2, ["0", "1", "2", "3"], 1)   # [["0"], ["1"]]
    assign_gpus(2, [])                        # None
    ```
    """
    listed = ",".join(gpus)
    if gpus_per_worker is None:
        if not gpus:
            return None
        if len(gpus) % nproc:
            fit = len(gpus) // nproc
            hint = (
                f"--gpus-per-worker {fit} (GPUs {','.join(gpus[fit * nproc :])} stay unused)"
                if fit
                else f"-n {len(gpus)} (one worker per GPU)"
            )
            raise LaunchError(
                f"cannot split the {len(gpus)} visible GPU(s) ({listed}) evenly among {nproc} "
                f"workers, and workers sharing a GPU would each take all of its memory. Pass "
                f"{hint}, --gpus-per-worker 0 to run the workers without GPUs, or set "
                f"CUDA_VISIBLE_DEVICES to the GPUs to use. Received: -n {nproc}, "
                f"{len(gpus)} GPU(s) ({listed})"
            )
        gpus_per_worker = len(gpus) // nproc
    if gpus_per_worker < 0:
        raise LaunchError(
            f"--gpus-per-worker must be >= 0. Received: --gpus-per-worker {gpus_per_worker}"
        )
    if gpus_per_worker * nproc > len(gpus):
        raise LaunchError(
            f"--gpus-per-worker {gpus_per_worker} needs {gpus_per_worker * nproc} GPUs for "
            f"{nproc} workers, but {len(gpus)} {'is' if len(gpus) == 1 else 'are'} visible"
            f"{f' ({listed})' if gpus else ''}. Pass a smaller --gpus-per-worker or -n, or "
            f"--gpus-per-worker 0 to run the workers without GPUs. Received: -n {nproc}, "
            f"--gpus-per-worker {gpus_per_worker}"
        )
    k = gpus_per_worker
    return [list(gpus[i * k : (i + 1) * k]) for i in range(nproc)]


def worker_environment(
    base: dict[str, str],
    ports: Sequence[int],
    index: int,
    ready_file: str | None,
    gpus: Sequence[str] | None = None,
    memory_growth: bool = False,
    restart_count: int = 0,
    network: str | None = None,
) -> dict[str, str]:
    """The environment of worker `index`: `base` plus TF_CONFIG and the launcher's variables.

    Args:
        base: The launcher's environment.
        ports: One port per worker.
        index: This worker's index.
        ready_file: Path the worker creates once its strategy exists, or None.
        gpus: This worker's GPUs, set as `CUDA_VISIBLE_DEVICES` (an empty list: `-1`, no
            GPU), or None to leave `CUDA_VISIBLE_DEVICES` as in `base`.
        memory_growth: Whether to set `TF_FORCE_GPU_ALLOW_GROWTH=true` (TensorFlow then
            allocates GPU memory as needed instead of taking it all at start-up).
        restart_count: How many times the group was restarted before this attempt
            (`--max-restarts`), set as `KMK_LAUNCH_RESTART_COUNT`.
        network: `"isolated"` (the workers share a network namespace of their own) or
            `"host"`, set as `KMK_LAUNCH_NETWORK`; None leaves it as in `base`.

    Returns:
        A new dict.

    Example:

    ```python
    env = worker_environment(dict(os.environ), [2222, 2223], 0, None, gpus=["0"])
    ```
    """
    env = dict(base)
    env["TF_CONFIG"] = tf_config_for(ports, index)
    env[RANK_ENV] = str(index)
    env[WORLD_SIZE_ENV] = str(len(ports))
    env[RESTART_ENV] = str(restart_count)
    env["PYTHONUNBUFFERED"] = "1"
    if ready_file is not None:
        env[READY_FILE_ENV] = ready_file
    else:
        env.pop(READY_FILE_ENV, None)
    if gpus is not None:
        env[GPU_ENV] = ",".join(gpus) if gpus else "-1"
    if memory_growth:
        env[MEMORY_GROWTH_ENV] = "true"
    if network is not None:
        env[NETWORK_ENV] = network
    return env
