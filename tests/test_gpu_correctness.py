"""What the kit does with GPUs, tested with fake device tables and logical CPUs (issue 17).

2: NCCL only when every replica is a distinct physical GPU. 3: a failing NCCL all-reduce
found when the strategy is made, with a fall-back. 4: hierarchical copy and odd replica
counts. 6: a GPU machine where TensorFlow registered no GPU, and `info`'s CUDA facts.
"""

from __future__ import annotations

import logging

import pytest
import tensorflow as tf

import keras_mirror_kit as kmk
from keras_mirror_kit import devices
from keras_mirror_kit.cli import info as cli_info
from keras_mirror_kit.devices import (
    choose_cross_device_ops,
    describe_gpus,
    device_table,
    gpu_diagnostics,
    kernel_support,
    mirrored_strategy,
    nccl_fallback,
    nvidia_hardware_signs,
    probe_all_reduce,
    unused_gpu_warning,
)
from tests.subproc import last_json, run_python


def gpus(*physical: str | None) -> list[tuple[str, str | None]]:
    """A fake device table: one logical GPU per entry, on the physical device given."""
    return [(f"/job:localhost/replica:0/task:0/device:GPU:{i}", p) for i, p in enumerate(physical)]


EIGHT_GPUS = gpus(*(f"GPU:{i}" for i in range(8)))
TWO_GPUS_SPLIT_IN_FOUR = gpus("GPU:0", "GPU:0", "GPU:1", "GPU:1")
MIXED = [("/job:localhost/replica:0/task:0/device:CPU:0", "CPU:0")] + gpus("GPU:0")
CPUS = [
    ("/job:localhost/replica:0/task:0/device:CPU:0", "CPU:0"),
    ("/job:localhost/replica:0/task:0/device:CPU:1", "CPU:0"),
]


# -- 2: NCCL on distinct physical GPUs only --------------------------------------------------


@pytest.mark.parametrize(
    "table, nccl_usable, expected",
    [
        (EIGHT_GPUS, True, "nccl"),
        (EIGHT_GPUS, False, "hierarchical_copy"),
        (TWO_GPUS_SPLIT_IN_FOUR, True, "hierarchical_copy"),  # NCCL: two ranks on one GPU
        (gpus("GPU:0", "GPU:0", "GPU:0"), True, "reduction_to_one_device"),  # split, odd
        (gpus("GPU:0", None), True, "hierarchical_copy"),  # cannot tell: no NCCL
        (MIXED, True, "reduction_to_one_device"),
        (CPUS, True, "reduction_to_one_device"),
        (gpus("GPU:0"), True, "reduction_to_one_device"),  # one replica: nothing to reduce
    ],
)
def test_auto_choice_is_a_function_of_the_device_table(table, nccl_usable, expected):
    assert choose_cross_device_ops("auto", table, nccl_usable=nccl_usable) == expected


def test_explicit_nccl_on_split_gpus_is_a_clear_error():
    assert choose_cross_device_ops("nccl", EIGHT_GPUS, nccl_usable=True) == "nccl"
    with pytest.raises(ValueError, match="one replica per physical GPU") as info:
        choose_cross_device_ops("nccl", TWO_GPUS_SPLIT_IN_FOUR, nccl_usable=True)
    message = str(info.value)
    assert "physical GPU GPU:0" in message and "cross_device_ops='auto'" in message
    assert "Received: cross_device_ops='nccl', replicas=4" in message
    for table, usable in ((MIXED, True), (CPUS, True), (EIGHT_GPUS, False)):
        with pytest.raises(ValueError, match="needs GPU replicas and a CUDA build"):
            choose_cross_device_ops("nccl", table, nccl_usable=usable)
    with pytest.raises(ValueError, match="Unknown `cross_device_ops`"):
        choose_cross_device_ops("ring", EIGHT_GPUS, nccl_usable=True)


