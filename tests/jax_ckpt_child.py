"""SyncedCheckpoint on Keras' JAX backend: `python -m tests.jax_ckpt_child ROOT TF_DIR TF_WIDE`.

One fresh interpreter (`KERAS_BACKEND=jax`, 2 simulated CPU devices) runs every checkpoint
case of `tests/test_jax_checkpoints.py` and writes what it saw to ROOT/result.json (the
weights to .npz files next to it): the uninterrupted reference (with the writes and saves
the kill trials plan from), synchronous and asynchronous saves, the replica check, the
refusal of a non-finite state, `keep_best`, `kmk.restore` and `ckpt export`, the W&B
logger, gradient accumulation with mixed precision across a crash, the checkpoints the
TensorFlow side wrote (TF_DIR; TF_WIDE, whose optimizer step does not fit JAX's int32),
and last the save on SIGTERM: the process then ends with `Preempted`'s status 75.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

os.environ["KERAS_BACKEND"] = "jax"
os.environ["KMK_SIMULATE_REPLICAS"] = "2"


def _error(call, *args, **kwargs) -> list[str] | None:
    try:
        call(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - reported, checked by the test
        return [type(err).__name__, str(err)]
    return None


def _crashed(call, *args, **kwargs) -> bool:
    """Whether `call` ended with the simulated crash of `tests.ckpt_helpers.StopAt`."""
    try:
        call(*args, **kwargs)
    except KeyboardInterrupt:
        return True
    return False


def main() -> int:
    root, tf_dir, tf_wide = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    import keras
    import numpy as np

    import keras_mirror_kit as kmk
    from keras_mirror_kit.checkpoint import store as checkpoint_store
    from keras_mirror_kit.checkpoint.divergence import _CHUNK_BYTES, check_replicas
    from keras_mirror_kit.checkpoint.state import state_variables
    from keras_mirror_kit.checkpoint.store import CheckpointStore
    from keras_mirror_kit.model_record import engine_of
    from tests.accum_helpers import SAVE_FREQ
    from tests.ckpt_helpers import StopAt, build, data, dataset, max_diff

    kmk.simulate_replicas(2)
    import jax

    result: dict = {"backend": keras.backend.backend(), "devices": len(jax.devices())}

    def save(name: str, model) -> str:
        path = root / f"{name}.npz"
        np.savez(path, *model.get_weights())
        return str(path)

    def fit(model, ds, directory, epochs=3, **options):
        callbacks = options.pop("callbacks", [])
        checkpoint = kmk.SyncedCheckpoint(directory, dataset=ds, **options)
        model.fit(ds, epochs=epochs, verbose=0, callbacks=[checkpoint, *callbacks])
        return checkpoint

    def manifest(directory) -> dict:
        return json.loads((Path(directory) / "manifest.json").read_text())

    # -- the reference: synchronous saves every 4 batches, as tests/ckpt_child.py runs -----
    writes, saves = [], []
    real_write, real_store_write = checkpoint_store.atomic_write, CheckpointStore.write

    def recording_write(path, write, **options):
        writes.append(path.name)
        return real_write(path, write, **options)

    def recording_store_write(self, arrays, meta):
        saves.append(int(meta.global_step))
        return real_store_write(self, arrays, meta)

    checkpoint_store.atomic_write, CheckpointStore.write = recording_write, recording_store_write
    model, ds = build("adam"), dataset()
    fit(model, ds, root / "sync", save_freq=4)
    checkpoint_store.atomic_write, CheckpointStore.write = real_write, real_store_write
    result["reference"] = {"weights": save("reference", model), "writes": writes, "saves": saves}
    result["reference"]["loss"] = model.history.history["loss"]  # per epoch
    sync_last = CheckpointStore(root / "sync").load_latest()

    # -- async_save: the same checkpoints, written in the background --------------------------
    model, ds = build("adam"), dataset()
    fit(model, ds, root / "async", save_freq=4, async_save=True)
    async_last = CheckpointStore(root / "async").load_latest()
    result["async"] = {
        "weights": save("async", model),
        "steps": [e["global_step"] for e in manifest(root / "async")["checkpoints"]],
        "sync_steps": [e["global_step"] for e in manifest(root / "sync")["checkpoints"]],
        "same_arrays": sorted(async_last.arrays) == sorted(sync_last.arrays)
        and all(
            np.array_equal(async_last.arrays[k], sync_last.arrays[k]) for k in sync_last.arrays
        ),
        "backend": async_last.meta.backend,
    }

    # -- an exact mid-epoch resume after a crash (in this process), synchronous and async ---
    resumed = {}
    for mode in ("sync", "async"):
        directory = root / f"crash-{mode}"
        model, ds = build("adam"), dataset()
        options = {"save_freq": 4, "async_save": mode == "async"}
        crashed = _crashed(fit, model, ds, directory, callbacks=[StopAt(1, 3)], **options)
        model, ds = build("adam", seed=77), dataset()  # other initial weights: all restored
        checkpoint = fit(model, ds, directory, **options)
        resumed[mode] = {
            "crashed": crashed,
            "restored": [checkpoint.last_restored.meta.epoch, checkpoint.last_restored.meta.step],
            "iterations": int(np.asarray(model.optimizer.iterations)),
            "weights": save(f"resumed-{mode}", model),
            "loss": model.history.history["loss"][0],  # the epoch resumed part-way
        }
    result["resumed"] = resumed

    # -- the replica check: the copies of a replicated array, one per device ----------------
    model = build("adam", batch_norm=True)
    named = [("model", v) for v in model.weights]
    kernel = model.layers[0].kernel
    replicas = {"copies": len(kernel.value.addressable_shards), "clean": None}
    replicas["clean"] = check_replicas(model, named, atol=0.0)

    def with_copy(variable, change):
        """`variable` with the second device's copy changed by `change` (a NumPy function)."""
        value = variable.value
        shards = [s.data for s in value.addressable_shards]
        device = next(iter(shards[1].devices()))
        changed = jax.device_put(change(np.array(shards[1])), device)
        variable.assign(
            jax.make_array_from_single_device_arrays(
                value.shape, value.sharding, [shards[0], changed]
            )
        )

    original = np.array(kernel.value)

    def bump(a):
        a.reshape(-1)[-1] += 0.5
        return a

    def nan(a):
        a.reshape(-1)[0] = np.nan
        return a

    with_copy(kernel, bump)
    replicas["bumped"] = _error(lambda: check_replicas(model, named, atol=0.0))
    replicas["bumped_within_atol"] = check_replicas(model, named, atol=0.5)
    kernel.assign(original)
    with_copy(kernel, nan)
    replicas["nan"] = _error(lambda: check_replicas(model, named, atol=0.0))
    kernel.assign(original)
    moving = model.layers[1].moving_variance
    with_copy(moving, lambda a: a + 0.25)
    replicas["batch_norm_gap"] = check_replicas(model, named, atol=0.0)
    # A variable of several slices: a difference in the last one is found.
    rows = _CHUNK_BYTES // 4 // 1000 * 5 // 2
    with engine_of(model).scope():
        big = keras.Variable(np.zeros((rows, 1000), "float32"), name="big")
    with_copy(big, bump)
    replicas["big"] = _error(lambda: check_replicas(model, [("model", big)], atol=0.0))
    replicas["big_slices"] = -(-rows * 1000 * 4 // _CHUNK_BYTES)
    # In fit(): a copy changed mid-epoch is refused at the next save, nothing written.

    class Diverge(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 5:
                with_copy(self.model.layers[0].kernel, bump)

    model, ds = build("adam"), dataset()
    directory = root / "diverged"
    replicas["in_fit"] = _error(
        lambda: fit(model, ds, directory, save_freq=3, callbacks=[Diverge()])
    )
    replicas["in_fit_saved"] = [e["global_step"] for e in manifest(directory)["checkpoints"]]
    result["replicas"] = replicas

    # -- a state holding NaN is refused; allow_non_finite saves it ---------------------------
    class Poison(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 3:
                layer = self.model.layers[0]
                layer.kernel.assign(np.full(layer.kernel.shape, np.nan, "float32"))

    non_finite = {}
    for allow in (False, True):
        model, ds = build("adam"), dataset()
        directory = root / f"nan-{allow}"
        non_finite[str(allow)] = {
            "error": _error(
                fit,
                model,
                ds,
                directory,
                epochs=1,
                save_freq=2,
                allow_non_finite=allow,
                callbacks=[Poison()],
            ),  # fmt: skip
            "saved": [[e["global_step"], e["finite"]] for e in manifest(directory)["checkpoints"]],
        }
    result["non_finite"] = non_finite

    # -- keep_best, kmk.restore and `keras-mirror-kit ckpt export` of a JAX checkpoint --------
    model, ds = build("adam"), dataset()
    # The highest val_loss ranks first (mode="max"): the first epoch's, which only keep_best
    # keeps beyond the newest and the two resume points before it (5 epochs: the second
    # epoch's is deleted, the first's kept).
    checkpoint = kmk.SyncedCheckpoint(
        root / "best", keep=1, keep_best=1, monitor="val_loss", mode="max"
    )
    validation = tuple(a[-48:] for a in data(144))  # samples not trained on
    history = model.fit(
        ds, epochs=5, verbose=0, validation_data=validation, validation_batch_size=16,
        callbacks=[checkpoint],
    ).history  # fmt: skip
    fresh = build("adam", seed=99)
    best = kmk.restore(fresh, root / "best", "best", optimizer=True)
    newest = CheckpointStore(root / "best").load_latest()
    result["keep_best"] = {
        "val_loss": history["val_loss"],
        "kept": [[e["epoch"], e.get("score")] for e in manifest(root / "best")["checkpoints"]],
        "best_epoch": best.meta.epoch,
        "best_score": best.meta.score.value,
        "restored_equal": all(
            np.array_equal(np.asarray(v), best.arrays[f"model/{i:05d}"])
            for i, v in enumerate(fresh.variables)
        ),
        "iterations": int(np.asarray(fresh.optimizer.iterations)),
        "newest_epoch": newest.meta.epoch,
    }
    plain = keras.Sequential(  # not built by the kit: no distribution
        [keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)]
    )
    kmk.restore(plain, root / "sync")
    from keras_mirror_kit.cli import main as cli

    export = root / "exported.keras"
    code = cli(["ckpt", "export", str(root / "sync"), "--to", str(export)])
    loaded = keras.saving.load_model(export)
    sample = np.random.default_rng(0).normal(size=(5, 6)).astype("float32")
    with np.load(result["reference"]["weights"]) as saved:
        reference = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    result["restore_export"] = {
        "plain_vs_reference": max_diff(plain.get_weights(), reference),
        "cli_code": code,
        "exported": str(export),
        "exported_vs_reference": max_diff(loaded.get_weights(), reference),
        "sample": sample.tolist(),
        "prediction": np.asarray(loaded.predict(sample, verbose=0)).tolist(),
    }

    # -- the W&B logger (offline), with SyncedCheckpoint's uploads and the monitor -----------
    import wandb

    from keras_mirror_kit.integrations.wandb import WandbLogger

    model, ds = build("adam"), dataset()
    logger = WandbLogger(
        project="kmk-jax",
        dir=root / "runs",
        mode="offline",
        upload_checkpoints=True,
        checkpoint_dir=root / "wandb-ckpt",
        settings=wandb.Settings(
            silent=True, console="off", x_disable_stats=True, disable_git=True
        ),
    )
    fit(model, ds, root / "wandb-ckpt", epochs=2, callbacks=[kmk.ThroughputMonitor(), logger])
    wandb.teardown()
    result["wandb"] = {"runs": str(root / "runs")}

    # -- gradient accumulation and mixed precision across a crash ---------------------------
    @kmk.distributed(
        global_batch_size=16, gradient_accumulation_steps=2, mixed_precision="mixed_bfloat16"
    )
    def accumulating(seed=3):
        keras.utils.set_random_seed(seed)
        model = keras.Sequential(
            [keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return model

    model, ds = accumulating(), dataset()
    model.fit(ds, epochs=3, verbose=0)
    accumulate = {"reference": save("accumulate-reference", model)}
    directory = root / "accumulate"
    model, ds = accumulating(), dataset()
    accumulate["crashed"] = _crashed(
        lambda: fit(model, ds, directory, save_freq=SAVE_FREQ, callbacks=[StopAt(1, 3)])
    )
    # The newest, at 9 micro-steps (epoch 1, step 3), lies between two updates.
    accumulate["saved"] = [[e["epoch"], e["step"]] for e in manifest(directory)["checkpoints"]]
    model, ds = accumulating(seed=41), dataset()
    checkpoint = fit(model, ds, directory, save_freq=SAVE_FREQ)
    accumulate["restored"] = [
        checkpoint.last_restored.meta.epoch,
        checkpoint.last_restored.meta.step,
    ]
    accumulate["variables"] = list(checkpoint.last_restored.meta.variables)
    accumulate["weights"] = save("accumulate-resumed", model)
    accumulate["iterations"] = int(np.asarray(model.optimizer.iterations))
    result["accumulate"] = accumulate

    # -- checkpoints written on TensorFlow, restored here ------------------------------------
    cross = {}
    model = build("adam", random_layers=True, seed=123)
    loaded = kmk.restore(model, tf_dir, optimizer=True)
    compared = []  # [path, saved dtype, dtype here, equal] in the saved order
    for i, (group, variable) in enumerate(state_variables(model)):
        if group == "metrics":  # a fit's sums: restore() puts back weights and optimizer
            continue
        saved, here = loaded.arrays[f"{group}/{i:05d}"], np.asarray(variable)
        equal = saved.shape == here.shape and np.array_equal(
            saved.astype(np.float64), here.astype(np.float64)
        )
        compared.append([variable.path, saved.dtype.name, here.dtype.name, bool(equal)])
    cross["compared"] = compared
    cross["written_on"] = loaded.meta.backend
    copy = root / "from-tf"
    shutil.copytree(tf_dir, copy)
    model, ds = build("adam", random_layers=True, seed=124), dataset()
    checkpoint = kmk.SyncedCheckpoint(copy, dataset=ds)
    model.fit(ds, epochs=2, verbose=0, callbacks=[checkpoint])
    cross["resumed_epoch"] = checkpoint.last_restored.meta.epoch
    cross["resumed_iterations"] = int(np.asarray(model.optimizer.iterations))
    model = build("adam", random_layers=True, seed=125)
    before = [np.asarray(v).copy() for v in model.variables]
    cross["wide"] = _error(lambda: kmk.restore(model, tf_wide, optimizer=True))
    cross["wide_untouched"] = all(
        np.array_equal(a, np.asarray(v)) for a, v in zip(before, model.variables)
    )
    # ... and one written here, for the TensorFlow side to restore.
    model, ds = build("adam", random_layers=True), dataset()
    fit(model, ds, root / "jax-written", epochs=1)
    cross["jax_dir"] = str(root / "jax-written")
    result["cross"] = cross

    # -- last: SIGTERM during fit() saves the step reached and ends with status 75 -----------
    class Terminate(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(np.asarray(self.model.optimizer.iterations)) == 8:
                os.kill(os.getpid(), signal.SIGTERM)

    model, ds = build("adam"), dataset()
    directory = root / "sigterm"
    preempted = {}
    try:
        fit(model, ds, directory, callbacks=[Terminate()])
    except kmk.Preempted as stop:
        preempted = {
            "where": [stop.epoch, stop.step, stop.global_step],
            "signal": stop.signal_name,
            "code": stop.code,
            "handler_back": signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
        }
        latest = CheckpointStore(directory).load_latest()
        preempted["saved"] = [latest.meta.epoch, latest.meta.step, latest.meta.global_step]
        model, ds = build("adam", seed=5), dataset()
        checkpoint = fit(model, ds, directory)
        preempted["weights"] = save("preempted-resumed", model)
        result["preempted"] = preempted
        (root / "result.json").write_text(json.dumps(result))
        raise
    (root / "result.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
