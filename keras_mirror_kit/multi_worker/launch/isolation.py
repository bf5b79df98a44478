"""`--network`: the workers of an attempt in a network namespace of their own, or a warning.

TensorFlow's gRPC server, which every worker of a cluster starts, listens on all interfaces
(`0.0.0.0:PORT`, hard-coded in TensorFlow) and runs whatever graph it is sent, without
authentication. So on Linux the launcher starts the workers of each attempt inside one
private network namespace holding nothing but a loopback interface: they reach each other
on 127.0.0.1 as before, and their ports exist nowhere else (`--network auto`, the default,
and `isolated`). Elsewhere, or where the host refuses namespaces, `auto` runs them on this
host's network with one WARNING; `isolated` refuses to start; `host` opts out (and warns).

How a namespace is made: a holder, a small Python process (`-I -S`, so single-threaded, as
`unshare(CLONE_NEWUSER)` requires), calls `unshare(2)` through ctypes (Python 3.11 has no
`os.unshare`): as root a network namespace alone (the workers keep root's privileges on the
host); otherwise, or where root may not (a container without CAP_SYS_ADMIN), a user
namespace with it, whose uid and gid maps name only the launcher's own ids, mapped onto
themselves (as `unshare --map-current-user --net` does), so the workers keep their identity,
and the files they write their owner. The holder brings `lo` up, checks that a connection
over it works, finds the free ports there (where the workers bind them), prints them, and
exits once the launcher has opened its `/proc/PID/ns/user` and `/proc/PID/ns/net` files.
Each worker inherits those descriptors and its wrapper (`wrapper.py`) enters the namespace
with `setns(2)` before it execs the worker's program: the workers stay the launcher's own
children (process groups, exit statuses, the parent-death signal, the relay: unchanged).
The launcher closes its descriptors once the workers are started; the namespace then lives
exactly as long as a process in it, and a restart makes a new one. Nothing outlives the
attempt: the holder has exited before the first worker starts (and dies on its stdin's EOF
or SIGPIPE if the launcher dies first).

Why ctypes rather than the `unshare` and `nsenter` programs: those are util-linux's, missing
from minimal images and with options that differ between versions; the system calls are in
every C library, and their errno says exactly why a host refuses, for the fall-back message.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass, field

from keras_mirror_kit.multi_worker import SECURITY_DOCS_URL
from keras_mirror_kit.multi_worker.launch.errors import LaunchError

NETWORK_CHOICES = ("auto", "isolated", "host")
# For tests and debugging only: "refuse" makes the holder act as on a host that refuses
# namespaces (the fall-back path); "user" makes a user namespace even as root.
TEST_NAMESPACES_ENV = "KMK_LAUNCH_TEST_NAMESPACES"
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
HOLDER_TIMEOUT_S = 30.0

# argv: "net", "user" or "refuse"; the number of ports. Prints "ready PORT..." or
# "refused STEP: WHY", then (ready) waits for EOF on stdin while the launcher opens
# /proc/PID/ns/*. Ports are found inside the namespace, where the workers will bind them.
_HOLDER = """
import os, sys
kind, count = sys.argv[1], int(sys.argv[2])

def refuse(step, why):
    sys.stdout.write(f"refused {step}: {why}\\n")
    sys.stdout.flush()
    sys.exit(3)

if kind == "refuse":
    refuse("unshare", "refused for a test (KMK_LAUNCH_TEST_NAMESPACES=refuse)")
uid, gid = os.geteuid(), os.getegid()
try:
    import ctypes
    unshare = ctypes.CDLL(None, use_errno=True).unshare
    unshare.argtypes = [ctypes.c_int]
except (ImportError, OSError, AttributeError) as err:
    refuse("unshare", f"no unshare() in this C library ({err})")
if unshare(0x40000000 | (0x10000000 if kind == "user" else 0)) != 0:
    code = ctypes.get_errno()
    refuse("unshare", f"{os.strerror(code)} (errno {code})")
if kind == "user":
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                       ("gid_map", f"{gid} {gid} 1")):
        try:
            with open(f"/proc/self/{name}", "w") as handle:
                handle.write(text)
        except FileNotFoundError:
            if name != "setgroups":  # kernels before 3.19 have no setgroups file
                refuse(name, "no such file")
        except OSError as err:
            refuse(f"writing {name}", err.strerror or err)
