"""Device selection and simulated replicas, each layout in a fresh process."""

from __future__ import annotations

import pytest

from tests.subproc import last_json, run_python

REPORT = """
import json, keras_mirror_kit as kmk
with kmk.distributed(per_replica_batch_size=8) as dist:
    pass
print("RESULT " + json.dumps({"replicas": dist.num_replicas, "devices": list(dist.devices),
                              "ops": dist.cross_device_ops, "global": dist.global_batch_size}))
"""


@pytest.mark.slow
def test_no_gpu_and_nothing_configured_gives_one_cpu_replica():
    result = last_json(run_python(REPORT))
    assert result["replicas"] == 1 and result["global"] == 8
    assert result["devices"][0].endswith("CPU:0")


@pytest.mark.slow
def test_environment_variable_simulates_replicas():
    result = last_json(run_python(REPORT, replicas=3))
    assert result["replicas"] == 3 and result["global"] == 24
    assert [d[-5:] for d in result["devices"]] == ["CPU:0", "CPU:1", "CPU:2"]
    assert result["ops"] == "reduction_to_one_device"


@pytest.mark.slow
def test_simulate_replicas_before_tensorflow_starts_and_is_idempotent():
    code = "import keras_mirror_kit as kmk\nkmk.simulate_replicas(2)\nkmk.simulate_replicas(2)\n"
    code += REPORT
    assert last_json(run_python(code))["replicas"] == 2


@pytest.mark.parametrize("how", ["call", "env"])
def test_simulating_after_tensorflow_started_is_a_clear_error(how, monkeypatch):
    # This process's runtime already runs (on the test bed's CPUs): one more is too late.
    import tensorflow as tf

    import keras_mirror_kit as kmk

    tf.constant(1.0) + 1  # the runtime is initialised (it may not be yet in this worker)
    have = len(tf.config.list_logical_devices("CPU"))
    n = have + 1
    with pytest.raises(RuntimeError) as info:
        if how == "call":
            kmk.simulate_replicas(n)
        else:
            monkeypatch.setenv("KMK_SIMULATE_REPLICAS", str(n))
            with kmk.distributed(per_replica_batch_size=8):
                pass
    message = str(info.value)
    assert f"simulate_replicas({n}) was called after TensorFlow initialised" in message
    assert f"it now has {have} logical CPU device(s)" in message
    assert f"KMK_SIMULATE_REPLICAS={n}" in message
    assert len(tf.config.list_logical_devices("CPU")) == have  # the bed is untouched


@pytest.mark.parametrize("value", ["two", "0", "-1", "2.5"])
def test_bad_environment_variable_is_a_clear_error(value, monkeypatch):
    # The parser needs no TensorFlow: it refuses before any device is touched.
    from keras_mirror_kit import backends

    monkeypatch.setenv("KMK_SIMULATE_REPLICAS", value)
    with pytest.raises(ValueError, match="must be a positive integer") as info:
        backends.configure_from_environment()
    assert f"KMK_SIMULATE_REPLICAS={value!r}" in str(info.value)
    monkeypatch.setenv("KMK_SIMULATE_REPLICAS", "  ")
    backends.configure_from_environment()  # blank: nothing to do


def test_bad_simulate_replicas_arguments():
    import keras_mirror_kit as kmk

    cases = [
        ({"n": 0}, ValueError, "n=0"),
        ({"n": "2"}, TypeError, "n='2'"),
        ({"n": 2, "device_type": "TPU"}, ValueError, "device_type='TPU'"),
        ({"n": 2, "device_type": "GPU"}, ValueError, "no physical GPU"),  # GPUs are hidden
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            kmk.simulate_replicas(**kwargs)


class FakeDeviceTable:
    """tf.config's device functions over a made-up host, with TensorFlow's rules: every
    visible physical device yields its logical devices (1 unless configured)."""

    def __init__(self, gpus: int) -> None:
        import tensorflow as tf

        self.tf = tf
        self.physical = {
            "GPU": [
                tf.config.PhysicalDevice(f"/physical_device:GPU:{i}", "GPU") for i in range(gpus)
            ],
            "CPU": [tf.config.PhysicalDevice("/physical_device:CPU:0", "CPU")],
        }
        self.visible = {kind: list(devices) for kind, devices in self.physical.items()}
        self.logical: dict[str, list] = {}

    def list_physical_devices(self, kind=None):
        return list(self.physical.get(kind, []))

    def get_visible_devices(self, kind=None):
        return list(self.visible.get(kind, []))

    def set_visible_devices(self, devices, kind=None):
        self.visible[kind] = list(devices) if isinstance(devices, list) else [devices]

    def get_logical_device_configuration(self, device):
        return self.logical.get(device.name)

    def set_logical_device_configuration(self, device, configs):
        self.logical[device.name] = list(configs)

    def list_logical_devices(self, kind=None):
        names = []
        for device in self.visible.get(kind, []):
            names += [None] * len(self.logical.get(device.name) or [None])
        return [
            self.tf.config.LogicalDevice(f"/device:{kind}:{i}", kind) for i in range(len(names))
        ]

    def install(self, monkeypatch):
        for name in (
            "list_physical_devices",
            "get_visible_devices",
            "set_visible_devices",
            "get_logical_device_configuration",
            "set_logical_device_configuration",
            "list_logical_devices",
        ):
            monkeypatch.setattr(self.tf.config, name, getattr(self, name))


@pytest.mark.parametrize(("gpus", "n"), [(1, 2), (4, 2), (8, 3), (2, 1)])
def test_simulate_replicas_on_a_gpu_host_gives_exactly_n_replicas(monkeypatch, gpus, n):
    from keras_mirror_kit.devices import DEFAULT_GPU_MEMORY_LIMIT_MB, replica_devices
    from keras_mirror_kit.devices import simulate_replicas as simulate

    table = FakeDeviceTable(gpus)
    table.install(monkeypatch)
    simulate(n)
    assert len(replica_devices()) == n
    assert table.visible["GPU"] == table.physical["GPU"][:1]
    limits = [c.memory_limit for c in table.logical["/physical_device:GPU:0"]]
    assert limits == [DEFAULT_GPU_MEMORY_LIMIT_MB] * n
    simulate(n)  # idempotent
    assert len(replica_devices()) == n


@pytest.mark.slow
def test_the_test_process_and_its_children_see_no_gpu():
    """The suite hides GPUs (tests/conftest.py), so CPU-only assertions hold on GPU hosts."""
    import os

    import tensorflow as tf

    assert os.environ.get("CUDA_VISIBLE_DEVICES") == "-1"
    assert tf.config.get_visible_devices("GPU") == []
    child = last_json(
        run_python(
            "import json, tensorflow as tf\n"
            "print('RESULT ' + json.dumps(len(tf.config.list_logical_devices('GPU'))))"
        )
    )
    assert child == 0
