"""The keras-io examples of docs/keras-io-examples.md run as scripts: killed, resumed, compared.

Usage:
    python -m tests.keras_io_child kill SPEC_JSON
    python -m tests.keras_io_child finish SPEC_JSON
    python -m tests.keras_io_child train SPEC_JSON

SPEC_JSON (written by tests/test_keras_io_examples.py):
    {"original": FILE, "adopted": FILE, "data": DIR, "work": DIR,
     "kill_at": [EPOCH, BATCH] | [FIT, EPOCH, BATCH], "fits": N,
     "raw": null | "string" | "dict", "validation_order": "ordered" | "multiset",
     "train_identity": "exact" | "color", "palette": [[R, G, B], ...],
     "custom_objects": [NAME, ...], "weights_out": FILE}

A script runs as `python script.py` would (`__name__ == "__main__"`), in a folder of its
own holding a copy of DATA, with every seed set (`keras.utils.set_random_seed(1337)`)
except NumPy's global one in the adopted script's runs, which gets another value in every
run: a script whose data depends on unseeded NumPy draws would see other data after a
resume, and the comparisons say so (the original's run keeps 1337, the seed the adopted
timeseries example gives its own shuffle, so that both hold out the same rows). The
keras-io examples are notebooks, so plots do nothing here (`matplotlib.pyplot` is a stub,
`keras.utils.plot_model` returns None: it raises without pydot outside a notebook), and
`import tensorflow_datasets as tfds` gives a stand-in whose `tfds.load(name, split=[...],
as_supervised=True)` reads the generated folder NAME here (`NNNN_LABEL.png` files, in
their order; `split` as `"train[A%:B%]"`) and yields `(uint8 image, int64 label)` pairs
of the images' own sizes, as TFDS' `cats_vs_dogs` does: nothing is downloaded.
`keras.Model.fit`, `evaluate` and `predict` are wrapped at class level (beneath the kit's
own wrappers) to record each call of the script, and `fit` gets one more callback, last,
that prints a progress marker after every training step:

    KMK_IO_STEP epoch=E batch=B step=S          (the script's first `fit`)
    KMK_IO_STEP fit=F epoch=E batch=B step=S    (its `fit` number F, from 1 on)

`kill` runs the adopted script in WORK/killed and SIGKILLs itself right after the marker of
training step BATCH of epoch EPOCH of the script's `fit` number FIT (0, the first, when
`kill_at` names no FIT; the checkpoint callback's turn at that step included).

`finish`, in this one process: runs the original script in WORK/original until its first
`fit` call (recorded, not run); the adopted script uninterrupted in WORK/reference, until
its last `fit` (the spec's `fits`, default 1) returned (what the script does after it is
checked on the resumed run); and the adopted script again in WORK/killed, which resumes
from the killed run's checkpoints (a script of several `fit` calls reruns them all; those
before the killed one find its checkpoint). Its RESULT line gives, for the last `fit`, the
restored step, the steps trained after it, the optimizer's iterations, the largest
difference from the uninterrupted run's weights and from every replica's copy of them
(each replica evaluates with its own copy), and the last epoch's validation logs of both
runs, and for every `fit` of both runs its steps, its optimizer's iterations and the step
its `SyncedCheckpoint` restored; the validation
samples of both `fit` calls and one epoch of their training samples (`raw`: read from the
first dataset down the pipeline whose features are strings or a dict, i.e. before the
example's own vectorizing map; `color`: images told apart by their mean color, which
survives the random flips and rotations of the augmentation); the script's own calls after
`fit` (evaluate, predict); and the model saved to `.keras` and loaded back with
`keras.models.load_model` (the predictions of both models on one validation sample, and the
loaded model's evaluation of the validation data next to the resumed `fit`'s last
validation, the fitted model's own evaluation of it). With `weights_out`, the uninterrupted
run's final weights are written there too (`.npz`, in `model.get_weights()` order).

`train` runs the adopted script once, uninterrupted, in WORK/train, until its last `fit`
returned, and writes to `weights_out` the weights at the start and at the end of each `fit`
(`fitF_start_N`, `fitF_end_N`, N counting `get_weights()`); its RESULT line gives each
`fit`'s steps and optimizer iterations. Run once on 1 and once on 2 replicas
(`KMK_SIMULATE_REPLICAS`), the two runs train on the same data from the same weights.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import re
import shutil
import signal
import sys
import types
from pathlib import Path
from typing import Any

os.environ.setdefault("KMK_SIMULATE_REPLICAS", "2")

SEED = 1337
RUNS = {"original": 0, "killed": 1, "reference": 2, "resumed": 3}


class StopAtFit(Exception):  # noqa: N818 (a signal to the runner, not an error)
    """Raised by the recording `fit` of the original script (its data is all we need) and,
    once its `fit` returned, of the uninterrupted run (its weights are all we need)."""


class Recorder:
    """The calls of `fit`, `evaluate` and `predict` that the running script made itself."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.stop_at_fit = False
        self.stop_after_fit = False
        self.fits = 1  # the script's fit() calls: the uninterrupted run stops after the last
        self.kill_at: list[int] | None = None  # [fit, epoch, batch]
        self.paused = False
        self.depth = 0  # > 0 inside a recorded call (validation inside fit is not recorded)