def test_device_table_maps_split_devices_to_their_physical_device():
    # The test process splits its one CPU in two, as simulate_replicas splits a GPU.
    names = [d.name for d in tf.config.list_logical_devices("CPU")]
    assert device_table(names) == [(names[0], "CPU:0"), (names[1], "CPU:0")]
    ops, chosen = devices.make_cross_device_ops("auto", names)
    assert chosen == "reduction_to_one_device"
    assert isinstance(ops, tf.distribute.ReductionToOneDevice)


# -- 3: NCCL that cannot run ------------------------------------------------------------------


def nccl_library_missing(strategy):
    raise tf.errors.NotFoundError(None, None, "Unable to load NCCL library: libnccl.so.2")


def test_the_real_probe_passes_a_working_all_reduce_and_fails_nccl_without_gpus():
    names = [d.name for d in tf.config.list_logical_devices("CPU")]
    probe_all_reduce(tf.distribute.MirroredStrategy(names))  # sums 1 + 1 == 2
    nccl_on_cpus = tf.distribute.MirroredStrategy(
        names, cross_device_ops=tf.distribute.NcclAllReduce()
    )
    with pytest.raises(tf.errors.InvalidArgumentError, match="NcclAllReduce"):
        probe_all_reduce(nccl_on_cpus)  # no NCCL kernel for CPUs: a real NCCL failure


@pytest.mark.parametrize("probe", [nccl_library_missing, probe_all_reduce])
def test_auto_falls_back_when_nccl_fails_at_the_probe(caplog, probe):
    names = [d.name for d in tf.config.list_logical_devices("CPU")]
    claimed = gpus("GPU:0", "GPU:1")  # the table says two GPUs, so NCCL is chosen
    with caplog.at_level(logging.WARNING, logger="keras_mirror_kit"):
        strategy, chosen = mirrored_strategy(
            names, "auto", table=claimed, nccl_usable=True, probe=probe
        )
    assert chosen == "hierarchical_copy" == nccl_fallback(2)
    assert isinstance(strategy.extended._cross_device_ops, tf.distribute.HierarchicalCopyAllReduce)
    probe_all_reduce(strategy)  # the fall-back works
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "NCCL all-reduce fails" in warned[0]
    assert "'hierarchical_copy'" in warned[0] and "tensorflow[and-cuda]" in warned[0]


def test_explicit_nccl_that_fails_at_the_probe_is_a_clear_error():
    names = [d.name for d in tf.config.list_logical_devices("CPU")]
    with pytest.raises(RuntimeError, match="Unable to load NCCL library") as info:
        mirrored_strategy(
            names,
            "nccl",
            table=gpus("GPU:0", "GPU:1"),
            nccl_usable=True,
            probe=nccl_library_missing,
        )
    assert "cross_device_ops='auto'" in str(info.value)


def test_the_probe_runs_only_when_nccl_was_chosen():
    names = [d.name for d in tf.config.list_logical_devices("CPU")]
    calls = []
    strategy, chosen = mirrored_strategy(names, "auto", probe=calls.append)
    assert chosen == "reduction_to_one_device" and calls == []
    strategy, chosen = mirrored_strategy(
        names, "auto", table=gpus("GPU:0", "GPU:1"), nccl_usable=True, probe=calls.append
    )
    assert chosen == "nccl" and calls == [strategy]  # a passing probe keeps NCCL
    assert [nccl_fallback(n) for n in (2, 3, 4, 5)] == [
        "hierarchical_copy",
        "reduction_to_one_device",
        "hierarchical_copy",
        "reduction_to_one_device",
    ]


# -- 4: hierarchical copy leaves a replica out with an odd count -------------------------------


def test_hierarchical_copy_rejects_odd_counts_and_auto_avoids_them():
    for count in (3, 5, 7):
        with pytest.raises(ValueError, match="even number of replicas") as info:
            choose_cross_device_ops(
                "hierarchical_copy", gpus(*(f"GPU:{i}" for i in range(count))), nccl_usable=False
            )
        assert f"replicas={count}" in str(info.value)
        table = gpus(*(f"GPU:{i}" for i in range(count)))
        assert choose_cross_device_ops("auto", table, nccl_usable=False) == (
            "reduction_to_one_device"
        )
    for count in (1, 2, 4, 6):
        table = gpus(*(f"GPU:{i}" for i in range(count)))
        assert choose_cross_device_ops("hierarchical_copy", table, nccl_usable=False) == (
            "hierarchical_copy"
        )


