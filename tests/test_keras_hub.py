"""KerasHub tasks built in a kit factory: the kit's `fit` runs, whatever their `fit` takes.

KerasHub's tasks override `fit(x, y, batch_size, sample_weight, validation_data,
validation_split, **kwargs)`: `callbacks`, `epochs` and `shuffle` arrive in `**kwargs`.
A tiny `BertTextClassifier` and a tiny `GPT2CausalLM`, each from its constructors (a
tokenizer from an in-memory vocabulary: nothing is downloaded), on 2 logical CPUs, train
on lists of texts and labels (the classifier) or a NumPy array of texts (the causal LM),
given positionally, with `SyncedCheckpoint` (every 2 steps), `EarlyStopping`, a
`CSVLogger` listed before `ThroughputMonitor`; a run killed mid-epoch resumes exactly
(mid-epoch, `EarlyStopping`'s count restored: it stops where the uninterrupted run did),
and the trained task saves to `.keras` and loads. Each task is built and traced once and
set back to its built state for each run (`tests.ckpt_helpers.set_back`).
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

import keras_mirror_kit as kmk
from tests.ckpt_helpers import CountBatches, StopAt, max_diff, set_back

pytestmark = pytest.mark.slow  # trains and traces two transformers

TWO = ["/cpu:0", "/cpu:1"]
BATCH = 8
WORDS = "the quick brown fox jumped over lazy dog a cat sat on mat good bad movie".split()
# 40 samples: 5 steps an epoch. EarlyStopping never sees the loss improve by 10 after
# epoch 0, so with patience 2 it stops at the end of epoch 2: 15 steps. Killed at epoch 2,
# batch 2 (13 steps), the newest checkpoint is at step 12 (every 2 steps): the resumed run
# trains the last 3 steps of epoch 2 and stops. Resumed at the epoch boundary it would
# train 5; with EarlyStopping's count lost, 8 (it would stop an epoch later).
SAMPLES, EPOCHS, STOPS_AFTER, CRASH, AFTER_RESUME = 40, 6, 15, (2, 2), 3


def texts(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.array([" ".join(rng.choice(WORDS, 5)) for _ in range(SAMPLES)])


def bert_classifier() -> keras.Model:
    import keras_hub

    vocabulary = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]

    @kmk.distributed(global_batch_size=BATCH, devices=TWO)
    def build_model() -> keras.Model:
        keras.utils.set_random_seed(1)
        tokenizer = keras_hub.models.BertTokenizer(vocabulary=vocabulary)
        preprocessor = keras_hub.models.BertTextClassifierPreprocessor(
            tokenizer, sequence_length=8
        )
        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=len(vocabulary),
            num_layers=1,
            num_heads=2,
            hidden_dim=8,
            intermediate_dim=16,
            max_sequence_length=8,
        )
        task = keras_hub.models.BertTextClassifier(
            backbone, num_classes=2, preprocessor=preprocessor
        )
        task.compile(
            optimizer=keras.optimizers.Adam(1e-2),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return task

    return build_model()


def gpt2_causal_lm() -> keras.Model:
    import keras_hub

    letters = "abcdefghijklmnopqrstuvwxyz"
    # Byte-level BPE over letters: "Ġ" marks a word's start, one merge per letter.
    vocabulary = {"<|endoftext|>": 0, "Ġ": 1}
    vocabulary.update({c: len(vocabulary) + i for i, c in enumerate(letters)})
    vocabulary.update({f"Ġ{c}": len(vocabulary) + i for i, c in enumerate(letters)})
    merges = [f"Ġ {c}" for c in letters]

    @kmk.distributed(global_batch_size=BATCH, devices=TWO)
    def build_model() -> keras.Model:
        keras.utils.set_random_seed(1)
        tokenizer = keras_hub.models.GPT2Tokenizer(vocabulary=vocabulary, merges=merges)
        preprocessor = keras_hub.models.GPT2CausalLMPreprocessor(tokenizer, sequence_length=12)
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=len(vocabulary),
            num_layers=1,
            num_heads=2,
            hidden_dim=8,
            intermediate_dim=16,
            max_sequence_length=16,
        )
        task = keras_hub.models.GPT2CausalLM(backbone, preprocessor=preprocessor)
        task.compile(optimizer=keras.optimizers.Adam(1e-2), sampler="greedy")
        return task

    return build_model()


TASKS = {"bert_classifier": bert_classifier, "gpt2_causal_lm": gpt2_causal_lm}


def fit_args(task_name: str) -> tuple[Any, ...]:
    """`fit`'s positional data: Python lists of texts and labels, as KerasHub's guides give
    them (the classifier), or a NumPy array of texts alone (the causal LM)."""
    x = texts()
    if task_name == "bert_classifier":
        return x.tolist(), [int("good" in s) for s in x]
    return (x,)


def train(task: keras.Model, task_name: str, directory: Path, *extra: Any) -> tuple[int, Path]:
    """One `fit` with the checkpoint, EarlyStopping, a logger before the monitor; the steps
    it trained and its CSV log."""
    counter = CountBatches()
    directory.mkdir(parents=True, exist_ok=True)
    log = directory / "log.csv"
    callbacks = [
        keras.callbacks.CSVLogger(str(log), append=True),
        kmk.ThroughputMonitor(warmup_steps=1),
        kmk.SyncedCheckpoint(directory / "ckpt", save_freq=2),
        keras.callbacks.EarlyStopping(monitor="loss", patience=2, min_delta=10),
        counter,
        *extra,
    ]
    # Positional data, and the rest in the task's **kwargs: as KerasHub's guides call it.
    task.fit(*fit_args(task_name), epochs=EPOCHS, verbose=0, callbacks=callbacks)
    return counter.batches, log


def newest_meta(directory: Path) -> dict[str, Any]:
    newest = max(directory.glob("ckpt-*.npz"), key=lambda p: p.stat().st_mtime_ns)
    with np.load(newest, allow_pickle=False) as npz:
        return json.loads(npz["__meta__"].tobytes())


@pytest.mark.parametrize("task_name", sorted(TASKS))
def test_a_keras_hub_task_trains_checkpoints_resumes_and_saves_through_the_kit(
    task_name, tmp_path, caplog
):
    task = TASKS[task_name]()
    reset = set_back(task)

    steps, log = train(reset(), task_name, tmp_path / "reference")
    reference = [w.copy() for w in task.get_weights()]
    assert steps == STOPS_AFTER
    with open(log, newline="") as handle:
        columns = next(csv.reader(handle))
    assert "samples_per_sec" in columns  # the monitor ran before the logger listed first

    with pytest.raises(KeyboardInterrupt):
        train(reset(), task_name, tmp_path / "run", StopAt(*CRASH))
    saved = newest_meta(tmp_path / "run" / "ckpt")["callbacks"]
    assert saved["EarlyStopping#0"]["wait"] == 1  # the count after epoch 1

    caplog.set_level(logging.WARNING, logger="keras_mirror_kit")
    steps, _ = train(reset([w * 0 for w in reference]), task_name, tmp_path / "run")
    assert steps == AFTER_RESUME  # mid-epoch, and EarlyStopping stopped where it did
    assert max_diff(reference, task.get_weights()) <= 1e-6
    assert not [r for r in caplog.records if "dataset=" in r.getMessage()]

    path = tmp_path / "task.keras"
    task.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded) is type(task)
    assert max_diff(task.get_weights(), loaded.get_weights()) == 0.0
    if task_name == "gpt2_causal_lm":  # its tokenizer and sampler came back too
        loaded.compile(sampler="greedy")
        prompts = ["the cat", "a dog"]
        assert loaded.generate(prompts, max_length=10) == task.generate(prompts, max_length=10)
    else:  # and its preprocessor
        x = fit_args(task_name)[0][:BATCH]
        gap = np.max(np.abs(loaded.predict(x, verbose=0) - task.predict(x, verbose=0)))
        assert gap <= 1e-5
