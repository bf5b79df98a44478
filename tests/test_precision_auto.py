"""`mixed_precision="auto"`: the decision over fake device tables, and what a model gets.

The decision (`precision.choose_policy`) is pure and is tested on made-up devices; the
backends' device descriptions on a made-up GPU host (`tf.config`'s queries answered by
fakes) and a made-up CPU. Nothing here depends on whether this host's CPU has bfloat16
instructions: every test that builds a model replaces the CPU the kit reads
(`precision.this_cpu`) with one that has them or not.
"""

from __future__ import annotations

import logging

import keras
import numpy as np
import pytest

import keras_mirror_kit as kmk
from keras_mirror_kit import precision
from keras_mirror_kit.precision import PrecisionChoice, ReplicaDevice, choose_policy

BF16, FP16 = "mixed_bfloat16", "mixed_float16"
X86_FLAGS = frozenset({"fpu", "sse2", "avx2", "avx512f", "fma"})


def gpu(capability, name="GPU"):
    return ReplicaDevice("gpu", name, compute_capability=capability)


def cpu(*extra, flags=X86_FLAGS, note=None):
    return ReplicaDevice("cpu", "Test CPU", cpu_flags=flags | set(extra), no_native_bfloat16=note)


@pytest.mark.parametrize(
    ("devices", "policy", "why"),
    [
        ([gpu((8, 0), "NVIDIA A100")] * 2, BF16, "NVIDIA A100 (compute capability 8.0) has bf"),
        ([gpu((9, 0), "NVIDIA H100")], BF16, "compute capability 9.0"),
        ([gpu((7, 0), "Tesla V100")], FP16, "float16 tensor cores but no bfloat16 (8.0+)"),
        ([gpu((7, 5), "Tesla T4")], FP16, "Tesla T4 (compute capability 7.5)"),
        ([gpu((6, 0), "Tesla P100")], None, "has no fast 16-bit (7.0+)"),
        ([gpu(None, "AMD MI250")], None, "AMD MI250: compute capability unknown"),
        # Replicas on unlike GPUs: the weakest decides (bfloat16 on one alone would differ).
        ([gpu((8, 0), "A100"), gpu((7, 0), "V100")], FP16, "V100 (compute capability 7.0)"),
        ([gpu((8, 6), "A10"), gpu((6, 1), "P40")], None, "P40 (compute capability 6.1)"),
        ([cpu("avx512_bf16")] * 2, BF16, "CPU Test CPU has avx512_bf16"),
        ([cpu("amx_tile", "amx_bf16")], BF16, "has amx_bf16"),
        ([cpu()], None, "no bfloat16 instructions (neither amx_bf16 nor avx512_bf16)"),
        ([cpu("amx_tile", "amx_int8")], None, "no bfloat16 instructions"),  # tiles, no bf16
        ([ReplicaDevice("cpu", "Mac")], None, "instruction flags unknown"),
        ([cpu("avx512_bf16", note="its kernels are slow")], None, "but its kernels are slow"),
        ([ReplicaDevice("tpu", "TPU v4")], BF16, "computes bfloat16 natively"),
        ([ReplicaDevice("ipu", "X")], None, "no 16-bit type known to be native"),
        ([cpu("avx512_bf16"), gpu((7, 0), "V100")], None, "share no native 16-bit type"),
        ([], None, "no replica device is known"),
    ],
)
def test_auto_chooses_a_type_every_replica_computes_natively(devices, policy, why):
    choice = choose_policy(devices)
    assert choice.policy == policy, choice
    assert why in choice.reason, choice.reason
    label = policy or "float32"
    assert choice.describe() == f'mixed_precision="auto" chose {label}: {choice.reason}'


X86_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme avx512f amx_bf16 amx_tile avx512_bf16
bugs\t\t: spectre_v1

