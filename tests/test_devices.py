"""Tests for the device and link catalog (qsync_lab.devices, data/devices.toml, data/links.toml)."""

import math
import re
import textwrap
from pathlib import Path

import pytest

from qsync_lab.devices import load_catalog
from qsync_lab.errors import QSyncError
from qsync_lab.precision import Precision
from qsync_lab.resources import data_file

SHIPPED_DEVICES = {
    "T4",
    "V100-SXM2-16GB",
    "V100-SXM2-32GB",
    "A10",
    "L4",
    "A100-SXM4-40GB",
    "A100-SXM4-80GB",
    "H100-SXM5-80GB",
    "H200-SXM-141GB",
    "RTX-3090",
    "RTX-4090",
    "cpu",
}
SHIPPED_LINKS = {
    "nvlink2",
    "nvlink3",
    "nvlink4",
    "pcie3_x16",
    "pcie4_x16",
    "eth_10g",
    "eth_25g",
    "eth_100g",
    "ib_hdr200",
    "loopback",
}
FP8 = {Precision.FP8_E4M3, Precision.FP8_E5M2}

# A device with compute capability 7.2 (Jetson AGX Xavier): between the fp16 and int8 rules.
XAVIER = """
[device.Xavier]
vendor = "NVIDIA"
kind = "gpu"
compute_capability = "7.2"
memory_gib = 32
memory_bandwidth_GBps = 136.5
peak_tflops = {{ {peaks} }}
source = "test fixture"
"""
T4_ENTRY = """
[device.T4]
vendor = "NVIDIA"
kind = "gpu"
compute_capability = "7.5"
memory_gib = {memory_gib}
memory_bandwidth_GBps = 320
peak_tflops = {{ {peaks} }}
source = "test fixture"
"""
T4_PEAKS = "fp32 = 8.1, fp16 = 65, int8 = 130"


def write(tmp_path: Path, text: str, name: str = "user.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def t4_entry(memory_gib: object = 16, peaks: str = T4_PEAKS) -> str:
    return T4_ENTRY.format(memory_gib=memory_gib, peaks=peaks)


def test_every_shipped_device_and_link_loads():
    catalog = load_catalog()
    assert set(catalog.devices) == SHIPPED_DEVICES
    assert set(catalog.links) == SHIPPED_LINKS
    for spec in catalog.devices.values():
        assert spec.source.strip(), spec.name
        assert set(spec.peak_flops) == spec.precisions, spec.name
        assert all(peak > 0 for peak in spec.peak_flops.values()), spec.name
    for link in catalog.links.values():
        assert link.bandwidth_Bps > 0 and link.latency_s > 0 and link.source.strip(), link.name


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        ("T4", {Precision.INT8, Precision.FP16, Precision.FP32}),
        ("V100-SXM2-16GB", {Precision.FP16, Precision.FP32}),
        ("V100-SXM2-32GB", {Precision.FP16, Precision.FP32}),
        ("A100-SXM4-40GB", set(Precision) - FP8),
        ("A10", set(Precision) - FP8),
        ("L4", set(Precision)),
        ("H100-SXM5-80GB", set(Precision)),
        ("H200-SXM-141GB", set(Precision)),
        ("RTX-4090", set(Precision)),
    ],
)
def test_precisions_follow_compute_capability(device, expected):
    spec = load_catalog().device(device)
    assert spec.precisions == expected
    assert all(spec.supports(p) for p in expected)
    assert not any(spec.supports(p) for p in set(Precision) - expected)


def test_gpu_peaks_grow_as_precision_narrows():
    """Data sanity: a tensor-core low precision is never slower than fp32 (catches typos)."""
    for spec in load_catalog().devices.values():
        if spec.kind == "gpu":
            fp32 = spec.peak_flops[Precision.FP32]
            assert all(peak >= fp32 for peak in spec.peak_flops.values()), spec.name
            if Precision.INT8 in spec.precisions:
                assert spec.peak_flops[Precision.INT8] >= spec.peak_flops[Precision.FP16], spec.name


def test_peaks_and_sizes_are_converted_to_si_units():
    catalog = load_catalog()
    t4, h100 = catalog.device("T4"), catalog.device("H100-SXM5-80GB")
    assert t4.peak_flops_for(Precision.FP16) == pytest.approx(65e12)
    assert t4.peak_flops_for("int8") == pytest.approx(130e12)
    assert t4.memory_bytes == 16 * 2**30
    assert t4.memory_bandwidth_Bps == pytest.approx(320e9)
    assert t4.compute_capability == (7, 5)
    # dense, not the datasheet's with-sparsity 1979 TFLOPS
    assert h100.peak_flops_for("fp16") == pytest.approx(989.4e12)
    assert h100.peak_flops_for("fp8_e4m3") == pytest.approx(1978.9e12)
    assert catalog.link("nvlink2").bandwidth_Bps == pytest.approx(150e9)
    assert catalog.link("eth_100g").latency_s == pytest.approx(20e-6)


