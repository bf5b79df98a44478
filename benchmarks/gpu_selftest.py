"""GPU self-test: on real GPUs, what the test suite can only simulate. Bounded in time.

Each check runs in a fresh process (device layouts are fixed when TensorFlow starts) and
prints one line: `PASS`, `FAIL` (with the reason) or `skipped: no GPU` (or `skipped: needs
2 GPUs`). Without a GPU the checks that make sense on a CPU still run, on 2 replicas
simulated on the CPU, so the script is exercised everywhere (`tests/test_gpu_selftest.py`
runs it in that mode).

The checks:

1. `strategy`: the default strategy over every GPU and a real all-reduce with the
   all-reduce the kit chose (NCCL on distinct physical GPUs).
2. `simulated`: `kmk.simulate_replicas(2)` on one GPU gives exactly 2 replicas and an
   all-reduce that is not NCCL.
3. `fit`: an end-to-end `fit` with `make_dataset`, `ThroughputMonitor`, `SyncedCheckpoint`,
   synchronized BatchNormalization and `steps_per_execution=2`, killed mid-epoch (an
   exception) and resumed by a fresh model: the resumed weights equal the uninterrupted
   run's (TensorFlow's op determinism on).
4. `float16`: one float16 overflow on replica 1 only: the step is skipped on every replica
   and the loss scale halved (`keras_mirror_kit.workarounds.keras_loss_scale`).
4b. `preprocess`: `make_dataset(..., preprocess=kmk.rescale())` on every replica (the
   default for kit-built models) against `preprocess_on="host"`: the same weights, the
   bytes per step copied to the devices (uint8 against float32), and the step times.
5. `launch`: `keras-mirror-kit launch -n 2` with one GPU per worker (needs 2 GPUs).
6. `scaling`: samples/s on 1 GPU and on 2, and the scaling efficiency (needs 2 GPUs).

Usage:

    python benchmarks/gpu_selftest.py              # about 2 minutes on 2 GPUs
    python benchmarks/gpu_selftest.py --timeout 120

Exit status: 0 when nothing failed (skips are not failures), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PRELUDE = """
import json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np, tensorflow as tf
GPUS = len(tf.config.list_physical_devices("GPU"))
import keras, keras_mirror_kit as kmk
def result(**fields):
    print("RESULT " + json.dumps(fields), flush=True)
