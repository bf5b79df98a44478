"""Slurm: `distributed()` under `srun` with several tasks, and the documented job script.

Unit tests read Slurm's variables (monkeypatched environment; TensorFlow's own
`SlurmClusterResolver`, not a copy): when a process counts as a Slurm task, the cluster and
GPUs each task gets, the ports. The end-to-end test runs the `sbatch` script of
docs/multi_worker.md with stand-in `srun` (2 tasks on 127.0.0.1 with the variables a real
srun sets) and `scontrol` (records its arguments) on PATH: a task gets Slurm's warning
signal (SIGUSR1) during training, both tasks save at the same step and exit with status 75,
the script requeues the job, and the requeued run resumes there and trains to the end.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import tensorflow as tf

from keras_mirror_kit.checkpoint.preemption import PREEMPTED_EXIT_CODE
from keras_mirror_kit.multi_worker import cluster
from tests.processes import assert_none_left
from tests.subproc import REPO, python_on_path

STEP = {
    "SLURM_PROCID": "3",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_NODELIST": "node[1-2]",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_JOB_ID": "1234",
}


@pytest.fixture()
def slurm_step(monkeypatch):
    for name in ("TF_CONFIG", "CUDA_VISIBLE_DEVICES", cluster.SLURM_PORT_BASE_ENV,
                 "SLURM_STEP_RESV_PORTS"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    for name, value in STEP.items():
        monkeypatch.setenv(name, value)
    return monkeypatch


def test_a_process_is_a_slurm_task_only_inside_a_job_step():
    assert cluster.slurm_num_tasks({}) == 0
    assert cluster.slurm_num_tasks(STEP) == 4
    batch_script = {"SLURM_JOB_ID": "1234", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"}
    assert cluster.slurm_num_tasks(batch_script) == 0  # sbatch's shell, not srun
    assert cluster.slurm_num_tasks({**STEP, "SLURM_STEP_NUM_TASKS": "x"}) == 0


def test_under_srun_tf_config_wins_and_else_slurm_counts(slurm_step):
    assert cluster.tf_config_num_workers() == 4
    config = {"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 0}}
    slurm_step.setenv("TF_CONFIG", json.dumps(config))
    assert cluster.tf_config_num_workers() == 2


def test_each_task_keeps_the_gpus_slurm_gave_it(slurm_step):
    slurm_step.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # as Slurm sets it for the task
    resolver = cluster.slurm_cluster_resolver()
    assert isinstance(resolver, tf.distribute.cluster_resolver.SlurmClusterResolver)
    assert resolver.cluster_spec().as_dict() == {
        "worker": ["node1:29872", "node1:29873", "node2:29872", "node2:29873"]
    }  # 20000 + 8 x 1234
    assert (resolver.task_type, resolver.task_id) == ("worker", 3)
    assert resolver.num_accelerators() == {"GPU": 2}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"  # left as Slurm set it
    # TensorFlow's resolver alone would give the task one of its two GPUs (2 // 2 tasks
    # per node), and fails for tasks without a GPU (below).
    plain = tf.distribute.cluster_resolver.SlurmClusterResolver(auto_set_gpu=False)
    assert plain.num_accelerators() == {"GPU": 1}


def test_tasks_without_a_gpu(slurm_step):
    slurm_step.setenv("CUDA_VISIBLE_DEVICES", "-1")
    resolver = cluster.slurm_cluster_resolver()
    assert resolver.num_accelerators() == {"GPU": 0}
    assert len(resolver.cluster_spec().as_dict()["worker"]) == 4
    with pytest.raises(ValueError, match="must not be zero"):  # TensorFlow's, unpatched
        tf.distribute.cluster_resolver.SlurmClusterResolver(
            gpus_per_node=0, gpus_per_task=0, auto_set_gpu=False
        ).cluster_spec()


def test_the_node_gpus_are_split_when_slurm_set_none(slurm_step, tmp_path):
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\nfor i in 0 1 2 3; do echo "GPU $i: Fake (UUID: GPU-$i)"; done\n')
    fake.chmod(0o755)
    slurm_step.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    resolver = cluster.slurm_cluster_resolver()
    resolver.cluster_spec()
    assert resolver.num_accelerators() == {"GPU": 2}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"  # task 3 = the 2nd task of node2


def test_ports_and_errors(slurm_step):
    slurm_step.setenv("SLURM_STEP_RESV_PORTS", "12000-12003")
    assert cluster.slurm_cluster_resolver().cluster_spec().as_dict()["worker"][0] == (
        "node1:12000"
    )
    slurm_step.setenv(cluster.SLURM_PORT_BASE_ENV, "31000")
    assert cluster.slurm_cluster_resolver().cluster_spec().as_dict()["worker"][1] == (
        "node1:31001"
    )
    slurm_step.setenv(cluster.SLURM_PORT_BASE_ENV, "port")
    with pytest.raises(ValueError, match="KMK_SLURM_PORT_BASE must be a port number"):
        cluster.slurm_cluster_resolver()
    slurm_step.delenv("SLURM_STEP_NODELIST")
    with pytest.raises(ValueError, match="not a task of a Slurm job step .*SLURM_STEP_NODELIST"):
        cluster.slurm_cluster_resolver()


# -- the documented job script, on 127.0.0.1 ---------------------------------------------------

SRUN = """
import os, signal, subprocess, sys, time
n = int(os.environ["SLURM_NTASKS"])
tasks = []
for i in range(n):  # the variables a real srun sets for each task of the step
    env = dict(os.environ, SLURM_PROCID=str(i), SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS=str(n),
               SLURM_STEP_NODELIST=os.environ["SLURM_JOB_NODELIST"],
               SLURM_STEP_TASKS_PER_NODE=str(n))
    tasks.append(subprocess.Popen(sys.argv[1:], env=env))