def test_h200_has_the_h100s_compute_and_its_own_memory():
    catalog = load_catalog()
    h200, h100 = catalog.device("h200-sxm-141gb"), catalog.device("H100-SXM5-80GB")
    assert h200.compute_capability == (9, 0) and h200.supports("fp8_e4m3")
    assert dict(h200.peak_flops) == dict(h100.peak_flops)
    assert h200.peak_flops_for("bf16") == pytest.approx(989.4e12)
    assert h200.peak_flops_for("fp8_e4m3") == pytest.approx(1978.9e12)
    assert h200.memory_bandwidth_Bps == pytest.approx(4800e9)
    assert h200.memory_bytes == 141 * 2**30
    assert "H200" in h200.source and "datasheet" in h200.source
    assert catalog.to_frame().loc["H200-SXM-141GB", "bandwidth_GBps"] == 4800


def test_hopper_efficiencies_are_the_measured_ratios():
    """GEMM TFLOP/s and copy TB/s measured on the lent GPUs, over the datasheet's figures."""
    catalog = load_catalog()
    h100, h200 = catalog.device("H100-SXM5-80GB"), catalog.device("H200-SXM-141GB")
    assert dict(h200.compute_efficiency) == {"linear": pytest.approx(788 / 989.4, abs=1e-3)}
    assert dict(h100.compute_efficiency) == {"linear": pytest.approx(798 / 989.4, abs=1e-3)}
    assert h200.memory_efficiency == pytest.approx(4.3 / 4.8, abs=1e-3)
    assert h100.memory_efficiency == pytest.approx(3.0 / 3.35, abs=1e-3)
    t4 = catalog.device("T4")
    assert not t4.compute_efficiency and t4.memory_efficiency is None


def test_cluster_command_shows_an_h200_cluster(tmp_path, capsys):
    from qsync_lab.cli import main

    path = write(tmp_path, """
        name = "one-h200"
        batch_size = 32
        [[node]]
        name = "n0"
        intra_node_link = "nvlink4"
        devices = [{ kind = "H200-SXM-141GB", count = 1 }]
        """, "h200.toml")
    assert main(["cluster", str(path)]) == 0
    out = capsys.readouterr().out
    assert "one-h200" in out and "1 x H200-SXM-141GB" in out


def test_cpu_entry_is_emulated_and_supports_every_precision():
    cpu = load_catalog().device("cpu")
    assert cpu.kind == "cpu" and cpu.emulated and cpu.compute_capability is None
    assert cpu.precisions == frozenset(Precision)
    fp32 = cpu.peak_flops_for(Precision.FP32)
    assert 0 < fp32 < 10e12
    assert all(cpu.peak_flops_for(p) == fp32 for p in Precision)
    assert not any(spec.emulated for spec in load_catalog().devices.values() if spec.kind == "gpu")


def test_unsupported_precision_names_device_and_its_precisions():
    v100 = load_catalog().device("V100-SXM2-32GB")
    assert v100.require("FP16") is Precision.FP16
    expected = r"V100-SXM2-32GB does not support bf16; it supports fp32, fp16"
    with pytest.raises(QSyncError, match=expected):
        v100.peak_flops_for("bf16")
    with pytest.raises(QSyncError, match="V100-SXM2-32GB does not support int8"):
        v100.require(Precision.INT8)


def test_device_lookup_is_case_insensitive_and_lists_known_names():
    catalog = load_catalog()
    assert catalog.device("t4") is catalog.device("T4")
    expected = r"unknown device 'P100'; choose one of: T4, V100-SXM2-16GB, .*cpu"
    with pytest.raises(QSyncError, match=expected) as err:
        catalog.device("P100")
    assert "\n" not in str(err.value)
    with pytest.raises(QSyncError, match=r"unknown link 'nvlink9'; choose one of: nvlink2, "):
        catalog.link("nvlink9")


def test_inline_link():
    link = load_catalog().link({"name": "roce", "bandwidth_GBps": 12.5, "latency_us": 5})
    assert (link.name, link.bandwidth_Bps, link.latency_s) == ("roce", 12.5e9, 5e-6)
    assert load_catalog().link({"bandwidth_GBps": 1, "latency_us": 0}).name == "inline"
    expected = r"^inline link: bandwidth_GBps: expected a positive number, got 0$"
    with pytest.raises(QSyncError, match=expected):
        load_catalog().link({"bandwidth_GBps": 0, "latency_us": 5})


