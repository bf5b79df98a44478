"""Test bed: this pytest process has 2 logical CPU devices, configured once, and no GPU.

Logical devices must be configured before TensorFlow initialises, so the session fixture
`tensorflow_test_bed` does it before the first test, when a collected module imported
TensorFlow (no test module may create a variable or run an op at import); this file itself
imports no TensorFlow. Tests that need another layout
(1 device, or a fresh runtime) run in a subprocess through `tests/subproc.py`.

GPUs are hidden (`CUDA_VISIBLE_DEVICES=-1`, inherited by every subprocess, and
`set_visible_devices` here), so the suite asserts the same device layouts on a GPU host as
on a laptop; what the kit does with GPUs is tested with fake device tables.

Every Python child a test starts (`subprocess`, seen through Python's `subprocess.Popen`
audit event, which `tests/forkserver.py` raises for the children it forks) is counted: each
test's teardown report carries `("children", n)` and `("forked", m)` (a module fixture's
children count for the first test that uses it), and the run ends with a line that says
how many children the tests started, how many were forked, and which tests outside the
`slow` tier started any.

This process collects garbage less often than CPython's default (`forkserver.tune_gc`;
`KMK_TEST_GC=0` keeps the default).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["WANDB_MODE"] = "offline"  # also for users who export WANDB_MODE=online
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.pop("KMK_SIMULATE_REPLICAS", None)
os.environ.pop("TF_CONFIG", None)
for _name in [n for n in os.environ if n.startswith("SLURM_")]:  # the suite under srun too
    del os.environ[_name]
# A CPU roof a developer stored with `bench --roof` would add `mfu` to every monitor's logs.
_ROOF_DIR = tempfile.mkdtemp(prefix="kmk-roof-")
atexit.register(shutil.rmtree, _ROOF_DIR, ignore_errors=True)
os.environ["KMK_ROOF_FILE"] = os.path.join(_ROOF_DIR, "roof.json")
os.environ["CUDA_VISIBLE_DEVICES"] = "-1"  # before TensorFlow loads CUDA; children inherit it
os.environ["HIP_VISIBLE_DEVICES"] = "-1"

import sys  # noqa: E402

import pytest  # noqa: E402

from tests import forkserver  # noqa: E402 (the standard library only)

forkserver.tune_gc()  # before the test modules import TensorFlow: tracing makes many young objects

LOGICAL_CPUS = 2


def configure_tensorflow() -> None:
    """Hides the GPUs and splits the CPU into `LOGICAL_CPUS` logical devices (once)."""
    import tensorflow as tf

    if len(tf.config.get_logical_device_configuration(_cpu(tf)) or []) == LOGICAL_CPUS:
        return
    try:
        tf.config.set_visible_devices([], "GPU")
        tf.config.set_logical_device_configuration(
            _cpu(tf), [tf.config.LogicalDeviceConfiguration()] * LOGICAL_CPUS
        )
    except RuntimeError as err:
        raise RuntimeError(
            "TensorFlow was initialised before the test bed could split the CPU: a test "
            "module creates a variable or runs an op at import (make it in a fixture)"
        ) from err


def _cpu(tf):
    return tf.config.list_physical_devices("CPU")[0]


@pytest.fixture(scope="session", autouse=True)
def tensorflow_test_bed():
    """The 2 logical CPU devices, before the first test, when a collected test module
    imported TensorFlow (session scope: before any module- or class-scoped fixture).

    Tests that import no TensorFlow (the pure modules: validation, checkpoint metadata,
    launch options) never load it, so they run in seconds alone.
    """
    if "tensorflow" in sys.modules:
        configure_tensorflow()


@pytest.fixture(scope="module")
def resumer():
    """One SGD model of `tests.ckpt_helpers.build` for a module's resumes whose checks do
    not depend on the weights a model starts from (one trace for them all): only its first
    fit starts from fresh weights, later ones from the previous test's, which a restore
    replaces as for any instance (see tests/test_synced_checkpoint.py::
    test_reusing_the_instance_after_fit_raised_resumes_like_a_new_one)."""
    from tests.ckpt_helpers import build  # TensorFlow: only for the modules that use it

    return build("sgd", seed=99)


@pytest.fixture(scope="module")
def fresh():
    """`fresh(optimizer="sgd")`: the module's one `tests.ckpt_helpers.build(optimizer)`
    model of that optimizer for runs from scratch (one trace for them all), set back at
    each call to the state it was built in (`tests.ckpt_helpers.set_back`): it trains as a
    new `build` would, bit for bit."""
    from tests.ckpt_helpers import build, set_back  # TensorFlow: only for modules using it

    made = {}

    def get(optimizer: str = "sgd"):
        if optimizer not in made:
            made[optimizer] = set_back(build(optimizer))
        return made[optimizer]()

    return get


def _environment_kept():
    """Yields once; then undoes what was changed in `os.environ` meanwhile."""
    before = dict(os.environ)
    yield
    if dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture(scope="module", autouse=True)
def module_environment_restored():
    """What a test module (its module fixtures included) changed in `os.environ` is undone
    after it: the children of the next module's tests in this process, which inherit
    `os.environ`, see the session's environment whichever module ran here before (a helper
    that set `KMK_SIMULATE_REPLICAS` when a fixture imported it gave a later JAX child 2
    devices)."""
    yield from _environment_kept()


@pytest.fixture(autouse=True)
def environment_restored():
    """Likewise for each test (and its function fixtures) within its module."""
    yield from _environment_kept()


def pytest_configure(config: pytest.Config) -> None:
    """Under `--dist loadfile` (README's command) xdist sends modules in collection order
    (`pytest_collection_modifyitems`, below), not by their number of tests; and a worker
    that crashes ends the run (its test failed) instead of being replaced: a replaced worker
    can hang `loadfile` forever (pytest-dev/pytest-xdist#784)."""
    if getattr(config.option, "dist", None) == "loadfile":
        config.option.loadscopereorder = False
        if getattr(config.option, "maxworkerrestart", None) is None:
            config.option.maxworkerrestart = 0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules with the most `slow` tests first (each module's tests in their order): under
    `--dist loadfile` the long modules start early and the many short ones fill the end."""
    slow: dict[object, int] = {}
    for item in items:
        slow[item.path] = slow.get(item.path, 0) + (item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: -slow[item.path])


_children_started = [0]
_children_forked = [0]  # of those, forked by tests/forkserver.py (its "kmk.test.fork" event)


def _count_children(event: str, args: tuple) -> None:
    # Interpreters only (a Python, or a console script beside this one): not `uname -p`.
    # An audit hook's exception would reach the Popen it watches: it never raises.
    if event == "kmk.test.fork":
        _children_forked[0] += 1
    if event != "subprocess.Popen":
        return
    try:
        command = args[1]
        first = command if isinstance(command, (str, bytes, os.PathLike)) else command[0]
        program = os.fsdecode(args[0] if args[0] is not None else first)
        here = os.path.dirname(sys.executable)
        if os.path.basename(program).startswith("python") or os.path.dirname(program) == here:
            _children_started[0] += 1
            if os.environ.get("KMK_TEST_FORK_LOG"):  # which children, for tests/forkserver.py
                with open(os.environ["KMK_TEST_FORK_LOG"], "a", encoding="utf-8") as log:
                    shown = [os.fsdecode(a)[:120] for a in command] if first is not command else []
                    log.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?')}\t{shown}\n")
    except Exception:  # noqa: BLE001 (counting must never break a test's child)
        pass


sys.addaudithook(_count_children)


_children_before: dict[str, tuple[int, int]] = {}


def pytest_runtest_logstart(nodeid: str, location) -> None:
    """Notes the count before the test's setup (its module fixtures' children count too)."""
    _children_before[nodeid] = (_children_started[0], _children_forked[0])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Puts the children of setup, call and teardown on the teardown report."""
    if call.when == "teardown":
        now = (_children_started[0], _children_forked[0])
        started, forked = _children_before.pop(item.nodeid, now)
        item.user_properties.append(("children", now[0] - started))
        item.user_properties.append(("forked", now[1] - forked))
    yield


_children_by_test: dict[str, tuple[int, int, bool]] = {}  # controller: nodeid -> (n, f, slow)


def pytest_runtest_logreport(report) -> None:
    """Collects each test's count (from its teardown report, which xdist sends here too)."""
    if report.when == "teardown":
        counts = dict(report.user_properties)
        _children_by_test[report.nodeid] = (
            counts.get("children", 0),
            counts.get("forked", 0),
            "slow" in report.keywords,
        )


def pytest_terminal_summary(terminalreporter) -> None:
    """One line: the children the tests started, and the fast-tier tests among them."""
    started = {k: v for k, v in _children_by_test.items() if v[0]}
    fast = sorted(k for k, (_, _, slow) in started.items() if not slow)
    terminalreporter.write_line(
        f"child processes started: {sum(n for n, _, _ in started.values())} "
        f"({sum(f for _, f, _ in started.values())} forked from the tests' zygotes), by "
        f"{len(started)} tests"
        + (f"; outside the slow tier: {', '.join(fast[:5])}" if fast else "")
        + (f" and {len(fast) - 5} more" if len(fast) > 5 else "")
    )
