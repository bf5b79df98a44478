"""`keras-mirror-kit launch --max-restarts K`: a failed worker restarts the whole group.

With small standard-library workers (real processes, no TensorFlow): which failures restart
(a non-zero status, a signal, status 75 of a worker that saved on a stop signal), which do
not (a worker that left early with status 0), the attempt shown in the output, `-n 1`, the
last failure named once K restarts are spent, and the peers of a preempted worker left to
exit by themselves. With TensorFlow (`launch -n 2 --max-restarts 3` where a seeded worker
is SIGKILLed at seeded moments in 3 attempts; the 4th attempt ends with the uninterrupted
2-worker weights, 1e-6, and no process is left): tests/test_preemption.py, where these
attempts resume the job its SIGTERM trials stopped. benchmarks/preemption_trials.py runs
10 jobs with one kill each.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from keras_mirror_kit.checkpoint.preemption import PREEMPTED_EXIT_CODE
from keras_mirror_kit.multi_worker import launch
from tests import network_modes as modes
from tests.processes import assert_none_left

REPO = Path(__file__).resolve().parent.parent
# The launcher as a program: the standard library and the import-free keras_mirror_kit packages.
LAUNCHER = [sys.executable, "-m", "keras_mirror_kit.multi_worker.launch"]

# Each worker appends its attempt to attempts-<rank> and records its pid; then acts on the
# mode for that attempt ("ok", "fail", "kill", "preempted", "early", "hang", "slow-75").
JOB = textwrap.dedent(
    """
    import json, os, signal, sys, time
    out, modes = sys.argv[1], sys.argv[2].split(",")
    rank = int(os.environ["KMK_LAUNCH_RANK"])
    attempt = int(os.environ["KMK_LAUNCH_RESTART_COUNT"])
    mode = modes[min(attempt, len(modes) - 1)]
    line = json.dumps({"attempt": attempt, "pid": os.getpid(),
                       "tf_config": os.environ["TF_CONFIG"],
                       "netns": os.readlink("/proc/self/ns/net")}) + "\\n"
    fd = os.open(os.path.join(out, f"attempts-{rank}"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.write(fd, line.encode())  # one write; readers take only lines that end in a newline
    os.close(fd)
    print(f"rank {rank} attempt {attempt} mode {mode}", flush=True)

    def recorded_by_worker_0():
        path = os.path.join(out, "attempts-0")
        lines = open(path).read().split("\\n")[:-1] if os.path.exists(path) else []
        return any(json.loads(line)["attempt"] == attempt for line in lines)

    deadline = time.monotonic() + 120
    while rank == 1 and not recorded_by_worker_0() and time.monotonic() < deadline:
        time.sleep(0.01)  # acts once worker 0 has recorded this attempt too
    if mode == "ok":
        sys.exit(0)
    if rank == 0 and mode != "slow-75":
        time.sleep(120)  # until the launcher stops it
        sys.exit(0)
    if mode == "fail":
        print("something broke", file=sys.stderr, flush=True)
        sys.exit(3)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "preempted":
        sys.exit(75)
    if mode == "early":
        sys.exit(0)
    if mode == "slow-75":  # rank 1 stops first; rank 0 "saves" for a while, then stops
        if rank == 0:
            time.sleep(2)
            with open(os.path.join(out, "saved-0"), "w") as f:
                f.write("exited by itself")
        sys.exit(75)
    time.sleep(120)
    """
)


@pytest.fixture()
def job(tmp_path) -> Path:
    path = tmp_path / "job.py"
    path.write_text(JOB)
    return path


@pytest.fixture()
def out(tmp_path) -> Path:
    path = tmp_path / "out"
    path.mkdir()
    return path


def _attempts(out: Path, rank: int) -> list[dict]:
    """The attempts worker `rank` recorded (whole lines only: one may be being written)."""
    path = out / f"attempts-{rank}"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return [json.loads(line) for line in lines]


def _pids(out: Path) -> list[int]:
    return [a["pid"] for rank in (0, 1) for a in _attempts(out, rank)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", modes.params("isolated", "host", "fallback"))
def test_failures_restart_every_worker_until_one_attempt_succeeds(
    capsys, monkeypatch, job, out, mode
):
    network = modes.apply(mode, monkeypatch)
    code = launch.main(
        ["-n", "2", "--grace", "1", "--finish-window", "2", "--max-restarts", "3", *network,
         str(job), str(out), "fail,kill,preempted,ok"]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0, err
    assert [a["attempt"] for a in _attempts(out, 0)] == [0, 1, 2, 3]
    assert [a["attempt"] for a in _attempts(out, 1)] == [0, 1, 2, 3]
    for n in range(1, 5):
        assert f"launch: attempt {n} of 4: starting 2 worker(s) on 127.0.0.1 ports" in err
    assert (
        "worker 1 exited with status 3; restarting all 2 worker(s) on new ports (restart 1 of "
        "--max-restarts 3)" in err
    )
    assert "worker 1 was killed by SIGKILL; restarting all 2 worker(s)" in err
    assert (
        "worker 1 exited with status 75 (it saved its state on a stop signal); restarting "
        "all 2 worker(s) on new ports (restart 3 of --max-restarts 3)" in err
    )
    assert "FAILED" not in err
    # Every attempt has its own cluster (TF_CONFIG), with ports found again.
    configs = [json.loads(a["tf_config"]) for a in _attempts(out, 0)]
    assert all(len(c["cluster"]["worker"]) == 2 for c in configs)
    # Each attempt in a namespace shared by its workers (a new one: the kernel reuses the
    # inode number of a freed namespace, so numbers may repeat), or in the host's.
    spaces = [a["netns"] for a in _attempts(out, 0)]
    assert spaces == [a["netns"] for a in _attempts(out, 1)]
    if mode == "isolated":
        assert modes.netns() not in spaces
        assert modes.EXPOSED not in err
    else:  # one WARNING for the launch, not one per attempt
        assert set(spaces) == {modes.netns()}
        assert err.count(modes.EXPOSED) == 1 and err.count("WARNING") == 1, err
    assert_none_left(_pids(out))


def test_after_k_restarts_the_last_failure_is_the_exit_status(capsys, job, out):
    code = launch.main(["-n", "2", "--grace", "1", "--max-restarts", "2", str(job), str(out),
                        "fail"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 3
    assert [a["attempt"] for a in _attempts(out, 1)] == [0, 1, 2]
    assert "restart 2 of --max-restarts 2" in err and "restart 3 of" not in err
    assert err.rstrip().endswith(
        "FAILED: worker 1 exited with status 3 (attempt 3: --max-restarts 2 used up)"
    )
    assert "last lines of worker 1's stderr:" in err and "something broke" in err


@pytest.mark.slow
def test_one_worker_is_supervised_too(capsys, job, out):
    code = launch.main(["-n", "1", "--max-restarts", "1", str(job), str(out), "slow-75,ok"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert [a["attempt"] for a in _attempts(out, 0)] == [0, 1]
    assert "attempt 2 of 2: starting 1 worker(s)" in err
    assert f"worker 0 exited with status {PREEMPTED_EXIT_CODE}" in err


@pytest.mark.slow
def test_peers_of_a_preempted_worker_may_finish_their_save(capsys, job, out):
    """Worker 1 exits with status 75 first; worker 0 (the chief, saving) exits 2 s later by
    itself: the launcher does not stop it (--grace 0.2 would have cut its save short)."""
    code = launch.main(["-n", "2", "--grace", "0.2", str(job), str(out), "slow-75"])
    err = capsys.readouterr().err
    assert code == PREEMPTED_EXIT_CODE
    assert (out / "saved-0").exists(), err
    assert "stopped worker 0" not in err


@pytest.mark.slow
def test_a_worker_that_leaves_early_is_not_restarted(capsys, job, out):
    code = launch.main(["-n", "2", "--grace", "1", "--finish-window", "1", "--max-restarts",
                        "3", str(job), str(out), "early"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == launch.EXIT_FAILED
    assert [a["attempt"] for a in _attempts(out, 0)] == [0]
    assert "restarting" not in err and "FAILED: worker 1 left early" in err
    assert_none_left(_pids(out))


@pytest.mark.parametrize("mode", modes.params("isolated", "host"))
def test_a_signal_to_the_launcher_is_not_restarted(job, out, mode):
    launcher = subprocess.Popen(
        [*LAUNCHER, "-n", "2", "--grace", "1", "--max-restarts", "3", *modes.args_for(mode),
         str(job), str(out), "hang"],
        env=modes.env_for(mode, {**os.environ, "PYTHONPATH": str(REPO)}),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120  # a bound for a stuck test, not a measurement
        while len(_pids(out)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.communicate()
    assert launcher.returncode == 128 + signal.SIGTERM, err
    assert "received SIGTERM; stopping workers" in err and "restarting" not in err
    assert [a["attempt"] for a in _attempts(out, 0)] == [0]
    assert_none_left(_pids(out))


def test_max_restarts_must_not_be_negative(capsys, job, out):
    assert launch.main(["-n", "2", "--max-restarts", "-1", str(job), str(out), "ok"]) == 2
    assert "--max-restarts must be >= 0" in capsys.readouterr().err
    assert launch.main(["-n", "2", "--max-restart", "1", str(job), str(out), "ok"]) == 2
    assert "did you mean --max-restarts?" in capsys.readouterr().err
