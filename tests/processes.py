"""Process helpers for the launcher and multi-worker tests: alive by pid, kill what is
left, assert none; a cluster of workers forked from the tests' zygote."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from tests import forkserver


def alive(pid: int) -> bool:
    """Whether `pid` is a running process (not a zombie, nor dead while its parent reaps it)."""
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return False


def _described(pid: int) -> str:
    """`pid` with its state, parent, group and command line, for a failure message."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            return (
                f"{pid} ({proc.status()}, ppid {proc.ppid()}, pgid {os.getpgid(pid)}: "
                f"{' '.join(proc.cmdline())[:120]})"
            )
    except (psutil.Error, OSError):
        return f"{pid} (gone)"


def kill(pids: list[int]) -> None:
    """SIGKILLs every pid that still exists."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def assert_none_left(pids: list[int]) -> None:
    """Fails (after killing them) if any of `pids` is still alive."""
    left = [pid for pid in pids if alive(pid)]
    described = [_described(pid) for pid in left]
    kill(left)
    assert not left, f"processes left behind: {left}: {'; '.join(described)}"


def tf_configs(n: int = 2) -> list[str]:
    """TF_CONFIG of each of `n` workers on free ports of 127.0.0.1 (as `launch` makes it)."""
    from keras_mirror_kit.multi_worker import launch

    ports = launch.free_ports(n)
    return [launch.tf_config_for(ports, index) for index in range(n)]


def run_cluster(
    args: list[str], envs: list[dict[str, str]], cwd: os.PathLike[str] | str, timeout: float = 420
) -> list[subprocess.CompletedProcess[str]]:
    """Runs the command `args` in `cwd` once per environment of `envs` (each with its
    worker's TF_CONFIG), forked from the tests' zygote (`tests/forkserver.py`), to their ends.

    For clusters whose checks are on training, not on the launcher (its process tree,
    signals and namespaces are checked on launched runs): each worker configures its own
    TensorFlow runtime and server as a new interpreter would. `timeout` bounds a stuck
    cluster (no check times it); what is left then is killed."""
    procs = [
        forkserver.popen(
            args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for env in envs
    ]
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic())))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)
    return [
        subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        for proc, (stdout, stderr) in zip(procs, outputs)
    ]


def worker_env(**extra: str) -> dict[str, str]:
    """This process's environment for a worker: the repository importable, TensorFlow
    quiet, no TF_CONFIG, simulated replicas or Keras workaround switch of ours; `extra` on top."""
    from tests.subproc import REPO

    env = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2"}
    for name in ("TF_CONFIG", "KMK_SIMULATE_REPLICAS", "KMK_KERAS_WORKAROUND"):
        env.pop(name, None)
    env.update(extra)
    return env


def run_worker_script(script: str, out: os.PathLike[str], n: int = 2) -> None:
    """Writes `script` to OUT/worker.py and runs it as an `n`-worker cluster (`run_cluster`,
    `python OUT/worker.py OUT` in each) whose stalled collective fails after 120 s instead
    of hanging; every worker must exit with status 0."""
    from tests.subproc import REPO

    path = os.path.join(out, "worker.py")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(script)
    env = worker_env(KMK_COLLECTIVE_TIMEOUT="120")
    done = run_cluster(
        [sys.executable, path, os.fspath(out)],
        [{**env, "TF_CONFIG": config} for config in tf_configs(n)],
        cwd=REPO,
        timeout=400,
    )
    for proc in done:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
