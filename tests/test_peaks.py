"""Peak FLOP/s: the GPU table, the CPU roof file, and which peak a set of replicas gets."""

from __future__ import annotations

import json
import re

import pytest

from keras_mirror_kit.throughput import peaks
from keras_mirror_kit.throughput.peaks import (
    COMPUTE_DTYPES,
    GPU_PEAKS,
    compute_dtype_key,
    gpu_peak_flops,
    load_roof,
    lookup_gpu,
    measure_matmul_roof,
    resolve_peak,
    roof_path,
    store_roof,
)
from keras_mirror_kit.validation import optional_positive_number

# The GPUs the table must cover (issue: datacenter and workstation GPUs of the last three
# generations), by the name TensorFlow reports for them.
REQUIRED = {
    "NVIDIA B200": "B200",
    "NVIDIA H200": "H200 SXM",
    "NVIDIA H100 80GB HBM3": "H100 SXM",
    "NVIDIA H100 PCIe": "H100 PCIe",
    "NVIDIA H100 NVL": "H100 NVL",
    "NVIDIA L40S": "L40S",
    "NVIDIA L4": "L4",
    "NVIDIA RTX 6000 Ada Generation": "RTX 6000 Ada",
    "NVIDIA GeForce RTX 4090": "RTX 4090",
    "NVIDIA A100-SXM4-80GB": "A100 SXM4",
    "NVIDIA A100-SXM4-40GB": "A100 SXM4",
    "NVIDIA A100 80GB PCIe": "A100 PCIe",
    "NVIDIA A100-PCIE-40GB": "A100 PCIe",
    "NVIDIA A10": "A10",
    "NVIDIA A40": "A40",
    "NVIDIA RTX A6000": "RTX A6000",
    "NVIDIA GeForce RTX 3090": "RTX 3090",
}


@pytest.mark.parametrize(("name", "model"), sorted(REQUIRED.items()))
def test_the_table_covers_the_common_gpus_by_their_tensorflow_names(name, model):
    entry = lookup_gpu(name)
    assert entry is not None and entry.model == model
    assert {"fp32", "bf16", "fp16"} <= set(entry.flops)  # all of these have bf16 tensor cores
    assert entry.flops["bf16"] >= entry.flops.get("tf32", 0) >= entry.flops["fp32"] > 1e12


def test_every_entry_has_a_source_and_sane_figures():
    for entry in GPU_PEAKS:
        assert re.search(r"https://\S+", entry.source), entry.model
        assert set(entry.flops) <= set(COMPUTE_DTYPES), entry.model
        assert all(1e12 < v < 1e16 for v in entry.flops.values()), entry.model
        for name in entry.names:
            assert lookup_gpu(name) is entry, name


def test_unknown_and_near_miss_names_get_no_peak():
    for name in ("NVIDIA A10G", "NVIDIA GeForce RTX 3090 Ti", "AMD Instinct MI300X", ""):
        assert lookup_gpu(name) is None, name
        assert gpu_peak_flops(name, "bf16") is None
    assert lookup_gpu("NVIDIA A100-SXM4-64GB").model == "A100 SXM4"  # a variant's pattern
    assert gpu_peak_flops("NVIDIA L4", "bf16") == pytest.approx(121e12)
    assert gpu_peak_flops("Tesla T4", "bf16") is None  # no bf16 on Turing


def test_compute_dtype_keys():
    assert compute_dtype_key("float32") == "fp32"
    assert compute_dtype_key("float32", tf32=True) == "tf32"
    assert compute_dtype_key("bfloat16", tf32=True) == "bf16"
    assert compute_dtype_key("float16") == "fp16"
    with pytest.raises(ValueError, match="compute_dtype"):
        compute_dtype_key("int8")


def test_validate_peak_flops():
    assert (
        optional_positive_number("peak_flops", None) is None
        and optional_positive_number("peak_flops", 312e12) == 312e12
    )
    with pytest.raises(ValueError, match="peak_flops"):
        optional_positive_number("peak_flops", 0)
    with pytest.raises(TypeError, match="peak_flops"):
        optional_positive_number("peak_flops", "312e12")