def test_to_frame_has_one_row_per_device_with_peak_columns():
    frame = load_catalog().to_frame()
    assert list(frame.index) == list(load_catalog().devices)
    columns = set(frame.columns)
    assert {"memory_gib", "bandwidth_GBps", "compute_capability", "precisions"} <= columns
    assert {f"peak_tflops_{p}" for p in Precision} <= columns
    t4 = frame.loc["T4"]
    assert t4[["memory_gib", "bandwidth_GBps"]].tolist() == [16.0, 320.0]
    assert t4["compute_capability"] == "7.5"
    assert t4["peak_tflops_int8"] == pytest.approx(130)
    assert math.isnan(t4["peak_tflops_bf16"])
    assert t4["precisions"] == "fp32, fp16, int8"


def test_default_catalog_is_cached_and_read_only():
    catalog = load_catalog()
    assert load_catalog() is catalog
    with pytest.raises(TypeError):
        catalog.devices["T4"] = catalog.devices["cpu"]
    with pytest.raises(TypeError):
        catalog.device("T4").peak_flops[Precision.FP32] = 0.0
    assert hash(catalog.device("T4")) == hash(load_catalog().device("T4"))


def test_user_file_adds_and_overrides_devices_and_links(tmp_path):
    path = write(
        tmp_path,
        t4_entry(memory_gib=8)
        + XAVIER.format(peaks="fp32 = 1.4, fp16 = 11")
        + '[link.roce]\nbandwidth_GBps = 12.5\nlatency_us = 5\nsource = "test"\n',
    )
    catalog = load_catalog(path)
    assert catalog.device("T4").memory_bytes == 8 * 2**30
    assert catalog.device("T4").source == "test fixture"
    assert catalog.device("Xavier").precisions == {Precision.FP16, Precision.FP32}
    assert catalog.link("roce").latency_s == pytest.approx(5e-6)
    assert "A100-SXM4-80GB" in catalog.devices
    assert load_catalog().device("T4").memory_bytes == 16 * 2**30  # the shared catalog is untouched
    assert "Xavier" not in load_catalog().devices


def test_rule_table_decides_precisions(tmp_path):
    xavier_int8 = write(
        tmp_path, XAVIER.format(peaks="fp32 = 1.4, fp16 = 11, int8 = 22"), "xavier.toml"
    )
    rule = write(tmp_path, '[min_compute_capability]\nint8 = "7.2"\n', "rule.toml")
    # shipped rule int8 >= 7.5: the 7.2 device must not list int8 ...
    expected = r"device\.Xavier\.peak_tflops: has int8, which compute capability 7\.2"
    with pytest.raises(QSyncError, match=expected):
        load_catalog(xavier_int8)
    # ... under a user rule int8 >= 7.2 it must.
    catalog = load_catalog(xavier_int8, rule)
    assert catalog.device("Xavier").precisions == {Precision.INT8, Precision.FP16, Precision.FP32}
    assert catalog.device("V100-SXM2-32GB").precisions == {Precision.FP16, Precision.FP32}
    # A rule that takes bf16 from Ampere makes the shipped A100 entries inconsistent.
    no_bf16 = write(tmp_path, '[min_compute_capability]\nbf16 = "9.0"\n', "no_bf16.toml")
    with pytest.raises(QSyncError) as err:
        load_catalog(no_bf16)
    message = str(err.value)
    assert message.startswith(f"{data_file('devices.toml')}: ")
    assert "device.A10.peak_tflops: has bf16" in message
    assert f'rule min_compute_capability.bf16 = "9.0" in {no_bf16}' in message