import fcntl, socket, struct
try:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:  # struct ifreq: 40 bytes
        flags = struct.unpack("16sh22x", fcntl.ioctl(sock, 0x8913, struct.pack(
            "16sh22x", b"lo", 0)))[1]  # SIOCGIFFLAGS
        fcntl.ioctl(sock, 0x8914, struct.pack("16sh22x", b"lo", flags | 1))  # IFF_UP
    held = []
    for _ in range(count + 1):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        held.append(sock)
        sock.bind(("127.0.0.1", 0))
    probe = held.pop()  # not a worker's port: a closed connection leaves it in TIME_WAIT
    probe.listen(1)
    with socket.create_connection(probe.getsockname(), timeout=10):
        probe.accept()[0].close()
    ports = [sock.getsockname()[1] for sock in held]
    for sock in [*held, probe]:
        sock.close()
except OSError as err:
    refuse("loopback", err)
sys.stdout.write("ready " + " ".join(map(str, ports)) + "\\n")
sys.stdout.flush()
sys.stdin.read()
"""


class IsolationRefused(Exception):
    """This host does not let the launcher make a private network namespace."""


@dataclass
class Namespace:
    """A made namespace: its ports, and the launcher's descriptors for joining it."""

    kind: str  # "user" (a user and a network namespace) or "net" (a network one, as root)
    ports: list[int]
    joins: list[tuple[int, int]] = field(default_factory=list)  # (fd, CLONE_NEW*), in order

    @property
    def fds(self) -> list[int]:
        return [fd for fd, _ in self.joins]

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.joins = []


def _kinds() -> list[str]:
    """The namespaces to try, in order: a network one alone as root, else with a user one."""
    if not sys.platform.startswith("linux"):
        raise IsolationRefused(f"network namespaces are Linux's; this is {sys.platform}")
    if not sys.executable:
        raise IsolationRefused("no Python interpreter to run the namespace's holder")
    test = os.environ.get(TEST_NAMESPACES_ENV, "").strip()
    if test == "refuse":
        return ["refuse"]
    if test == "user":
        return ["user"]
    return ["net", "user"] if os.geteuid() == 0 else ["user"]


def _read_line(process: subprocess.Popen[bytes], timeout: float) -> str | None:
    """The holder's first line, or None if it closed its stdout or did not answer in time."""
    fd = process.stdout.fileno()  # type: ignore[union-attr]
    data = b""
    deadline = time.monotonic() + timeout
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        readable, _, _ = select.select([fd], [], [], left)
        if readable:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
    return data.decode("utf-8", errors="replace").strip() or None


def _host_policy() -> str:
    """The host's switches that refuse unprivileged user namespaces, as a clause, or ""."""
    found = []
    switches = (
        ("/proc/sys/kernel/unprivileged_userns_clone", "0", "kernel.unprivileged_userns_clone"),
        ("/proc/sys/user/max_user_namespaces", "0", "user.max_user_namespaces"),
        (
            "/proc/sys/kernel/apparmor_restrict_unprivileged_userns",
            "1",
            "kernel.apparmor_restrict_unprivileged_userns",
        ),
    )
    for path, refusing, name in switches:
        try:
            with open(path) as handle:
                value = handle.read().strip()
        except OSError:
            continue
        if value == refusing:
            found.append(f"{name} = {value}")
    return f"; the host has {' and '.join(found)}" if found else ""


