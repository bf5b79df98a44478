"""The one schema of a checkpoint's metadata (`CheckpointMeta`) and of the manifest's entries.

A checkpoint file holds its metadata as one JSON object (its `__meta__` member), and the
manifest (`manifest.json`) lists each kept checkpoint with a few of those fields. The JSON
keys are spelled here only: writers build these classes, readers get them, and `to_json` /
`from_json` translate, reading the files of earlier versions too:

* a file without `"state"` (written before random-state saving) holds `model.weights`,
  not `model.variables` (`CheckpointMeta.state` is `"weights"` then);
* a file without `"fit_index"` was written by the `fit()` that reads it (`fit_record`);
* a manifest of keras-mirror-kit 0.1.0 lists each file's `"sha256"`, not the `"crc32"`
  of its members (`ManifestEntry.sha256`).

Reading checks every field's type (and that counts are whole numbers, not negative):
anything else is a `ValueError`, which the store reports as an unreadable checkpoint or
manifest, never another exception.

Nothing here imports NumPy, Keras or TensorFlow.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from keras_mirror_kit.checkpoint.fit_record import FitRecord

__all__ = [
    "CALLBACK_ARRAY",
    "CALLBACK_ARRAYS",
    "FORMAT",
    "MANIFEST",
    "STATE_VARIABLES",
    "STATE_WEIGHTS",
    "VERSION",
    "CheckpointMeta",
    "DataDescription",
    "ManifestEntry",
    "Score",
    "callback_array_key",
    "callback_array_keys",
    "checkpoint_index",
    "checkpoint_name",
    "manifest_json",
    "parse_json",
    "read_manifest_json",
    "shortened",
]

FORMAT = "keras-mirror-kit-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
STATE_VARIABLES = "variables"  # model.variables: weights and the random layers' state
STATE_WEIGHTS = "weights"  # model.weights: files without a "state" key
_NAME = re.compile(r"ckpt-([0-9]{8})\.npz")  # fullmatch: ASCII digits, no trailing newline
_LIMIT = 1 << 64  # the magnitude no number a checkpoint records reaches
# How a callback state marks a value saved as an array, or a list of arrays.
CALLBACK_ARRAY, CALLBACK_ARRAYS = "__array__", "__arrays__"
_MAX_LISTED_ARRAYS = 1 << 20  # arrays one `__arrays__` marker may name


def checkpoint_name(index: int) -> str:
    """The file name of checkpoint number `index` (`ckpt-00000007.npz`)."""
    return f"ckpt-{index:08d}.npz"


def checkpoint_index(name: str) -> int | None:
    """The number in a checkpoint's file name, or None for any other name."""
    match = _NAME.fullmatch(name) if isinstance(name, str) else None
    return int(match.group(1)) if match else None


def parse_json(data: bytes) -> object:
    """The JSON value of `data` (UTF-8).

    Raises:
        ValueError: When it is not UTF-8 JSON, or nests too deeply to parse.
    """
    try:
        return json.loads(data.decode("utf-8"))
    except RecursionError:
        raise ValueError("its JSON nests too deeply") from None


def _whole(value: object, key: object, minimum: int | None = 0) -> int:
    """`value` as an int: a whole number (not a bool) in range, else a ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"its {key!r} is not a number ({_short(value)})")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise ValueError(f"its {key!r} is not a whole number ({_short(value)})")
    number = int(value)
    low = -_LIMIT if minimum is None else minimum
    if not low <= number < _LIMIT:
        raise ValueError(f"its {key!r} is out of range ({_short(value)})")
    return number


def shortened(text: str, limit: int = 60) -> str:
    """`text` cut to `limit` characters (a name or value of a hostile file, in a message)."""
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _short(value: object) -> str:
    """`repr(value)`, shortened."""
    return shortened(repr(value))


def _int(data: Mapping[str, Any], key: str, minimum: int | None = 0) -> int | None:
    value = data.get(key)
    return None if value is None else _whole(value, key, minimum)


def _str(data: Mapping[str, Any], key: str) -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"its {key!r} is not a string ({_short(value)})")
    return value


def _fit_record(data: Mapping[str, Any]) -> FitRecord | None:
    """The `FitRecord` of a checkpoint's metadata; None for a file without `fit_index`."""
    index, epochs = _int(data, "fit_index"), _int(data, "fit_epochs")
    script = data.get("script_fit_epochs")
    history = (
        tuple(None if e is None else _whole(e, "script_fit_epochs") for e in script)
        if isinstance(script, list)
        else ()
    )
    return None if index is None else FitRecord(index, epochs, history[:index])


