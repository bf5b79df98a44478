"""The replica check compares big variables in bounded slices (issue 12: a save's extra host
memory at most 1.1x the state, so the check's temporaries must not grow with the largest
variable), and still finds every difference, wherever in the variable it is.

Before, each copy was compared to replica 0's whole: a bool tensor the size of the variable
(a quarter of a float32 variable's bytes), and for differing copies several more, float
differences included (over twice the variable). Now it is at most 4 MiB of it at a time.
"""

from __future__ import annotations

import sys

import keras
import numpy as np
import pytest

import keras_mirror_kit as kmk
from keras_mirror_kit.checkpoint.divergence import (
    _CHUNK_BYTES,
    ReplicaDivergenceError,
    check_replicas,
)
from tests.subproc import last_json, run_python

MIB = 1 << 20

# In a fresh interpreter with 2 logical CPU replicas, one 128 MiB float32 kernel. Without
# oneDNN's allocator (which keeps freed blocks in a pool) and with a fixed 1 MiB mmap
# threshold, every tensor over 1 MiB is its own mapping, returned to the system when freed:
# the peak resident set during a check over the resident set before it is what the check
# allocated. The peak is reset through /proc/self/clear_refs ("5": reset VmHWM).
_MEMORY_CHILD = """
import json
import keras
import numpy as np
import keras_mirror_kit as kmk
kmk.simulate_replicas(2, device_type="CPU")
from keras_mirror_kit.checkpoint.divergence import (
    ReplicaDivergenceError, check_replicas,
)

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

def added_during(action):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    action()
    return status("VmHWM") - before

@kmk.distributed(global_batch_size=16)
def build():
    dense = keras.layers.Dense(8192, use_bias=False, kernel_initializer="zeros")
    return keras.Sequential([keras.Input((4096,)), dense])

try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError as error:  # a sandbox without it: the peak cannot be reset
    print("RESULT " + json.dumps({"skip": f"/proc/self/clear_refs: {error}"}))
    raise SystemExit(0)
model = build()
named = [("model", v) for v in model.weights]
kernel = model.weights[0]
assert check_replicas(model, named, atol=0.0) == 0.0  # warm up
equal = added_during(lambda: check_replicas(model, named, atol=0.0))
copies = model.distribute_strategy.experimental_local_results(kernel.value)
# A whole assign: a sliced one would put the variable in copy-on-read mode (every read a copy).
values = np.zeros(kernel.shape, "float32")
values[-1, -1] = 0.5  # the last element differs: the comparison of each element
copies[1].assign(values)
del values
try:
    check_replicas(model, named, atol=0.0)
    raise AssertionError("no ReplicaDivergenceError")
except ReplicaDivergenceError as error:
    assert "max |diff| 0.5" in str(error), error
differing = added_during(lambda: check_replicas(model, named, atol=1.0))  # within atol
print("RESULT " + json.dumps({
    "variable": kernel.shape[0] * kernel.shape[1] * 4, "equal": equal, "differing": differing,
}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self (Linux)")
def test_the_check_of_a_big_variable_allocates_a_few_mib_not_its_size():
    env = {"TF_ENABLE_ONEDNN_OPTS": "0", "MALLOC_MMAP_THRESHOLD_": str(MIB)}
    result = last_json(run_python(_MEMORY_CHILD, env=env, timeout=240))
    if "skip" in result:
        pytest.skip(result["skip"])
    variable = result["variable"]
    assert variable == 128 * MIB
    figures = (
        f"equal {result['equal'] / MIB:.1f} MiB, differing {result['differing'] / MIB:.1f} MiB"
    )
    # Before: 32 MiB (the bool tensor) for equal copies, over 256 MiB for differing ones.
    assert result["equal"] <= 16 * MIB, figures
    assert result["differing"] <= 16 * MIB, figures


class Holder(keras.layers.Layer):
    """Non-trainable zero variables of the given shapes and dtypes."""

    def __init__(self, specs: dict[str, tuple[tuple[int, ...], str]], **kwargs):
        super().__init__(**kwargs)
        self.specs = specs

    def build(self, input_shape):
        for name, (shape, dtype) in self.specs.items():
            self.add_weight(
                name=name, shape=shape, dtype=dtype, initializer="zeros", trainable=False
            )

    def call(self, x):
        return x


def _model(specs, *extra_layers):
    @kmk.distributed(global_batch_size=16)
    def build():
        return keras.Sequential([keras.Input((1,)), Holder(specs), *extra_layers])

    model = build()
    return model, [("model", v) for v in model.weights]


def _copies(model, variable):
    return model.distribute_strategy.experimental_local_results(variable.value)


def _slice_lengths(dtype: str) -> set[int]:
    """The slice lengths of both comparisons (integers are compared as float64)."""
    size = np.dtype(dtype).itemsize if dtype != "bfloat16" else 2
    return {_CHUNK_BYTES // size, _CHUNK_BYTES // (8 if "int" in dtype else size)}


# Two and a half slices of the equality comparison, as a 2-D variable whose rows straddle
# the slice boundaries (the comparison is on the flattened copies).
_COLUMNS = 1000


@pytest.mark.parametrize(
    "dtype, value, gap",
    [
        ("float32", 0.5, "0.5"),
        ("bfloat16", 0.5, "0.5"),
        ("float16", -0.25, "0.25"),
        ("int32", 7, "7"),
        ("bool", True, "1"),
    ],
)
def test_a_difference_is_found_in_any_slice_of_a_big_variable(dtype, value, gap):
    lengths = _slice_lengths(dtype)
    size = max(lengths) * 5 // 2
    rows = -(-size // _COLUMNS)
    model, named = _model({"big": ((rows, _COLUMNS), dtype)})
    variable = model.weights[0]
    size = rows * _COLUMNS
    copies = _copies(model, variable)
    zero = False if dtype == "bool" else 0
    positions = {0, size - 1} | {p for n in lengths for b in (n, 2 * n) for p in (b - 1, b)}
    assert max(positions) < size
    for position in sorted(positions):
        row, column = divmod(position, _COLUMNS)
        copies[1][row, column].assign(value)
        with pytest.raises(
            ReplicaDivergenceError, match=rf"holder[_0-9]*/big \(max \|diff\| {gap}\)"
        ):
            check_replicas(model, named, atol=0.0)
        copies[1][row, column].assign(zero)
    assert check_replicas(model, named, atol=0.0) == 0.0  # all restored: no false alarm


def test_the_largest_difference_over_all_slices_is_reported():
    length = _CHUNK_BYTES // 2
    model, named = _model({"big": ((3 * length,), "bfloat16")})
    copies = _copies(model, model.weights[0])
    copies[1][length - 1].assign(0.25)
    copies[1][3 * length - 1].assign(-0.75)  # the largest, in the last slice
    copies[1][length].assign(0.5)
    with pytest.raises(ReplicaDivergenceError, match=r"big \(max \|diff\| 0\.75\)"):
        check_replicas(model, named, atol=0.0)
    assert check_replicas(model, named, atol=0.75) == 0.0
    copies[1][3 * length - 1].assign(0.0)
    copies[1][0].assign(1.0)  # now the largest is in the first slice
    with pytest.raises(ReplicaDivergenceError, match=r"big \(max \|diff\| 1\)"):
        check_replicas(model, named, atol=0.6)


def test_nan_or_inf_on_one_replica_in_a_late_slice_is_named_as_such():
    length = _CHUNK_BYTES // 4
    model, named = _model({"big": ((3 * length,), "float32")})
    copies = _copies(model, model.weights[0])
    copies[1][3 * length - 1].assign(float("nan"))  # only replica 1, in its last slice
    with pytest.raises(
        ReplicaDivergenceError, match=r"holder[_0-9]*/big \(NaN or Inf on replica \[1\]"
    ):
        check_replicas(model, named, atol=0.0)
    copies[0][3 * length - 1].assign(float("nan"))  # NaN on both, in the same place: equal
    assert check_replicas(model, named, atol=0.0) == 0.0
    copies[0][3 * length - 1].assign(0.0)
    copies[1][3 * length - 1].assign(0.0)
    copies[0][length].assign(float("inf"))  # replica 0 only, first element of a slice
    with pytest.raises(ReplicaDivergenceError, match=r"NaN or Inf on replica \[0\]"):
        check_replicas(model, named, atol=0.0)


def test_scalars_empty_and_complex_variables():
    specs = {
        "scalar": ((), "float32"),
        "empty": ((0, 3), "float32"),
        "empty_int": ((0,), "int32"),
        "complex": ((_CHUNK_BYTES // 8 * 2 + 3,), "complex64"),  # three slices
    }
    model, named = _model(specs)
    assert check_replicas(model, named, atol=0.0) == 0.0
    scalar, _, _, wide = model.weights
    _copies(model, scalar)[1].assign(2.0)
    with pytest.raises(ReplicaDivergenceError, match=r"holder[_0-9]*/scalar \(max \|diff\| 2\)"):
        check_replicas(model, named, atol=0.0)
    _copies(model, scalar)[1].assign(0.0)
    _copies(model, wide)[1][-1].assign(3j)  # only the imaginary part, in the last slice
    with pytest.raises(ReplicaDivergenceError, match=r"holder[_0-9]*/complex \(max \|diff\| 3\)"):
        check_replicas(model, named, atol=0.0)
    _copies(model, wide)[1][-1].assign(0j)
    assert check_replicas(model, named, atol=0.0) == 0.0


def test_batch_norm_statistics_differing_in_a_late_slice_are_reported_not_raised():
    features = _CHUNK_BYTES // 4 * 2 + 5  # three slices

    @kmk.distributed(global_batch_size=16)
    def build():
        return keras.Sequential([keras.Input((features,)), keras.layers.BatchNormalization()])

    model = build()
    named = [("model", v) for v in model.weights]
    batch_norm = model.layers[-1]
    _copies(model, batch_norm.moving_variance)[1][-1].assign(1.5)
    assert check_replicas(model, named, atol=0.0) == 0.5
    _copies(model, batch_norm.gamma)[1][features // 2].assign(1.25)  # not a statistic
    with pytest.raises(ReplicaDivergenceError, match=r"gamma \(max \|diff\| 0\.25\)"):
        check_replicas(model, named, atol=0.0)