when = os.environ.get("FAKE_SLURM_SIGNAL_WHEN")
if when:  # Slurm's --signal: SIGUSR1 to a task (here once it reached a step)
    while not os.path.exists(when) and all(t.poll() is None for t in tasks):
        time.sleep(0.02)
    task = tasks[int(os.environ["FAKE_SLURM_SIGNAL_TASK"])]
    if task.poll() is None:
        task.send_signal(signal.SIGUSR1)
    open(os.environ["FAKE_SLURM_SIGNAL_SENT"], "w").close()
codes = [t.wait() for t in tasks]
sys.exit(max(c if c >= 0 else 128 - c for c in codes))  # srun: the highest status
"""

SCONTROL = """
import os, sys
with open(os.environ["FAKE_SCONTROL_LOG"], "a") as log:
    log.write(" ".join(sys.argv[1:]) + "\\n")
"""

TRAIN = """
import os, runpy, sys
out = os.environ["TRAIN_OUT"]
sys.argv = ["train.py", out, "--tiny", "--epochs", "2", "--ckpt", os.environ["TRAIN_CKPT"],
            "--save-freq", "2", "--mark-step", "3",
            "--hold-last-step", os.environ["FAKE_SLURM_SIGNAL_SENT"],
            "--preemption-signals", "SIGTERM,SIGUSR1"]
runpy.run_module("tests.mw_child", run_name="__main__")
"""


def _job_script() -> str:
    text = (REPO / "docs" / "multi_worker.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    scripts = [b for b in blocks if "#SBATCH --requeue" in b]
    assert len(scripts) == 1, "docs/multi_worker.md must hold one sbatch script with --requeue"
    return scripts[0]


def _free_port_pair() -> int:
    for _ in range(100):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            base = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", base + 1))
                except OSError:
                    continue
                return base
    raise AssertionError("no two consecutive free ports")


def _stand_in(path: Path, code: str) -> None:
    path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(code))
    path.chmod(0o755)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_documented_sbatch_script_saves_on_slurms_signal_and_requeues(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stand_in(bin_dir / "srun", SRUN)
    _stand_in(bin_dir / "scontrol", SCONTROL)
    python_on_path(bin_dir / "python")
    (tmp_path / "train.py").write_text(TRAIN)
    (tmp_path / "job.sh").write_text(_job_script())
    log, ckpt = tmp_path / "scontrol.log", tmp_path / "ckpt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TF_CONFIG"))}
    env.pop("KMK_SIMULATE_REPLICAS", None)
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env['PATH']}",
        PYTHONPATH=str(REPO),
        TF_CPP_MIN_LOG_LEVEL="2",
        SLURM_JOB_ID="4242",
        SLURM_NTASKS="2",
        SLURM_JOB_NODELIST="127.0.0.1",
        FAKE_SCONTROL_LOG=str(log),
        TRAIN_CKPT=str(ckpt),
    )

    def run(out: Path, signal_task: int | None) -> subprocess.CompletedProcess[str]:
        out.mkdir()
        extra = {"TRAIN_OUT": str(out), "FAKE_SLURM_SIGNAL_SENT": str(out / "sent"),
                 cluster.SLURM_PORT_BASE_ENV: str(_free_port_pair())}  # fmt: skip
        if signal_task is None:
            (out / "sent").write_text("no signal in this run")
        else:
            extra.update(FAKE_SLURM_SIGNAL_WHEN=str(out / f"reached-0-{signal_task}"),
                         FAKE_SLURM_SIGNAL_TASK=str(signal_task))  # fmt: skip
        proc = subprocess.Popen(["bash", "job.sh"], cwd=tmp_path, env={**env, **extra},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)  # fmt: skip
        try:
            stdout, stderr = proc.communicate(timeout=600)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.communicate()
        pids = [json.loads(p.read_text())["pid"] for p in out.glob("pids-*.json")]
        assert len(pids) == 2, f"{len(pids)} task(s) started; job's stderr:\n{stderr[-6000:]}"
        time.sleep(0)  # (the tasks were waited for by the stand-in srun)
        assert_none_left(pids)
        return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)

    first = run(tmp_path / "run1", signal_task=1)
    assert first.returncode == PREEMPTED_EXIT_CODE, first.stderr[-6000:]
    assert log.read_text() == "requeue 4242\n"  # the script requeued the job
    stops = [json.loads((tmp_path / "run1" / f"preempted-0-{r}.json").read_text()) for r in (0, 1)]
    assert stops[0]["saved"] == stops[1]["saved"]
    assert [s["signal"] for s in stops] == ["another worker's signal", "SIGUSR1"]
    saved_step = stops[0]["saved"][2]
    assert 3 <= saved_step < 16 and stops[0]["iterations"] == saved_step

    second = run(tmp_path / "run2", signal_task=None)  # the requeued job
    assert second.returncode == 0, second.stderr[-6000:]
    assert log.read_text() == "requeue 4242\n"  # no second requeue
    results = [json.loads((tmp_path / "run2" / f"result-{r}.json").read_text()) for r in (0, 1)]
    for rank, result in enumerate(results):
        assert result["strategy"] in ("MultiWorkerMirroredStrategy", "CollectiveAllReduceStrategy")
        assert (result["num_workers"], result["num_replicas"]) == (2, 2)
        assert result["is_chief"] is (rank == 0)
        assert result["restored_from"]["global_step"] == saved_step
        assert result["iterations"] == 16
    assert results[0]["losses"] == results[1]["losses"]
