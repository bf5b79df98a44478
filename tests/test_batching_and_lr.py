"""Batch-size arithmetic and learning-rate scaling rules."""

from __future__ import annotations

import math

import pytest

import keras_mirror_kit as kmk


def test_global_batch_size_multiplies():
    assert kmk.global_batch_size(64, 2) == 128
    assert kmk.global_batch_size(1, 8) == 8


@pytest.mark.parametrize(
    ("args", "exc", "fragment"),
    [
        ((0, 2), ValueError, "per_replica_batch_size=0"),
        ((-4, 2), ValueError, "per_replica_batch_size=-4"),
        ((64, 0), ValueError, "num_replicas=0"),
        ((64.0, 2), TypeError, "per_replica_batch_size=64.0"),
        ((True, 2), TypeError, "per_replica_batch_size=True"),
        (("64", 2), TypeError, "per_replica_batch_size='64'"),
    ],
)
def test_global_batch_size_rejects_bad_input(args, exc, fragment):
    with pytest.raises(exc, match="Received") as info:
        kmk.global_batch_size(*args)
    assert fragment in str(info.value)


def test_per_replica_batch_size_splits_and_rejects_uneven():
    assert kmk.per_replica_batch_size(128, 2) == 64
    with pytest.raises(ValueError, match="divide evenly") as info:
        kmk.per_replica_batch_size(129, 2)
    assert "global_batch_size=129" in str(info.value)
    assert "128" in str(info.value) and "130" in str(info.value)  # suggests valid sizes
    with pytest.raises(ValueError, match="divide evenly"):
        kmk.per_replica_batch_size(1, 2)  # would leave one replica with an empty batch


@pytest.mark.parametrize(
    ("rule", "expected"),
    [("linear", 4e-3), ("sqrt", 2e-3), ("none", 1e-3)],
)
def test_scale_learning_rate_rules(rule, expected):
    assert kmk.scale_learning_rate(1e-3, 64, 256, rule=rule) == pytest.approx(expected)


def test_scale_learning_rate_default_is_linear_and_handles_shrinking():
    assert kmk.scale_learning_rate(0.1, 256, 64) == pytest.approx(0.025)
    assert kmk.scale_learning_rate(0.1, 100, 200, rule="sqrt") == pytest.approx(0.1 * math.sqrt(2))


@pytest.mark.parametrize(
    ("kwargs", "exc", "fragment"),
    [
        ({"base_learning_rate": 0.0}, ValueError, "base_learning_rate=0.0"),
        ({"base_learning_rate": -1e-3}, ValueError, "base_learning_rate=-0.001"),
        ({"base_learning_rate": float("nan")}, ValueError, "base_learning_rate=nan"),
        ({"base_learning_rate": "1e-3"}, TypeError, "base_learning_rate='1e-3'"),
        ({"base_batch_size": 0}, ValueError, "base_batch_size=0"),
        ({"global_batch_size": -1}, ValueError, "global_batch_size=-1"),
        ({"rule": "cubic"}, ValueError, "rule='cubic'"),
        ({"rule": None}, ValueError, "rule=None"),
    ],
)
def test_scale_learning_rate_rejects_bad_input(kwargs, exc, fragment):
    args = {"base_learning_rate": 1e-3, "base_batch_size": 64, "global_batch_size": 128}
    args.update(kwargs)
    with pytest.raises(exc, match="Received") as info:
        kmk.scale_learning_rate(**args)
    assert fragment in str(info.value)
