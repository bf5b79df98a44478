"""Python children that start with TensorFlow (or Keras on JAX) already imported: forked
from a warm parent.

Most children of the suite run `import tensorflow` first, which costs 5-8 s of CPU on the
CI machine, more than many of them then spend training. Importing TensorFlow loads its
libraries and Python modules but initialises no runtime: the devices, the logical-device
split, the thread pools, the eager context and the CUDA driver are made at first use. So
a process that has imported TensorFlow and done nothing else (one per pytest process: the
*zygote*, `python -m tests.forkserver`) can `fork()` children that each still configure
their own runtime as a fresh interpreter would (`set_logical_device_configuration`,
`TF_CONFIG`, `XLA_FLAGS`, `CUDA_VISIBLE_DEVICES`), at a fraction of the cost. Children with
`KERAS_BACKEND=jax` are forked from a second zygote that imported Keras on JAX and `jax`,
and no TensorFlow (about 3.5 s of CPU saved each): importing JAX creates no backend either
(`XLA_FLAGS`, the platforms and the device count are read when the child first asks for a
device), so JAX's warning about `fork()` in a multithreaded process does not apply.

`popen([sys.executable, ...], env=..., stdout=PIPE, ...)` returns a `subprocess.Popen`-like
`ForkedProcess` (pid, poll, wait, communicate, send_signal, kill) for a child forked by a
zygote, or a real `subprocess.Popen` wherever a fork would not be the same process:

* arguments other than `python [-u] -c CODE | -m MODULE | SCRIPT [args]`, another
  executable, `KERAS_BACKEND` other than `tensorflow` and `jax`, a value of an environment
  variable TensorFlow, Keras, JAX or the interpreter reads when it starts
  (`IMPORT_TIME_VARIABLES`, every `KERAS_*` and `JAX_*`, another `keras.json`) other than
  the zygote's, `preexec_fn`, `start_new_session`, `pass_fds`, or input on stdin;
* `KMK_TEST_FORK=0` in the environment of pytest (every child a real interpreter), or the
  zygote failing to start or ending (every later child is a real interpreter; a child it
  forked whose exit it never reported raises `ChildProcessError` from `wait`).

A forked child's own `subprocess.run([sys.executable, ...])` goes through `run` too: the
children the library starts for a check (`kmk.check_replicas`' child, `doctor`'s self-test,
`bench`'s workers) are forked from the same zygotes when their parent was (the library
calls `subprocess.run` as before; only how the interpreter comes to be differs).
`subprocess.Popen` is left alone, so the launcher's workers, which the launcher's tests
follow by process group, parent-death signal and namespace, stay new interpreters.

The zygotes and the pytest processes collect garbage less often than CPython's default
(`tune_gc`: tracing a Keras model makes millions of short-lived objects, and the default
thresholds spend a few percent of the suite's CPU scanning them); the children forked from
a zygote inherit its thresholds.

`KMK_TEST_FORK_LOG=FILE` appends one JSON line per child started through here: forked or
not, and its arguments.

A child forked here differs from a new interpreter only in what the zygote imported
(TensorFlow, NumPy, Keras and what they import, or Keras and JAX, are in `sys.modules` from
the start; Keras wrote no `keras.json` into a `KERAS_HOME` that has none), in its parent
process (the zygote), in its garbage-collection thresholds and in its hash seed (the
zygote's, unless `PYTHONHASHSEED` is set). Tests that check what an import loads, or the
parent's pid, use `subprocess` directly. The child's exit follows the interpreter's own:
non-daemon threads are joined, `atexit` handlers run, the standard streams are flushed.
"""

from __future__ import annotations

import array
import atexit
import gc
import io
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from typing import Any

