"""`keras-mirror-kit launch --network`: where the workers' ports exist, and the one WARNING.

Two small standard-library workers (real processes, no TensorFlow) each listen on the port
`TF_CONFIG` gives it, as TensorFlow's server does (here on 127.0.0.1 only: the test exposes
nothing), and worker 1 connects to worker 0 over 127.0.0.1. While they wait for the test,
the test reads the listening sockets of the host's network namespace (its own
`/proc/self/net/tcp{,6}`) and of each worker's (`/proc/PID/net/...`):

- isolated (the default where this host allows, and a user namespace forced as root): both
  workers share one network namespace that is not the host's; their ports listen there and
  nowhere in the host's; no warning; when the launch is over, no process is left in it
  (the namespace's holder included);
- `--network host` and the fall-back (`KMK_LAUNCH_TEST_NAMESPACES=refuse`): the host's
  namespace, the ports in it, and exactly one WARNING naming the ports, the risk and the
  option; `--network isolated` then refuses to start.

Tests follow the workers' progress markers; time bounds only end a stuck test.
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

from keras_mirror_kit.multi_worker import NETWORK_ENV, SECURITY_DOCS_URL, launch
from tests import network_modes as modes
from tests.processes import assert_none_left

REPO = Path(__file__).resolve().parent.parent
LAUNCHER = [sys.executable, "-m", "keras_mirror_kit.multi_worker.launch"]

WORKER = textwrap.dedent(
    """
    import json, os, socket, sys, time
    out = sys.argv[1]
    config = json.loads(os.environ["TF_CONFIG"])
    rank = config["task"]["index"]
    port = int(config["cluster"]["worker"][rank].rsplit(":", 1)[1])
    server = socket.socket()
    server.bind(("127.0.0.1", port))
    server.listen()
    reached = None
    if rank == 1:  # worker 0's server, over the loopback of this worker's namespace
        peer = config["cluster"]["worker"][0].rsplit(":", 1)
        deadline = time.monotonic() + 60
        while reached is None and time.monotonic() < deadline:
            try:
                socket.create_connection((peer[0], int(peer[1])), timeout=5).close()
                reached = True
            except OSError:
                time.sleep(0.05)
    record = {"pid": os.getpid(), "port": port, "netns": os.readlink("/proc/self/ns/net"),
              "uid": os.getuid(), "network": os.environ.get("NETWORK_ENV"), "reached": reached}
    path = os.path.join(out, f"worker-{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.rename(path + ".tmp", path)  # whole, or not there
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(out, "go")) and time.monotonic() < deadline:
        time.sleep(0.02)
    """
).replace("NETWORK_ENV", NETWORK_ENV)


def _records(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("worker-*.json"))]


@pytest.mark.slow  # a launcher and its workers
@pytest.mark.parametrize("mode", modes.params(*modes.MODES))
def test_worker_ports_exist_only_where_the_network_mode_puts_them(tmp_path, mode):
    job, out = tmp_path / "job.py", tmp_path / "out"
    job.write_text(WORKER)
    out.mkdir()
    env = modes.env_for(mode, {**os.environ, "PYTHONPATH": str(REPO)})
    command = [*LAUNCHER, "-n", "2", "--startup-timeout", "0", *modes.args_for(mode), str(job)]
    proc = subprocess.Popen(
        [*command, str(out)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # so that the test can clean up after a failure
    )
    try:
        deadline = time.monotonic() + 120  # bounds a stuck start; the test waits for progress
        while len(_records(out)) < 2:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the workers never started"
            time.sleep(0.05)
        records = _records(out)
        host = modes.listening_ports()  # this test's namespace: the host's
        inside = [modes.listening_ports(r["pid"]) for r in records]  # each worker's
        (out / "go").write_text("go")
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    ports = [r["port"] for r in records]
    assert all(port in seen for port, seen in zip(ports, inside)), (ports, inside)
    assert records[1]["reached"] is True  # the workers reach each other on 127.0.0.1
    assert {r["uid"] for r in records} == {os.getuid()}  # the same user, in any namespace
    start = f"starting 2 worker(s) on 127.0.0.1 ports {ports[0]}, {ports[1]}"
    if mode in modes.ISOLATED:
        namespace = records[0]["netns"]
        assert records[1]["netns"] == namespace != modes.netns()
        assert not set(ports) & host, f"worker ports {ports} listen in the host's namespace"
        assert {r["network"] for r in records} == {"isolated"}
        assert f"{start} in a network namespace of their own (loopback only)" in stderr
        assert modes.EXPOSED not in stderr and "WARNING" not in stderr, stderr
        assert modes.members(namespace) == [], "processes left in the workers' namespace"
    else:
        assert {r["netns"] for r in records} == {modes.netns()}
        assert set(ports) <= host
        assert {r["network"] for r in records} == {"host"}
        assert f"{start} (this host's network)" in stderr
        assert stderr.count("WARNING") == 1 and stderr.count(modes.EXPOSED) == 1, stderr
        warning = next(line for line in stderr.splitlines() if "WARNING" in line)
        assert f"(ports {ports[0]}, {ports[1]}; new ones after a restart)" in warning
        assert "without authentication or encryption" in warning
        assert "can run code as this user" in warning and SECURITY_DOCS_URL in warning
        if mode == "host":
            assert "WARNING: --network host: " in warning
        else:
            assert "could not start the workers in a network namespace of their own (" in warning
            assert "KMK_LAUNCH_TEST_NAMESPACES=refuse" in warning
            assert "pass --network isolated to refuse to start without isolation" in warning
    assert "[worker" not in stdout  # the workers wrote nothing; the relay added nothing
    assert_none_left([r["pid"] for r in records])


def test_network_isolated_refuses_to_start_without_a_namespace(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv(launch.TEST_NAMESPACES_ENV, "refuse")
    job = tmp_path / "job.py"
    job.write_text(f"open({str(tmp_path / 'started')!r}, 'w').close()\n")
    assert launch.main(["-n", "2", "--network", "isolated", str(job)]) == 1
    err = capsys.readouterr().err
    assert (
        "keras-mirror-kit launch: error: could not start the workers: --network isolated: "
        "cannot start the workers in a network namespace of their own: unshare: refused for "
        "a test (KMK_LAUNCH_TEST_NAMESPACES=refuse)"
    ) in err
    assert "Received: --network isolated" in err and "WARNING" not in err
    assert not (tmp_path / "started").exists()  # no worker started


def test_an_unknown_network_mode_is_a_usage_error(capsys, tmp_path):
    job = tmp_path / "job.py"
    job.write_text("print(1)\n")
    assert launch.main(["-n", "2", "--network", "none", str(job)]) == launch.EXIT_USAGE
    assert "invalid choice: 'none'" in capsys.readouterr().err
