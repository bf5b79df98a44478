"""`keras-mirror-kit launch`: run one training script as N local workers, like torchrun.

```
keras-mirror-kit launch -n 2 train.py --epochs 10
keras-mirror-kit launch -n 2 -- train.py --epochs 10      # "--" ends the launcher's options
keras-mirror-kit launch -n 2 -- python3 train.py --epochs 10   # a command, as for mpirun
keras-mirror-kit launch -n 2 -- ./run.sh
python -m keras_mirror_kit.multi_worker.launch -n 2 -m my_package.train
```

The first word after the launcher's options decides how a worker is started (see
`resolve_target`): a Python script (a `.py`/`.pyw`/`.pyz` path, a directory with a
`__main__.py`, or a file whose `#!` line names python, or with no `#!` line, that
compiles as Python) runs as `sys.executable -u script args...`; `-m module` as
`sys.executable -u -m module args...`; an executable file or a program on `PATH` runs as
the command itself (`python3 train.py`, `./run.sh`). Anything else is refused before any
worker starts. Each worker gets a `TF_CONFIG` naming N workers on free 127.0.0.1 ports
(found by binding port 0, where the workers will bind them) and its own `task.index`, so
`kmk.distributed()` picks `MultiWorkerMirroredStrategy` without a code change. Every line
a worker writes is relayed with a `[worker i] ` prefix (stdout to stdout, stderr to
stderr).

TensorFlow's server in each worker listens on all interfaces and runs any graph it is
sent, so by default (`--network auto`) the workers of an attempt run, on Linux, in one
network namespace of their own with only a loopback interface (see `isolation`); where the
host refuses that, they run on this host's network after one WARNING that names the ports.
`--network isolated` refuses to start without the namespace; `--network host` opts out
(workers that need the network: W&B online, remote data), with the same WARNING. Each
worker gets `KMK_LAUNCH_NETWORK=isolated` or `host`, and `distributed()` then leaves the
warning to the launcher. For tests only, `KMK_LAUNCH_TEST_NAMESPACES=refuse` in the
launcher's environment acts as a host that refuses namespaces, `=user` makes a user
namespace even as root.

TensorFlow does not bound how long a worker waits for its peers, so the launcher does: a
worker is *ready* once its strategy exists (the kit creates the file named by
`KMK_LAUNCH_READY_FILE` then, after every worker has connected), and if any worker is not
ready within `--startup-timeout` seconds the group is stopped. The group is also stopped
when any worker exits with a non-zero status, when a worker exits with status 0 and the
others have not all exited `--finish-window` seconds later (it left its peers waiting in a
collective), or after `--timeout` seconds if given: the others get SIGTERM, then SIGKILL
after `--grace` seconds (TensorFlow's coordination service catches SIGTERM, so a blocked
worker often needs the SIGKILL). Each worker runs in its own process group, and the whole
group is stopped, so processes the worker started do not outlive it (at a normal end too,
with the same grace period). The launcher then exits with the failing worker's status (128
+ N when it was killed by signal N; 1 for a worker that left early; 124 on a timeout) after
a message naming that worker and the last lines of its stderr.

Workers never outlive the launcher: SIGINT, SIGTERM and SIGHUP stop them as above, and if
the launcher dies without doing so (SIGKILL, a crash), each worker gets SIGKILL from the
kernel (Linux only: a parent-death signal, set by a small Python wrapper that then execs
the worker's program) and a small watchdog process kills every worker's process group as
soon as the launcher is gone. For tests and debugging only, `KMK_LAUNCH_NO_PDEATHSIG=1` or
`KMK_LAUNCH_NO_WATCHDOG=1` in the launcher's environment turns one of the two off.
Elsewhere than Linux, the watchdog alone does this, and what a worker left in its group
gets SIGKILL right after SIGTERM at a normal end (no /proc to wait on); where `os.waitid`
is missing (macOS before Python 3.13) the launcher reaps a worker when it sees it exit,
so what that worker left in its group is no longer stopped.

`--max-restarts K` turns the launcher into a supervisor: when a worker fails (a non-zero
status or a signal, including status 75, `PREEMPTED_EXIT_CODE`, of a worker that saved on a
stop signal someone sent it) or a worker does not join within `--startup-timeout`, the
others are stopped as above and all N start again on new ports, up to K times, with
`KMK_LAUNCH_RESTART_COUNT` telling each attempt its number; a script with a
`SyncedCheckpoint` resumes from its newest checkpoint. A worker that exits with status 75
lets its peers (which saved at the same step) exit by themselves within `--finish-window`
seconds before they are stopped. No restart follows a worker that left early with status
0 (a script error a restart would repeat), `--timeout` (it bounds all attempts together)
or a signal to the launcher itself. After K restarts the launcher exits with the last
failure, naming the worker.

On a host with GPUs each worker gets its own: `--gpus-per-worker K` (default: the visible
GPUs split evenly) sets `CUDA_VISIBLE_DEVICES` per worker (see `visible_gpus` and
`assign_gpus`); `--memory-growth` sets `TF_FORCE_GPU_ALLOW_GROWTH=true` in every worker.

The parts: `options` (the command line and its checks), `targets` (what a worker runs),
`environment` (ports, `TF_CONFIG`, GPUs and variables of each worker), `isolation` (the
workers' network namespace, or the warning), `workers` (one worker process: start, output
relay, exit), `wrapper` (each worker's first program: the parent-death signal, entering
the namespace), `orphan_guard` (the watchdog, and the switches of both), `group` (the N
workers of one attempt: start, watch, stop, report) and `supervisor` (`main`: signals and
restarts). The package uses only the standard library (it never imports TensorFlow).
"""