def test_roof_path_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KMK_ROOF_FILE", str(tmp_path / "r.json"))
    assert roof_path() == tmp_path / "r.json"
    monkeypatch.delenv("KMK_ROOF_FILE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert roof_path() == tmp_path / "cache" / "keras-mirror-kit" / "roof.json"


def test_store_and_load_the_roof_keeping_other_cpus(tmp_path):
    path = tmp_path / "sub" / "roof.json"
    store_roof({"fp32": {"flops_per_sec": 1.0e11}}, path=path, cpu="other CPU")
    store_roof({"fp32": {"flops_per_sec": 2.0e11}}, path=path, cpu="this CPU")
    store_roof({"bf16": {"flops_per_sec": 4.0e11}}, path=path, cpu="this CPU")
    assert load_roof(path, cpu="this CPU") == {
        "fp32": {"flops_per_sec": 2.0e11},
        "bf16": {"flops_per_sec": 4.0e11},
    }
    assert load_roof(path, cpu="other CPU") == {"fp32": {"flops_per_sec": 1.0e11}}
    assert load_roof(path, cpu="unknown") == {}
    assert [p.name for p in path.parent.iterdir()] == ["roof.json"]  # no temporary left


def test_a_foreign_or_broken_file_is_never_overwritten_or_trusted(tmp_path):
    path = tmp_path / "roof.json"
    path.write_text('{"something": "else"}')
    with pytest.raises(ValueError, match="not a roof file"):
        store_roof({"fp32": {"flops_per_sec": 1.0e11}}, path=path, cpu="c")
    assert json.loads(path.read_text()) == {"something": "else"}
    path.write_text("{ truncated")
    assert load_roof(path, cpu="c") == {}
    with pytest.raises(ValueError, match="not a roof file"):
        store_roof({"fp32": {"flops_per_sec": 1.0e11}}, path=path, cpu="c")
    assert path.read_text() == "{ truncated"


def test_measured_roof_is_the_matmul_arithmetic_over_the_fastest_round():
    result = measure_matmul_roof("float32", size=128, repeats=2, rounds=2)
    assert result["flops_per_sec"] == pytest.approx(2 * 128**3 * 2 / result["seconds"])
    assert result["dtype"] == "float32" and result["size"] == 128
    with pytest.raises(ValueError, match="size"):
        measure_matmul_roof("float32", size=0)


def test_cpu_replicas_share_one_roof(monkeypatch, tmp_path):
    """2 simulated CPU replicas (conftest) run on one CPU: its roof counts once."""
    path = tmp_path / "roof.json"
    monkeypatch.setenv("KMK_ROOF_FILE", str(path))
    devices = ("/job:localhost/replica:0/task:0/device:CPU:0", "/device:CPU:1")
    unknown = resolve_peak(devices, "float32")
    assert unknown.per_device is None and unknown.total is None
    assert str(path) in unknown.source
    store_roof({"fp32": {"flops_per_sec": 3.0e11}, "bf16": {"flops_per_sec": 5.0e11}})
    fp32 = resolve_peak(devices, "float32")
    assert (fp32.total, fp32.devices, fp32.dtype) == (3.0e11, 1, "fp32")
    assert resolve_peak(devices, "bfloat16").total == 5.0e11
    assert resolve_peak(devices, "bfloat16", num_workers=2).total == 1.0e12
    given = resolve_peak(devices, "float32", peak_flops=7.0e11)
    assert (given.total, given.source) == (7.0e11, "peak_flops=")


def test_cpu_name_names_the_core_count():
    assert re.search(r", \d+ cores$", peaks.cpu_name())


class FakeGpu:
    def __init__(self, index: int) -> None:
        self.name = f"/physical_device:GPU:{index}"
        self.device_type = "GPU"


def fake_gpus(monkeypatch, name: str, count: int, split_first: int = 0) -> None:
    """No GPU here: TensorFlow's device queries answer as on a host with `count` GPUs."""
    import tensorflow as tf

    gpus = [FakeGpu(i) for i in range(count)]
    monkeypatch.setattr(tf.config, "get_visible_devices", lambda kind=None: gpus)
    monkeypatch.setattr(
        tf.config,
        "get_logical_device_configuration",
        lambda d: [object()] * split_first if split_first and d is gpus[0] else None,
    )
    monkeypatch.setattr(
        tf.config.experimental,
        "get_device_details",
        lambda d: {"device_name": name, "compute_capability": (8, 0)},
    )


def test_gpu_replicas_get_the_table_peak_per_physical_gpu(monkeypatch):
    import tensorflow as tf

    fake_gpus(monkeypatch, "NVIDIA A100-SXM4-80GB", count=2)
    devices = ("/job:localhost/replica:0/task:0/device:GPU:0", "/device:GPU:1")
    monkeypatch.setattr(tf.config.experimental, "tensor_float_32_execution_enabled", lambda: True)
    tf32 = resolve_peak(devices, "float32")
    assert (tf32.dtype, tf32.devices, tf32.total) == ("tf32", 2, pytest.approx(2 * 156e12))
    assert "a100" in tf32.source.lower()
    assert resolve_peak(devices, "bfloat16").total == pytest.approx(2 * 312e12)
    monkeypatch.setattr(tf.config.experimental, "tensor_float_32_execution_enabled", lambda: False)
    assert resolve_peak(devices, "float32").total == pytest.approx(2 * 19.5e12)


def test_logical_gpus_split_from_one_gpu_count_once(monkeypatch):
    fake_gpus(monkeypatch, "NVIDIA L4", count=1, split_first=2)
    peak = resolve_peak(("/device:GPU:0", "/device:GPU:1"), "bfloat16")
    assert (peak.devices, peak.total) == (1, pytest.approx(121e12))


def test_an_unknown_gpu_gets_no_peak_and_says_which(monkeypatch):
    fake_gpus(monkeypatch, "NVIDIA Imaginary 9000", count=1)
    peak = resolve_peak(("/device:GPU:0",), "bfloat16")
    assert peak.total is None and "NVIDIA Imaginary 9000" in peak.source
    assert resolve_peak(("/device:GPU:0",), "bfloat16", peak_flops=1e14).total == 1e14
