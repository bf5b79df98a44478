"""Multi-worker training: TF_CONFIG validation, the Keras workaround, `launch`, and real
2-worker runs on 127.0.0.1.

Every worker is a real process (the pytest process has its own TensorFlow runtime with 2
logical CPUs, and a `MultiWorkerMirroredStrategy` constructor blocks until its peers
connect): started by `launch` (new interpreters) where the launcher is what is checked
(how it names a failed or early worker, stops the others and what they started, the
startup timeout, the network namespace, its warning), else forked from the tests' zygote
with a TF_CONFIG each (the chief-job cluster, the resumed run, the accumulation run, the
unshared checkpoint directories). Every wait is bounded; on a timeout every process a
test started is killed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.distribute import multi_worker_util

import keras_mirror_kit as kmk
from keras_mirror_kit.multi_worker import cluster, launch
from keras_mirror_kit.multi_worker.cluster import parse_tf_config
from keras_mirror_kit.multi_worker.launch.options import _split_argv
from keras_mirror_kit.workarounds import keras_multi_worker_fit
from tests import forkserver
from tests import network_modes as modes
from tests.processes import (
    alive,
    assert_none_left,
    kill,
    run_cluster,
    tf_configs,
    worker_env,
)
from tests.subproc import last_json, python_on_path, run_python

REPO = Path(__file__).resolve().parent.parent
CHILD = "tests.mw_child"
TOLERANCE = 1e-6


# -- helpers ---------------------------------------------------------------------------------


def _cfg(cluster: object, task: object = None, **extra: object) -> str:
    config: dict = {"cluster": cluster, **extra}
    if task is not None:
        config["task"] = task
    return json.dumps(config)


def _recorded_pids(out: Path) -> list[int]:
    pids: list[int] = []
    for path in sorted(out.glob("pids-*.json")):
        info = json.loads(path.read_text())
        pids += [info["pid"]] + ([info["grandchild_pid"]] if "grandchild_pid" in info else [])
    return pids


def _launch(
    out: Path,
    *child_args: str,
    launcher_args: tuple[str, ...] = (),
    timeout: float = 300,
    observe: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Runs `python -m keras_mirror_kit.multi_worker.launch -n 2 ... -m tests.mw_child OUT args`.

    `timeout` only bounds a launch that never ends; no test depends on how long it takes.
    The chief's work after training (W&B, results) may take long on a loaded machine: the
    other worker's earlier exit is not taken for an early one unless it is 120 s earlier.
    `observe`: once both workers' strategies exist (their servers listen), they wait while
    `_observe_sockets` records where their ports listen, in OUT/observed.json."""
    command = [sys.executable, "-m", "keras_mirror_kit.multi_worker.launch", "-n", "2"]
    command += ["--finish-window", "120", *launcher_args]  # the last one given counts
    command += ["-m", CHILD, str(out), *child_args]
    if observe:
        command += ["--hold-after-strategy", str(out / "go")]
    proc = forkserver.popen(
        command,
        cwd=REPO,
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        if observe:
            _observe_sockets(proc, out, timeout)
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        kill(_recorded_pids(out))
        stdout, stderr = proc.communicate(timeout=30)
        raise AssertionError(
            f"launch did not finish in {timeout} s\n{stdout[-3000:]}\n{stderr[-6000:]}"
        ) from None
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def _observe_sockets(proc: subprocess.Popen[str], out: Path, timeout: float) -> None:
    """While both workers hold after creating their strategy: the listening sockets of the
    host's network namespace (this test's) and of each worker's, in OUT/observed.json."""
    try:
        deadline = time.monotonic() + timeout  # bounds a stuck start; progress decides
        while len(list(out.glob("listening-*.json"))) < 2:
            if proc.poll() is not None or time.monotonic() > deadline:
                return  # the launch failed: its output says why
            time.sleep(0.05)
        workers = [json.loads((out / f"listening-{r}.json").read_text()) for r in (0, 1)]
        for worker in workers:
            worker["netns"] = modes.netns(worker["pid"])
            worker["listening"] = sorted(modes.listening_ports(worker["pid"]))
        observed = {
            "host_netns": modes.netns(),
            "host_listening": sorted(modes.listening_ports()),
            "workers": workers,
        }
        (out / "observed.json").write_text(json.dumps(observed))
    finally:
        (out / "go").write_text("go")


def _results(out: Path, n: int = 2) -> list[dict]:
    return [json.loads((out / f"result-{rank}.json").read_text()) for rank in range(n)]


def _weights(out: Path, rank: int, prefix: str) -> list[np.ndarray]:
    with np.load(out / f"weights-{rank}.npz") as data:
        keys = sorted(
            (k for k in data.files if k.startswith(prefix)), key=lambda k: int(k[len(prefix) :])
        )
        return [data[k] for k in keys]


def _max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    assert len(a) == len(b) and a
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def _one_process_two_replicas(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The child run as one process with 2 simulated replicas (the multi-worker reference)."""
    return forkserver.run(
        [sys.executable, "-m", CHILD, str(out), *args],
        cwd=REPO,
        env=worker_env(KMK_SIMULATE_REPLICAS="2"),
        capture_output=True,
        text=True,
        timeout=240,
    )


def _ok(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, (
        f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}"
    )


# -- TF_CONFIG parsing and validation ------------------------------------------------------

WORKERS2 = {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        (json.dumps({"task": {"type": "worker", "index": 0}}), "no 'cluster'"),
        (_cfg({}), "no 'cluster'"),
        (_cfg(WORKERS2), "no 'task'"),
        (_cfg(WORKERS2, {"type": "worker", "index": 2}), "task index 2 is out of range"),
        (_cfg(WORKERS2, {"type": "worker", "index": -1}), "out of range"),
        (_cfg(WORKERS2, {"type": "worker", "index": "0"}), "'task.index' must be an integer"),
        (_cfg(WORKERS2, {"type": "worker", "index": True}), "'task.index' must be an integer"),
        (_cfg(WORKERS2, {"type": "master", "index": 0}), "unknown task type 'master'"),
        (_cfg(WORKERS2, {"type": "evaluator", "index": 0}), "unknown task type 'evaluator'"),
        (_cfg(WORKERS2, {"type": "chief", "index": 0}), "not a job of the cluster"),
        (_cfg(WORKERS2, {"index": 0}), "'task.type' must name a job"),
        (_cfg(WORKERS2, "worker"), "'task' must be an object"),
        (_cfg({"master": ["a:1"]}, {"type": "master", "index": 0}), "unknown job 'master'"),
        (_cfg({"ps": ["a:1"], "worker": ["b:2"]}, {"type": "worker"}), "'ps' job"),
        (_cfg({"worker": ["a:http", "b:2"]}, {"type": "worker"}), "must be an integer"),
        (_cfg({"worker": ["a:70000", "b:2"]}, {"type": "worker"}), "from 1 to 65535"),
        (_cfg({"worker": ["a", "b:2"]}, {"type": "worker"}), "no 'host:port' form"),
        (_cfg({"worker": [2222, "b:2"]}, {"type": "worker"}), "'host:port' string"),
        (_cfg({"worker": "a:1,b:2"}, {"type": "worker"}), "not a string"),
        (_cfg({"worker": []}, {"type": "worker"}), "non-empty list"),
        (_cfg({"chief": ["a:1", "b:2"], "worker": ["c:3"]}, {"type": "chief"}), "one chief"),
        (_cfg({"worker": ["a:1", "a:1"]}, {"type": "worker"}), "share the address"),
        (_cfg({"evaluator": ["a:1"]}), "no 'chief' or 'worker'"),
        (_cfg({"worker": {"0": "a:1", "2": "b:2"}}, {"type": "worker"}), "0..n-1"),
    ],
)
def test_invalid_tf_config_is_a_clear_error(raw, expected):
    with pytest.raises(ValueError, match="TF_CONFIG is invalid") as info:
        parse_tf_config(raw)
    assert expected in str(info.value)
    assert "Received: TF_CONFIG=" in str(info.value)


def test_tf_config_from_the_environment(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert parse_tf_config() is None and cluster.tf_config_num_workers() == 0
    monkeypatch.setenv("TF_CONFIG", "  ")
    assert cluster.tf_config_num_workers() == 0
    monkeypatch.setenv("TF_CONFIG", _cfg(WORKERS2, {"type": "worker", "index": 1}))
    assert cluster.tf_config_num_workers() == 2
    monkeypatch.setenv("TF_CONFIG", '{"cluster": ')
    with pytest.raises(ValueError, match="not valid JSON"):
        cluster.tf_config_num_workers()


@pytest.mark.parametrize(
    ("cluster", "task_type", "index", "workers", "chief", "rank"),
    [
        (WORKERS2, "worker", 0, 2, True, 0),
        (WORKERS2, "worker", 1, 2, False, 1),
        ({"chief": ["c:1"], "worker": ["w:1", "w:2"]}, "chief", 0, 3, True, 0),
        ({"chief": ["c:1"], "worker": ["w:1", "w:2"]}, "worker", 0, 3, False, 1),
        ({"chief": ["c:1"], "worker": ["w:1", "w:2"]}, "worker", 1, 3, False, 2),
        ({"worker": ["w:1", "w:2"], "evaluator": ["e:1"]}, "worker", 0, 2, True, 0),
        ({"worker": {"1": "w:2", "0": "w:1"}}, "worker", 1, 2, False, 1),
        ({"worker": ["[::1]:2222", "[::1]:2223"]}, "worker", 1, 2, False, 1),
    ],
)
def test_chief_in_every_cluster_shape_agrees_with_tensorflow(
    cluster, task_type, index, workers, chief, rank
):
    config = parse_tf_config(_cfg(cluster, {"type": task_type, "index": index}))
    assert config is not None
    assert (config.num_workers, config.rank == 0, config.rank) == (workers, chief, rank)
    # MultiWorkerMirroredStrategy's `should_checkpoint` is this TensorFlow function.
    assert multi_worker_util.is_chief(config.cluster, task_type, index) is chief


def test_the_chief_warns_once_that_the_servers_listen_everywhere(monkeypatch, caplog):
    """Outside `launch` (which isolates its workers or warns itself, and says so in
    KMK_LAUNCH_NETWORK), the chief of a cluster logs one WARNING naming every address."""
    from keras_mirror_kit.multi_worker import NETWORK_ENV, SECURITY_DOCS_URL, exposure

    monkeypatch.setattr(exposure, "_warned", False)
    monkeypatch.delenv(NETWORK_ENV, raising=False)
    spec = {"chief": ["c:1"], "worker": [f"w{i}:2222" for i in range(9)]}
    with caplog.at_level("WARNING", logger="keras_mirror_kit"):
        assert exposure.warn_exposed_servers(spec, chief=False) is False  # not the chief
        assert exposure.warn_exposed_servers(spec, chief=True) is True
        assert exposure.warn_exposed_servers(spec, chief=True) is False  # once
    (record,) = caplog.records
    assert record.levelname == "WARNING"
    text = record.getMessage()
    assert "of each of the 10 tasks of this cluster listens on all network interfaces" in text
    assert "port of its address: c:1, w0:2222, w1:2222," in text and "w6:2222 and 2 more)" in text
    assert SECURITY_DOCS_URL in text
    for value in ("isolated", "host"):  # set by launch: nothing more to say
        monkeypatch.setattr(exposure, "_warned", False)
        monkeypatch.setenv(NETWORK_ENV, value)
        assert exposure.warn_exposed_servers(spec, chief=True) is False


def test_single_task_needs_no_task_entry():
    config = parse_tf_config(_cfg({"worker": ["a:1"]}))
    assert config is not None and config.num_workers == 1 and config.task_type is None
    assert config.rank is None and config.address is None


def test_distributed_rejects_a_bad_tf_config_before_creating_anything(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", _cfg(WORKERS2, {"type": "worker", "index": 5}))
    with pytest.raises(ValueError, match="task index 5 is out of range"):
        kmk.distributed(global_batch_size=8).distribution  # noqa: B018


@pytest.mark.parametrize("strategy", ["auto", "multi_worker"])
def test_devices_under_a_multi_worker_strategy_is_an_error_not_ignored(monkeypatch, strategy):
    """`devices=` was silently ignored by MultiWorkerMirroredStrategy. This worker's port is
    taken, so code that got past the check would fail on the port (not hang, nor build a
    multi-worker strategy in this process)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        spec = {"worker": [f"127.0.0.1:{holder.getsockname()[1]}", "127.0.0.1:1"]}
        monkeypatch.setenv("TF_CONFIG", _cfg(spec, {"type": "worker", "index": 0}))
        config = kmk.distributed(global_batch_size=8, devices=["/cpu:0"], strategy=strategy)
        with pytest.raises(ValueError) as info:
            config.distribution  # noqa: B018
    message = str(info.value)
    assert "`devices` cannot be used with a multi-worker strategy" in message
    assert "--gpus-per-worker" in message and "Received: devices=['/cpu:0']" in message


def test_one_worker_tf_config_keeps_mirrored_strategy(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", _cfg({"worker": ["127.0.0.1:2222"]}, {"type": "worker"}))
    assert kmk.distributed(global_batch_size=8)._wants_multi_worker() is False
    assert kmk.distributed(global_batch_size=8, strategy="multi_worker")._wants_multi_worker()


# -- create_strategy: argument errors are raised before TensorFlow's constructor ------------


@pytest.mark.parametrize(
    ("kwargs", "error", "expected"),
    [
        ({"cross_device_ops": "hierarchical_copy"}, ValueError, "single-host MirroredStrategy"),
        ({"cross_device_ops": "gloo"}, ValueError, "Unknown `cross_device_ops`"),
        ({"cross_device_ops": tf.distribute.NcclAllReduce()}, ValueError, "CrossDeviceOps"),
        ({"cross_device_ops": "nccl"}, ValueError, "needs GPUs"),
        ({"cluster_resolver": "slurm"}, TypeError, "ClusterResolver"),
        ({"collective_timeout_s": -1}, ValueError, "collective_timeout_s"),
    ],
)
def test_create_strategy_argument_errors(monkeypatch, kwargs, error, expected):
    monkeypatch.setenv("TF_CONFIG", _cfg(WORKERS2, {"type": "worker", "index": 0}))
    with pytest.raises(error, match=expected):
        cluster.create_strategy(**kwargs)


def test_a_cluster_resolver_view_is_validated_like_tf_config():
    spec = tf.train.ClusterSpec({"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]})
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        spec, task_type="worker", task_id=5
    )
    with pytest.raises(ValueError, match="cluster resolver's view is invalid: task index 5"):
        cluster.create_strategy(cluster_resolver=resolver)


def test_bad_collective_timeout_variable(monkeypatch):
    monkeypatch.setenv("KMK_COLLECTIVE_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="KMK_COLLECTIVE_TIMEOUT"):
        cluster.create_strategy()


def test_bad_workaround_variable_fails_before_connecting(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", _cfg(WORKERS2, {"type": "worker", "index": 0}))
    monkeypatch.setenv(keras_multi_worker_fit.ENV_VAR, "maybe")
    with pytest.raises(ValueError, match="KMK_KERAS_WORKAROUND"):
        cluster.create_strategy()


def test_port_already_in_use_is_refused_instead_of_hanging(monkeypatch):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        other = launch.free_ports(1)[0]
        spec = {"worker": [f"127.0.0.1:{port}", f"127.0.0.1:{other}"]}
        monkeypatch.setenv("TF_CONFIG", _cfg(spec, {"type": "worker", "index": 0}))
        with pytest.raises(ValueError, match=f"port {port} is already in use"):
            cluster.create_strategy()


# -- the Keras workaround, in this process (no multi-worker strategy here) -----------------


def test_workaround_version_guard():
    assert keras_multi_worker_fit.status("3.15.0") == "tested"
    assert keras_multi_worker_fit.status("3.15.1") == "tested"
    # Keras' source here still has the failing calls, so a newer version is "untested".
    assert keras_multi_worker_fit.status("3.99.0") == "untested"
    assert keras_multi_worker_fit.status() == "tested", (
        f"Keras {keras.__version__} is not the version the multi-worker workaround was "
        "tested on: run tests/test_multi_worker.py and update TESTED_KERAS"
    )
    assert "keras-team/keras#20585" in keras_multi_worker_fit.__doc__
    assert "tensorflow/tensorflow#72388" in keras_multi_worker_fit.__doc__


def test_workaround_is_not_applied_without_a_multi_worker_strategy():
    assert not keras_multi_worker_fit.is_multi_worker(tf.distribute.get_strategy())
    assert not keras_multi_worker_fit.is_multi_worker(tf.distribute.MirroredStrategy(["/cpu:0"]))
    assert not keras_multi_worker_fit.is_multi_worker(None)
    assert keras_multi_worker_fit.apply(tf.distribute.get_strategy()) is False
    assert not keras_multi_worker_fit.is_applied()


def test_workaround_outside_tested_versions(monkeypatch):
    from keras.src.backend.tensorflow import trainer

    original_reduce = trainer.reduce_per_replica
    monkeypatch.setattr(keras_multi_worker_fit, "is_multi_worker", lambda strategy: True)
    monkeypatch.setattr(keras_multi_worker_fit.keras, "__version__", "3.99.0")
    try:
        # Upstream fixed (the failing calls are gone): nothing is installed, no warning.
        monkeypatch.setattr(keras_multi_worker_fit, "_bugs_present", lambda: False)
        assert keras_multi_worker_fit.apply(object()) is False
        assert not keras_multi_worker_fit.is_applied()
        # Still broken on an untested version: a clear warning, then the wrappers, once.
        monkeypatch.setattr(keras_multi_worker_fit, "_bugs_present", lambda: True)
        with pytest.warns(keras_multi_worker_fit.KerasWorkaroundWarning, match="3.99.0"):
            assert keras_multi_worker_fit.apply(object()) is True
        installed = trainer.reduce_per_replica
        assert installed is not original_reduce and keras_multi_worker_fit.is_applied()
        assert keras_multi_worker_fit.apply(object()) is True  # idempotent: no second wrapper
        assert trainer.reduce_per_replica is installed
        # The wrapper hands every non-multi-worker strategy to Keras' own function.
        monkeypatch.setattr(keras_multi_worker_fit, "is_multi_worker", lambda strategy: False)
        value = tf.constant(2.0)
        assert installed({"loss": value}, tf.distribute.get_strategy(), "auto")["loss"] is value
        monkeypatch.setenv(keras_multi_worker_fit.ENV_VAR, "sometimes")
        with pytest.raises(ValueError, match="KMK_KERAS_WORKAROUND"):
            keras_multi_worker_fit.apply(object())
    finally:
        keras_multi_worker_fit._uninstall()
    assert trainer.reduce_per_replica is original_reduce
    assert not keras_multi_worker_fit.is_applied()


def test_workaround_switched_off(monkeypatch):
    monkeypatch.setenv(keras_multi_worker_fit.ENV_VAR, "off")
    monkeypatch.setattr(keras_multi_worker_fit, "is_multi_worker", lambda strategy: True)
    assert keras_multi_worker_fit.apply(object()) is False
    assert not keras_multi_worker_fit.is_applied()


# -- launch: the launcher alone, with small non-TensorFlow scripts (in this process) -------

# A worker in "fail" or "hang" mode sleeps HANG_S, then writes finished-<rank>: a launcher
# that did not stop it would let it get there (tests check progress, not the clock).
HANG_S = 120
SCRIPT = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    out, mode = sys.argv[1], sys.argv[2]
    rank = int(os.environ["KMK_LAUNCH_RANK"])
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    info = {"pid": os.getpid()}
    if mode in ("fail", "leave-child"):
        info["grandchild_pid"] = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(600)"]).pid
    pids = os.path.join(out, f"pids-{rank}.json")
    with open(pids + ".tmp", "w") as f:  # whole or not at all: the tests poll for it
        json.dump(info, f)
    os.replace(pids + ".tmp", pids)
    print(f"index={task['index']} rank={rank} world={os.environ['KMK_LAUNCH_WORLD_SIZE']}")
    print(f"to stderr {rank}", file=sys.stderr)
    if mode == "fail" and rank == 1:
        deadline = time.monotonic() + HANG_S  # fails once worker 0 has recorded its pids
        while not os.path.exists(os.path.join(out, "pids-0.json")) and time.monotonic() < deadline:
            time.sleep(0.01)
        print("boom: something broke", file=sys.stderr)
        sys.exit(3)
    if mode in ("fail", "hang"):
        time.sleep(HANG_S)
        with open(os.path.join(out, f"finished-{rank}"), "w") as f:
            f.write("not stopped")
    """
).replace("HANG_S", str(HANG_S))


def _finished(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob("finished-*"))


@pytest.fixture()
def script(tmp_path):
    path = tmp_path / "job.py"
    path.write_text(SCRIPT)
    return path


def test_launch_argument_splitting():
    split = _split_argv
    assert split(["-n", "2", "train.py", "--epochs", "3"]) == (
        ["-n", "2"],
        ["train.py", "--epochs", "3"],
    )
    assert split(["-n", "2", "--grace", "1", "--", "train.py", "--", "-n"]) == (
        ["-n", "2", "--grace", "1"],
        ["train.py", "--", "-n"],
    )
    assert split(["--nproc=2", "-m", "pkg.train", "-n", "5"]) == (
        ["--nproc=2", "-m"],
        ["pkg.train", "-n", "5"],
    )


def test_launch_usage_errors(capsys, script):
    assert launch.main([]) == 2
    assert launch.main(["-n", "2"]) == 2
    assert launch.main(["-n", "0", str(script)]) == 2
    assert launch.main(["-n", "2", "--grace", "-1", str(script)]) == 2
    assert launch.main(["-n", "2", "no_such_script.py"]) == 2
    err = capsys.readouterr().err
    assert "no such script: 'no_such_script.py'" in err and "-n must be a positive" in err


# -- launch: a command instead of a script (`launch -n 2 -- python3 train.py`, as mpirun) ---

TASK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    out = sys.argv[1]
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    with open(os.path.join(out, f"task-{task['index']}.json"), "w") as f:
        json.dump({"index": task["index"], "argv": sys.argv[1:], "executable": sys.executable,
                   "via": os.environ.get("KMK_TEST_PYTHON_VIA")}, f)
    print(f"task {task['index']} ran")
    """
)


def _tasks(out: Path, n: int = 2) -> list[dict]:
    return [json.loads((out / f"task-{i}.json").read_text()) for i in range(n)]


@pytest.fixture()
def python3_on_path(tmp_path, monkeypatch) -> Path:
    """A `python3` on PATH that is this interpreter, reached only through PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python_on_path(bin_dir / "python3")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    return bin_dir / "python3"


def test_launch_runs_a_command_like_mpirun(capsys, tmp_path, python3_on_path):
    """`keras-mirror-kit launch -n 2 -- python3 train.py --epochs 3` runs the command."""
    from keras_mirror_kit import cli

    train = tmp_path / "train.py"
    train.write_text(TASK_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    code = cli.main(["launch", "-n", "2", "--", "python3", str(train), str(out), "--epochs", "3"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    for index, task in enumerate(_tasks(out)):
        assert task["index"] == index
        assert task["argv"] == [str(out), "--epochs", "3"]
        assert task["via"] == str(python3_on_path)  # the command, run as given
    assert "[worker 0] task 0 ran" in captured.out and "[worker 1] task 1 ran" in captured.out
    assert f"python3 {train} {out} --epochs 3" in captured.err  # the launcher's start line


def test_launch_runs_an_executable_file(capsys, tmp_path, monkeypatch):
    run_sh = tmp_path / "run.sh"
    run_sh.write_text('#!/bin/sh\nprintf "%s" "$TF_CONFIG" > "$1/tf-$KMK_LAUNCH_RANK.json"\n')
    run_sh.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    assert launch.main(["-n", "2", "--", "./run.sh", str(tmp_path)]) == 0
    for rank in range(2):
        config = parse_tf_config((tmp_path / f"tf-{rank}.json").read_text())
        assert config is not None and config.num_workers == 2 and config.task_index == rank


def test_launch_runs_python_files_on_its_own_interpreter(tmp_path, monkeypatch):
    """A Python file with no .py suffix (plain, or executable with a python `#!`) is a
    script, run on the launcher's interpreter like `train.py`."""
    monkeypatch.chdir(tmp_path)
    Path("plain").write_text(TASK_SCRIPT)
    Path("tool").write_text("#!/no/such/python3\n" + TASK_SCRIPT)
    Path("tool").chmod(0o755)
    for name in ("plain", "tool"):
        out = tmp_path / f"out-{name}"
        out.mkdir()
        assert launch.main(["-n", "2", name, str(out)]) == 0
        assert [t["executable"] for t in _tasks(out)] == [sys.executable] * 2


def test_how_the_first_word_is_run(tmp_path, monkeypatch, python3_on_path):
    monkeypatch.chdir(tmp_path)
    Path("train.py").write_text("print(1)\n")
    Path("train").write_text("print(1)\n")
    Path("run.sh").write_text("#!/bin/sh\necho 1\n")
    Path("run.sh").chmod(0o755)
    Path("pkg").mkdir()
    Path("pkg", "__main__.py").write_text("print(1)\n")
    py = [sys.executable, "-u"]
    assert launch.resolve_target("train.py") == ("script", [*py, "train.py"])
    assert launch.resolve_target("train") == ("script", [*py, "train"])
    assert launch.resolve_target("pkg") == ("script", [*py, "pkg"])
    assert launch.resolve_target("pkg.train", module=True) == ("module", [*py, "-m", "pkg.train"])
    assert launch.resolve_target("run.sh") == ("command", [os.path.join(".", "run.sh")])
    assert launch.resolve_target("./run.sh") == ("command", ["./run.sh"])
    assert launch.resolve_target("python3") == ("command", ["python3"])
    assert launch.resolve_target(sys.executable) == ("command", [sys.executable])


@pytest.mark.parametrize(
    ("make", "target", "expected"),
    [
        ("text", "notes.txt", "'notes.txt' is neither a Python script nor an executable file"),
        ("shell", "run.sh", "Make it executable (`chmod +x run.sh`)"),
        (None, "no-such-program-kmk", "no such file here and no program of that name on PATH"),
        (None, "./no-such-program-kmk", "no such file."),
        (None, "missing.py", "no such script: 'missing.py'"),
        ("dir", "empty_dir", "is a directory without a __main__.py"),
    ],
)
def test_a_first_word_that_cannot_run_is_refused_before_any_worker(
    capsys, tmp_path, monkeypatch, make, target, expected
):
    monkeypatch.chdir(tmp_path)
    if make == "text":
        Path(target).write_text("epochs = 3 ; this is not (python\n")
    elif make == "shell":
        Path(target).write_text("#!/bin/sh\necho hi\n")  # not executable
    elif make == "dir":
        Path(target).mkdir()
    with pytest.raises(launch.LaunchError, match="Received: ") as info:
        launch.resolve_target(target)
    assert expected in str(info.value)
    assert launch.main(["-n", "2", "--", target, "--epochs", "3"]) == launch.EXIT_USAGE
    err = capsys.readouterr().err
    assert "keras-mirror-kit launch: error: " in err and expected in err
    assert f"Received: {target}" in err
    assert "starting" not in err  # refused before any worker started


def test_launch_help_shows_the_script_and_the_command_forms(capsys, monkeypatch):
    from keras_mirror_kit import cli

    monkeypatch.setenv("COLUMNS", "250")  # no line wrapping inside the phrases below
    assert launch.main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "[--] script.py [args ...]" in text and "[--] command [args ...]" in text
    assert "-n 2 -- python3 train.py" in text and "-n 2 train.py" in text
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = capsys.readouterr().out
    assert "(launch -n 2 train.py)" in text and "(launch -n 2 -- python3 train.py)" in text


def test_free_ports_and_tf_config():
    ports = launch.free_ports(3)
    assert len(set(ports)) == 3
    for index in range(3):
        config = parse_tf_config(launch.tf_config_for(ports, index))
        assert config is not None and config.num_workers == 3 and config.task_index == index
        assert config.address == f"127.0.0.1:{ports[index]}"
    with pytest.raises(ValueError):
        launch.tf_config_for(ports, 3)


def test_launch_relays_prefixed_output(capsys, script, tmp_path):
    assert launch.main(["-n", "2", str(script), str(tmp_path), "ok"]) == 0
    captured = capsys.readouterr()
    assert "[worker 0] index=0 rank=0 world=2" in captured.out
    assert "[worker 1] index=1 rank=1 world=2" in captured.out
    assert "[worker 0] to stderr 0" in captured.err and "[worker 1] to stderr 1" in captured.err


def test_launch_stops_everyone_when_a_worker_fails(capsys, script, tmp_path):
    code = launch.main(["-n", "2", "--grace", "1", str(script), str(tmp_path), "fail"])
    err = capsys.readouterr().err
    assert code == 3
    assert _finished(tmp_path) == []  # worker 0 was stopped, not waited for
    assert "exited with status 3; stopped worker 0" in err
    assert "worker 1 (pid" in err and "exited with status 3" in err
    assert "boom: something broke" in err and "FAILED: worker 1" in err
    pids = _recorded_pids(tmp_path)
    assert len(pids) == 4  # two workers and the grandchild each started
    assert_none_left(pids)


def test_launch_one_worker(capsys, script, tmp_path):
    assert launch.main(["-n", "1", str(script), str(tmp_path), "ok"]) == 0
    assert "[worker 0] index=0 rank=0 world=1" in capsys.readouterr().out


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_launch_forwards_ctrl_c(script, tmp_path, inherited):
    # The launcher as a program (python -m: the standard library and the import-free
    # keras_mirror_kit packages, no TensorFlow). "ignored": a shell starts background
    # jobs with SIGINT ignored; a SIGINT sent to the launcher still counts.
    proc = subprocess.Popen(
        [sys.executable, "-m", "keras_mirror_kit.multi_worker.launch", "-n", "2", "--grace",
         "1", str(script), str(tmp_path), "hang"],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_ignore_sigint if inherited == "ignored" else None,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240  # bounds a stuck start; the test waits for progress
        while len(list(tmp_path.glob("pids-*.json"))) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "workers never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
        pids = _recorded_pids(tmp_path)
        left = [pid for pid in pids if alive(pid)]
        kill(left)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "received SIGINT; stopping workers" in err
    assert len(pids) == 2 and not left and _finished(tmp_path) == []


def test_launch_kills_what_workers_leave_behind(capsys, script, tmp_path):
    assert launch.main(["-n", "2", "--grace", "1", str(script), str(tmp_path), "leave-child"]) == 0
    pids = _recorded_pids(tmp_path)
    assert len(pids) == 4
    assert_none_left(pids)


@pytest.mark.slow
def test_launch_startup_and_overall_timeouts(capsys, script, tmp_path):
    code = launch.main(
        ["-n", "2", "--startup-timeout", "1", "--grace", "1", str(script), str(tmp_path), "hang"]
    )
    assert code == launch.EXIT_TIMEOUT and _finished(tmp_path) == []
    err = capsys.readouterr().err
    assert "worker 0, worker 1 did not join the cluster within --startup-timeout 1 s" in err
    assert_none_left(_recorded_pids(tmp_path))

    code = launch.main(
        [
            "-n",
            "2",
            "--startup-timeout",
            "0",
            "--timeout",
            "1",
            "--grace",
            "1",
            str(script),
            str(tmp_path),
            "hang",
        ]
    )
    assert code == launch.EXIT_TIMEOUT and _finished(tmp_path) == []
    assert "--timeout 1 s reached; stopped worker 0, worker 1" in capsys.readouterr().err
    assert_none_left(_recorded_pids(tmp_path))


# -- real multi-worker training: 2 workers on 127.0.0.1 --------------------------------------
#
# reference: 1 process, 2 simulated replicas, 2 epochs       (global batch 64, 8 steps/epoch)
# first:     2 workers, epoch 0, checkpoints every 3 steps     -> equal to reference epoch 0
#            (launched, --network auto: where their servers listen; W&B, throughput)
# killed:    2 workers resume at epoch 1 (checkpoint after its step 3); worker 1 is
#            SIGKILLed after epoch 1 batch 4                   -> launch fails fast, names it
#            (launched, --network host: the launcher's one warning)
# resumed:   2 workers resume from epoch 1 step 3, run 5 steps -> equal to reference epoch 1
#            (forked from the zygote with TF_CONFIG, no launcher: the check is on training)
#
# Launched workers are new interpreters (the launcher starts them: its process tree,
# signals and namespaces are checked); clusters whose checks are on training or on the
# kit's errors (`_run_cluster`) are forked from the tests' zygote.


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    _ok(_one_process_two_replicas(out, "--epochs", "2", "--ckpt", str(out / "ckpt"),
                                  "--save-freq", "3"))  # fmt: skip
    return out


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("mw_ckpt") / "ckpt"


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, ckpt_dir):
    out = tmp_path_factory.mktemp("first")
    proc = _launch(
        out,
        "--epochs",
        "1",
        "--ckpt",
        str(ckpt_dir),
        "--save-freq",
        "3",
        "--observe",
        str(out / "observe"),
        observe=True,  # where the workers' servers listen, in the default --network auto
    )
    _ok(proc)
    (out / "launcher.err").write_text(proc.stderr)
    return out, sorted(p.name for p in ckpt_dir.iterdir())


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory, ckpt_dir, first_run):
    out = tmp_path_factory.mktemp("killed")
    proc = _launch(
        out,
        "--epochs", "2", "--ckpt", str(ckpt_dir), "--save-freq", "3",
        "--die-rank", "1", "--die-epoch", "1", "--die-at-batch", "4", "--spawn-grandchild",
        launcher_args=("--grace", "3", "--network", "host"),  # the other launches: auto
        timeout=300,
    )  # fmt: skip
    finished_at = time.time()  # compared with the time worker 1 wrote before its SIGKILL
    manifest = json.loads((ckpt_dir / "manifest.json").read_text())
    return out, proc, finished_at, manifest


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory, ckpt_dir, killed_run):
    """The resume, by 2 workers started without the launcher (what it checks is training)."""
    out = tmp_path_factory.mktemp("resumed")
    _run_cluster(out, tf_configs(), "--epochs", "2", "--ckpt", str(ckpt_dir),
                 "--save-freq", "3")  # fmt: skip
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_workers_train_like_one_process_with_two_replicas(reference, first_run):
    out, _ = first_run
    results = _results(out)
    for rank, result in enumerate(results):
        # tf.distribute.MultiWorkerMirroredStrategy's class is CollectiveAllReduceStrategy.
        assert result["strategy"] in ("CollectiveAllReduceStrategy", "MultiWorkerMirroredStrategy")
        assert result["num_replicas"] == 2 and result["num_workers"] == 2
        assert result["global_batch_size"] == 64
        assert result["cross_device_ops"] == "collective-ring"
        assert result["is_chief"] is (rank == 0)
        assert result["iterations"] == 8 and result["epochs_run"] == [0]
    ref = json.loads((reference / "result-0.json").read_text())
    assert ref["strategy"] == "MirroredStrategy" and ref["num_replicas"] == 2
    # Both workers start from the chief's initial weights, which are the reference's.
    assert _max_diff(_weights(out, 0, "init_"), _weights(reference, 0, "init_")) == 0.0
    w0, w1 = _weights(out, 0, "e0_"), _weights(out, 1, "e0_")
    assert _max_diff(w0, w1) == 0.0, "the workers' weights differ"
    ref_w = _weights(reference, 0, "e0_")
    diff = _max_diff(w0, ref_w)
    moved = _max_diff(ref_w, _weights(reference, 0, "init_"))
    print(
        f"2 workers vs 1 process x 2 replicas: max |dw| = {diff:.3g} (training moved {moved:.3g})"
    )
    assert moved > 1e-3
    assert diff <= TOLERANCE
    # Every worker logs the global loss (all-reduced), equal to the single-process one.
    assert results[0]["losses"] == results[1]["losses"]
    np.testing.assert_allclose(results[0]["losses"], ref["losses"][:8], atol=TOLERANCE)

    def metrics(result):  # the training metrics; throughput is timing, per worker clock
        return [
            {k: v for k, v in logs.items() if k in ("loss", "accuracy")}
            for logs in result["epoch_logs"]
        ]

    assert metrics(results[0]) == metrics(results[1])
    assert metrics(results[0])[0]["loss"] > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_checkpoints_are_written_once_by_the_chief(first_run):
    out, files = first_run
    chief, worker = _results(out)
    # Saves after steps 3 and 6 (save_freq=3) and at the end of the epoch: 3 files, once.
    assert files == ["ckpt-00000001.npz", "ckpt-00000002.npz", "ckpt-00000003.npz",
                     "manifest.json"]  # fmt: skip
    assert worker["ckpt_events"] == [], "the non-chief touched the checkpoint directory"
    renamed = [
        Path(e[2]).name for e in chief["ckpt_events"] if e[0] in ("os.rename", "os.replace")
    ]
    assert sorted(n for n in renamed if n.startswith("ckpt-")) == files[:3]
    assert renamed.count("manifest.json") == 3


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_workers_servers_listen_only_in_their_own_namespace(first_run):
    """Issue 27: under `launch` (default `--network auto`), the TensorFlow server of each
    worker listens on its port in the workers' network namespace, and the host's has
    neither port; nobody warns (the launcher isolated them, so the chief does not warn)."""
    probe = modes.PROBES["isolated"]
    if not probe.available:
        pytest.skip(f"this host cannot isolate the launcher's workers: {probe.detail}")
    out, _ = first_run
    observed = json.loads((out / "observed.json").read_text())
    workers = observed["workers"]
    for worker in workers:
        assert worker["port"] in worker["listening"], worker  # the server listens in there
        assert worker["netns"] != observed["host_netns"]
    assert workers[0]["netns"] == workers[1]["netns"]
    ports = {worker["port"] for worker in workers}
    assert not ports & set(observed["host_listening"]), "a worker port in the host's namespace"
    err = (out / "launcher.err").read_text()
    assert "in a network namespace of their own (loopback only)" in err
    assert modes.EXPOSED not in err


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_worker_stops_the_launch_quickly(killed_run):
    out, proc, finished_at, manifest = killed_run
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr[-4000:]
    assert "worker 1 (pid" in proc.stderr and "was killed by SIGKILL" in proc.stderr
    assert "FAILED: worker 1 was killed by SIGKILL" in proc.stderr
    assert "was killed by SIGKILL; stopped worker 0" in proc.stderr
    # From the kill to the launcher's exit is --grace (3 s) plus polling; a generous
    # bound, measured from worker 1's own record of when it was killed (not from the
    # start, which includes TensorFlow's start-up: slow on a loaded machine).
    killed_at = float((out / "killed-1").read_text())
    assert finished_at - killed_at < 60, f"launch exited {finished_at - killed_at:.1f} s later"
    pids = _recorded_pids(out)
    assert len(pids) == 4  # 2 workers, each with a grandchild
    assert_none_left(pids)
    assert not (out / "result-0.json").exists() and not (out / "result-1.json").exists()
    latest = manifest["checkpoints"][-1]
    assert (latest["epoch"], latest["step"], latest["global_step"]) == (1, 3, 11)
    # On this host's network: one warning, the launcher's (the chief, whose strategy
    # existed, does not add its own). The steps it trained (to global step 11) are in
    # the weights the resumed run ends on (test_a_resumed_multi_worker_run_...).
    assert proc.stderr.count(modes.EXPOSED) == 1, proc.stderr[-6000:]
    assert "keras-mirror-kit launch: WARNING: --network host: " in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_worker_that_leaves_training_early_is_named(tmp_path):
    """Worker 1 exits with status 0 in the middle of epoch 0 (as if its data ran out).
    TensorFlow's heartbeat then fails worker 0 (or, if it does not within --finish-window,
    the launcher stops it): either way the launcher names worker 1, not worker 0."""
    proc = _launch(
        tmp_path, "--tiny", "--epochs", "2",
        "--die-rank", "1", "--die-epoch", "0", "--die-at-batch", "2", "--die-exit-0",
        launcher_args=("--grace", "3", "--finish-window", "60"),
    )  # fmt: skip
    assert proc.returncode != 0, proc.stderr[-4000:]
    assert (tmp_path / "killed-1").exists()  # it left at the planned step
    assert "worker 1 (pid" in proc.stderr
    assert (
        "FAILED: worker 1 left early (it exited with status 0 while worker 0 still ran)"
        in proc.stderr
    ), proc.stderr[-4000:]
    assert "stopped worker 1" not in proc.stderr and "FAILED: worker 0" not in proc.stderr
    assert not (tmp_path / "result-0.json").exists()  # worker 0 never finished training
    assert_none_left(_recorded_pids(tmp_path))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_resumed_multi_worker_run_continues_from_the_checkpoint(reference, resumed_run):
    results = _results(resumed_run)
    for result in results:
        assert result["restored_from"] == {"epoch": 1, "step": 3, "global_step": 11}
        assert result["epochs_run"] == [1] and len(result["losses"]) == 5
        assert result["iterations"] == 16
    assert results[1]["ckpt_events"] == []
    assert results[0]["ckpt_events"], "the chief wrote no checkpoint"
    w0, w1 = _weights(resumed_run, 0, "e1_"), _weights(resumed_run, 1, "e1_")
    assert _max_diff(w0, w1) == 0.0
    diff = _max_diff(w0, _weights(reference, 0, "e1_"))
    print(f"resumed 2 workers vs uninterrupted 1 process: max |dw| = {diff:.3g}")
    assert diff <= TOLERANCE
    # (Logged losses are running means since the epoch's first trained batch, so they
    # differ from the uninterrupted run's; both workers log the same ones.)
    assert results[0]["losses"] == results[1]["losses"]


def _run_cluster(
    out: Path,
    tf_configs: list[str],
    *child_args: str,
    timeout: float = 420,
    check: bool = True,
) -> list[subprocess.CompletedProcess[str]]:
    """Runs one tests.mw_child per TF_CONFIG, without the launcher, to their ends
    (`tests.processes.run_cluster`: forked, so they skip TensorFlow's import). `check`:
    every worker must exit with status 0."""
    done = run_cluster(
        [sys.executable, "-m", CHILD, str(out), *child_args],
        [worker_env(TF_CONFIG=config) for config in tf_configs],
        cwd=REPO,
        timeout=timeout,
    )
    if check:
        for proc in done:
            assert proc.returncode == 0, (
                f"rc={proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
            )
    return done


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_chief_job_shape_and_keras_still_needs_the_workaround(tmp_path):
    """With a `chief` job, worker 0 is not the chief. Keras unpatched still fails."""
    chief_port, worker_port = launch.free_ports(2)
    spec = {"chief": [f"127.0.0.1:{chief_port}"], "worker": [f"127.0.0.1:{worker_port}"]}
    configs = [
        _cfg(spec, {"type": "chief", "index": 0}),
        _cfg(spec, {"type": "worker", "index": 0}),
    ]
    outputs = _run_cluster(tmp_path, configs, "--probe-upstream")
    # A cluster started without the launcher: its chief says, once, what listens where.
    warned = [proc.stderr.count(f"{modes.EXPOSED} of its host") for proc in outputs]
    assert warned == [1, 0], [proc.stderr[-3000:] for proc in outputs]
    addresses = f"127.0.0.1:{chief_port}, 127.0.0.1:{worker_port}), without auth"
    assert addresses in outputs[0].stderr
    chief, worker = _results(tmp_path)
    assert chief["is_chief"] is True and worker["is_chief"] is False
    assert chief["num_workers"] == worker["num_workers"] == 2
    assert chief["num_replicas"] == 2
    for result in (chief, worker):
        assert result["upstream_error"] is not None, (
            f"Keras {keras.__version__} trained under MultiWorkerMirroredStrategy without "
            "the kit's workaround: the upstream fix (keras-team/keras#20585) has landed. "
            "Check keras_multi_worker_fit.status() and narrow TESTED_KERAS."
        )
        # The kit's models build from their first local part (keras_uneven_first_batch),
        # so unpatched Keras fails at failure 2 of keras_multi_worker_fit: the per-step
        # logs reduced with axis=0 on scalars.
        assert result["upstream_error"].startswith(
            "ValueError: Invalid reduction dimension 0 for input with 0 dimensions"
        ), result["upstream_error"]
        assert result["reapplied"] is True
    assert chief["losses"] == worker["losses"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_peer_that_never_starts_is_bounded_by_the_startup_timeout(tmp_path):
    # Worker 1 sleeps 300 s before importing anything; without the startup timeout the
    # launch would outlast the (generous) 240 s bound below, or worker 1 would wake up.
    proc = _launch(
        tmp_path, "--delay-rank", "1", "--delay", "300",
        launcher_args=("--startup-timeout", "8", "--grace", "2"),
        timeout=240,
    )  # fmt: skip
    assert proc.returncode == launch.EXIT_TIMEOUT, proc.stderr[-3000:]
    assert "did not join the cluster within --startup-timeout 8 s" in proc.stderr
    assert not (tmp_path / "awake-1").exists()  # stopped while still asleep
    pids = _recorded_pids(tmp_path)
    assert len(pids) == 2
    assert_none_left(pids)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_multi_worker_strategy_without_a_cluster_is_one_worker():
    proc = run_python(
        """
        import json
        import keras_mirror_kit as kmk
        from keras_mirror_kit.workarounds import keras_multi_worker_fit
        dist = kmk.distributed(global_batch_size=8, strategy="multi_worker").distribution
        print("RESULT " + json.dumps([dist.num_workers, dist.num_replicas, dist.is_chief,
                                      dist.cross_device_ops, keras_multi_worker_fit.is_applied()]))
        """,
        timeout=120,
    )
    assert last_json(proc) == [1, 1, True, "collective-ring", False]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_workers_that_do_not_share_the_checkpoint_directory_fail_clearly(
    tmp_path, ckpt_dir, first_run
):
    """Worker 0 sees a checkpoint, worker 1 an empty directory: resuming would desync the
    workers (or hang a collective), so both stop with a clear error before any step.

    Without the launcher (which would stop the second worker once the first failed): each
    worker stops by itself."""
    import shutil

    shutil.copytree(ckpt_dir, tmp_path / "ckpt-0")
    (tmp_path / "ckpt-1").mkdir()
    out = tmp_path / "out"
    out.mkdir()
    procs = _run_cluster(
        out, tf_configs(), "--epochs", "2", "--ckpt", str(tmp_path / "ckpt-{rank}"),
        check=False,
    )  # fmt: skip
    for proc in procs:
        assert proc.returncode != 0, proc.stderr[-4000:]
        text = proc.stdout + proc.stderr
        assert "would resume from different checkpoints" in text, text[-4000:]
        assert "on a filesystem shared by all workers" in text
    assert not (out / "result-0.json").exists() and not (out / "result-1.json").exists()


@pytest.mark.slow
def test_throughput_and_wandb_in_a_real_two_worker_run(first_run):
    """Per-worker figures on every worker; a W&B run (offline) on the chief only."""
    out, _ = first_run
    results = _results(out)
    for result in results:
        logs = result["epoch_logs"][-1]
        assert logs["samples_per_sec"] > 0
        assert logs["samples_per_sec_per_worker"] == pytest.approx(logs["samples_per_sec"] / 2)
        assert logs["samples_per_sec_per_replica"] == pytest.approx(
            logs["samples_per_sec"] / 2
        )  # 2 replicas in all, one per worker
    chief_runs = list((out / "observe" / "runs-0").rglob("run-*.wandb"))
    assert len(chief_runs) == 1
    assert not list((out / "observe" / "runs-1").rglob("*.wandb"))  # the worker logs nothing
    assert not (out / "observe" / "runs-1" / "wandb").exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_workers_accumulate_gradients_like_one_process_with_two_replicas(tmp_path):
    """Issue 15 item 5: `gradient_accumulation_steps=2` on 2 real workers (one replica
    each, started without the launcher) ends on the weights of 1 process with 2 replicas,
    same data order, and updates the weights once every 2 micro-batches."""
    out, ref = tmp_path / "workers", tmp_path / "reference"
    child_args = ("--tiny", "--accumulate", "2")  # 8 micro-batches of 64: 4 updates
    _run_cluster(out, tf_configs(), *child_args)
    _ok(_one_process_two_replicas(ref, *child_args))
    expected = json.loads((ref / "result-0.json").read_text())
    assert expected["num_replicas"] == 2 and expected["strategy"] == "MirroredStrategy"
    for result in [*_results(out), expected]:
        assert result["num_replicas"] == 2
        assert (result["micro_steps"], result["iterations"]) == (8, 4)
        assert result["weight_updates"] == 4, result  # only every 2nd micro-batch updates
    assert _results(out)[0]["num_workers"] == 2
    ref_w = _weights(ref, 0, "e0_")
    moved = _max_diff(ref_w, _weights(ref, 0, "init_"))
    assert moved > 1e-3  # the training moved the weights
    w0, w1 = _weights(out, 0, "e0_"), _weights(out, 1, "e0_")
    assert _max_diff(w0, w1) == 0.0, "the workers' weights differ"
    assert _max_diff(w0, ref_w) <= TOLERANCE
