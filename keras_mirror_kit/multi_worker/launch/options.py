"""The launcher's command line: parsing, and checks before any worker starts."""

from __future__ import annotations

import argparse
import difflib
import os
from collections.abc import Sequence

from keras_mirror_kit.multi_worker import PREEMPTED_EXIT_CODE
from keras_mirror_kit.multi_worker.gpus import visible_gpus
from keras_mirror_kit.multi_worker.launch.environment import assign_gpus
from keras_mirror_kit.multi_worker.launch.errors import PROG, LaunchError
from keras_mirror_kit.multi_worker.launch.isolation import NETWORK_CHOICES
from keras_mirror_kit.multi_worker.launch.targets import resolve_target

FINISH_WINDOW_S = 30.0

_VALUE_OPTIONS = (
    "-n",
    "--nproc",
    "--startup-timeout",
    "--timeout",
    "--grace",
    "--finish-window",
    "--gpus-per-worker",
    "--max-restarts",
    "--network",
)
_FLAG_OPTIONS = ("-m", "--memory-growth", "-h", "--help")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage=(
            f"{PROG} -n N [options] [--] script.py [args ...]\n"
            f"       {PROG} -n N [options] [--] command [args ...]\n"
            f"       {PROG} -n N [options] -m module [args ...]"
        ),
        description=(
            "Start N local worker processes of a training script or command, each with a "
            "TF_CONFIG for a MultiWorkerMirroredStrategy cluster on 127.0.0.1, in a network "
            "namespace of their own where the host allows it (--network). If one "
            "fails, the others are stopped and the launcher exits non-zero. A Python "
            "script (a .py file, or a file that is Python source) runs on this "
            "launcher's Python; a command (a program on PATH or an executable file, as "
            "for mpirun or horovodrun) runs as given."
        ),
        epilog=(
            "examples:\n"
            f"  {PROG} -n 2 train.py --epochs 10\n"
            f"  {PROG} -n 2 -- python3 train.py --epochs 10\n"
            f"  {PROG} -n 2 -- ./run.sh\n"
            f"  {PROG} -n 2 -m my_package.train --epochs 10\n"
            f"  {PROG} -n 4 --gpus-per-worker 2 --memory-growth train.py   # 8 GPUs\n"
            f"  {PROG} -n 2 --max-restarts 3 train.py   # restart all after a failure\n"
            f"  {PROG} -n 2 --network host train.py     # workers on this host's network\n"
            "\n"
            "Options are not abbreviated; everything after `--` goes to the script.\n"
            "The workers never outlive the launcher: SIGINT, SIGTERM and SIGHUP stop them,\n"
            "and if the launcher is killed, they are killed."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # `--startup 5` is an error, not --startup-timeout
    )
    parser.add_argument(
        "-n", "--nproc", type=int, required=True, metavar="N", help="number of workers (>= 1)"
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="seconds for every worker to join the cluster, i.e. to create its strategy "
        "(default 300; 0: no limit, e.g. for scripts that do not use keras_mirror_kit)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=0.0,
        metavar="S",
        help="stop the workers if they have not all finished after S seconds (default: none)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds between SIGTERM and SIGKILL when stopping workers, and for what "
        "they leave behind at a normal end (default 5)",
    )
    parser.add_argument(
        "--finish-window",
        type=float,
        default=FINISH_WINDOW_S,
        metavar="S",
        help="once a worker exits with status 0, the others must exit within S seconds, "
        "else that worker left them waiting: the run fails and they are stopped "
        f"(default {FINISH_WINDOW_S:g}; 0: wait without limit)",
    )
    parser.add_argument(
        "--gpus-per-worker",
        type=int,
        default=None,
        metavar="K",
        help="give each worker K GPUs of its own via CUDA_VISIBLE_DEVICES (default: the "
        "visible GPUs split evenly, an error if N does not divide them; nothing set "
        "without GPUs; 0: no GPU for any worker)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="K",
        help="when a worker fails (a non-zero status, a signal, also status "
        f"{PREEMPTED_EXIT_CODE} after a save on a stop signal) or does not join, stop the "
        "others and start all N again on new ports, up to K times; the script resumes "
        "from its SyncedCheckpoint (default 0: no restart)",
    )
    parser.add_argument(
        "--network",
        choices=NETWORK_CHOICES,
        default="auto",
        help="auto (default): on Linux, run the workers in a private network namespace "
        "(loopback only: their TensorFlow servers, which listen on all interfaces and run "
        "any graph they are sent, exist nowhere else), else on this host's network with a "
        "warning; isolated: the same, but refuse to start without the namespace; host: this "
        "host's network, e.g. for W&B online or remote data (warns)",
    )
    parser.add_argument(
        "--memory-growth",
        action="store_true",
        help="set TF_FORCE_GPU_ALLOW_GROWTH=true in every worker: TensorFlow takes GPU "
        "memory as needed instead of all of it at start-up",
    )
    parser.add_argument(
        "-m",
        dest="module",
        action="store_true",
        help="run the target as a module (python -m TARGET), like python's -m",
    )
    return parser