RECORDER = Recorder()


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _plot_stub() -> None:
    """`import matplotlib.pyplot as plt` gives a module whose every function does nothing."""
    pyplot = types.ModuleType("matplotlib.pyplot")
    pyplot.__getattr__ = lambda name: _noop  # type: ignore[method-assign]
    package = types.ModuleType("matplotlib")
    package.__path__ = []  # a package, so that `import matplotlib.pyplot` works
    package.pyplot = pyplot  # type: ignore[attr-defined]
    sys.modules["matplotlib"] = package
    sys.modules["matplotlib.pyplot"] = pyplot


def _tfds_stub() -> None:
    """`import tensorflow_datasets as tfds` gives the stand-in of the module docstring."""
    import tensorflow as tf

    module = types.ModuleType("tensorflow_datasets")
    module.disable_progress_bar = _noop  # type: ignore[attr-defined]

    @tf.autograph.experimental.do_not_convert
    def decode(path: Any, label: Any) -> Any:
        return tf.io.decode_png(tf.io.read_file(path), channels=3), label

    def load(name: str, split: list[str], as_supervised: bool = False, **kwargs: Any) -> Any:
        assert as_supervised and not kwargs, (as_supervised, kwargs)
        files = sorted(str(path) for path in Path(name).glob("*.png"))
        parts = []
        for part in split:
            found = re.fullmatch(r"train\[(\d*)%?:(\d*)%?\]", part)
            assert found, f"the stand-in reads splits as 'train[A%:B%]', not {part!r}"
            cuts = [len(files) * int(p or d) for p, d in zip(found.groups(), (0, 100))]
            assert all(cut % 100 == 0 for cut in cuts), "a split that cuts no whole file"
            chosen = files[cuts[0] // 100 : cuts[1] // 100]
            labels = [int(Path(path).stem.rsplit("_", 1)[1]) for path in chosen]
            pairs = tf.data.Dataset.from_tensor_slices((chosen, tf.constant(labels, tf.int64)))
            parts.append(pairs.map(decode))
        return parts

    module.load = load  # type: ignore[attr-defined]
    sys.modules["tensorflow_datasets"] = module


def _progress_callback(kill_at: list[int] | None, fit_index: int = 0) -> Any:
    import keras

    class Progress(keras.callbacks.Callback):
        """Counts the training steps and prints a marker after each (kills at `kill_at`)."""

        def __init__(self) -> None:
            super().__init__()
            self.epoch = -1
            self.trained = 0

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self.epoch = epoch

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self.trained += 1
            fit = f"fit={fit_index} " if fit_index else ""
            where = f"{fit}epoch={self.epoch} batch={batch} step={self.trained}"
            print(f"KMK_IO_STEP {where}", flush=True)
            if kill_at == [fit_index, self.epoch, batch]:
                os.kill(os.getpid(), signal.SIGKILL)

    return Progress()


def _replica_copies(model: Any) -> list[Any]:
    """Every replica's copy of every model variable (`get_weights` reads the first's)."""
    import numpy as np

    copies = []
    for variable in model.weights:
        value = getattr(variable, "_value", variable)
        copies.append([np.array(copy) for copy in getattr(value, "values", (value,))])
    return copies


def install_patches() -> None:
    """Wraps `keras.Model.fit`, `evaluate` and `predict`; stubs the plots (module docstring)."""
    import keras
    import numpy as np

    _plot_stub()
    _tfds_stub()
    keras.utils.plot_model = _noop
    fit, evaluate, predict = keras.Model.fit, keras.Model.evaluate, keras.Model.predict
    fit_signature = inspect.signature(fit)

    def recording_fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        if RECORDER.depth or RECORDER.paused:
            return fit(self, *args, **kwargs)
        bound = fit_signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        index = sum(1 for call in RECORDER.calls if call["method"] == "fit")
        call: dict[str, Any] = {"method": "fit", "model": self, "args": dict(bound.arguments)}
        RECORDER.calls.append(call)
        if RECORDER.stop_at_fit:
            raise StopAtFit
        call["start_weights"] = [np.array(w) for w in self.get_weights()]
        progress = _progress_callback(RECORDER.kill_at, index)
        bound.arguments["callbacks"] = [*(bound.arguments["callbacks"] or []), progress]
        RECORDER.depth += 1
        try:
            history = fit(*bound.args, **bound.kwargs)
        finally:
            RECORDER.depth -= 1
        call["weights"] = [np.array(w) for w in self.get_weights()]
        call["copies"] = _replica_copies(self)
        call["iterations"] = int(self.optimizer.iterations.numpy())
        call["trained"] = progress.trained
        call["history"] = {k: [float(v) for v in vs] for k, vs in history.history.items()}
        if RECORDER.stop_after_fit and index + 1 == RECORDER.fits:
            raise StopAtFit
        return history

    def recorded(method: str, original: Any) -> Any:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            if RECORDER.depth or RECORDER.paused:
                return original(self, *args, **kwargs)
            RECORDER.depth += 1
            try:
                result = original(self, *args, **kwargs)
            finally:
                RECORDER.depth -= 1
            values = np.asarray(keras.tree.flatten(result), dtype="float64")
            RECORDER.calls.append(
                {
                    "method": method,
                    "model": self,
                    "shape": list(np.shape(result)) if method == "predict" else None,
                    "finite": bool(np.all(np.isfinite(values))) and values.size > 0,
                }
            )
            return result

        return wrapper

    keras.Model.fit = recording_fit
    keras.Model.evaluate = recorded("evaluate", evaluate)
    keras.Model.predict = recorded("predict", predict)


def _imdb_stand_in(num_words: int | None = None) -> Any:
    """`keras.datasets.imdb.load_data`'s return value, from the generated `imdb.npz` here."""
    import numpy as np

    with np.load("imdb.npz") as data:
        parts = []
        for name in ("train", "test"):
            flat, lengths = data[f"x_{name}_flat"], data[f"x_{name}_lengths"]
            rows = np.split(flat, np.cumsum(lengths)[:-1])
            sequences = np.empty(len(rows), dtype=object)
            sequences[:] = [row.tolist() for row in rows]
            parts.append((sequences, data[f"y_{name}"]))
    return tuple(parts)


def run_script(path: str, data: str, folder: Path, run: str) -> dict[str, Any]:
    """Runs `path` as `__main__` in `folder` (a copy of `data` on first use); its namespace."""
    import keras
    import numpy as np

    if not folder.exists():
        shutil.copytree(data, folder)
    os.chdir(folder)
    keras.utils.set_random_seed(SEED)
    # The original draws from NumPy's global generator seeded as the adopted timeseries
    # example seeds its own (the same split); each adopted run gets another seed.
    np.random.seed(SEED if run == "original" else 1000 + RUNS[run])
    namespace: dict[str, Any] = {
        "__name__": "__main__",
        "__file__": path,
        "kmk_test_imdb_load_data": _imdb_stand_in,
    }
    code = compile(Path(path).read_text(encoding="utf-8"), path, "exec")
    try:
        exec(code, namespace)  # noqa: S102 (the example's script, as `python script.py`)
    except StopAtFit:
        pass
    return namespace


# -- what fit() was given ------------------------------------------------------------------


def _is_dataset(value: Any) -> bool:
    import tensorflow as tf

    return isinstance(value, tf.data.Dataset)


def _raw(dataset: Any, raw: str | None) -> Any:
    """The first dataset down the pipeline whose features are strings / a dict (`raw`)."""
    import tensorflow as tf

    node = dataset
    while raw is not None:
        spec = node.element_spec
        features = spec[0] if isinstance(spec, tuple) else spec
        if raw == "dict" and isinstance(features, dict):
            break
        if raw == "string" and getattr(features, "dtype", None) == tf.string:
            break
        node = getattr(node, "_input_dataset", None)
        if node is None:
            raise AssertionError(f"no {raw} features down the pipeline of {dataset!r}")
    return node


def _split(value: Any, start: int, stop: int | None) -> Any:
    import keras

    return keras.tree.map_structure(lambda leaf: leaf[start:stop], value)


def _array_parts(args: dict[str, Any]) -> tuple[Any, Any]:
    """(training (x, y), validation (x, y) or None) of arrays, as Keras' fit cuts them."""
    x, y, fraction = args["x"], args["y"], args.get("validation_split") or 0.0
    if not fraction:
        return (x, y), None
    import keras

    samples = len(keras.tree.flatten(x)[0])
    cut = int(math.floor(samples * (1.0 - fraction)))  # keras' train_validation_split
    return (_split(x, 0, cut), _split(y, 0, cut)), (_split(x, cut, None), _split(y, cut, None))


def validation_batches(args: dict[str, Any], raw: str | None = None) -> list[Any]:
    """The validation data of a recorded `fit`, as a list of `(x, y)` batches."""
    data = args.get("validation_data")
    if data is None:
        if _is_dataset(args["x"]):
            return []
        part = _array_parts(args)[1]
        return [] if part is None else [part]
    if _is_dataset(data):
        return list(_raw(data, raw).as_numpy_iterator())
    return [tuple(data[:2])]


def training_batches(args: dict[str, Any], raw: str | None = None) -> list[Any]:
    """One epoch of the training data of a recorded `fit`, as `(x, y)` batches."""
    if _is_dataset(args["x"]):
        return list(_raw(args["x"], raw).as_numpy_iterator())
    return [_array_parts(args)[0]]


def _key(value: Any) -> Any:
    """A hashable, exact identity of one sample's value (numbers compared as float64)."""
    import numpy as np

    if isinstance(value, dict):
        return tuple((name, _key(value[name])) for name in sorted(value))
    array = np.asarray(value)
    if array.dtype.kind in "OSU":
        return ("text", tuple(str(v) for v in array.ravel()))
    return (array.shape, np.asarray(array, dtype="float64").tobytes())


def _rows(batch: Any) -> list[tuple[Any, Any]]:
    import keras
    import numpy as np

    x, y = batch[0], batch[1]
    count = len(keras.tree.flatten(x)[0])
    take = lambda value, i: keras.tree.map_structure(lambda leaf: np.asarray(leaf)[i], value)  # noqa: E731
    return [(take(x, i), take(y, i)) for i in range(count)]


def sample_ids(batches: list[Any], identity: str, palette: list[list[float]]) -> list[Any]:
    """Each sample's identity, in order: its exact value, or its image's nearest color."""
    import numpy as np

    found = []
    for batch in batches:
        for x, y in _rows(batch):
            if identity == "color":
                mean = np.asarray(x, dtype="float64").reshape(-1, 3).mean(axis=0)
                distances = np.linalg.norm(np.asarray(palette) - mean, axis=1)
                nearest = int(np.argmin(distances))
                found.append(("color", nearest if distances[nearest] < 30 else None, _key(y)))
            else:
                found.append((_key(x), _key(y)))
    return found


# -- the runs ------------------------------------------------------------------------------


def _fit_calls(run: str, count: int = 1) -> list[dict[str, Any]]:
    fits = [call for call in RECORDER.calls if call["method"] == "fit"]
    assert len(fits) == count, f"the {run} script called fit() {len(fits)} times, not {count}"
    return fits


def _fit_call(run: str) -> dict[str, Any]:
    return _fit_calls(run, 1)[0]


def _fit_summary(call: dict[str, Any]) -> dict[str, Any]:
    """One recorded fit's epochs, steps, optimizer iterations and the step it restored."""
    callbacks = call["args"]["callbacks"] or []
    found = [cb for cb in callbacks if type(cb).__name__ == "SyncedCheckpoint"]
    restored = found[0].last_restored if len(found) == 1 else None
    return {
        "epochs": call["args"]["epochs"],
        "trained": call["trained"],
        "iterations": call["iterations"],
        "restored_step": None if restored is None else restored.meta["global_step"],
    }


def _save_weights(path: str, **weights: list[Any]) -> None:
    import numpy as np

    np.savez(path, **{f"{name}_{i}": w for name, ws in weights.items() for i, w in enumerate(ws)})


def _synced_checkpoint(call: dict[str, Any]) -> Any:
    import keras_mirror_kit as kmk

    found = [cb for cb in call["args"]["callbacks"] or [] if isinstance(cb, kmk.SyncedCheckpoint)]
    assert len(found) == 1, "the adopted script gives fit() no (or several) SyncedCheckpoint"
    return found[0]


def _custom_objects(namespace: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The script's layer classes, taking the base arguments Keras passes when loading.

    A keras-io layer whose `__init__` takes only its own arguments (no `**kwargs` for
    `name`, `trainable`, `dtype`) cannot be rebuilt by `keras.models.load_model` at all,
    with or without the kit; the subclass passes its own arguments on and drops those.
    """
    objects = {}
    for name in names:
        cls = namespace[name]

        def init(self: Any, *args: Any, _cls: Any = cls, **kwargs: Any) -> None:
            for base in ("name", "trainable", "dtype"):
                kwargs.pop(base, None)
            _cls.__init__(self, *args, **kwargs)

        objects[name] = type(name, (cls,), {"__init__": init})
    return objects


def _save_and_load(call: dict[str, Any], namespace: dict[str, Any], spec: dict[str, Any]):
    """The fitted model saved to `.keras`, loaded back: its prediction on one validation
    sample, and its evaluation of the validation data next to fit's last validation.

    The fitted model's own evaluation is the one `fit` made after its last step (its last
    epoch's `val_` logs, on 2 replicas): the loaded model (one device) evaluates the same
    samples (the multiset, where the example's validation data reshuffles on each read), in
    batches of the size of the first one read here (for arrays, all of them in one batch).
    A mean over the same samples: the same terms summed in another order.
    """
    import keras
    import numpy as np

    model = call["model"]
    batches = validation_batches(call["args"])
    sample = _split(batches[0][0], 0, 1)
    path = os.path.abspath("saved_by_test.keras")
    model.save(path)
    loaded = keras.models.load_model(
        path, custom_objects=_custom_objects(namespace, spec.get("custom_objects", []))
    )
    predicted = model.predict(sample, verbose=0)
    reloaded = loaded.predict(sample, verbose=0)

    def joined(*leaves: Any) -> Any:
        return np.concatenate([np.asarray(leaf) for leaf in leaves])

    x = keras.tree.map_structure(joined, *[batch[0] for batch in batches])
    y = keras.tree.map_structure(joined, *[batch[1] for batch in batches])
    size = len(keras.tree.flatten(batches[0][0])[0])
    loaded_eval = loaded.evaluate(x, y, batch_size=size, verbose=0, return_dict=True)
    fitted = {
        key[len("val_") :]: values[-1]
        for key, values in call["history"].items()
        if key.startswith("val_")
    }
    return {
        "predict_diff": float(np.max(np.abs(np.asarray(predicted) - np.asarray(reloaded)))),
        "predict_shape": list(np.shape(predicted)),
        "evaluated": fitted,
        "loaded_evaluated": {key: float(value) for key, value in loaded_eval.items()},
        "weights_equal": all(
            np.array_equal(a, b) for a, b in zip(model.get_weights(), loaded.get_weights())
        ),
    }


def _compare(original: list[Any], adopted: list[Any], ordered: bool) -> dict[str, Any]:
    if not ordered:
        original, adopted = sorted(original, key=repr), sorted(adopted, key=repr)
    mismatch = next((i for i, (a, b) in enumerate(zip(original, adopted)) if a != b), None)
    return {
        "original": len(original),
        "adopted": len(adopted),
        "distinct": len(set(adopted)),
        "equal": original == adopted,
        "first_mismatch": mismatch,
        "unidentified": sum(1 for key in adopted if key[0] == "color" and key[1] is None),
    }


def _after_fit(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The script's own evaluate / predict calls after its last fit."""
    index = max(i for i, call in enumerate(calls) if call["method"] == "fit")
    return [
        {"method": call["method"], "shape": call["shape"], "finite": call["finite"]}
        for call in calls[index + 1 :]
    ]


def kill(spec: dict[str, Any]) -> int:
    install_patches()
    kill_at = list(spec["kill_at"])
    RECORDER.kill_at = kill_at if len(kill_at) == 3 else [0, *kill_at]
    run_script(spec["adopted"], spec["data"], Path(spec["work"]) / "killed", "killed")
    return 1  # the kill never came


def train(spec: dict[str, Any]) -> int:
    install_patches()
    RECORDER.fits = spec.get("fits", 1)
    RECORDER.stop_after_fit = True
    run_script(spec["adopted"], spec["data"], Path(spec["work"]) / "train", "reference")
    fits = _fit_calls("adopted", RECORDER.fits)
    weights = {f"fit{i}_start": call["start_weights"] for i, call in enumerate(fits)}
    weights.update({f"fit{i}_end": call["weights"] for i, call in enumerate(fits)})
    _save_weights(spec["weights_out"], **weights)
    print("RESULT " + json.dumps({"fits": [_fit_summary(call) for call in fits]}), flush=True)
    return 0


def finish(spec: dict[str, Any]) -> int:
    import numpy as np

    install_patches()
    work = Path(spec["work"])
    RECORDER.stop_at_fit = True
    run_script(spec["original"], spec["data"], work / "original", "original")
    original = _fit_call("original")
    RECORDER.stop_at_fit = False

    RECORDER.calls = []
    RECORDER.fits = spec.get("fits", 1)
    RECORDER.stop_after_fit = True  # the script's own steps after fit: checked on the resumed
    run_script(spec["adopted"], spec["data"], work / "reference", "reference")
    reference_fits = _fit_calls("reference", RECORDER.fits)
    reference = reference_fits[-1]
    RECORDER.stop_after_fit = False
    if spec.get("weights_out"):
        _save_weights(spec["weights_out"], end=reference["weights"])

    RECORDER.calls = []
    namespace = run_script(spec["adopted"], spec["data"], work / "killed", "resumed")
    resumed_fits = _fit_calls("resumed", RECORDER.fits)
    resumed = resumed_fits[-1]
    after_fit = _after_fit(RECORDER.calls)
    RECORDER.paused = True

    restored = _synced_checkpoint(resumed).last_restored
    pairs = list(zip(reference["weights"], resumed["weights"]))
    resume = {
        "restored_step": None if restored is None else int(restored.meta["global_step"]),
        "trained": resumed["trained"],
        "iterations": resumed["iterations"],
        "reference_iterations": reference["iterations"],
        "reference_trained": reference["trained"],
        "same_shapes": len(pairs) == len(resumed["weights"])
        and all(a.shape == b.shape for a, b in pairs),
        "max_diff": max(float(np.max(np.abs(a - b))) for a, b in pairs),
        "copies": [len(copies) for copies in resumed["copies"]],
        "max_copy_diff": max(
            float(np.max(np.abs(a - b)))
            for ref, res in zip(reference["copies"], resumed["copies"])
            for a, b in zip(ref, res)
        ),
        # The resumed epoch's validation (the last epoch: both runs end on it).
        "val_logs": {
            key: [reference["history"][key][-1], values[-1]]
            for key, values in resumed["history"].items()
            if key.startswith("val_")
        },
        "reference_fits": [_fit_summary(call) for call in reference_fits],
        "resumed_fits": [_fit_summary(call) for call in resumed_fits],
    }
    raw, palette = spec.get("raw"), spec.get("palette", [])
    validation = _compare(
        sample_ids(validation_batches(original["args"], raw), "exact", palette),
        sample_ids(validation_batches(reference["args"], raw), "exact", palette),
        ordered=spec["validation_order"] == "ordered",
    )
    identity = spec["train_identity"]
    training = _compare(
        sample_ids(training_batches(original["args"], raw), identity, palette),
        sample_ids(training_batches(reference["args"], raw), identity, palette),
        ordered=False,
    )
    saved = _save_and_load(resumed, namespace, spec)
    result = {
        "resume": resume,
        "validation": validation,
        "training": training,
        "after_fit": after_fit,
        "saved": saved,
    }
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def main() -> int:
    import keras_mirror_kit as kmk

    # Before any script runs: the original builds its model before any kit call.
    kmk.simulate_replicas(int(os.environ["KMK_SIMULATE_REPLICAS"]))
    mode, spec_path = sys.argv[1], sys.argv[2]
    with open(spec_path, encoding="utf-8") as handle:
        spec = json.load(handle)
    return {"kill": kill, "finish": finish, "train": train}[mode](spec)


if __name__ == "__main__":
    sys.exit(main())
