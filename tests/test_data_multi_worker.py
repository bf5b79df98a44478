"""Sharding by index: 2 workers through `launch` on an image-folder job equal one 2-replica
process, and each worker decodes only its own part of every global batch."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from tests import data_files, forkserver
from tests.subproc import REPO

CHILD = "tests.mw_data_child"


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2"}
    for name in ("TF_CONFIG", "KMK_SIMULATE_REPLICAS", "KMK_KERAS_WORKAROUND"):
        env.pop(name, None)
    env.update(extra)
    return env


def _run(command: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    proc = forkserver.popen(
        command,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=30)
        raise AssertionError(
            f"did not finish in {timeout} s\n{stdout[-3000:]}\n{stderr[-6000:]}"
        ) from None
    assert proc.returncode == 0, f"rc={proc.returncode}\n{stdout[-3000:]}\n{stderr[-8000:]}"
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def _weights(path):
    with np.load(path) as npz:
        return [npz[k] for k in sorted(npz.files, key=lambda k: int(k.split("_")[1]))]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_workers_decode_disjoint_parts_and_train_like_one_process(tmp_path):
    data = data_files.image_folder(tmp_path / "data", per_class=16, sizes=(10, 18))
    one, two = tmp_path / "one", tmp_path / "two"
    _run([sys.executable, "-m", CHILD, str(one), str(data)], _env(KMK_SIMULATE_REPLICAS="2"), 400)
    launch = [sys.executable, "-m", "keras_mirror_kit.multi_worker.launch", "-n", "2"]
    launched = _run(
        [*launch, "--finish-window", "120", "-m", CHILD, str(two), str(data)], _env(), 600
    )
    assert "shard" not in launched.stdout.lower() + launched.stderr.lower()  # no AUTO warning

    reference = json.loads((one / "result-0.json").read_text())
    workers = [json.loads((two / f"result-{rank}.json").read_text()) for rank in (0, 1)]
    assert reference["num_replicas"] == 2 and reference["num_workers"] == 1
    assert [w["num_workers"] for w in workers] == [2, 2]
    # Each worker decoded half of what one process decodes, and together exactly that:
    # every sample of every epoch (training and validation) once, none twice, none never.
    single = collections.Counter(reference["decoded"])
    assert all(len(w["decoded"]) == len(reference["decoded"]) // 2 for w in workers)
    assert (
        collections.Counter(workers[0]["decoded"]) + collections.Counter(workers[1]["decoded"])
        == single
    )
    for worker in workers:
        assert worker["loss"] == reference["loss"] and worker["val_loss"] == reference["val_loss"]
    expected = _weights(one / "weights-0.npz")
    for rank in (0, 1):
        got = _weights(two / f"weights-{rank}.npz")
        assert max(float(np.max(np.abs(a - b))) for a, b in zip(expected, got)) <= 1e-6


def test_each_worker_keeps_a_contiguous_block_of_a_batch():
    """The block each worker decodes is the one MultiWorkerMirroredStrategy keeps for it
    (measured: keras_mirror_kit/data/sharding.py's docstring). Refusing a block computed
    for another layout: tests/test_data_sources.py."""
    from keras_mirror_kit.data.sharding import WorkerSlice, own_range

    def blocks(workers, replicas_per_worker, size):
        return [
            tuple(
                int(v)
                for v in own_range(np.int64(size), WorkerSlice(r, workers, replicas_per_worker))
            )
            for r in range(workers)
        ]

    assert blocks(2, 1, 8) == [(0, 4), (4, 8)]
    assert blocks(2, 1, 2) == [(0, 1), (1, 2)] and blocks(2, 1, 1) == [(0, 1), (1, 1)]
    assert blocks(2, 2, 8) == [(0, 4), (4, 8)] and blocks(2, 2, 5) == [(0, 4), (4, 5)]


def test_a_worker_with_nothing_of_a_short_last_batch_still_yields_it(monkeypatch):
    """2 workers, 1 replica each, a last batch of 1 sample: worker 1's block of it is empty;
    it yields the batch's size with copies (the sharding keeps none of them)."""
    import json

    import tensorflow as tf

    import keras_mirror_kit as kmk

    cluster = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}
    monkeypatch.setenv(
        "TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 1}})
    )
    loaded = []

    def load(item):
        loaded.append(item)
        return tf.cast(item, tf.float32)[tf.newaxis]

    ds = kmk.make_dataset(
        np.arange(5), np.arange(5), 4, shuffle=False, load=load, drop_remainder=False
    )
    batches = [(x.numpy(), y.numpy()) for x, y in ds]
    assert [len(x) for x, _ in batches] == [4, 1]
    assert batches[0][0][2:, 0].tolist() == [2.0, 3.0] and batches[0][1][2:].tolist() == [2, 3]