def callback_array_key(key: str, name: str, index: int | None = None) -> str:
    """The array name of a callback state's value saved as an array (`callback/K/N[/i]`)."""
    return f"callback/{key}/{name}" if index is None else f"callback/{key}/{name}/{index:05d}"


def callback_array_keys(states: Mapping[str, Any]) -> list[str]:
    """The array names the callback states of a checkpoint's metadata refer to.

    Raises:
        ValueError: When a marker is malformed (`{"__arrays__": n}` with n not a count).
    """
    keys: list[str] = []
    for key, state in states.items():
        for name, value in state.items():
            if isinstance(value, Mapping) and value.get(CALLBACK_ARRAY):
                keys.append(callback_array_key(key, name))
            elif isinstance(value, Mapping) and CALLBACK_ARRAYS in value:
                count = _whole(value[CALLBACK_ARRAYS], f"{key}.{name}")
                if count > _MAX_LISTED_ARRAYS:
                    raise ValueError(f"its {key}.{name} lists {count} arrays")
                keys += [callback_array_key(key, name, i) for i in range(count)]
    return keys


def _flag(data: Mapping[str, Any], key: str) -> bool | None:
    value = data.get(key)
    return None if value is None else bool(value)


@dataclass(frozen=True)
class Score:
    """What `keep_best` ranks a checkpoint by: the metric, its direction, this save's value.

    `mode` is None while the direction is unknown, `value` None for a save that was not
    scored (the logs lacked the metric); such a checkpoint is not ranked.
    """

    monitor: str
    mode: str | None = None
    value: float | None = None

    @property
    def ranked(self) -> bool:
        """Whether this score takes part in the ranking (a direction and a finite value)."""
        return self.mode in ("min", "max") and self.value is not None and math.isfinite(self.value)

    def to_json(self) -> dict[str, Any]:
        """The `monitor`, `mode` and `score` keys."""
        return {"monitor": self.monitor, "mode": self.mode, "score": self.value}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Score | None:
        """The score recorded in `data`, or None when it records none."""
        monitor, value = data.get("monitor"), data.get("score")
        if not isinstance(monitor, str) or not monitor:
            return None
        number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        if isinstance(number, int) and abs(number) >= _LIMIT:
            number = None  # no float holds it
        mode = data.get("mode")
        return cls(monitor, mode if isinstance(mode, str) else None, number)