def _make(kind: str, n: int) -> Namespace:
    """Starts a holder for one kind of namespace; the namespace, or IsolationRefused."""
    holder = [sys.executable, "-I", "-S", "-c", _HOLDER, kind, str(n)]
    try:
        process = subprocess.Popen(
            holder,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # out of reach of the terminal's Ctrl-C
        )
    except OSError as err:
        raise IsolationRefused(f"cannot start the namespace's holder: {err}") from err
    joins: list[tuple[int, int]] = []
    try:
        line = _read_line(process, HOLDER_TIMEOUT_S)
        if line is None or not line.startswith("ready "):
            if line is None:
                process.kill()
                process.wait()
                last = (process.stderr.read() or b"").decode(errors="replace").strip()  # type: ignore[union-attr]
                line = f"the holder gave no answer{f': {last.splitlines()[-1]}' if last else ''}"
            raise IsolationRefused(line.removeprefix("refused "))
        ports = [int(word) for word in line.split()[1:]]
        names = [("user", CLONE_NEWUSER)] if kind == "user" else []
        for name, nstype in [*names, ("net", CLONE_NEWNET)]:
            # Opened while the holder lives: its pid cannot be another process's yet.
            fd = os.open(f"/proc/{process.pid}/ns/{name}", os.O_RDONLY | os.O_CLOEXEC)
            joins.append((fd, nstype))
        return Namespace(kind, ports, joins)
    except OSError as err:
        for fd, _ in joins:
            os.close(fd)
        raise IsolationRefused(f"cannot open the namespace: {err}") from err
    finally:
        for stream in (process.stdin, process.stdout, process.stderr):
            with contextlib.suppress(OSError):
                stream.close()  # type: ignore[union-attr]
        try:
            process.wait(timeout=10)  # it exits on its stdin's EOF
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def make_namespace(n: int) -> Namespace:
    """A private network namespace with `n` free ports on its loopback, or IsolationRefused."""
    reasons = []
    for kind in _kinds():
        try:
            return _make(kind, n)
        except IsolationRefused as err:
            what = {"net": "a network namespace", "user": "a user namespace"}.get(kind, "")
            reasons.append(f"{what}: {err}" if what else str(err))
    raise IsolationRefused("; ".join(reasons) + _host_policy())


@dataclass(frozen=True)
class Probe:
    """Whether this host lets the launcher isolate its workers, and how or why not."""

    available: bool
    kind: str | None  # "user" or "net" when available
    detail: str


def probe() -> Probe:
    """Makes (and drops) one namespace, as `launch` would; for `doctor` and the tests."""
    try:
        namespace = make_namespace(1)
    except IsolationRefused as err:
        return Probe(False, None, str(err))
    namespace.close()
    how = {
        "net": "a network namespace of their own (as root)",
        "user": "a user and a network namespace of their own (unprivileged)",
    }[namespace.kind]
    return Probe(True, namespace.kind, how)


def exposure_warning(ports: list[int], refused: str | None) -> str:
    """The WARNING of a launch on this host's network: the ports, the risk, the options."""
    listed = ", ".join(map(str, ports))
    risk = (
        f"TensorFlow's server in each worker listens on all network interfaces of this host "
        f"(ports {listed}; new ones after a restart), without authentication or encryption, "
        "and runs whatever computation it is sent: anyone who can reach this host on those "
        "ports can run code as this user"
    )
    if refused is None:
        return (
            f"WARNING: --network host: {risk}. Use it on a trusted network only; the default, "
            f"--network auto, isolates the workers where the host allows. See {SECURITY_DOCS_URL}"
        )
    return (
        "WARNING: could not start the workers in a network namespace of their own "
        f"({refused}), so they run on this host's network: {risk}. Run on a trusted network "
        "or allow unprivileged user namespaces; pass --network isolated to refuse to start "
        f"without isolation, or --network host to choose this mode. See {SECURITY_DOCS_URL}"
    )


class NetworkPlan:
    """The network of each attempt, by `--network`; remembers a refusal and the warning."""

    def __init__(self, choice: str) -> None:
        self.choice = choice
        self.refused: str | None = None
        self.warned = False

    def namespace(self, n: int) -> Namespace | None:
        """A new namespace for an attempt, or None: this host's network."""
        if self.choice == "host" or self.refused is not None:
            return None
        try:
            return make_namespace(n)
        except IsolationRefused as err:
            if self.choice == "isolated":
                raise LaunchError(
                    f"--network isolated: cannot start the workers in a network namespace "
                    f"of their own: {err}. Allow unprivileged user namespaces, run as root, "
                    f"or pass --network auto or host to run on this host's network (see "
                    f"{SECURITY_DOCS_URL}). Received: --network isolated"
                ) from None
            self.refused = str(err)
            return None

    def warning(self, ports: list[int]) -> str | None:
        """The WARNING for an attempt on this host's network, once per launch."""
        if self.warned:
            return None
        self.warned = True
        return exposure_warning(ports, None if self.choice == "host" else self.refused)