# Read when TensorFlow (and the Keras it imports) is imported: a child must see the zygote's.
# Besides these, every KERAS_* variable, and the keras.json that KERAS_HOME (or HOME) points at.
IMPORT_TIME_VARIABLES = (
    "TF_ENABLE_ONEDNN_OPTS", "TF_CPP_MIN_LOG_LEVEL", "TF_USE_LEGACY_KERAS",
    # ... and what the interpreter reads when it starts
    "PYTHONWARNINGS", "PYTHONHASHSEED", "PYTHONIOENCODING", "PYTHONUTF8", "PYTHONDEVMODE",
    "PYTHONFAULTHANDLER", "PYTHONSAFEPATH", "PYTHONNOUSERSITE", "PYTHONOPTIMIZE",
    "PYTHONMALLOC", "PYTHONTRACEMALLOC", "LC_ALL", "LC_CTYPE", "LANG",
)  # fmt: skip
_MAX_FDS = 3
_BASE_ENV = dict(os.environ)  # at collection, before any test's monkeypatch
BACKENDS = ("tensorflow", "jax")  # one zygote each, started at its first child
# Young objects collected every 10,000 allocations instead of 700 (CPython's default).
GC_THRESHOLDS = (10_000, 50, 100)
_subprocess_run = subprocess.run  # the real one: a forked child's `subprocess.run` is `run`


def tune_gc() -> None:
    """Collects garbage less often in a process that traces Keras models (see the docstring)."""
    if os.environ.get("KMK_TEST_GC", "1") != "0":
        gc.set_threshold(*GC_THRESHOLDS)


