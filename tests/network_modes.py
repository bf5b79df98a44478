"""The launcher's network modes, for tests that run in each: how to ask for one, and checks.

Modes: "isolated" (the default, `--network auto`, where this host allows a namespace),
"isolated-user" (a user namespace even as root: `KMK_LAUNCH_TEST_NAMESPACES=user`),
"host" (`--network host`) and "fallback" (`auto` on a host that refuses namespaces,
simulated by `KMK_LAUNCH_TEST_NAMESPACES=refuse`). An isolated mode is skipped where this
host cannot make its namespace (no unprivileged user namespaces, not Linux), or where the
suite itself runs with `KMK_LAUNCH_TEST_NAMESPACES=refuse` (to try it as on such a host).

Sockets are read from `/proc/PID/net/tcp` and `tcp6`, which show the network namespace of
process PID (`self`: this test's, i.e. the host's).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from keras_mirror_kit.multi_worker.launch import isolation

MODES = ("isolated", "isolated-user", "host", "fallback")
ISOLATED = ("isolated", "isolated-user")
# The phrase of the launcher's one WARNING (and of the chief's, "of its host").
EXPOSED = "listens on all network interfaces"


def _probe(test_value: str | None) -> isolation.Probe:
    """What `launch` can do here; `test_value` sets KMK_LAUNCH_TEST_NAMESPACES meanwhile.

    With None, this process's own environment counts: the suite run with
    `KMK_LAUNCH_TEST_NAMESPACES=refuse` behaves as on a host that refuses namespaces."""
    saved = os.environ.get(isolation.TEST_NAMESPACES_ENV)
    try:
        if test_value is not None:
            os.environ[isolation.TEST_NAMESPACES_ENV] = test_value
        return isolation.probe()
    finally:
        os.environ.pop(isolation.TEST_NAMESPACES_ENV, None)
        if saved is not None:
            os.environ[isolation.TEST_NAMESPACES_ENV] = saved


PROBES = {"isolated": _probe(None)}
PROBES["isolated-user"] = _probe("user") if PROBES["isolated"].available else PROBES["isolated"]


def param(mode: str) -> object:
    """`mode` as a pytest parameter, skipped where this host cannot make its namespace."""
    probe = PROBES.get(mode)
    reason = f"this host cannot isolate the launcher's workers: {probe.detail if probe else ''}"
    skip = probe is not None and not probe.available
    return pytest.param(mode, id=mode, marks=pytest.mark.skipif(skip, reason=reason))


def params(*modes: str) -> list[object]:
    return [param(mode) for mode in modes]


def env_for(mode: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The launcher's environment for `mode` (a copy of `base`, default os.environ)."""
    env = dict(os.environ if base is None else base)
    env.pop(isolation.TEST_NAMESPACES_ENV, None)
    if mode == "isolated-user":
        env[isolation.TEST_NAMESPACES_ENV] = "user"
    elif mode == "fallback":
        env[isolation.TEST_NAMESPACES_ENV] = "refuse"
    return env


def args_for(mode: str) -> list[str]:
    """The launcher's options for `mode`."""
    return ["--network", "host"] if mode == "host" else []


def apply(mode: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Sets this process's environment for an in-process `launch.main`; returns its options."""
    monkeypatch.delenv(isolation.TEST_NAMESPACES_ENV, raising=False)
    value = env_for(mode, {}).get(isolation.TEST_NAMESPACES_ENV)
    if value is not None:
        monkeypatch.setenv(isolation.TEST_NAMESPACES_ENV, value)
    return args_for(mode)


def netns(pid: int | str = "self") -> str:
    """The network namespace of a process, as `net:[INODE]`."""
    return os.readlink(f"/proc/{pid}/ns/net")


def listening_ports(pid: int | str = "self") -> set[int]:
    """TCP ports in state LISTEN (IPv4 and IPv6) in the network namespace of process `pid`."""
    ports: set[int] = set()
    for name in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{name}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) > 3 and fields[3] == "0A":  # TCP_LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def members(namespace: str) -> list[int]:
    """The pids of every process in network namespace `namespace` (that this user can see)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/net") == namespace:
                    found.append(int(entry))
            except OSError:
                continue
    return found
