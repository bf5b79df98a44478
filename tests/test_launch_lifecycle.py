"""`keras-mirror-kit launch`: how workers end, and which GPUs each one gets.

- No worker outlives the launcher: SIGHUP is handled like SIGTERM, and after a SIGKILL of
  the launcher no worker nor anything it started is alive (checked by pid); the watchdog
  alone and the parent-death signal alone (the other one turned off) each kill every worker.
- Without `os.waitid` (macOS before Python 3.13) the launcher still works.
- A worker that exits with status 0 while the others still run is a failure of that
  worker; "stopped" names only the workers the launcher stopped.
- `--grace` holds at a normal end too; options are never abbreviated.
- `CUDA_VISIBLE_DEVICES` per worker (`--gpus-per-worker`), from fake GPU lists: the
  launcher's own `CUDA_VISIBLE_DEVICES`, or an `nvidia-smi` on PATH.

The workers are small standard-library scripts (no TensorFlow), real processes. Tests
follow the workers' progress markers; time bounds only end a stuck test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from keras_mirror_kit.multi_worker import launch
from keras_mirror_kit.multi_worker.launch import group as launch_group
from tests import network_modes as modes
from tests.processes import alive, assert_none_left, kill

REPO = Path(__file__).resolve().parent.parent
# The launcher as a program: the standard library and the import-free keras_mirror_kit packages.
LAUNCHER = [sys.executable, "-m", "keras_mirror_kit.multi_worker.launch"]
HANG_S = 120

# Every worker records its pid (and its helper's) in pids-<rank>.json. A worker that
# "hangs" sleeps HANG_S, then writes finished-<rank>: a launcher that did not stop it lets
# it get there.
JOB = textwrap.dedent(
    """
    import json, os, signal, subprocess, sys, time
    out, mode = sys.argv[1], sys.argv[2]
    rank = int(os.environ["KMK_LAUNCH_RANK"])

    def mark(name, text=""):  # whole or not at all: readers poll for these files
        path = os.path.join(out, name)
        with open(os.path.join(out, f".{name}.tmp"), "w") as f:
            f.write(text)
        os.replace(os.path.join(out, f".{name}.tmp"), path)

    def exited(pid):  # gone, or a zombie its parent has not reaped yet
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except OSError:
            return True

    def wait_for(test):
        deadline = time.monotonic() + HANG_S
        while not test():
            if time.monotonic() > deadline:
                sys.exit(99)
            time.sleep(0.02)

    def parent_death_signal():  # PR_GET_PDEATHSIG (Linux)
        import ctypes
        value = ctypes.c_int(-1)
        ctypes.CDLL(None).prctl(2, ctypes.byref(value), 0, 0, 0)
        return value.value

    info = {"pid": os.getpid(), "pdeathsig": parent_death_signal(),
            "netns": os.readlink("/proc/self/ns/net")}
    if mode in ("hang-helper", "helper-cleans-up", "helper-ignores-term"):
        # The one that ignores SIGTERM holds no pipe of the launcher's: nothing but the
        # launcher's own wait keeps it from returning before the SIGKILL took effect.
        quiet = subprocess.DEVNULL if mode == "helper-ignores-term" else None
        helper = subprocess.Popen(
            [sys.executable, "-c", HELPER, out, str(rank), mode], stdout=quiet, stderr=quiet)
        info["helper_pid"] = helper.pid
        wait_for(lambda: os.path.exists(os.path.join(out, f"helper-ready-{rank}")))
    mark(f"pids-{rank}.json", json.dumps(info))
    print(f"rank {rank} argv {sys.argv[3:]}", flush=True)
    mark(f"env-{rank}.json", json.dumps({k: os.environ.get(k) for k in (
        "CUDA_VISIBLE_DEVICES", "TF_FORCE_GPU_ALLOW_GROWTH")}))
    if mode in ("helper-cleans-up", "helper-ignores-term"):
        if rank == 0:  # a normal end a little after worker 1's
            wait_for(lambda: os.path.exists(os.path.join(out, "pids-1.json")))
            pid1 = json.loads(open(os.path.join(out, "pids-1.json")).read())["pid"]
            wait_for(lambda: exited(pid1))
        sys.exit(0)
    if mode in ("early", "early-then-peer-fails") and rank == 1:
        sys.exit(0)  # leaves while worker 0 still trains
    if mode == "early-then-peer-fails":
        wait_for(lambda: os.path.exists(os.path.join(out, "pids-1.json")))
        pid1 = json.loads(open(os.path.join(out, "pids-1.json")).read())["pid"]
        wait_for(lambda: exited(pid1))
        # Fails once the launcher has seen worker 1's exit (its test writes this marker).
        wait_for(lambda: os.path.exists(os.path.join(out, "launcher-saw-exit-1")))
        print("lost my peer", file=sys.stderr, flush=True)
        sys.exit(3)
    if mode == "ok":
        sys.exit(0)
    time.sleep(HANG_S)
    mark(f"finished-{rank}", "not stopped")
    """
).replace("HANG_S", str(HANG_S))

# A process the worker leaves in its process group. Modes: sleeps (dies on SIGTERM); on
# SIGTERM, writes cleaned-<rank> after a short clean-up; ignores SIGTERM.
HELPER = textwrap.dedent(
    """
    import os, signal, sys, time
    out, rank, mode = sys.argv[1], sys.argv[2], sys.argv[3]

    def clean_up(signum, frame):
        time.sleep(0.3)
        with open(os.path.join(out, f"cleaned-{rank}"), "w") as f:
            f.write("cleaned up after SIGTERM")
        sys.exit(0)

    if mode == "helper-cleans-up":
        signal.signal(signal.SIGTERM, clean_up)
    elif mode == "helper-ignores-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(os.path.join(out, f"helper-ready-{rank}"), "w") as f:
        f.write("handler installed")
    time.sleep(600)
    """
)


@pytest.fixture()
def job(tmp_path) -> Path:
    path = tmp_path / "job.py"
    path.write_text(f"HELPER = {HELPER!r}\n" + JOB)
    return path


@pytest.fixture()
def out(tmp_path) -> Path:
    path = tmp_path / "out"
    path.mkdir()
    return path


def _recorded(out: Path) -> list[int]:
    pids: list[int] = []
    for path in sorted(out.glob("pids-*.json")):
        info = json.loads(path.read_text())
        pids += [info["pid"]] + ([info["helper_pid"]] if "helper_pid" in info else [])
    return pids


def _finished(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob("finished-*"))


# -- A: workers end when the launcher dies, in any way ----------------------------------------


@pytest.mark.parametrize(
    ("sig", "form", "off", "mode"),
    [
        pytest.param(signal.SIGKILL, "script", None, "default", id="sigkill"),
        pytest.param(signal.SIGHUP, "script", None, "default", id="sighup"),
        pytest.param(signal.SIGKILL, "command", None, "default", id="sigkill-shell-command"),
        pytest.param(
            signal.SIGKILL, "script", launch.NO_PDEATHSIG_ENV, "default",
            id="sigkill-watchdog-alone",
        ),
        pytest.param(
            signal.SIGKILL, "command", launch.NO_PDEATHSIG_ENV, "default",
            id="sigkill-shell-command-watchdog-alone",
        ),
        pytest.param(
            signal.SIGKILL, "script", launch.NO_WATCHDOG_ENV, "default",
            id="sigkill-pdeathsig-alone",
        ),
        pytest.param(
            signal.SIGKILL, "command", launch.NO_WATCHDOG_ENV, "default",
            id="sigkill-shell-command-pdeathsig-alone",
        ),
        pytest.param(signal.SIGKILL, "script", None, "host", id="sigkill-network-host"),
        *(  # the parent-death signal and the watchdog, each alone, across a user namespace
            pytest.param(
                signal.SIGKILL, form, off, "isolated-user", id=f"{name}-user-namespace",
                marks=modes.param("isolated-user").marks,
            )
            for name, form, off in (
                ("sigkill-pdeathsig-alone", "script", launch.NO_WATCHDOG_ENV),
                ("sigkill-shell-command-watchdog-alone", "command", launch.NO_PDEATHSIG_ENV),
            )
        ),
    ],
)  # fmt: skip
def test_no_worker_outlives_the_launcher(tmp_path, job, out, sig, form, off, mode):
    """Each worker has a helper process; in the command form the worker is a shell whose
    child is the real job. After the launcher gets `sig`, none of them is alive 10 s later.

    `off` turns one of the two mechanisms off: the watchdog alone kills every worker's
    whole process group; the parent-death signal alone kills every worker (the launcher's
    own children), but not what they started, which the check then finds alive. `mode`:
    the launcher's network ("default": what this host allows; see tests/network_modes.py)."""
    if form == "script":
        target = [str(job)]
    else:
        run_sh = tmp_path / "run.sh"
        run_sh.write_text(f'#!/bin/sh\n"{sys.executable}" "{job}" "$@"\necho after\n')
        run_sh.chmod(0o755)
        target = ["--", str(run_sh)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if mode != "default":
        env = modes.env_for(mode, env)
    env.pop(launch.NO_PDEATHSIG_ENV, None)
    env.pop(launch.NO_WATCHDOG_ENV, None)
    if off is not None:
        env[off] = "1"
    stderr_path = tmp_path / "launcher.err"
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen(
            [*LAUNCHER, "-n", "2", "--grace", "1", "--startup-timeout", "0",
             *modes.args_for(mode), *target, str(out), "hang-helper"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,  # so that the test can clean up after a failure
            # As from a terminal: under `nohup pytest` the launcher would inherit SIGHUP
            # ignored and rightly keep ignoring it (test_sighup_is_left_alone_under_nohup).
            preexec_fn=_sighup_default,
        )  # fmt: skip
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 240  # bounds a stuck start; the test waits for progress
        while len(list(out.glob("pids-*.json"))) < 2:
            assert proc.poll() is None, stderr_path.read_text()
            assert time.monotonic() < deadline, "the workers never started"
            time.sleep(0.05)
        children = psutil.Process(proc.pid).children()
        workers = [p.pid for p in children if p.cmdline()[-1:] == ["hang-helper"]]
        watchdogs = [p.pid for p in children if p.pid not in workers]
        descendants = psutil.Process(proc.pid).children(recursive=True)
        pids = sorted({p.pid for p in descendants} | set(_recorded(out)))
        # 2 workers and 2 helpers (+ 2 shells in the command form) and the watchdog
        assert len(_recorded(out)) == 4 and len(pids) >= (4 if form == "script" else 6)
        assert len(workers) == 2 and len(watchdogs) == (0 if off == launch.NO_WATCHDOG_ENV else 1)
        infos = [json.loads(p.read_text()) for p in sorted(out.glob("pids-*.json"))]
        if form == "script":  # the job is the worker: it carries the parent-death signal
            expected = 0 if off == launch.NO_PDEATHSIG_ENV else signal.SIGKILL
            assert [info["pdeathsig"] for info in infos] == [expected, expected]
        if mode != "default":  # the jobs (in the command form, the shells' children)
            isolated = mode in modes.ISOLATED
            assert (infos[0]["netns"] != modes.netns()) is isolated, infos
            assert infos[0]["netns"] == infos[1]["netns"]
        proc.send_signal(sig)
        proc.wait(timeout=120)
        # Only the workers when the parent-death signal acts alone (no watchdog).
        reaped = workers if off == launch.NO_WATCHDOG_ENV else pids
        deadline = time.monotonic() + 10  # the bound, measured from the launcher's end
        while any(alive(pid) for pid in reaped) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [pid for pid in reaped if alive(pid)]
        survivors = [pid for pid in pids if alive(pid)]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        kill([*pids, *_recorded(out)])
    assert not left, f"alive 10 s after the launcher's {sig.name}: {left}"
    if off == launch.NO_WATCHDOG_ENV:  # the watchdog is really off: the helpers outlive it
        assert sorted(survivors) == sorted(set(pids) - set(workers)), survivors
    else:
        assert _finished(out) == []
    if sig == signal.SIGHUP:  # stopped like SIGTERM, with the launcher's own exit
        err = stderr_path.read_text()
        assert proc.returncode == 128 + signal.SIGHUP, err
        assert "received SIGHUP; stopping workers" in err


def _sighup_default() -> None:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def test_sighup_is_left_alone_under_nohup(job, out):
    """A launcher started with SIGHUP ignored (nohup) keeps ignoring it."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        assert launch.main(["-n", "1", str(job), str(out), "ok"]) == 0
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ok", "early"])
def test_without_os_waitid_the_launcher_polls(monkeypatch, capsys, job, out, mode):
    """As on macOS before Python 3.13 (no os.waitid, WNOWAIT, CLD_EXITED): a normal end
    and a worker that leaves early are handled as with them, with no AttributeError."""
    for name in ("waitid", "WNOWAIT", "CLD_EXITED"):
        monkeypatch.delattr(os, name, raising=False)
    code = launch.main(
        ["-n", "2", "--startup-timeout", "0", "--finish-window", "1", "--grace", "1",
         str(job), str(out), mode]
    )  # fmt: skip
    err = capsys.readouterr().err
    if mode == "ok":
        assert code == 0, err
    else:
        assert code == launch.EXIT_FAILED, err
        assert "exited with status 0 while worker 0 still ran" in err
        assert "; stopped worker 0" in err and "FAILED: worker 1 left early" in err
    assert len(_recorded(out)) == 2 and _finished(out) == []
    assert_none_left(_recorded(out))


# -- B: a worker that exits 0 while the others still run ------------------------------------


@pytest.mark.slow
def test_a_worker_that_exits_0_while_the_others_train_fails_the_run(capsys, job, out):
    code = launch.main(
        ["-n", "2", "--startup-timeout", "0", "--finish-window", "1", "--grace", "1",
         str(job), str(out), "early"]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == launch.EXIT_FAILED, err
    assert "worker 1 (pid" in err and "exited with status 0 while worker 0 still ran" in err
    assert "and worker 0 had not finished --finish-window 1 s later" in err
    assert "; stopped worker 0" in err and "stopped worker 1" not in err
    assert "FAILED: worker 1 left early" in err
    assert _finished(out) == []  # worker 0 was stopped, not waited for
    assert_none_left(_recorded(out))


def _mark_exits_seen(monkeypatch: pytest.MonkeyPatch, out: Path) -> None:
    """OUT/launcher-saw-exit-<i> once the launcher (in this process) has seen worker i's
    exit: its `peek_exit`, wrapped, returns what it returned and writes the marker."""
    real = launch_group.peek_exit

    def peek_exit(worker):
        code = real(worker)
        marker = out / f"launcher-saw-exit-{worker.index}"
        if code is not None and not marker.exists():
            marker.write_text(str(code))
        return code

    monkeypatch.setattr(launch_group, "peek_exit", peek_exit)


@pytest.mark.slow
def test_a_peer_failing_after_an_early_exit_names_the_worker_that_left(
    capsys, monkeypatch, job, out
):
    """Worker 1 exits 0; worker 0 then fails (as TensorFlow's heartbeat makes it do), once
    the launcher has seen worker 1's exit (a marker, not a delay): the launcher names
    worker 1, and "stopped" no one (both had exited)."""
    _mark_exits_seen(monkeypatch, out)
    code = launch.main(
        ["-n", "2", "--startup-timeout", "0", "--finish-window", "600", "--grace", "1",
         str(job), str(out), "early-then-peer-fails"]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 3, err
    assert "worker 1 (pid" in err and "exited with status 0 while worker 0 still ran; " in err
    assert "then worker 0 (pid" in err and "exited with status 3" in err
    assert "stopped" not in err
    assert "FAILED: worker 1 left early" in err and "then worker 0 exited with status 3" in err
    assert "lost my peer" in err  # worker 0's last lines
    assert_none_left(_recorded(out))


@pytest.mark.slow
def test_the_startup_timeout_names_a_worker_that_exited_before_joining(capsys, job, out):
    code = launch.main(
        [
            "-n",
            "2",
            "--startup-timeout",
            "5",
            "--finish-window",
            "0",
            "--grace",
            "1",
            str(job),
            str(out),
            "early",
        ]
    )  # fmt: skip  (5 s: worker 1 has exited by then even on a loaded machine)
    err = capsys.readouterr().err
    assert code == launch.EXIT_TIMEOUT, err
    assert (
        "worker 1 exited with status 0 before joining the cluster; worker 0 did not join "
        "the cluster within --startup-timeout 5 s"
    ) in err
    assert "keras_mirror_kit; pass --startup-timeout 0 for such scripts); stopped worker 0" in err
    assert _finished(out) == []
    assert_none_left(_recorded(out))


# -- C: --grace at a normal end; no abbreviated options -------------------------------------


def test_helpers_get_the_grace_period_at_a_normal_end(capsys, job, out):
    """Both workers exit 0 (one a little after the other: still a success); each left a
    helper that cleans up on SIGTERM. It gets to, within a generous --grace."""
    assert launch.main(["-n", "2", "--grace", "60", str(job), str(out), "helper-cleans-up"]) == 0
    assert sorted(p.name for p in out.glob("cleaned-*")) == ["cleaned-0", "cleaned-1"]
    pids = _recorded(out)
    assert len(pids) == 4
    assert_none_left(pids)


@pytest.mark.slow
def test_a_helper_that_ignores_sigterm_is_killed_after_the_grace_period(capsys, job, out):
    assert launch.main(["-n", "2", "--grace", "1", str(job), str(out), "helper-ignores-term"]) == 0
    pids = _recorded(out)
    assert len(pids) == 4
    assert_none_left(pids)


@pytest.mark.slow
def test_the_launcher_returns_once_what_it_killed_has_died(capsys, job, out, monkeypatch):
    """A SIGKILL takes effect when its process next runs, which on a loaded host can be a
    while. Here the launcher's SIGKILL reaches the groups 0.5 s late: it still returns only
    once nothing of theirs is alive."""
    real = launch_group.signal_group

    def late(process: subprocess.Popen[bytes], sig: int) -> None:
        if sig != signal.SIGKILL:
            return real(process, sig)
        threading.Timer(0.5, real, (process, sig)).start()

    monkeypatch.setattr(launch_group, "signal_group", late)
    assert launch.main(["-n", "2", "--grace", "1", str(job), str(out), "helper-ignores-term"]) == 0
    pids = _recorded(out)
    assert len(pids) == 4
    assert_none_left(pids)


@pytest.mark.parametrize(
    ("options", "unknown", "meant"),
    [
        (["--startup", "5"], "--startup", "--startup-timeout"),
        (["--startup=5"], "--startup", "--startup-timeout"),
        (["--gr", "1"], "--gr", "--grace"),
        (["--gpus", "1"], "--gpus", "--gpus-per-worker"),
        (["--grase", "1"], "--grase", "--grace"),
        (["--epochs", "3"], "--epochs", None),
    ],
)
def test_options_are_not_abbreviated(capsys, job, out, options, unknown, meant):
    code = launch.main(["-n", "2", *options, str(job), str(out), "ok"])
    err = capsys.readouterr().err
    assert code == launch.EXIT_USAGE, err
    assert f"unknown option {unknown}" in err
    assert "The launcher's options are not abbreviated; options meant for the script" in err
    assert f"Received: {options[0]}" in err
    if meant:
        assert f"did you mean {meant}?" in err
    else:
        assert "did you mean" not in err
    assert "starting" not in err and not list(out.iterdir())  # no worker started


def test_options_after_the_double_dash_belong_to_the_script(capsys, job, out):
    assert launch.main(["-n", "1", "--", str(job), str(out), "ok", "--startup", "5"]) == 0
    assert "[worker 0] rank 0 argv ['--startup', '5']" in capsys.readouterr().out


# -- D: GPUs per worker ----------------------------------------------------------------------


def test_visible_gpus_from_cuda_visible_devices():
    env = "CUDA_VISIBLE_DEVICES"
    assert launch.visible_gpus({env: "0,1,2,3"}) == ["0", "1", "2", "3"]
    assert launch.visible_gpus({env: " 4, 6 "}) == ["4", "6"]
    assert launch.visible_gpus({env: "GPU-8a1c,GPU-77f2"}) == ["GPU-8a1c", "GPU-77f2"]
    assert launch.visible_gpus({env: "2,-1,3"}) == ["2"]  # CUDA stops at an invalid entry
    assert launch.visible_gpus({env: "-1"}) == [] and launch.visible_gpus({env: ""}) == []


NVIDIA_SMI_L = """\
GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0b9e1c43-9d0c-4a5e-8d7f-1a2b3c4d5e6f)
GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-1c8f2d54-0e1d-4b6f-9e80-2b3c4d5e6f70)
GPU 2: NVIDIA H100 80GB HBM3 (UUID: GPU-2d703e65-1f2e-4c70-8f91-3c4d5e6f7081)
GPU 3: NVIDIA H100 80GB HBM3 (UUID: GPU-3e614f76-203f-4d81-90a2-4d5e6f708192)
"""


@pytest.fixture()
def fake_nvidia_smi(tmp_path, monkeypatch) -> Path:
    """An `nvidia-smi` on PATH that lists 4 GPUs (`-L`), for a host without them."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    program = bin_dir / "nvidia-smi"
    program.write_text(f'#!/bin/sh\n[ "$1" = "-L" ] || exit 9\ncat <<"EOF"\n{NVIDIA_SMI_L}EOF\n')
    program.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    return program


def test_visible_gpus_from_nvidia_smi(tmp_path, fake_nvidia_smi):
    assert launch.visible_gpus({}, nvidia_smi=str(fake_nvidia_smi)) == ["0", "1", "2", "3"]
    assert launch.visible_gpus({}) == ["0", "1", "2", "3"]  # found on PATH
    assert launch.visible_gpus({}, nvidia_smi=None) == []
    assert launch.visible_gpus({}, nvidia_smi=str(tmp_path / "missing")) == []
    failing = tmp_path / "failing-smi"
    failing.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    failing.chmod(0o755)
    assert launch.visible_gpus({}, nvidia_smi=str(failing)) == []
    # CUDA_VISIBLE_DEVICES, when set, is what the workers could see: nvidia-smi is not asked.
    assert launch.visible_gpus({"CUDA_VISIBLE_DEVICES": "3"}) == ["3"]


def test_assign_gpus():
    four = ["0", "1", "2", "3"]
    assert launch.assign_gpus(2, four) == [["0", "1"], ["2", "3"]]
    assert launch.assign_gpus(4, four) == [["0"], ["1"], ["2"], ["3"]]
    assert launch.assign_gpus(2, four, 1) == [["0"], ["1"]]
    assert launch.assign_gpus(3, four, 1) == [["0"], ["1"], ["2"]]
    assert launch.assign_gpus(2, four, 0) == [[], []]
    assert launch.assign_gpus(2, []) is None  # no GPU: nothing set
    assert launch.assign_gpus(2, [], 0) == [[], []]
    assert launch.assign_gpus(2, ["GPU-a", "GPU-b"]) == [["GPU-a"], ["GPU-b"]]


@pytest.mark.parametrize(
    ("nproc", "gpus", "per_worker", "expected"),
    [
        (
            2,
            ["0", "1", "2"],
            None,
            "cannot split the 3 visible GPU(s) (0,1,2) evenly among 2 workers, and workers "
            "sharing a GPU would each take all of its memory. Pass --gpus-per-worker 1 "
            "(GPUs 2 stay unused), --gpus-per-worker 0 to run the workers without GPUs, or "
            "set CUDA_VISIBLE_DEVICES to the GPUs to use. Received: -n 2, 3 GPU(s) (0,1,2)",
        ),
        (2, ["0"], None, "Pass -n 1 (one worker per GPU), --gpus-per-worker 0 to run"),
        (
            2,
            ["0", "1", "2"],
            2,
            "--gpus-per-worker 2 needs 4 GPUs for 2 workers, but 3 are visible (0,1,2). "
            "Pass a smaller --gpus-per-worker or -n, or --gpus-per-worker 0 to run the "
            "workers without GPUs. Received: -n 2, --gpus-per-worker 2",
        ),
        (2, [], 1, "--gpus-per-worker 1 needs 2 GPUs for 2 workers, but 0 are visible."),
        (2, ["0", "1"], -1, "--gpus-per-worker must be >= 0"),
    ],
)
def test_gpus_that_cannot_be_split_are_an_error(nproc, gpus, per_worker, expected):
    with pytest.raises(launch.LaunchError, match="Received: ") as info:
        launch.assign_gpus(nproc, gpus, per_worker)
    assert expected in str(info.value)


def _envs(out: Path, n: int = 2) -> list[dict]:
    return [json.loads((out / f"env-{rank}.json").read_text()) for rank in range(n)]


def test_each_worker_gets_its_own_gpus(capsys, monkeypatch, tmp_path, job):
    """From the launcher's CUDA_VISIBLE_DEVICES (kept as a list to split)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    monkeypatch.delenv("TF_FORCE_GPU_ALLOW_GROWTH", raising=False)
    runs = {
        "even": ([], [("4,5", None), ("6,7", None)]),
        "one": (["--gpus-per-worker", "1", "--memory-growth"], [("4", "true"), ("5", "true")]),
        "none": (["--gpus-per-worker", "0"], [("-1", None), ("-1", None)]),
    }
    lines = {}
    for name, (options, expected) in runs.items():
        out = tmp_path / name
        out.mkdir()
        assert launch.main(["-n", "2", *options, str(job), str(out), "ok"]) == 0
        envs = _envs(out)
        got = [(e["CUDA_VISIBLE_DEVICES"], e["TF_FORCE_GPU_ALLOW_GROWTH"]) for e in envs]
        assert got == expected, name
        lines[name] = capsys.readouterr().err
    assert "; worker 0: GPU 4,5, worker 1: GPU 6,7 (CUDA_VISIBLE_DEVICES): " in lines["even"]
    assert (
        "; worker 0: GPU 4, worker 1: GPU 5 (CUDA_VISIBLE_DEVICES); "
        "TF_FORCE_GPU_ALLOW_GROWTH=true: "
    ) in lines["one"]
    assert "; no GPU (CUDA_VISIBLE_DEVICES=-1): " in lines["none"]


def test_gpus_found_by_nvidia_smi_are_split(capsys, monkeypatch, fake_nvidia_smi, job, out):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert launch.main(["-n", "4", str(job), str(out), "ok"]) == 0
    assert [e["CUDA_VISIBLE_DEVICES"] for e in _envs(out, 4)] == ["0", "1", "2", "3"]
    assert "worker 3: GPU 3 (CUDA_VISIBLE_DEVICES)" in capsys.readouterr().err


def test_gpus_that_do_not_divide_stop_the_launch_before_any_worker(capsys, monkeypatch, job, out):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    assert launch.main(["-n", "2", str(job), str(out), "ok"]) == launch.EXIT_USAGE
    err = capsys.readouterr().err
    assert "keras-mirror-kit launch: error: cannot split the 3 visible GPU(s) (0,1,2)" in err
    assert "starting" not in err and not list(out.iterdir())


def test_no_gpu_leaves_the_environment_alone(capsys, monkeypatch, job, out):
    """The test bed hides GPUs (CUDA_VISIBLE_DEVICES=-1): workers inherit it unchanged."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert launch.main(["-n", "2", str(job), str(out), "ok"]) == 0
    assert [e["CUDA_VISIBLE_DEVICES"] for e in _envs(out)] == ["-1", "-1"]
    assert "GPU" not in capsys.readouterr().err