class _Channel:
    """Newline-ended JSON messages over a Unix socket, file descriptors with the first."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buffer = b""

    def send(self, message: dict[str, Any], fds: list[int] | None = None) -> None:
        data = json.dumps(message).encode() + b"\n"  # JSON escapes every newline it holds
        if fds:
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
            sent = self.sock.sendmsg([data], rights)
            self.sock.sendall(data[sent:])
        else:
            self.sock.sendall(data)

    def pending(self) -> bool:
        """Whether a whole message is already buffered (select would not see it)."""
        return b"\n" in self._buffer

    def receive(self) -> tuple[dict[str, Any] | None, list[int]]:
        """The next message (None once the other end closed) and the descriptors it carried."""
        fds = array.array("i")
        while b"\n" not in self._buffer:
            data, ancdata, _, _ = self.sock.recvmsg(
                1 << 16, socket.CMSG_SPACE(_MAX_FDS * fds.itemsize)
            )
            for level, kind, raw in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(raw[: len(raw) - (len(raw) % fds.itemsize)])
            if not data:
                return None, list(fds)
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line), list(fds)

    def close(self) -> None:
        self.sock.close()


# -- the zygote ----------------------------------------------------------------------------


def _child_main(request: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: become the requested program and exit as the interpreter does."""
    global _may_start_zygotes  # noqa: PLW0603 (this process is the child now)
    code = 0
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        if request["cwd"]:
            os.chdir(request["cwd"])
        mode, target, argv = request["mode"], request["target"], request["argv"]
        unbuffered = request["unbuffered"] or os.environ.get("PYTHONUNBUFFERED")
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = _text_stream(1, bool(unbuffered), os.isatty(1), "strict")
        sys.stderr = _text_stream(2, bool(unbuffered), True, "backslashreplace")
        sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        first = "" if mode == "-c" else os.path.dirname(os.path.abspath(target))
        if mode == "-m":
            first = os.getcwd()
        sys.path[:] = [first, *extra, *request["site_path"]]
        sys.argv = list(argv)
        _zygotes.clear()
        _zygotes.update(request["zygotes"])  # its own children fork from them too
        _may_start_zygotes = False
        subprocess.run = run
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = __builtins__
        sys.modules["__main__"] = main
        if mode == "-c":
            exec(compile(target, "<string>", "exec"), main.__dict__)  # noqa: S102
        elif mode == "-m":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            main.__dict__["__file__"] = target
            runpy.run_path(target, run_name="__main__")
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT  # the interpreter ends itself with SIGINT then
    except BaseException:  # noqa: BLE001 - what the interpreter prints for an uncaught one
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # noqa: SLF001
        atexit._run_exitfuncs()  # noqa: SLF001
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001, S110
            pass
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def _text_stream(fd: int, unbuffered: bool, line_buffering: bool, errors: str) -> io.TextIOWrapper:
    """A standard stream as CPython makes it: buffered bytes unless `-u`, then text."""
    raw = io.FileIO(fd, "w", closefd=False)
    binary = raw if unbuffered else io.BufferedWriter(raw)
    return io.TextIOWrapper(
        binary, errors=errors, line_buffering=line_buffering, write_through=unbuffered
    )


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _die_with_parent() -> None:
    """Linux: the zygote gets SIGKILL when the pytest process that started it dies."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # elsewhere it ends when the pytest process's atexit kills it


def serve(path: str, backend: str = "tensorflow") -> None:
    """A zygote: imports TensorFlow (or Keras on JAX, and `jax`), then forks one child per
    request on socket `path`."""
    tune_gc()
    if backend == "jax":
        import jax  # noqa: F401 - no backend is made: the child asks for its devices
        import keras  # noqa: F401 - on JAX (the zygote's KERAS_BACKEND)
    else:
        import tensorflow  # noqa: F401 - the point of the zygote

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    _die_with_parent()
    waiting: dict[int, _Channel] = {}
    site_path = list(sys.path[1:])  # the repository (PYTHONPATH), the standard library, site
    sys.stdout.write("READY\n")
    sys.stdout.flush()
    while True:
        ready, _, _ = select.select([listener, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                try:
                    conn.send({"returncode": code})
                except OSError:
                    pass
                conn.close()
        if listener in ready:
            conn = _Channel(listener.accept()[0])
            request, fds = conn.receive()
            if request is None or request.get("stop"):
                conn.close()
                for fd in fds:
                    os.close(fd)
                if request is not None:
                    return
                continue
            request["site_path"] = site_path
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                for other in waiting.values():
                    other.close()
                os.close(wake_r)
                os.close(wake_w)
                _child_main(request, fds)
            for fd in fds:
                os.close(fd)
            waiting[pid] = conn
            conn.send({"pid": pid})


# -- the client ----------------------------------------------------------------------------


class ForkedProcess:
    """A child forked by the zygote, driven like a `subprocess.Popen`."""

    def __init__(self, channel: _Channel, pid: int, args: list[str], text: bool,
                 stdout: int | None, stderr: int | None) -> None:  # fmt: skip
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self._channel = channel
        self.stdin = None
        self.stdout = _reader(stdout, text)
        self.stderr = _reader(stderr, text)
        self._outputs: dict[str, Any] = {}
        self._readers: list[threading.Thread] | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            ready, _, _ = select.select([self._channel.sock], [], [], 0)
            if ready or self._channel.pending():
                self._collect()
        return self.returncode

    def _collect(self) -> None:
        message, _ = self._channel.receive()
        self._channel.close()
        if message is None:
            raise ChildProcessError(
                f"the tests' zygote ended before it reported the exit status of pid {self.pid}"
            )
        self.returncode = int(message["returncode"])

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not self._channel.pending():
                ready, _, _ = select.select([self._channel.sock], [], [], timeout)
                if not ready:
                    raise subprocess.TimeoutExpired(self.args, timeout)
            self._collect()
        return self.returncode  # type: ignore[return-value]

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        if self._readers is None:  # once: a call again after a timeout goes on waiting
            self._readers = [
                threading.Thread(target=_drain, args=(stream, self._outputs, name), daemon=True)
                for name, stream in (("out", self.stdout), ("err", self.stderr))
                if stream is not None
            ]
            for reader in self._readers:
                reader.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in self._readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self._outputs.get("out"), self._outputs.get("err")

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not reaped yet, so the pid is still this child's
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> ForkedProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait()


def _reader(fd: int | None, text: bool) -> Any:
    if fd is None:
        return None
    return os.fdopen(fd, "r" if text else "rb", errors="replace" if text else None)


def _drain(stream: Any, outputs: dict[str, Any], name: str) -> None:
    outputs[name] = stream.read()
    stream.close()


_zygotes: dict[str, dict[str, Any] | None] = {}  # backend -> {"path", "env"}; None: none
_started: dict[str, dict[str, Any]] = {}  # backend -> {"proc", "path", "folder"}: its own
_may_start_zygotes = True  # False in a forked child: it uses its parent's zygotes


def _zygote_path(backend: str) -> str | None:
    """The socket of this process's zygote for `backend`, started on first use (None: none)."""
    if backend in _zygotes:
        proc = _started.get(backend, {}).get("proc")
        if proc is not None and proc.poll() is not None:
            _zygotes[backend] = None  # it died: new interpreters from now on
        return (_zygotes[backend] or {}).get("path")
    _zygotes[backend] = None
    if not _may_start_zygotes or os.environ.get("KMK_TEST_FORK", "1") == "0":
        return None
    if not hasattr(os, "fork"):
        return None
    folder = tempfile.mkdtemp(prefix="kmk-zygote-")
    path = os.path.join(folder, "socket")
    env = _zygote_env(backend)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.forkserver", path, backend],
        env=env, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    ready, _, _ = select.select([proc.stdout], [], [], 600)
    if not ready or proc.stdout is None or proc.stdout.readline().strip() != "READY":
        proc.kill()
        proc.wait()
        return None
    _zygotes[backend] = {"path": path, "env": env}
    if not _started:
        atexit.register(_stop_zygotes)
    _started[backend] = {"proc": proc, "path": path, "folder": folder}
    return path


