"""Compression specs and settings: text forms, round trips, matching, one-line errors."""

import pytest

from qsync_lab.compress import METHODS, CompressionSettings, CompressionSpec
from qsync_lab.errors import QSyncError


@pytest.mark.parametrize("text, fields", [
    ("global_qsgd:8", {"method": "global_qsgd", "bits": 8}),
    ("global_qsgd:16,dithering=exponential", {"bits": 16, "dithering": "exponential"}),
    ("aps:fp8_e4m3", {"method": "aps", "format": "fp8_e4m3"}),
    ("cgx:4,error_feedback=true,group_size=512", {"bits": 4, "error_feedback": True,
                                                  "group_size": 512}),
    ("cgx:2,rounding=nearest,min_numel=0", {"bits": 2, "rounding": "nearest", "min_numel": 0}),
    ("FP16", {"method": "fp16"}),
])
def test_text_forms_parse_and_print_back(text, fields):
    spec = CompressionSpec.parse(text)
    assert all(getattr(spec, k) == v for k, v in fields.items())
    assert CompressionSpec.parse(str(spec)) == spec
    assert CompressionSpec.parse(spec.to_dict()) == spec


@pytest.mark.parametrize("method", METHODS.values(), ids=list(METHODS))
def test_every_registered_method_reads_and_prints_its_short_form(method):
    text = f"{method.name}:{method.example}" if method.short else method.name
    spec = CompressionSpec.parse(text)
    assert str(spec) == text and spec.method == method.name
    assert method.module.startswith("qsync_lab.compress.")


def test_cost_label_drops_what_does_not_change_the_time_per_element():
    spec = CompressionSpec.parse("cgx:4,error_feedback=true,min_numel=0,compress_1d=true")
    assert spec.cost_label == "cgx:4,error_feedback=true"
    assert CompressionSpec.parse("cgx:4,group_size=256").cost_label == "cgx:4,group_size=256"


@pytest.mark.parametrize("text, message", [
    ("zip", "unknown compression method 'zip'"),
    ("cgx:four", "cannot read compression spec 'cgx:four'"),
    ("cgx:9", "bits must be 1..8, got 9"),
    ("cgx:4,colour=red", "cannot read 'colour=red'"),
    ("cgx:4,error_feedback=yes", "error_feedback must be true or false"),
    ("cgx:4,group_size=-3", "group_size must be a whole number"),
    ("aps:fp8_e3m4", "format must be fp8_e5m2 or fp8_e4m3"),
    ("", "compression spec must be text"),
])
def test_bad_specs_fail_in_one_line(text, message):
    with pytest.raises(QSyncError, match=message) as err:
        CompressionSpec.parse(text)
    assert "\n" not in str(err.value)


def test_settings_match_exact_then_regex_then_default_and_skip_small_and_1d():
    settings = CompressionSettings.parse({"_default": "cgx:4", "re:.*attn.*": "global_qsgd:8",
                                          "head.weight": None})
    assert settings.spec_for("head.weight", numel=10**6, ndim=2) is None
    assert settings.spec_for("l0.attn.q.weight", numel=10**6, ndim=2).method == "global_qsgd"
    assert settings.spec_for("l0.mlp.weight", numel=10**6, ndim=2).method == "cgx"
    assert settings.spec_for("l0.mlp.bias", numel=10**6, ndim=1) is None
    assert settings.spec_for("l0.mlp.weight", numel=100, ndim=2) is None
    assert settings.methods == ("cgx", "global_qsgd")
    assert not CompressionSettings.parse(None) and not CompressionSettings.parse({"x": None})
    with pytest.raises(QSyncError, match="compression pattern 're:\\('"):
        CompressionSettings.parse({"re:(": "fp16"})