processor\t: 1
flags\t\t: fpu
"""
ARM_CPUINFO = "processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd sve bf16 i8mm\n"


def test_cpu_flags_are_read_from_cpuinfo_text():
    assert precision.parse_cpu_flags(X86_CPUINFO) == {
        "fpu", "vme", "avx512f", "amx_bf16", "amx_tile", "avx512_bf16",
    }  # fmt: skip
    assert precision._cpu_model(X86_CPUINFO) == "Intel(R) Xeon(R) Platinum 8480+"  # noqa: SLF001
    arm = precision.parse_cpu_flags(ARM_CPUINFO)
    assert "bf16" in arm and not arm & precision.CPU_BFLOAT16_FLAGS  # Arm's bf16: not measured
    assert precision.parse_cpu_flags("processor\t: 0\n") == frozenset()


def test_this_cpu_without_proc_cpuinfo_is_unknown_and_stays_float32(monkeypatch):
    def unreadable(self, *args, **kwargs):
        raise FileNotFoundError(str(self))

    monkeypatch.setattr(precision.Path, "read_text", unreadable)
    precision.this_cpu.cache_clear()
    try:
        unknown = precision.this_cpu()
    finally:
        precision.this_cpu.cache_clear()
    assert unknown.platform == "cpu" and unknown.cpu_flags is None
    assert choose_policy([unknown]).policy is None


def test_auto_is_a_valid_policy_and_the_error_names_it():
    assert precision.validate_policy("auto") == "auto"
    with pytest.raises(ValueError, match=r"'auto', 'mixed_float16', 'mixed_bfloat16' or None"):
        kmk.distributed(8, mixed_precision="bfloat16")


def test_each_choice_is_logged_once_per_process(monkeypatch, caplog):
    monkeypatch.setattr(precision, "_logged", set())
    first = PrecisionChoice(BF16, "CPU X has avx512_bf16")
    with caplog.at_level(logging.INFO, logger="keras_mirror_kit"):
        precision.log_choice(first)
        precision.log_choice(PrecisionChoice(BF16, "CPU X has avx512_bf16"))
        precision.log_choice(PrecisionChoice(None, "CPU Y has no bfloat16 instructions"))
    lines = [r.getMessage() for r in caplog.records if "mixed_precision" in r.getMessage()]
    assert lines == [
        'mixed_precision="auto" chose mixed_bfloat16: CPU X has avx512_bf16',
        'mixed_precision="auto" chose float32: CPU Y has no bfloat16 instructions',
    ]


# --- the backends' descriptions of the replicas' devices -------------------------------


def test_tensorflow_describes_each_replica_gpu_by_its_physical_gpu(monkeypatch):
    import tensorflow as tf

    from keras_mirror_kit.backends import tensorflow as backend
    from tests.test_peaks import FakeGpu

    gpus = [FakeGpu(0), FakeGpu(1)]
    details = {
        gpus[0].name: {"device_name": "NVIDIA A100", "compute_capability": (8, 0)},
        gpus[1].name: {"device_name": "Tesla V100", "compute_capability": (7, 0)},
    }
    monkeypatch.setattr(tf.config, "get_visible_devices", lambda kind=None: gpus)
    # The first GPU is split into 2 logical GPUs: logical 0 and 1 are the A100, 2 the V100.
    monkeypatch.setattr(
        tf.config,
        "get_logical_device_configuration",
        lambda d: [object(), object()] if d is gpus[0] else None,
    )
    monkeypatch.setattr(tf.config.experimental, "get_device_details", lambda d: details[d.name])

    class Engine:
        devices = ("/job:localhost/replica:0/task:0/device:GPU:0", "/device:GPU:1")

    found = backend.precision_devices(Engine())
    assert found == [gpu((8, 0), "NVIDIA A100")] * 2
    assert choose_policy(found).policy == BF16
    Engine.devices = (*Engine.devices, "/device:GPU:2")
    found = backend.precision_devices(Engine())
    assert found[-1] == gpu((7, 0), "Tesla V100")
    assert choose_policy(found).policy == FP16


def test_tensorflow_describes_a_cpu_replica_and_heeds_onednn_off(monkeypatch):
    from keras_mirror_kit.backends import tensorflow as backend

    monkeypatch.setattr(precision, "this_cpu", lambda: cpu("avx512_bf16"))
    monkeypatch.delenv("TF_ENABLE_ONEDNN_OPTS", raising=False)

    class Engine:
        devices = ("/job:localhost/replica:0/task:0/device:CPU:0", "/device:CPU:1")

    assert choose_policy(backend.precision_devices(Engine())).policy == BF16
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "0")
    choice = choose_policy(backend.precision_devices(Engine()))
    assert choice.policy is None and "TF_ENABLE_ONEDNN_OPTS=0" in choice.reason


def test_jax_describes_gpus_by_compute_capability_and_keeps_its_cpu_float32(monkeypatch):
    jax = pytest.importorskip("jax")
    from keras_mirror_kit.backends import jax as backend

    class Device:
        def __init__(self, index, kind, capability=None):
            self.id, self.device_kind = index, kind
            if capability is not None:
                self.compute_capability = capability

    table = {"gpu": [Device(0, "NVIDIA H100", "9.0"), Device(1, "Tesla T4", "7.5")]}
    monkeypatch.setattr(jax, "devices", lambda platform=None: table[platform])
    monkeypatch.setattr(precision, "this_cpu", lambda: cpu("avx512_bf16"))

    class Engine:
        class strategy:  # noqa: N801  (a DataParallel's mesh holds device names)
            class device_mesh:  # noqa: N801
                devices = np.array(["gpu:0"])

    assert backend.precision_devices(Engine()) == [gpu((9, 0), "NVIDIA H100")]
    Engine.strategy.device_mesh.devices = np.array(["gpu:0", "gpu:1"])
    assert choose_policy(backend.precision_devices(Engine())).policy == FP16
    table["gpu"] = [Device(0, "AMD Instinct MI250X")]  # ROCm: no compute capability
    Engine.strategy.device_mesh.devices = np.array(["gpu:0"])
    assert choose_policy(backend.precision_devices(Engine())).policy is None
    Engine.strategy.device_mesh.devices = np.array(["cpu:0", "cpu:1"])
    choice = choose_policy(backend.precision_devices(Engine()))
    assert choice.policy is None and "XLA's CPU kernels" in choice.reason


# --- what a model built with "auto" gets (2 CPU replicas) ------------------------------


def small_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model


@pytest.mark.parametrize(
    ("fake_cpu", "compute"),
    [(cpu("avx512_bf16"), "bfloat16"), (cpu(), "float32")],
    ids=["bf16-cpu", "plain-cpu"],
)
def test_auto_builds_the_factorys_layers_in_the_chosen_type(
    monkeypatch, caplog, fake_cpu, compute
):
    monkeypatch.setattr(precision, "this_cpu", lambda: fake_cpu)
    monkeypatch.setattr(precision, "_logged", set())
    build = kmk.distributed(per_replica_batch_size=8, mixed_precision="auto")(small_model)
    with caplog.at_level(logging.INFO, logger="keras_mirror_kit"):
        model = build()
        build()  # the same decision: no second line
    hidden, output = model.layers
    assert hidden.compute_dtype == compute
    assert output.compute_dtype == "float32"  # the softmax keeps its range either way
    assert all(v.dtype == "float32" for v in model.weights)
    assert keras.config.dtype_policy().name == "float32"  # the global policy is restored
    assert not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    lines = [r.getMessage() for r in caplog.records if "chose" in r.getMessage()]
    label = "mixed_bfloat16" if compute == "bfloat16" else "float32"
    assert lines == [f'mixed_precision="auto" chose {label}: {choose_policy([fake_cpu]).reason}']


def test_auto_in_the_with_form_and_float16_with_loss_scaling_on_2_replicas(monkeypatch):
    """A made-up V100 per replica: "auto" is float16, and Keras' loss scaling (made
    replica-consistent by the kit) trains on the 2 CPU replicas standing in for them."""
    from keras_mirror_kit import backends

    monkeypatch.setattr(
        backends.current(), "precision_devices", lambda engine: [gpu((7, 0), "Tesla V100")] * 2
    )
    with kmk.distributed(per_replica_batch_size=8, mixed_precision="auto") as dist:
        model = small_model()
    assert dist.num_replicas == 2
    assert model.layers[0].compute_dtype == "float16"
    assert model.layers[-1].compute_dtype == "float32"
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    x = np.random.default_rng(0).normal(size=(64, 6)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    history = model.fit(kmk.make_dataset(x, y, dist.global_batch_size, seed=0), verbose=0)
    assert np.isfinite(history.history["loss"][-1])