THREE_REPLICAS = """
import json, tensorflow as tf, keras_mirror_kit as kmk
kmk.backends.configure_from_environment()  # KMK_SIMULATE_REPLICAS=3: three logical CPUs
names = [d.name for d in tf.config.list_logical_devices("CPU")]
strategy = tf.distribute.MirroredStrategy(names,
                                          cross_device_ops=tf.distribute.HierarchicalCopyAllReduce())
@tf.function
def step():
    def one():
        context = tf.distribute.get_replica_context()
        return context.all_reduce("SUM", tf.cast(context.replica_id_in_sync_group, tf.float32) + 1)
    return strategy.run(one)
sums = [float(t) for t in strategy.experimental_local_results(step())]
try:
    kmk.distributed(global_batch_size=3, cross_device_ops="hierarchical_copy").distribution
    error = None
except ValueError as err:
    error = str(err)
auto = kmk.distributed(global_batch_size=3).distribution.cross_device_ops
print("RESULT " + json.dumps({"replicas": len(names), "sums": sums, "error": error,
                              "auto": auto}))
"""


@pytest.mark.slow
def test_hierarchical_copy_on_three_replicas_leaves_one_out_and_the_kit_refuses_it():
    result = last_json(run_python(THREE_REPLICAS, replicas=3))
    assert result["replicas"] == 3
    # Plain TensorFlow: 1 + 2 + 3 should be 6; replica 3's value is left out. A TensorFlow
    # that sums all three fixed it upstream (then odd counts could be allowed again).
    assert result["sums"] == [3.0, 3.0, 3.0], result
    assert "even number of replicas" in result["error"] and "replicas=3" in result["error"]
    assert result["auto"] == "reduction_to_one_device"


# -- 6: GPUs TensorFlow does not use, and info's CUDA facts ---------------------------------


def test_nvidia_hardware_signs_from_injected_places(tmp_path):
    dev, proc = tmp_path / "dev", tmp_path / "proc"
    dev.mkdir()
    (dev / "nvidiactl").touch()  # the control device alone is no GPU
    (proc / "gpus").mkdir(parents=True)
    assert nvidia_hardware_signs(str(dev), str(proc), which=lambda name: None) == []
    (dev / "nvidia0").touch()
    (dev / "nvidia1").touch()
    (proc / "gpus" / "0000:17:00.0").mkdir()
    found = nvidia_hardware_signs(str(dev), str(proc), which=lambda name: f"/usr/bin/{name}")
    assert found == [
        str(dev / "nvidia0"),
        str(dev / "nvidia1"),
        str(proc / "gpus"),
        "nvidia-smi on PATH",
    ]


CUDA_BUILD = {
    "is_cuda_build": True,
    "cuda_version": "12.5.1",
    "cudnn_version": "9",
    "cuda_compute_capabilities": ["sm_60", "sm_70", "sm_80", "sm_89", "compute_90"],
}


def test_unused_gpu_warning_names_the_cause_and_the_fix():
    signs = ["/dev/nvidia0", "nvidia-smi on PATH"]
    message = unused_gpu_warning(
        tf_gpus=0, signs=signs, build_info=CUDA_BUILD, cuda_visible_devices=None
    )
    assert "/dev/nvidia0" in message and "CUDA 12.5.1 / cuDNN 9" in message
    assert 'pip install "tensorflow[and-cuda]"' in message
    message = unused_gpu_warning(
        tf_gpus=0, signs=signs, build_info={"is_cuda_build": False}, cuda_visible_devices="0,1"
    )
    assert "no CUDA support" in message and "tensorflow[and-cuda]" in message
    for quiet in (
        dict(tf_gpus=2, signs=signs, cuda_visible_devices=None),  # TensorFlow has them
        dict(tf_gpus=0, signs=[], cuda_visible_devices=None),  # no NVIDIA GPU here
        dict(tf_gpus=0, signs=signs, cuda_visible_devices="-1"),  # hidden on purpose
        dict(tf_gpus=0, signs=signs, cuda_visible_devices=""),
    ):
        assert unused_gpu_warning(build_info=CUDA_BUILD, **quiet) is None, quiet


