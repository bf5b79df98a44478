"""The suite's forked children (`tests/forkserver.py`) behave as fresh interpreters do."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests import forkserver
from tests.subproc import REPO

pytestmark = pytest.mark.slow

FORKING = os.environ.get("KMK_TEST_FORK", "1") != "0"

DEVICES = """
import json, os, sys
import tensorflow as tf
n = int(sys.argv[1])
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * n)
print(json.dumps({"devices": len(tf.config.list_logical_devices("CPU")), "ppid": os.getppid(),
                  "argv": sys.argv, "name": __name__, "cwd": os.getcwd(),
                  "env": os.environ.get("KMK_FORK_PROBE")}))
"""


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2", **extra}


def test_each_child_configures_its_own_runtime(tmp_path) -> None:
    seen = []
    for n in (3, 1, 2):  # a runtime made by an earlier child would refuse the next split
        proc = forkserver.run(
            [sys.executable, "-c", DEVICES, str(n)], env=_env(KMK_FORK_PROBE=str(n)),
            cwd=tmp_path, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        seen.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert [s["devices"] for s in seen] == [3, 1, 2]
    assert [s["argv"] for s in seen] == [["-c", "3"], ["-c", "1"], ["-c", "2"]]
    assert {s["name"] for s in seen} == {"__main__"}
    assert {s["cwd"] for s in seen} == {str(tmp_path)}
    assert [s["env"] for s in seen] == ["3", "1", "2"]
    if FORKING:  # forked by the zygote, not started by this process
        assert all(s["ppid"] != os.getpid() for s in seen)


def test_an_import_time_variable_gets_a_new_interpreter() -> None:
    other = "1" if os.environ.get("TF_ENABLE_ONEDNN_OPTS") == "0" else "0"
    proc = forkserver.run(
        [sys.executable, "-c", DEVICES, "1"], env=_env(TF_ENABLE_ONEDNN_OPTS=other),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["ppid"] == os.getpid()


def test_exit_codes_signals_timeouts_and_the_interpreters_exit(tmp_path) -> None:
    def run(code: str, **kwargs):
        return forkserver.run(
            [sys.executable, "-c", code], env=_env(), capture_output=True, text=True,
            timeout=kwargs.pop("timeout", 120), **kwargs,
        )  # fmt: skip

    assert run("import sys; sys.exit(3)").returncode == 3
    assert run("import sys; sys.exit('bye')").returncode == 1
    failed = run("raise ValueError('boom')")
    assert failed.returncode == 1 and "ValueError: boom" in failed.stderr
    assert run("import os, signal; os.kill(os.getpid(), signal.SIGKILL)").returncode == -9
    assert run("raise KeyboardInterrupt").returncode == -signal.SIGINT
    ended = run(  # a non-daemon thread is joined, then atexit runs, then stdout is flushed
        "import atexit, threading\n"
        "go = threading.Event()\n"
        "atexit.register(lambda: print('atexit'))\n"
        "threading.Thread(target=lambda: (go.wait(), print('thread'))).start()\n"
        "print('main')\n"
        "go.set()\n"
    )
    assert ended.stdout.split() == ["main", "thread", "atexit"], ended.stdout
    script = tmp_path / "script.py"
    script.write_text("import sys\nprint(__file__, sys.argv[1:], sys.path[0])\n")
    by_path = forkserver.run(
        [sys.executable, "script.py", "a"], cwd=tmp_path, env=_env(), capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert by_path.stdout.split() == [str(script), "['a']", str(tmp_path)], by_path.stdout
    module = forkserver.run(
        [sys.executable, "-m", "tests.subproc"], env=_env(), cwd=REPO, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert module.returncode == 0, module.stderr
    here = run("import os, sys; print(os.getcwd()); print('to err', file=sys.stderr)",
               stderr=subprocess.STDOUT)  # fmt: skip
    assert here.stdout.split("\n")[:2] == [os.getcwd(), "to err"], here.stdout
    # Children that end at once: their pid and exit status may arrive in one read.
    assert [run(f"raise SystemExit({i})").returncode for i in range(8)] == list(range(8))
    with pytest.raises(subprocess.TimeoutExpired):
        run("import time; time.sleep(600)", timeout=2)
    slow = forkserver.popen(
        [sys.executable, "-c", "import time; time.sleep(1); print('late')"], env=_env(),
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    with pytest.raises(subprocess.TimeoutExpired):
        slow.communicate(timeout=0)
    assert slow.communicate(timeout=120) == ("late\n", None)  # a second call goes on


def test_a_running_child_is_a_popen(tmp_path) -> None:
    marker = tmp_path / "started"
    code = (
        "import pathlib, sys, time\n"
        f"pathlib.Path({str(marker)!r}).write_text('x')\n"
        "print('up', flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = forkserver.popen(
        [sys.executable, "-c", code], env=_env(), stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "up"
    assert marker.exists() and proc.poll() is None
    proc.terminate()
    assert proc.wait(timeout=120) == -signal.SIGTERM
    proc.stdout.close()


JAX_DEVICES = """
import json, os, sys
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={sys.argv[1]}"
before = sorted(m for m in ("tensorflow", "jax", "keras") if m in sys.modules)
import jax
import keras
print(json.dumps({"devices": len(jax.devices("cpu")), "backend": keras.backend.backend(),
                  "ppid": os.getppid(), "before": before,
                  "tensorflow": "tensorflow" in sys.modules}))
"""


def test_jax_children_fork_from_a_zygote_without_tensorflow_and_pick_their_devices() -> None:
    seen = []
    for n in (3, 1, 2):  # a backend made by an earlier child would keep its device count
        proc = forkserver.run(
            [sys.executable, "-c", JAX_DEVICES, str(n)], env=_env(KERAS_BACKEND="jax"),
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "fork()" not in proc.stderr, proc.stderr[-3000:]  # JAX's multithreading warning
        seen.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert [s["devices"] for s in seen] == [3, 1, 2]
    assert {s["backend"] for s in seen} == {"jax"}
    assert not any(s["tensorflow"] for s in seen)  # the JAX zygote imported none
    if FORKING:
        assert all(s["ppid"] != os.getpid() for s in seen)
        assert all(s["before"] == ["jax", "keras"] for s in seen)


NESTED = """
import json, os, subprocess, sys
child = subprocess.run([sys.executable, "-c", "import os; print(os.getppid())"],
                       capture_output=True, text=True, timeout=300, check=True)
try:
    subprocess.run([sys.executable, "-c", "print('partial', flush=True); import time; "
                    "time.sleep(600)"], capture_output=True, text=True, timeout=float(sys.argv[1]))
    late = None
except subprocess.TimeoutExpired as expired:
    late = expired.stdout
print(json.dumps({"me": os.getpid(), "ppid": os.getppid(), "child_ppid": int(child.stdout),
                  "late": late}))
"""


def test_a_forked_childs_own_python_children_are_forked_too() -> None:
    """What the library starts with `subprocess.run([sys.executable, ...])` from a forked child
    (`check_replicas`' child, doctor's self-test, bench's workers) is a sibling forked by the
    same zygote; a timeout still kills it and carries what it wrote, as `subprocess.run`'s."""
    proc = forkserver.run(
        [sys.executable, "-c", NESTED, "20"], env=_env(), capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    if FORKING:
        assert seen["ppid"] != os.getpid()  # the zygote's child ...
        assert seen["child_ppid"] == seen["ppid"]  # ... and so is its own child
    else:
        assert seen["child_ppid"] == seen["me"]
    assert seen["late"] == "partial\n"
