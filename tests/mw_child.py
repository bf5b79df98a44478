"""Training job run by the multi-worker tests, through `keras-mirror-kit launch` or alone.

Usage: python -m tests.mw_child OUT_DIR [--epochs N] [--ckpt DIR] [--save-freq F]
       (in DIR, "{rank}" is replaced by the worker's rank)
           [--die-rank R --die-epoch E --die-at-batch B [--die-exit-0]]
           [--delay-rank R --delay S]
           [--spawn-grandchild] [--probe-upstream]
           [--tiny] [--mark-step K[,K...]] [--hold-last-step FILE]
           [--preemption-signals SIGTERM,SIGUSR1] [--accumulate N]
           [--hold-after-strategy FILE]

Trains the CIFAR-10 CNN on a little synthetic data with `kmk.distributed` and
`kmk.make_dataset`, one process per worker (TF_CONFIG from the launcher) or a single
process with KMK_SIMULATE_REPLICAS=2. Each process writes OUT_DIR/result-<rank>.json (what
it saw: chief-ness, replicas, losses, every file it wrote, renamed or deleted) and
OUT_DIR/weights-<rank>.npz (initial weights and weights after each epoch).

For the preemption and restart tests: --tiny trains a one-layer model instead of the CNN
(the same data and order); --mark-step K writes OUT_DIR/reached-<attempt>-<rank> once this
process has trained K steps (<attempt>: KMK_LAUNCH_RESTART_COUNT, 0 outside the launcher;
a list gives each attempt its own K); --hold-last-step FILE waits, before the last step of
training, until FILE exists ("{attempt}" in FILE replaced), so that a signal sent before
FILE is created lands in training. On
`Preempted` (a save on a stop signal) OUT_DIR/preempted-<attempt>-<rank>.json says where it
stopped, and the process exits with status 75. --accumulate N passes
gradient_accumulation_steps=N to `kmk.distributed` and records how many micro-batches
changed the weights (the optimizer's updates). --hold-after-strategy FILE writes
OUT_DIR/listening-<rank>.json (pid, the port of this task in TF_CONFIG) once the strategy
exists (its TensorFlow server listens then), and waits until FILE exists.

Markers that a test polls for (pids-<rank>.json, reached-*, awake-*, listening-*, killed-*)
are written whole: a temporary file beside them, then `os.replace`, so whoever sees one
reads all of it.

A new interpreter (a launched worker, a Slurm task) skips the optional imports of
TensorFlow and Keras that no job here uses (`skip_optional_imports`: JAX, Matplotlib,
pandas; a third of its ~8 s of CPU before the first line of work), and ends as the tests'
zygote ends the children it forks (`exit_as_forked_children_do`: non-daemon threads
joined, `atexit` handlers run, the standard streams flushed, then `os._exit` with the
status, 75 on `Preempted`), without the interpreter's teardown of TensorFlow (about 1.2 s
of CPU). KMK_TEST_LEAN_WORKER=0 runs it as a plain interpreter (to compare).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import subprocess
import sys
import threading
import time

NUM_TRAIN, GLOBAL_BATCH, DATA_SEED, ORDER_SEED, INIT_SEED = 512, 64, 3, 17, 7
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
# Imported by TensorFlow (tf.lite: JAX) and Keras (pandas, Matplotlib) only where installed
# (`try: import ... except ImportError`), used by none of the tests' jobs: 2.5-3 s of CPU of
# the ~8 s a fresh worker spends importing TensorFlow.
OPTIONAL_IMPORTS = ("jax", "jaxlib", "matplotlib", "pandas")
LEAN_ENV = "KMK_TEST_LEAN_WORKER"  # "0": every import and the interpreter's own exit


def _lean() -> bool:
    return os.environ.get(LEAN_ENV, "1") != "0"


def skip_optional_imports() -> None:
    """In a fresh interpreter (TensorFlow not imported yet), before TensorFlow's import:
    JAX, Matplotlib and pandas look absent, as on a host without them (None in
    `sys.modules`: `import` raises ModuleNotFoundError, `importlib.util.find_spec` is None).

    A child forked from the tests' zygote (which imported them with TensorFlow) is left
    alone, and so is a job run with KMK_TEST_LEAN_WORKER=0.
    """
    if "tensorflow" in sys.modules or not _lean():
        return
    for name in OPTIONAL_IMPORTS:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]


def exit_as_forked_children_do(status: object) -> None:
    """Ends the process as tests/forkserver.py ends a child it forked: non-daemon threads
    joined, `atexit` handlers run, stdout and stderr flushed, then `os._exit(status)`.

    What this skips is the interpreter's teardown (module clean-up, TensorFlow's C++
    destructors): about 1.2 s of CPU per worker. With KMK_TEST_LEAN_WORKER=0: `sys.exit`.
    """
    if not _lean():
        sys.exit(status)
    if status is None:
        code = 0
    elif isinstance(status, int):
        code = status & 0xFF
    else:
        print(status, file=sys.stderr)
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # noqa: SLF001 (as Python's exit)
    atexit._run_exitfuncs()  # noqa: SLF001
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def write_marker(path: str, text: str) -> None:
    """Writes `path` whole or not at all (a temporary file in its folder, then os.replace)."""
    folder, name = os.path.split(path)
    temporary = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
    with open(temporary, "w") as handle:
        handle.write(text)
    os.replace(temporary, path)


def _rank() -> int:
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        return int(os.environ.get("SLURM_PROCID", "0"))  # a Slurm task, or one process
    config = json.loads(raw)
    task, chiefs = config["task"], len(config["cluster"].get("chief", []))
    return 0 if task["type"] == "chief" else chiefs + int(task["index"])


def _watch_writes(events: list[list[str]]) -> None:
    """Records every file this process opens for writing, renames or removes (Python-level)."""

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                mode is None and isinstance(flags, int) and flags & WRITE_FLAGS
            )
            if writes and isinstance(path, (str, bytes, os.PathLike)):
                events.append(["open-write", os.fsdecode(path)])
        elif event in ("os.rename", "os.replace"):
            events.append([event, os.fsdecode(args[0]), os.fsdecode(args[1])])
        elif event in ("os.remove", "os.unlink", "os.rmdir", "os.mkdir"):
            events.append([event, os.fsdecode(args[0])])

    sys.addaudithook(hook)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--ckpt")
    parser.add_argument("--save-freq", default="epoch")
    parser.add_argument("--die-rank", type=int)
    parser.add_argument("--die-epoch", type=int, default=0)
    parser.add_argument("--die-at-batch", type=int, default=2)
    parser.add_argument(
        "--die-exit-0", action="store_true", help="leave with status 0 instead of SIGKILL"
    )
    parser.add_argument("--delay-rank", type=int)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--spawn-grandchild", action="store_true")
    parser.add_argument("--probe-upstream", action="store_true")
    parser.add_argument(
        "--observe",
        help="add ThroughputMonitor and an offline WandbLogger writing under this directory",
    )
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--mark-step", default="")
    parser.add_argument("--hold-last-step")
    parser.add_argument("--preemption-signals", default="SIGTERM")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--hold-after-strategy")
    args = parser.parse_args()
    skip_optional_imports()
    rank = _rank()
    attempt = os.environ.get("KMK_LAUNCH_RESTART_COUNT", "0")
    marks = [int(k) for k in args.mark_step.split(",") if k]
    mark_at = marks[int(attempt)] if int(attempt) < len(marks) else None
    result: dict = {"rank": rank, "pid": os.getpid()}
    if args.spawn_grandchild:
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        result["grandchild_pid"] = grandchild.pid
    os.makedirs(args.out, exist_ok=True)
    write_marker(os.path.join(args.out, f"pids-{rank}.json"), json.dumps(result))
    if args.delay_rank == rank:
        time.sleep(args.delay)
        write_marker(
            os.path.join(args.out, f"awake-{rank}"),
            "the delay ended before anyone stopped this worker",
        )

    import keras
    import numpy as np

    import keras_mirror_kit as kmk
    from keras_mirror_kit.callbacks.synced_checkpoint import SyncedCheckpoint
    from keras_mirror_kit.checkpoint.preemption import Preempted
    from keras_mirror_kit.datasets import make_synthetic_cifar10
    from keras_mirror_kit.workarounds import keras_multi_worker_fit

    @kmk.distributed(global_batch_size=GLOBAL_BATCH, gradient_accumulation_steps=args.accumulate)
    def build():
        keras.utils.set_random_seed(INIT_SEED)
        if args.tiny:
            model = keras.Sequential(
                [
                    keras.Input((32, 32, 3)),
                    keras.layers.Flatten(),
                    keras.layers.Dense(10, activation="softmax"),
                ]
            )
        else:
            model = kmk.models.tutorial_cnn()  # the tutorial's CIFAR-10 CNN
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
        return model

    (x, y), _ = make_synthetic_cifar10(NUM_TRAIN, 0, seed=DATA_SEED)
    dist = build.distribution
    result.update(
        is_chief=dist.is_chief,
        num_replicas=dist.num_replicas,
        num_workers=dist.num_workers,
        strategy=dist.strategy_name,
        cross_device_ops=dist.cross_device_ops,
        global_batch_size=dist.global_batch_size,
        workaround_status=keras_multi_worker_fit.status(),
    )

    if args.hold_after_strategy:
        config = json.loads(os.environ["TF_CONFIG"])
        address = config["cluster"][config["task"]["type"]][config["task"]["index"]]
        write_marker(
            os.path.join(args.out, f"listening-{rank}.json"),
            json.dumps({"pid": os.getpid(), "port": int(address.rsplit(":", 1)[1])}),
        )
        deadline = time.monotonic() + 300
        while not os.path.exists(args.hold_after_strategy) and time.monotonic() < deadline:
            time.sleep(0.02)

    if args.probe_upstream:
        # Keras unpatched: expect the upstream failure (a fixed Keras would train here).
        os.environ[keras_multi_worker_fit.ENV_VAR] = "off"
        keras_multi_worker_fit._uninstall()
        probe = build()
        ds = kmk.make_dataset(x[:128], y[:128], GLOBAL_BATCH, seed=ORDER_SEED)
        try:
            probe.fit(ds, epochs=1, verbose=0)
            result["upstream_error"] = None
        except Exception as err:  # noqa: BLE001
            result["upstream_error"] = f"{type(err).__name__}: {str(err)[:300]}"
        os.environ[keras_multi_worker_fit.ENV_VAR] = "auto"
        result["reapplied"] = keras_multi_worker_fit.apply(dist.strategy)

    model = build()
    weights: dict[str, np.ndarray] = {f"init_{i}": w for i, w in enumerate(model.get_weights())}
    dataset = kmk.make_dataset(x, y, GLOBAL_BATCH, seed=ORDER_SEED, preprocess=kmk.rescale())
    losses: list[float] = []
    seen = [model.get_weights()]  # the weights after the last batch (--accumulate)
    timing = {"step_s": 0.0, "save_s": 0.0}
    epochs_run: list[int] = []

    class Record(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            epochs_run.append(epoch)
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            self.began = time.monotonic()
            if args.hold_last_step and self.model.optimizer.iterations.numpy() == last_step:
                hold = args.hold_last_step.replace("{attempt}", attempt)
                deadline = time.monotonic() + 300
                while not os.path.exists(hold) and time.monotonic() < deadline:
                    time.sleep(0.01)

        def on_train_batch_end(self, batch, logs=None):
            self.trained = getattr(self, "trained", 0) + 1
            if self.trained > 1:  # the longest step after the first (which traces)
                timing["step_s"] = max(timing["step_s"], time.monotonic() - self.began)
            if self.trained == mark_at:
                write_marker(
                    os.path.join(args.out, f"reached-{attempt}-{rank}"),
                    str(int(self.model.optimizer.iterations.numpy())),
                )
            losses.append(float(logs["loss"]))
            if args.accumulate > 1:  # count the micro-batches that changed the weights
                now = self.model.get_weights()
                changed = any(not np.array_equal(a, b) for a, b in zip(now, seen[-1]))
                result["weight_updates"] = result.get("weight_updates", 0) + int(changed)
                seen[-1] = now
            if args.die_rank == rank and (self.epoch, batch) == (
                args.die_epoch,
                args.die_at_batch,
            ):
                sys.stdout.flush()
                # When, for the launcher's reaction time.
                write_marker(os.path.join(args.out, f"killed-{rank}"), repr(time.time()))
                if args.die_exit_0:  # a worker that leaves early, as if its data ran out
                    sys.stderr.flush()
                    os._exit(0)
                os.kill(os.getpid(), signal.SIGKILL)

        def on_epoch_end(self, epoch, logs=None):
            for i, w in enumerate(self.model.get_weights()):
                weights[f"e{epoch}_{i}"] = w
            result.setdefault("epoch_logs", []).append(
                {k: float(v) for k, v in (logs or {}).items()}
            )

    callbacks: list = [Record()]
    if args.observe:
        from keras_mirror_kit.integrations.wandb import WandbLogger

        os.environ.update(
            WANDB_MODE="offline",
            WANDB_SILENT="true",
            WANDB_DATA_DIR=os.path.join(args.observe, f"data-{rank}"),
            WANDB_CACHE_DIR=os.path.join(args.observe, f"cache-{rank}"),
            WANDB_CONFIG_DIR=os.path.join(args.observe, f"config-{rank}"),
        )
        run_dir = os.path.join(args.observe, f"runs-{rank}")
        os.makedirs(run_dir, exist_ok=True)
        callbacks = [
            kmk.ThroughputMonitor(warmup_steps=1),
            *callbacks,
            WandbLogger(project="kmk-mw-test", dir=run_dir),
        ]
    events: list[list[str]] = []
    if args.ckpt:
        args.ckpt = args.ckpt.replace("{rank}", str(rank))  # a per-worker (unshared) dir
        save_freq = args.save_freq if args.save_freq == "epoch" else int(args.save_freq)
        callbacks.insert(
            0,
            SyncedCheckpoint(
                args.ckpt,
                save_freq=save_freq,
                keep=100,
                dataset=dataset,
                preemption_signals=[s for s in args.preemption_signals.split(",") if s],
            ),
        )
        _watch_writes(events)
        real_save = callbacks[0]._save

        def timed_save(*a, **k):
            began = time.monotonic()
            real_save(*a, **k)
            timing["save_s"] = time.monotonic() - began

        callbacks[0]._save = timed_save
    last_step = args.epochs * (NUM_TRAIN // GLOBAL_BATCH) - 1
    fit_began = time.monotonic()
    try:
        model.fit(dataset, epochs=args.epochs, verbose=0, callbacks=callbacks)
        timing["fit_s"] = time.monotonic() - fit_began
    except Preempted as stop:
        with open(os.path.join(args.out, f"preempted-{attempt}-{rank}.json"), "w") as handle:
            json.dump(
                {
                    "saved": [stop.epoch, stop.step, stop.global_step],
                    "signal": stop.signal_name,
                    "iterations": int(model.optimizer.iterations.numpy()),
                    **timing,
                    "restored_from": callbacks[0].last_restored.meta["global_step"]
                    if callbacks[0].last_restored is not None
                    else None,
                },
                handle,
            )
        raise
    ckpt_dir = os.path.abspath(args.ckpt) if args.ckpt else None
    ckpt_events = [
        e for e in list(events) if any(os.path.abspath(p).startswith(ckpt_dir) for p in e[1:])
    ]
    result.update(
        losses=losses,
        epochs_run=epochs_run,
        iterations=int(model.optimizer.iterations.numpy()),
        micro_steps=int(model.optimizer._iterations.numpy()),
        timing=timing,
        ckpt_events=ckpt_events,
        restored_from=(
            {k: callbacks[0].last_restored.meta[k] for k in ("epoch", "step", "global_step")}
            if args.ckpt and callbacks[0].last_restored is not None
            else None
        ),
    )
    if args.observe:
        import wandb

        wandb.teardown()
    np.savez(os.path.join(args.out, f"weights-{rank}.npz"), **weights)
    with open(os.path.join(args.out, f"result-{rank}.json"), "w") as handle:
        json.dump(result, handle)
    print(f"worker {rank} done: chief={dist.is_chief} loss={losses[-1]:.6f}", flush=True)
    return 0


if __name__ == "__main__":
    try:
        ended: object = main()
    except SystemExit as stop:  # Preempted (status 75), argparse's usage errors
        ended = stop.code
    exit_as_forked_children_do(ended)