@dataclass(frozen=True)
class DataDescription:
    """The data a checkpoint was written with, which a mid-epoch resume compares.

    `samples` are those the epoch's order permutes, `seed` the seed of that order;
    each is None when unknown (no `SyncedCheckpoint(dataset=)`, a model the kit did not
    build).
    """

    global_batch_size: int | None = None
    epoch_length: int | None = None
    steps_per_execution: int | None = None
    seed: int | None = None
    samples: int | None = None

    def to_json(self) -> dict[str, Any]:
        """The keys `global_batch_size` ... `data_samples`, in the order files hold them."""
        return {
            "global_batch_size": self.global_batch_size,
            "epoch_length": self.epoch_length,
            "steps_per_execution": self.steps_per_execution,
            "data_seed": self.seed,
            "data_samples": self.samples,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DataDescription:
        """The description recorded in `data` (None for each key it lacks)."""
        return cls(
            global_batch_size=_int(data, "global_batch_size"),
            epoch_length=_int(data, "epoch_length"),
            steps_per_execution=_int(data, "steps_per_execution"),
            seed=_int(data, "data_seed", minimum=None),
            samples=_int(data, "data_samples"),
        )


@dataclass(frozen=True)
class CheckpointMeta(Mapping[str, Any]):
    """The metadata of one checkpoint: its progress, its `fit()`, its data, its variables.

    Also reads as the mapping of its JSON keys (`meta["epoch"]`), as the file holds them.

    Attributes:
        epoch: The epoch to go on with (the next one when `epoch_end`).
        step: Batches of that epoch trained (0 at an epoch end).
        epoch_end: Whether it was written at an epoch boundary.
        global_step: The optimizer's step count, or None without an optimizer.
        state: `"variables"` (`model.variables`) or `"weights"` (older files).
        fit: Which `fit()` of the script wrote it (`fit_record.FitRecord`: its number, its
            `epochs` and those of the `fit()` calls before it); None in older files.
        stopped: Whether that `fit()` had been asked to stop (by a callback).
        finite: Whether every value saved is finite.
        num_replicas: The replica count of the run that wrote it.
        backend: The Keras backend that wrote it (`"tensorflow"`, `"jax"`); None in older
            files.
        data: The data it was written with.
        variables: `"group:path"` of each saved variable, by array number.
        trained: For each optimizer the model holds (`model_parts.optimizers_of`'s order),
            the array numbers of the model's variables it was built to train (the
            trainable ones when it was built); None in older files.
        callbacks: The other callbacks' states (arrays replaced by markers).
        score: What `keep_best` ranks it by, or None without `keep_best`.
        model_config: The model's serialized architecture, or None.
        file: Its file name (set by the store when it writes the file).
        version: The format version.
    """

    epoch: int
    step: int
    epoch_end: bool = False
    global_step: int | None = None
    state: str = STATE_VARIABLES
    fit: FitRecord | None = None
    stopped: bool = False
    finite: bool = True
    num_replicas: int | None = None
    backend: str | None = None
    data: DataDescription = field(default_factory=DataDescription)
    variables: tuple[str, ...] = ()
    trained: tuple[tuple[int, ...], ...] | None = None
    callbacks: Mapping[str, Any] = field(default_factory=dict)
    score: Score | None = None
    model_config: Mapping[str, Any] | None = None
    file: str | None = None
    version: int = VERSION

    @property
    def legacy_state(self) -> bool:
        """Whether it holds `model.weights` (no random-layer state), as files without "state"."""
        return self.state != STATE_VARIABLES

    def to_json(self) -> dict[str, Any]:
        """The JSON object a checkpoint file holds, keys in the order files hold them."""
        return {
            "epoch": self.epoch,
            "step": self.step,
            "epoch_end": self.epoch_end,
            "global_step": self.global_step,
            "state": self.state,
            "fit_index": self.fit.index if self.fit else None,
            "fit_epochs": self.fit.epochs if self.fit else None,
            "script_fit_epochs": list(self.fit.script_epochs) if self.fit else None,
            "stopped": self.stopped,
            "finite": self.finite,
            "num_replicas": self.num_replicas,
            **({"backend": self.backend} if self.backend else {}),
            **self.data.to_json(),
            "variables": list(self.variables),
            **({"trained": [list(t) for t in self.trained]} if self.trained is not None else {}),
            "callbacks": dict(self.callbacks),
            **(self.score.to_json() if self.score is not None else {}),
            **({"model_config": dict(self.model_config)} if self.model_config else {}),
            "format": FORMAT,
            "version": self.version,
            **({"file": self.file} if self.file is not None else {}),
        }

    @classmethod
    def from_json(cls, data: object) -> CheckpointMeta:
        """Reads a checkpoint file's metadata (of any version).

        Raises:
            ValueError: When it is not the metadata of a keras-mirror-kit checkpoint.
        """
        if not isinstance(data, Mapping):
            raise ValueError("its metadata is not a JSON object")
        if data.get("format") != FORMAT:
            raise ValueError(f"its format is {data.get('format')!r}")
        for key in ("epoch", "step"):
            if _int(data, key) is None:
                raise ValueError(f"its metadata has no {key!r}")
        callbacks, config = data.get("callbacks"), data.get("model_config")
        variables = data.get("variables") or []
        if not isinstance(variables, list) or not all(isinstance(v, str) for v in variables):
            raise ValueError("its 'variables' is not a list of strings")
        if callbacks is not None and not (
            isinstance(callbacks, Mapping)
            and all(isinstance(state, Mapping) for state in callbacks.values())
        ):
            raise ValueError("its 'callbacks' is not an object of callback states")
        if config is not None and not isinstance(config, Mapping):
            raise ValueError("its 'model_config' is not a JSON object")
        version = _int(data, "version")
        trained = data.get("trained")
        if trained is not None and not (
            isinstance(trained, list)
            and all(
                isinstance(t, list) and all(type(n) is int and n >= 0 for n in t) for t in trained
            )
        ):
            raise ValueError("its 'trained' is not a list of lists of array numbers")
        return cls(
            epoch=_whole(data["epoch"], "epoch"),
            step=_whole(data["step"], "step"),
            epoch_end=bool(data.get("epoch_end")),
            global_step=_int(data, "global_step"),
            state=_str(data, "state") or STATE_WEIGHTS,
            fit=_fit_record(data),
            stopped=bool(data.get("stopped")),
            finite=data.get("finite") is not False,
            num_replicas=_int(data, "num_replicas"),
            backend=_str(data, "backend") or None,
            data=DataDescription.from_json(data),
            variables=tuple(variables),
            trained=None if trained is None else tuple(tuple(t) for t in trained),
            callbacks={str(k): dict(v) for k, v in (callbacks or {}).items()},
            score=Score.from_json(data),
            model_config=dict(config) if config else None,
            file=_str(data, "file"),
            version=VERSION if version is None else version,
        )

    @cached_property
    def _json(self) -> dict[str, Any]:
        return self.to_json()

    def __getitem__(self, key: str) -> Any:
        return self._json[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._json)

    def __len__(self) -> int:
        return len(self._json)


@dataclass(frozen=True)
class ManifestEntry:
    """One checkpoint as the manifest lists it (or as rebuilt from its file's metadata).

    The progress fields repeat the file's metadata (retention and resume decide on them);
    each is None when unknown (then the file is read). `crc32` (or `sha256`, 0.1.0) and
    `size` are what the file is verified against; an entry without them is not listed
    in the manifest. `unreadable`: a file whose metadata could not be read.
    """

    file: str
    index: int
    epoch: int | None = None
    step: int | None = None
    epoch_end: bool | None = None
    global_step: int | None = None
    fit_index: int | None = None
    stopped: bool | None = None
    finite: bool | None = None
    score: Score | None = None
    crc32: str | None = None
    sha256: str | None = None
    size: int | None = None
    unreadable: bool = False

    @property
    def listed(self) -> bool:
        """Whether the manifest records a checksum for it."""
        return self.crc32 is not None or self.sha256 is not None

    @property
    def finite_state(self) -> bool:
        """Whether its state can be restored: readable, and not known to hold NaN or Inf."""
        return not self.unreadable and self.finite is not False

    @classmethod
    def of(
        cls, meta: CheckpointMeta, file: str, crc32: str | None = None, size: int | None = None
    ) -> ManifestEntry:
        """The entry of a checkpoint file with this metadata."""
        index = checkpoint_index(file)
        if index is None:
            raise ValueError(f"not a checkpoint file name: {file!r}")
        return cls(
            file=file,
            index=index,
            epoch=meta.epoch,
            step=meta.step,
            epoch_end=meta.epoch_end,
            global_step=meta.global_step,
            fit_index=meta.fit.index if meta.fit else None,
            stopped=meta.stopped,
            finite=meta.finite,
            score=meta.score,
            crc32=crc32,
            size=size,
        )

    def to_json(self) -> dict[str, Any]:
        """The manifest's JSON object of this entry (fields not known are left out)."""
        progress = {
            "epoch": self.epoch,
            "step": self.step,
            "epoch_end": self.epoch_end,
            "global_step": self.global_step,
            "fit_index": self.fit_index,
            "stopped": self.stopped,
            "finite": self.finite,
        }
        listed = {"file": self.file, "crc32": self.crc32, "sha256": self.sha256}
        return {
            **{k: v for k, v in progress.items() if v is not None},
            **(self.score.to_json() if self.score is not None else {}),
            **{k: v for k, v in listed.items() if v is not None},
            **({"size": self.size} if self.size is not None else {}),
            **({"unreadable": True} if self.unreadable else {}),
        }

    @classmethod
    def from_json(cls, data: object) -> ManifestEntry | None:
        """An entry of the manifest, or None for one that names no checkpoint file."""
        if not isinstance(data, Mapping):
            return None
        index = checkpoint_index(str(data.get("file", "")))
        if index is None:
            return None
        try:
            return cls(
                file=str(data["file"]),
                index=index,
                epoch=_int(data, "epoch"),
                step=_int(data, "step"),
                epoch_end=_flag(data, "epoch_end"),
                global_step=_int(data, "global_step"),
                fit_index=_int(data, "fit_index"),
                stopped=_flag(data, "stopped"),
                finite=_flag(data, "finite"),
                score=Score.from_json(data),
                crc32=str(data["crc32"]) if data.get("crc32") is not None else None,
                sha256=str(data["sha256"]) if data.get("sha256") is not None else None,
                size=_int(data, "size"),
                unreadable=bool(data.get("unreadable")),
            )
        except ValueError:
            return cls(file=str(data["file"]), index=index, unreadable=True)


def manifest_json(latest: str, entries: Sequence[ManifestEntry]) -> dict[str, Any]:
    """The manifest's JSON object: the kept checkpoints, oldest first, and the newest."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "latest": latest,
        "checkpoints": [entry.to_json() for entry in entries],
    }


def read_manifest_json(data: object) -> tuple[str | None, list[ManifestEntry]]:
    """The newest file and the entries of a manifest (entries naming no checkpoint dropped).

    Raises:
        ValueError: When it is not a keras-mirror-kit manifest.
    """
    if (
        not isinstance(data, Mapping)
        or data.get("format") != FORMAT
        or not isinstance(data.get("checkpoints"), list)
    ):
        raise ValueError("not a keras-mirror-kit manifest")
    entries = [ManifestEntry.from_json(item) for item in data["checkpoints"]]
    latest = data.get("latest")
    return (latest if isinstance(latest, str) else None), [e for e in entries if e is not None]