def _split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Splits argv into the launcher's options and `script.py args...`.

    The launcher's options end at a `--` or at the first word that is neither an option
    nor an option's value; everything from there on belongs to the script.
    """
    argv = list(argv)
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return argv[:i], argv[i + 1 :]
        if not token.startswith("-") or token == "-":
            return argv[:i], argv[i:]
        i += 2 if token in _VALUE_OPTIONS else 1
    return argv, []


def _check_options(parser: argparse.ArgumentParser, own: Sequence[str]) -> None:
    """Refuses an unknown or abbreviated option with the options it may have meant."""
    known = (*_VALUE_OPTIONS, *_FLAG_OPTIONS)
    skip = False
    for token in own:
        if skip:
            skip = False
            continue
        name = token.split("=", 1)[0]
        if name in known or (len(name) > 2 and name[:2] in ("-n", "-h") and name[1] != "-"):
            skip = token in _VALUE_OPTIONS
            continue
        close = [o for o in known if o.startswith(name)] or difflib.get_close_matches(
            name, known, n=2, cutoff=0.8
        )
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        parser.error(
            f"unknown option {name}{hint}. The launcher's options are not abbreviated; "
            "options meant for the script or command go after it (e.g. `-n 2 -- train.py "
            f"{token}`). Received: {token}"
        )


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """The launcher's options, with `target` and `args` (what the workers run) added."""
    parser = _build_parser()
    own, command = _split_argv(argv)
    _check_options(parser, own)
    args = parser.parse_args(own)
    if not command:
        parser.error(
            "the script or command to run is missing (e.g. `-n 2 train.py` or "
            "`-n 2 -- python3 train.py`)"
        )
    args.target, args.args = command[0], command[1:]
    return args


def validate(args: argparse.Namespace) -> None:
    """Checks the options, and adds `kind`, `command` and `gpus`: refused before any start."""
    if args.nproc < 1:
        raise LaunchError(f"-n must be a positive number of workers. Received: -n {args.nproc}")
    if args.max_restarts < 0:
        raise LaunchError(
            "--max-restarts must be >= 0 (0: no restart). Received: --max-restarts "
            f"{args.max_restarts}"
        )
    for name in ("startup_timeout", "timeout", "grace", "finish_window"):
        value = getattr(args, name)
        if value < 0:
            flag = "--" + name.replace("_", "-")
            raise LaunchError(f"{flag} must be >= 0 seconds. Received: {flag} {value}")
    check_keras_backend(os.environ.get("KERAS_BACKEND"))
    args.kind, prefix = resolve_target(args.target, module=args.module)
    args.command = [*prefix, *args.args]
    if args.gpus_per_worker is not None and args.gpus_per_worker < 0:
        raise LaunchError(
            "--gpus-per-worker must be >= 0 (0: no GPU for any worker). Received: "
            f"--gpus-per-worker {args.gpus_per_worker}"
        )
    args.gpus = assign_gpus(args.nproc, visible_gpus(), args.gpus_per_worker)


def check_keras_backend(backend: str | None) -> None:
    """Refuses a job for another Keras backend than TensorFlow, before any worker starts.

    The workers are `MultiWorkerMirroredStrategy` workers (TensorFlow). On JAX the kit trains
    in one process over all local devices; multi-process JAX (`jax.distributed`) is not
    built. A script that selects JAX itself is refused by each worker's `distributed()`.
    """
    name = (backend or "").strip().lower()
    if not name or name == "tensorflow":
        return
    if name == "jax":
        raise LaunchError(
            "launch starts TensorFlow workers (MultiWorkerMirroredStrategy, one TF_CONFIG "
            "each); multi-process training on Keras' JAX backend (jax.distributed) is not "
            "built in keras-mirror-kit. On JAX, train in one process over all local devices "
            "(keras.distribution.DataParallel): run the script itself, e.g. "
            "`KERAS_BACKEND=jax python3 train.py`, or select TensorFlow for launch "
            f"(KERAS_BACKEND=tensorflow). Received: KERAS_BACKEND={backend!r}"
        )
    raise LaunchError(
        "launch starts TensorFlow workers (MultiWorkerMirroredStrategy), and keras-mirror-kit "
        f"distributes on Keras' TensorFlow and JAX backends only. Set KERAS_BACKEND=tensorflow "
        f"for launch. Received: KERAS_BACKEND={backend!r}"
    )
