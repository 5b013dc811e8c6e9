"""The indicator's disk cache: a second study of the same model reads the scores back
(without scoring), equal to the computed ones; any change to the weights, batches or
precisions scores again."""

import pytest
import torch

import qsync_lab.indicator
from qsync_lab import Study
from qsync_lab.indicator import cache
from qsync_lab.indicator.cache import indicator_key


def test_a_second_study_of_the_same_model_reads_its_scores_back(monkeypatch, tmp_path):
    monkeypatch.setenv("QSYNC_LAB_CACHE", str(tmp_path))
    first = Study("digits_cnn", cluster="local-hybrid", progress=False).indicator()
    assert len(list((tmp_path / "indicators").glob("*.csv"))) == 1

    def refuse(*args, **kwargs):
        raise AssertionError("scored again")

    monkeypatch.setattr(qsync_lab.indicator, "indicator", refuse)
    again = Study("digits_cnn", cluster="local-hybrid", progress=False).indicator()
    assert again.equals(first)
    with pytest.raises(AssertionError, match="scored again"):  # other precisions: scored
        Study("digits_cnn", cluster="local-hybrid", progress=False).indicator(["fp16"])


def test_the_key_follows_the_weights_the_batches_the_precisions_and_the_code(monkeypatch):
    study = Study("digits_mlp", cluster="local-hybrid", progress=False)
    batches = [study.example]
    key = indicator_key(study.model, study.graph, batches, study.loss_fn, ["fp16"])
    assert key == indicator_key(study.model, study.graph, batches, study.loss_fn, ["fp16"])
    assert key != indicator_key(study.model, study.graph, batches, study.loss_fn, ["int8"])
    inputs, target = study.example
    other = [((inputs[0] + 1,), target)]
    assert key != indicator_key(study.model, study.graph, other, study.loss_fn, ["fp16"])
    with monkeypatch.context() as patched:
        patched.setattr(cache, "_code_digest", lambda: "edited")
        assert key != indicator_key(study.model, study.graph, batches, study.loss_fn, ["fp16"])
    with torch.no_grad():
        next(study.model.parameters())[0].add_(1e-3)
    assert key != indicator_key(study.model, study.graph, batches, study.loss_fn, ["fp16"])
