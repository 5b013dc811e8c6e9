"""OpPrecision parsing and validation; the digits split and its cache."""

import hashlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from qsync_lab.datasets import digits_split_arrays, load_digits_split
from qsync_lab.errors import QSyncError
from qsync_lab.precision import Precision
from qsync_lab.policy import OpPrecision


@pytest.mark.parametrize("spec, expected", [
    ("int8", ("int8", "fp16", "nearest", "tensor")),
    ("FP16", ("fp16", "fp16", "nearest", "tensor")),
    (Precision.BF16, ("bf16", "bf16", "nearest", "tensor")),
    ("fp8_e4m3", ("fp8_e4m3", "fp8_e5m2", "nearest", "tensor")),
    ({"forward": "int8", "backward": "fp32", "rounding": "stochastic", "granularity": "channel"},
     ("int8", "fp32", "stochastic", "channel")),
])
def test_parse_fills_in_documented_defaults(spec, expected):
    cfg = OpPrecision.parse(spec)
    assert tuple(cfg.to_dict().values()) == expected
    assert OpPrecision.parse(cfg.to_dict()) == OpPrecision.parse(cfg.to_dict())


@pytest.mark.parametrize("build, message", [
    (lambda: OpPrecision("int8"), "must be a Precision"),
    (lambda: OpPrecision(Precision.INT8, rounding="floor"), "unknown rounding 'floor'"),
    (lambda: OpPrecision(Precision.INT8, granularity="row"), "unknown granularity 'row'"),
    (lambda: OpPrecision(Precision.FP8_E4M3, granularity="channel"), "int8 operators only"),
    (lambda: OpPrecision.parse(3), "got int"),
])
def test_invalid_configs_are_one_line_errors(build, message):
    with pytest.raises(QSyncError, match=message) as info:
        build()
    assert "\n" not in str(info.value)


def test_fp32_detection():
    assert OpPrecision.parse("fp32").is_fp32
    assert not OpPrecision.parse({"forward": "fp32", "backward": "fp16"}).is_fp32


def test_digits_split_is_deterministic_and_standardized():
    x_train, y_train, x_test, y_test = load_digits_split(seed=3)
    again = load_digits_split(seed=3)
    assert all(torch.equal(a, b) for a, b in zip((x_train, y_train, x_test, y_test), again))
    assert x_train.shape[1:] == (1, 8, 8) and len(x_train) + len(x_test) == 1797
    assert abs(x_train.mean().item()) < 1e-5 and abs(x_train.std().item() - 1) < 1e-3
    assert set(y_test.tolist()) == set(range(10))
    assert not torch.equal(load_digits_split(seed=4)[1], y_train)
    with pytest.raises(QSyncError, match="test_fraction"):
        load_digits_split(test_fraction=1.5)


def test_the_cached_split_is_scikit_learns_and_spares_its_import(tmp_path, monkeypatch):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    monkeypatch.setenv("QSYNC_LAB_CACHE", str(tmp_path))
    images, labels = load_digits(return_X_y=True)
    expected = train_test_split(images, labels, test_size=0.3, random_state=5, stratify=labels)
    fresh = digits_split_arrays(5, 0.3)
    (cached,) = (tmp_path / "datasets").iterdir()
    assert all(np.array_equal(a, b) for a, b in zip(fresh, expected))
    assert all(np.array_equal(a, b) for a, b in zip(digits_split_arrays(5, 0.3), expected))
    code = ("import hashlib, sys; from qsync_lab.datasets import load_digits_split; "
            "x = load_digits_split(5, 0.3)[0]; "
            "print('sklearn' in sys.modules, hashlib.sha256(x.numpy().tobytes()).hexdigest())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)  # in a fresh process, reading the cache
    digest = hashlib.sha256(load_digits_split(5, 0.3)[0].numpy().tobytes()).hexdigest()
    assert done.stdout.split() == ["False", digest]
    cached.write_bytes(b"not a zip file")  # a damaged cache is computed again
    assert all(np.array_equal(a, b) for a, b in zip(digits_split_arrays(5, 0.3), expected))
