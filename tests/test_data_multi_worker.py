"""Sharding by index: 2 workers on an image-folder job equal one 2-replica process, and
each worker decodes only its own part of every global batch.

The workers are real processes with a TF_CONFIG each (as `launch` makes it), forked from
the tests' zygote: what is checked is the data pipeline, not the launcher (whose own
runs are in tests/test_multi_worker.py)."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from keras_mirror_kit.multi_worker import launch
from tests import data_files, forkserver
from tests.subproc import REPO

CHILD = "tests.mw_data_child"


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2"}
    for name in ("TF_CONFIG", "KMK_SIMULATE_REPLICAS", "KMK_KERAS_WORKAROUND"):
        env.pop(name, None)
    env.update(extra)
    return env


def _run(
    command: list[str], envs: list[dict[str, str]], timeout: float
) -> list[subprocess.CompletedProcess]:
    """Runs `command` once per environment (at the same time), each to its end (status 0)."""
    procs = [
        forkserver.popen(
            command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for env in envs
    ]
    deadline = time.monotonic() + timeout  # bounds a stuck job; no check times it
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"did not finish in {timeout} s") from None
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)
    done = []
    for proc, (stdout, stderr) in zip(procs, outputs):
        assert proc.returncode == 0, f"rc={proc.returncode}\n{stdout[-3000:]}\n{stderr[-8000:]}"
        done.append(subprocess.CompletedProcess(command, proc.returncode, stdout, stderr))
    return done


def _weights(path):
    with np.load(path) as npz:
        return [npz[k] for k in sorted(npz.files, key=lambda k: int(k.split("_")[1]))]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_workers_decode_disjoint_parts_and_train_like_one_process(tmp_path):
    data = data_files.image_folder(tmp_path / "data", per_class=16, sizes=(10, 18))
    one, two = tmp_path / "one", tmp_path / "two"
    _run(
        [sys.executable, "-m", CHILD, str(one), str(data)], [_env(KMK_SIMULATE_REPLICAS="2")], 400
    )
    ports = launch.free_ports(2)
    workers_env = [_env(TF_CONFIG=launch.tf_config_for(ports, rank)) for rank in (0, 1)]
    for proc in _run([sys.executable, "-m", CHILD, str(two), str(data)], workers_env, 600):
        assert "shard" not in proc.stdout.lower() + proc.stderr.lower()  # no AUTO warning

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