CPU_ENTRY = """
[device.cpu]
kind = "cpu"
vendor = "x"
memory_gib = 1
memory_bandwidth_GBps = 1
peak_tflops = { fp32 = 1 }
source = "x"
"""
LINK_ENTRY = '[link.x]\nbandwidth_GBps = 1\nlatency_us = 1\nsource = "x"\n'
MALFORMED_CATALOGS = {
    "syntax": ("[device.T4\n", "", "invalid TOML: "),
    "number-str": (
        t4_entry(memory_gib="'x'"),
        "device.T4.memory_gib",
        "expected a positive number, got 'x'",
    ),
    "number-bool": (
        t4_entry(memory_gib="true"),
        "device.T4.memory_gib",
        "expected a positive number, got True",
    ),
    "number-negative": (
        t4_entry(memory_gib=-1),
        "device.T4.memory_gib",
        "expected a positive number, got -1",
    ),
    "missing-key": (
        t4_entry().replace("memory_gib = 16\n", ""),
        "device.T4.memory_gib",
        "missing; expected a positive number",
    ),
    "unknown-key": (
        t4_entry().replace("vendor", "vendr"),
        "device.T4.vendr",
        "unknown key; expected one of: ",
    ),
    "kind": (
        t4_entry().replace('"gpu"', '"tpu"'),
        "device.T4.kind",
        'expected one of "gpu", "cpu", got \'tpu\'',
    ),
    "cc-float": (
        t4_entry().replace('"7.5"', "7.5"),
        "device.T4.compute_capability",
        'like "7.5", got 7.5',
    ),
    "cc-text": (
        t4_entry().replace('"7.5"', '"sm75"'),
        "device.T4.compute_capability",
        "got 'sm75'",
    ),
    "peak-missing": (
        t4_entry(peaks="fp32 = 8.1, fp16 = 65"),
        "device.T4.peak_tflops",
        "missing int8, which compute capability 7.5 supports",
    ),
    "peak-extra": (
        t4_entry(peaks=T4_PEAKS + ", bf16 = 65"),
        "device.T4.peak_tflops",
        "has bf16, which compute capability 7.5 does not support",
    ),
    "peak-precision": (
        t4_entry(peaks=T4_PEAKS + ", fp64 = 4"),
        "device.T4.peak_tflops.fp64",
        "unknown precision 'fp64'",
    ),
    "peak-value": (
        t4_entry(peaks="fp32 = 8.1, fp16 = 'fast', int8 = 130"),
        "device.T4.peak_tflops.fp16",
        "expected a positive number, got 'fast'",
    ),
    "peak-type": (
        t4_entry().replace("peak_tflops = ", "peak_tflops = 1 #"),
        "device.T4.peak_tflops",
        "expected a table, got 1",
    ),
    "entry-type": ("[device]\nT4 = 3\n", "device.T4", "expected a table, got 3"),
    "cpu-peaks": (
        CPU_ENTRY,
        "device.cpu.peak_tflops",
        "missing tf32; the cpu kind emulates every precision",
    ),
    "cpu-cc": (
        CPU_ENTRY + 'compute_capability = "8.0"\n',
        "device.cpu.compute_capability",
        "unknown key",
    ),
    "rule-precision": (
        '[min_compute_capability]\nfp4 = "10.0"\n',
        "min_compute_capability.fp4",
        "unknown precision 'fp4'",
    ),
    "rule-value": (
        "[min_compute_capability]\nint8 = 7.5\n",
        "min_compute_capability.int8",
        "got 7.5",
    ),
    "link-bandwidth": (
        LINK_ENTRY.replace("= 1", '= "fast"', 1),
        "link.x.bandwidth_GBps",
        "expected a positive number, got 'fast'",
    ),
    "link-no-latency": (
        LINK_ENTRY.replace("latency_us = 1\n", ""),
        "link.x.latency_us",
        "missing; expected a number >= 0",
    ),
    "link-latency": (
        LINK_ENTRY.replace("latency_us = 1", "latency_us = -2"),
        "link.x.latency_us",
        "expected a number >= 0, got -2",
    ),
    "link-source": (
        LINK_ENTRY.replace('source = "x"\n', ""),
        "link.x.source",
        "missing; expected a non-empty string",
    ),
    "efficiency-over-one": (
        t4_entry() + "memory_efficiency = 1.2\n",
        "device.T4.memory_efficiency",
        "over the limit of 1",
    ),
    "efficiency-value": (
        t4_entry() + "compute_efficiency = { linear = 0 }\n",
        "device.T4.compute_efficiency.linear",
        "expected a positive number, got 0",
    ),
    "schema": ("schema_version = 2\n", "schema_version", "expected 1, got 2"),
    "top-key": (
        "[devices.T4]\nkind = 'gpu'\n",
        "devices",
        "unknown key; expected one of: device, link, min_compute_capability",
    ),
}


@pytest.mark.parametrize(
    ("text", "key", "reason"), MALFORMED_CATALOGS.values(), ids=list(MALFORMED_CATALOGS)
)
def test_malformed_catalog_file_is_one_line_naming_file_and_key(tmp_path, text, key, reason):
    path = write(tmp_path, text)
    with pytest.raises(QSyncError) as err:
        load_catalog(path)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: {key}: " if key else f"{path}: ")
    assert reason in message


def test_missing_catalog_file(tmp_path):
    missing = tmp_path / "nope.toml"
    expected = rf"^{re.escape(str(missing))}: no such file; check the path$"
    with pytest.raises(QSyncError, match=expected):
        load_catalog(missing)