def _stop_zygotes() -> None:
    for started in _started.values():
        proc = started["proc"]
        proc.kill()
        proc.wait()
        proc.stdout.close()
        try:
            os.unlink(started["path"])
            os.rmdir(started["folder"])
        except OSError:
            pass


def _parse(args: list[str]) -> tuple[str, str, list[str], bool] | None:
    """(mode, target, sys.argv, unbuffered) of `python ARGS`, None for what is not served."""
    rest, unbuffered = list(args[1:]), False
    while rest and rest[0] == "-u":
        rest, unbuffered = rest[1:], True
    if len(rest) >= 2 and rest[0] == "-c":
        return "-c", rest[1], ["-c", *rest[2:]], unbuffered
    if len(rest) >= 2 and rest[0] == "-m":
        return "-m", rest[1], [rest[1], *rest[2:]], unbuffered
    if rest and not rest[0].startswith("-"):
        return "script", rest[0], rest, unbuffered
    return None


# What `popen` hands a forked child as `Popen` would: other arguments get a real Popen.
_SERVED_KWARGS = {
    "stdin", "stdout", "stderr", "env", "cwd", "text", "universal_newlines", "encoding",
    "errors", "close_fds", "bufsize",
}  # fmt: skip


def _backend(args: Any, env: dict[str, str], kwargs: dict[str, Any]) -> str | None:
    """The zygote that can fork `python ARGS` under `env` as a new interpreter would run it."""
    if not isinstance(args, (list, tuple)) or not args or str(args[0]) != sys.executable:
        return None
    unsupported = ("preexec_fn", "start_new_session", "pass_fds", "shell", "process_group")
    if any(kwargs.get(name) for name in unsupported) or kwargs.get("stdin") == subprocess.PIPE:
        return None
    if set(kwargs) - _SERVED_KWARGS:  # e.g. user=, umask=, restore_signals=: a real Popen
        return None
    backend = env.get("KERAS_BACKEND", "tensorflow")
    if backend not in BACKENDS:
        return None
    zygote_env = (_zygotes.get(backend) or {}).get("env") or _zygote_env(backend)
    prefixes = ("KERAS_", "JAX_")
    names = {*IMPORT_TIME_VARIABLES, *(n for n in (*env, *zygote_env) if n.startswith(prefixes))}
    names -= {"KERAS_BACKEND", "KERAS_HOME"}
    if any(env.get(name) != zygote_env.get(name) for name in names):
        return None
    config = _keras_config(env)
    if config is None or config != _keras_config(zygote_env):
        return None
    return backend


_KERAS_DEFAULTS = {"floatx": "float32", "epsilon": 1e-07, "image_data_format": "channels_last"}


def _keras_config(env: dict[str, str]) -> dict[str, Any] | None:
    """What the keras.json Keras reads at import under `env` sets (None: unreadable)."""
    home = env.get("KERAS_HOME") or os.path.join(env.get("HOME") or "/", ".keras")
    try:
        with open(os.path.join(os.path.expanduser(home), "keras.json"), "rb") as handle:
            found = json.load(handle)
    except FileNotFoundError:
        found = {}  # Keras' defaults (it writes them there, which a fork does not)
    except (OSError, ValueError):
        return None
    config = {**_KERAS_DEFAULTS, **found} if isinstance(found, dict) else None
    if config is not None:
        config.setdefault("backend", "tensorflow")
        if env.get("KERAS_BACKEND"):  # the variable wins over the file's backend
            config["backend"] = env["KERAS_BACKEND"]
    return config