"""

CHECKS: dict[str, tuple[int, str]] = {
    # name: (GPUs needed, or 0 = runs on simulated CPU replicas too; code)
    "strategy": (
        1,
        """
        with kmk.distributed(per_replica_batch_size=8) as dist:
            pass
        total = dist.strategy.reduce("SUM", dist.strategy.run(lambda: tf.constant(1.0)), axis=None)
        ok = float(total) == dist.num_replicas == GPUS
        result(ok=ok, detail=f"{dist.num_replicas} replicas, all-reduce={dist.cross_device_ops}")
        """,
    ),
    "simulated": (
        1,
        """
        dist = kmk.distributed(per_replica_batch_size=8).distribution
        ok = dist.num_replicas == 2 and dist.cross_device_ops != "nccl"
        result(ok=ok, detail=f"{dist.num_replicas} replicas, all-reduce={dist.cross_device_ops}")
        """,
    ),
    "fit": (
        0,
        """
        tf.config.experimental.enable_op_determinism()
        rng = np.random.default_rng(0)
        x = rng.integers(0, 255, size=(512, 8, 8, 3), dtype=np.uint8)
        y = (x.mean(axis=(1, 2, 3)) > 127).astype("int32")

        def build(seed):
            @kmk.distributed(per_replica_batch_size=16, sync_batch_norm=True,
                             steps_per_execution=2)
            def factory():
                keras.utils.set_random_seed(seed)
                model = keras.Sequential([
                    keras.Input((8, 8, 3)), keras.layers.Conv2D(8, 3, activation="relu"),
                    keras.layers.BatchNormalization(), keras.layers.Flatten(),
                    keras.layers.Dense(2)])
                model.compile("adam", keras.losses.SparseCategoricalCrossentropy(True))
                return model
            model = factory()
            ds = kmk.make_dataset(x, y, factory.distribution.global_batch_size, seed=1,
                                  preprocess=kmk.rescale())
            return model, ds

        class Crash(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if int(self.model.optimizer.iterations.numpy()) >= 12:
                    raise KeyboardInterrupt("simulated crash")

        root = sys.argv[1]
        reference, ds = build(3)
        monitor = kmk.ThroughputMonitor(warmup_steps=2)
        reference.fit(ds, epochs=3, verbose=0, callbacks=[
            monitor, kmk.SyncedCheckpoint(root + "/ref", save_freq=4, dataset=ds)])
        crashed, ds = build(3)
        try:
            crashed.fit(ds, epochs=3, verbose=0, callbacks=[
                kmk.SyncedCheckpoint(root + "/run", save_freq=4, dataset=ds), Crash()])
        except KeyboardInterrupt:
            pass
        resumed, ds = build(99)
        resumed.fit(ds, epochs=3, verbose=0, callbacks=[
            kmk.SyncedCheckpoint(root + "/run", save_freq=4, dataset=ds)])
        gap = max(float(np.max(np.abs(a - b)))
                  for a, b in zip(reference.get_weights(), resumed.get_weights()))
        ok = gap <= 1e-5
        result(ok=ok, detail=f"resumed weights within {gap:.1e} of the uninterrupted run; "
               f"{monitor.last.get('samples_per_sec', 0):.0f} samples/s")
        """,
    ),
    "float16": (
        0,
        """
        @kmk.distributed(global_batch_size=2, mixed_precision="mixed_float16")
        def build():
            model = keras.Sequential([keras.Input((1,))] + [
                keras.layers.Dense(1, kernel_initializer="ones") for _ in range(2)])
            model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
            return model
        model = build()
        x = np.ones((2, 1), "float32")
        x[1] = 1000.0  # overflows float16 on replica 1 only
        model.fit(x, np.zeros((2, 1), "float32"), batch_size=2, epochs=1, verbose=0)
        scale = float(model.optimizer.dynamic_scale.numpy())
        finite = all(np.isfinite(w).all() for w in model.get_weights())
        skipped = int(model.optimizer.iterations.numpy()) == 0
        result(ok=finite and skipped and scale == 2.0**14,
               detail=f"step skipped={skipped}, weights finite={finite}, loss scale {scale:g}")
        """,
    ),
    "preprocess": (
        0,
        """
        tf.config.experimental.enable_op_determinism()  # GPU convolutions: same sums
        from keras_mirror_kit.data import replica_variant
        n = 4096 if GPUS else 512
        rng = np.random.default_rng(0)
        x = rng.integers(0, 256, size=(n, 32, 32, 3), dtype=np.uint8)
        y = rng.integers(0, 10, size=(n,), dtype=np.uint8)
        rows = {}
        for on in ("host", "auto"):
            @kmk.distributed(per_replica_batch_size=32)
            def factory():
                keras.utils.set_random_seed(0)
                model = kmk.models.tutorial_cnn()
                model.compile(keras.optimizers.SGD(0.01), "sparse_categorical_crossentropy")
                return model
            model, dist = factory(), factory.distribution
            ds = kmk.make_dataset(x, y, dist.global_batch_size, seed=0,
                                  preprocess=kmk.rescale(), preprocess_on=on)
            fed = replica_variant(ds).dataset() if on == "auto" else ds
            element = next(iter(dist.strategy.experimental_distribute_dataset(fed)))
            nbytes = sum(int(np.prod(t.shape)) * t.dtype.size
                         for leaf in tf.nest.flatten(element)
                         for t in dist.strategy.experimental_local_results(leaf))
            model.fit(ds, epochs=1, verbose=0)  # traces the step
            monitor = kmk.ThroughputMonitor(warmup_steps=3)
            model.fit(ds, epochs=2, verbose=0, callbacks=[monitor])
            rows[on] = (model.get_weights(), nbytes, monitor.last["step_time_ms"])
        gap = max(float(np.max(np.abs(a - b))) for a, b in zip(rows["host"][0], rows["auto"][0]))
        ok = gap <= 1e-6 and rows["auto"][1] < rows["host"][1]
        result(ok=ok, detail=f"weights within {gap:.1e} of host preprocessing; bytes/step to "
               f"devices {rows['host'][1]} -> {rows['auto'][1]} "
               f"({rows['auto'][1] / rows['host'][1]:.2f}x); step time "
               f"{rows['host'][2]:.1f} -> {rows['auto'][2]:.1f} ms")
        """,
    ),
    "launch": (
        2,
        """
        import subprocess, tempfile
        script = os.path.join(sys.argv[1], "worker.py")
        with open(script, "w") as handle:
            handle.write("import os, tensorflow as tf\\n"
                         "print('GPUS', os.environ.get('CUDA_VISIBLE_DEVICES'), "
                         "len(tf.config.list_physical_devices('GPU')), flush=True)\\n")
        proc = subprocess.run([sys.executable, "-m", "keras_mirror_kit.cli", "launch", "-n",
                               "2", "--", script], capture_output=True, text=True, timeout=300)
        lines = [line for line in proc.stdout.splitlines() if "GPUS" in line]
        ok = proc.returncode == 0 and len(lines) == 2 and all(
            line.split()[-1] == str(GPUS // 2) for line in lines)
        result(ok=ok, detail="; ".join(lines) or proc.stderr[-300:])
        """,
    ),
    "scaling": (
        2,
        """
        import subprocess
        out = os.path.join(sys.argv[1], "bench.json")
        proc = subprocess.run([sys.executable, "-m", "keras_mirror_kit.cli", "bench",
                               "--replicas", "1,2", "--steps", "100", "--json", out],
                              capture_output=True, text=True, timeout=600)
        rows = json.load(open(out)) if proc.returncode == 0 else []
        two = [r for r in rows if r.get("replicas") == 2]
        eff = two[0].get("scaling_efficiency") if two else None
        result(ok=eff is not None, detail=f"scaling efficiency 1 -> 2 GPUs: {eff}")
        """,
    ),
}


def gpu_count() -> int:
    """GPUs TensorFlow sees here (asked in a throwaway process)."""
    code = PRELUDE + "\nprint('RESULT ' + json.dumps({'gpus': GPUS}))\n"
    fields = run_child(code, {}, timeout=120, workdir=tempfile.gettempdir())
    return int(fields.get("gpus", 0))


def run_child(code: str, env: dict[str, str], timeout: float, workdir: str) -> dict:
    """Runs `code` in a fresh interpreter; its RESULT line as a dict (or the failure)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **env}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, workdir],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=full_env,
            cwd=workdir,
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "detail": f"timed out after {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return {"ok": False, "detail": f"exit {proc.returncode}: {proc.stderr.strip()[-400:]}"}


def main(argv: list[str] | None = None) -> int:
    """Runs every check; prints one line each and a summary.

    Args:
        argv: Command-line arguments (default: `sys.argv[1:]`).

    Returns:
        0 when no check failed, 1 otherwise.

    Example:

    ```python
    main(["--timeout", "120"])
    ```
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=300, help="seconds per check")
    args = parser.parse_args(argv)
    gpus = gpu_count()
    print(f"gpu_selftest: {gpus} GPU(s) visible", flush=True)
    failed = 0
    for name, (needs, body) in CHECKS.items():
        if needs and gpus < needs:
            reason = "no GPU" if gpus == 0 else f"needs {needs} GPUs"
            print(f"{name:<10} skipped: {reason}", flush=True)
            continue
        env = {}
        if name == "simulated":
            env = {"KMK_SIMULATE_REPLICAS": "2", "CUDA_VISIBLE_DEVICES": "0"}
        elif gpus == 0:
            env = {"KMK_SIMULATE_REPLICAS": "2"}  # the CPU split in 2 replicas
        with tempfile.TemporaryDirectory() as workdir:
            code = PRELUDE + textwrap.dedent(body)
            fields = run_child(code, env, args.timeout, workdir)
        ok = bool(fields.get("ok"))
        failed += not ok
        print(f"{name:<10} {'PASS' if ok else 'FAIL'}  {fields.get('detail', '')}", flush=True)
    print(f"gpu_selftest: {'all checks passed' if not failed else f'{failed} failed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