def test_distributed_logs_the_unused_gpu_warning_once(monkeypatch, caplog):
    # The test process hides GPUs with CUDA_VISIBLE_DEVICES=-1, so TensorFlow has none here.
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    # Patched where warn_if_gpus_unused looks them up: its own module, not the package.
    monkeypatch.setattr(gpu_diagnostics, "nvidia_hardware_signs", lambda: ["/dev/nvidia0"])
    monkeypatch.setattr(gpu_diagnostics, "_gpu_warning_logged", False)
    with caplog.at_level(logging.WARNING, logger="keras_mirror_kit"):
        for _ in range(2):
            assert kmk.distributed(per_replica_batch_size=1).distribution.num_replicas == 2
    warned = [r.getMessage() for r in caplog.records if "registered none" in r.getMessage()]
    assert len(warned) == 1 and "tensorflow[and-cuda]" in warned[0]


@pytest.mark.parametrize(
    "capability, compiled, expected",
    [
        ((8, 0), CUDA_BUILD["cuda_compute_capabilities"], "native"),
        ((8, 6), CUDA_BUILD["cuda_compute_capabilities"], "native"),  # sm_80 runs on 8.6
        ((9, 0), CUDA_BUILD["cuda_compute_capabilities"], "ptx-jit"),  # H100/H200: PTX only
        ((12, 0), CUDA_BUILD["cuda_compute_capabilities"], "ptx-jit"),
        ((5, 2), CUDA_BUILD["cuda_compute_capabilities"], "none"),
        ((9, 0), ["sm_90a"], "native"),
        ((10, 0), ["sm_90a"], "none"),
        ((9, 0), [], "unknown"),
    ],
)
def test_kernel_support_by_compute_capability(capability, compiled, expected):
    support, warning = kernel_support(capability, compiled)
    assert support == expected
    assert (warning is None) == (expected in ("native", "unknown"))
    if expected == "ptx-jit":
        assert "many minutes" in warning and "newer than the kernels" in warning


def test_info_shows_cuda_build_and_each_gpus_compute_capability(capsys):
    fake_gpus = [
        ("/physical_device:GPU:0", {"device_name": "NVIDIA H200", "compute_capability": (9, 0)}),
        (
            "/physical_device:GPU:1",
            {"device_name": "NVIDIA A100-SXM4-80GB", "compute_capability": (8, 0)},
        ),
    ]
    build, rows, warnings = describe_gpus(fake_gpus, CUDA_BUILD)
    assert build == {
        key: CUDA_BUILD[key]
        for key in ("is_cuda_build", "cuda_version", "cudnn_version", "cuda_compute_capabilities")
    }
    assert [(r["compute_capability"], r["kernels"]) for r in rows] == [
        ("9.0", "ptx-jit"),
        ("8.0", "native"),
    ]
    assert len(warnings) == 1 and warnings[0].startswith("/physical_device:GPU:0: ")

    info = cli_info.collect()  # this process: no GPU, this wheel's real build facts
    real = tf.sysconfig.get_build_info()
    assert info["cuda_build"]["is_cuda_build"] == bool(real.get("is_cuda_build"))
    assert info["cuda_build"]["cuda_compute_capabilities"] == list(
        real.get("cuda_compute_capabilities") or []
    )
    assert info["gpu_details"] == [] and info["warnings"] == []
    info.update(cuda_build=build, gpu_details=rows, warnings=warnings)
    cli_info.print_table(info)
    out = capsys.readouterr().out
    assert "CUDA build       CUDA 12.5.1, cuDNN 9, kernels for sm_60, sm_70" in out
    assert "/physical_device:GPU:0: NVIDIA H200, compute capability 9.0 (kernels: ptx-jit)" in out
    assert "(kernels: native)" in out
    assert "WARNING: /physical_device:GPU:0: the GPU's compute capability 9.0 is newer" in out