def _zygote_env(backend: str) -> dict[str, str]:
    env = {**_BASE_ENV, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.pop("KERAS_BACKEND", None)
    if backend != "tensorflow":
        env["KERAS_BACKEND"] = backend
    return env


def _fd_for(spec: Any, default: int, keep: list[int]) -> tuple[int, int | None]:
    """(fd the child gets, fd this side reads) for a Popen stdout/stderr/stdin argument."""
    if spec is None:
        return default, None
    if spec == subprocess.PIPE:
        read, write = os.pipe()
        keep.append(write)
        return write, read
    if spec == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
        keep.append(fd)
        return fd, None
    if isinstance(spec, int):
        return spec, None
    return spec.fileno(), None


def popen(args: list[str], **kwargs: Any) -> Any:
    """A `subprocess.Popen(args, **kwargs)`, forked from a zygote where that is the same."""
    env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
    parsed = _parse([str(a) for a in args]) if isinstance(args, (list, tuple)) else None
    backend = _backend(args, env, kwargs) if parsed is not None else None
    path = _zygote_path(backend) if backend is not None else None
    _log(args, path is not None)
    if path is None:
        return subprocess.Popen(args, **kwargs)
    text = bool(kwargs.get("text") or kwargs.get("universal_newlines") or kwargs.get("encoding"))
    opened: list[int] = []
    stdin, _ = _fd_for(kwargs.get("stdin"), 0, opened)
    out, out_read = _fd_for(kwargs.get("stdout"), 1, opened)
    if kwargs.get("stderr") == subprocess.STDOUT:
        err, err_read = out, None
    else:
        err, err_read = _fd_for(kwargs.get("stderr"), 2, opened)
    mode, target, argv, unbuffered = parsed
    cwd = kwargs.get("cwd") or os.getcwd()  # the caller's, as for a Popen
    request = {
        "mode": mode, "target": target, "argv": argv, "unbuffered": unbuffered,
        "env": env, "cwd": os.fspath(cwd),
        "zygotes": {name: z for name, z in _zygotes.items() if z},
    }  # fmt: skip
    if mode == "script":
        request["target"] = os.path.join(os.fspath(cwd), target)
    channel = _Channel(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
    try:
        try:
            channel.sock.connect(path)
            channel.send(request, [stdin, out, err])
            reply, _ = channel.receive()
        finally:
            for fd in opened:
                os.close(fd)
    except OSError:
        reply = None
    if reply is None:  # the zygote is gone: a new interpreter, and no more forks
        channel.close()
        for fd in (out_read, err_read):
            if fd is not None:
                os.close(fd)
        _zygotes[backend] = None
        return subprocess.Popen(args, **kwargs)
    sys.audit("subprocess.Popen", sys.executable, list(args), cwd, env)  # counted as a child
    sys.audit("kmk.test.fork")
    return ForkedProcess(channel, int(reply["pid"]), list(args), text, out_read, err_read)


def _log(args: Any, forked: bool) -> None:
    """Appends `{"forked": ..., "args": ...}` to the file `KMK_TEST_FORK_LOG` names, if any."""
    path = os.environ.get("KMK_TEST_FORK_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as log:
            shown = [str(a)[:200] for a in args] if isinstance(args, (list, tuple)) else str(args)
            log.write(json.dumps({"forked": forked, "args": shown}) + "\n")


def run(
    args: list[str],
    *,
    timeout: float | None = None,
    check: bool = False,
    capture_output: bool = False,
    input: Any = None,  # noqa: A002 - subprocess.run's name
    **kwargs: Any,
) -> subprocess.CompletedProcess:
    """`subprocess.run`, through `popen` (a timeout kills the child and carries its output)."""
    if capture_output:
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
    if input is not None:
        return _subprocess_run(args, timeout=timeout, check=check, input=input, **kwargs)
    with popen(args, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(args, timeout, output=out, stderr=err) from None
    done = subprocess.CompletedProcess(args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


if __name__ == "__main__":
    serve(*sys.argv[1:3])
