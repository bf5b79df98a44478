"""`keras_mirror_kit.validation`: TypeError for a wrong type, ValueError for a wrong value."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from keras_mirror_kit.validation import (
    check_path,
    non_empty_str,
    non_negative_number,
    one_of,
    positive_int_or,
)


def test_positive_int_or_a_word():
    assert positive_int_or("save_freq", "epoch", "epoch") == "epoch"
    assert positive_int_or("save_freq", np.int64(3), "epoch") == 3
    for value, error in (("batch", ValueError), (0, ValueError), (2.5, TypeError),
                         (True, TypeError), (None, TypeError)):  # fmt: skip
        with pytest.raises(error, match=r"`save_freq` must be 'epoch' or a positive integer"):
            positive_int_or("save_freq", value, "epoch", "batches")


def test_non_negative_number():
    assert non_negative_number("verify_atol", 0) == 0.0
    assert non_negative_number("verify_atol", 1e-6) == 1e-6
    for value, error in ((-1, ValueError), (float("nan"), ValueError), ("0", TypeError),
                         (False, TypeError)):  # fmt: skip
        with pytest.raises(error, match="verify_atol="):
            non_negative_number("verify_atol", value)


def test_strings_choices_and_paths():
    assert non_empty_str("monitor", "val_loss") == "val_loss"
    with pytest.raises(ValueError, match="monitor=''"):
        non_empty_str("monitor", "")
    with pytest.raises(TypeError, match="monitor=3"):
        non_empty_str("monitor", 3)
    assert one_of("mode", "min", ("auto", "min", "max")) == "min"
    with pytest.raises(ValueError, match=r"`mode` must be 'auto', 'min' or 'max'\. .*mode='up'"):
        one_of("mode", "up", ("auto", "min", "max"))
    with pytest.raises(TypeError, match="mode=1"):
        one_of("mode", 1, ("auto", "min", "max"))
    assert check_path("directory", Path("ckpts")) == Path("ckpts")
    with pytest.raises(ValueError, match="directory=''"):
        check_path("directory", "")
    with pytest.raises(TypeError, match="directory=None"):
        check_path("directory", None)