from __future__ import annotations

from keras_mirror_kit.multi_worker import NETWORK_ENV as NETWORK_ENV
from keras_mirror_kit.multi_worker import PREEMPTED_EXIT_CODE as PREEMPTED_EXIT_CODE
from keras_mirror_kit.multi_worker import READY_FILE_ENV as READY_FILE_ENV
from keras_mirror_kit.multi_worker.gpus import GPU_ENV as GPU_ENV
from keras_mirror_kit.multi_worker.gpus import visible_gpus
from keras_mirror_kit.multi_worker.launch.environment import (
    MEMORY_GROWTH_ENV as MEMORY_GROWTH_ENV,
)
from keras_mirror_kit.multi_worker.launch.environment import RANK_ENV as RANK_ENV
from keras_mirror_kit.multi_worker.launch.environment import RESTART_ENV as RESTART_ENV
from keras_mirror_kit.multi_worker.launch.environment import WORLD_SIZE_ENV as WORLD_SIZE_ENV
from keras_mirror_kit.multi_worker.launch.environment import (
    assign_gpus,
    free_ports,
    tf_config_for,
    worker_environment,
)
from keras_mirror_kit.multi_worker.launch.errors import EXIT_FAILED as EXIT_FAILED
from keras_mirror_kit.multi_worker.launch.errors import EXIT_TIMEOUT as EXIT_TIMEOUT
from keras_mirror_kit.multi_worker.launch.errors import EXIT_USAGE as EXIT_USAGE
from keras_mirror_kit.multi_worker.launch.errors import PROG as PROG
from keras_mirror_kit.multi_worker.launch.errors import LaunchError
from keras_mirror_kit.multi_worker.launch.isolation import (
    TEST_NAMESPACES_ENV as TEST_NAMESPACES_ENV,
)
from keras_mirror_kit.multi_worker.launch.orphan_guard import NO_PDEATHSIG_ENV as NO_PDEATHSIG_ENV
from keras_mirror_kit.multi_worker.launch.orphan_guard import NO_WATCHDOG_ENV as NO_WATCHDOG_ENV
from keras_mirror_kit.multi_worker.launch.supervisor import main
from keras_mirror_kit.multi_worker.launch.targets import resolve_target

__all__ = [
    "LaunchError",
    "assign_gpus",
    "free_ports",
    "main",
    "resolve_target",
    "tf_config_for",
    "visible_gpus",
    "worker_environment",
]
