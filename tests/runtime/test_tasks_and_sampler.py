"""Bundled tasks and the uneven per-rank sampler."""

import random

import numpy as np
import pytest
import torch

from qsync_lab.errors import QSyncError
from qsync_lab.models import get_model
from qsync_lab.runtime.sampler import UnevenBatchSampler, loss_weight
from qsync_lab.runtime.tasks import default_task, load_task


def test_mnist1d_is_generated_locally_and_leaves_the_global_generators_alone():
    random.seed(7)
    np.random.seed(7)
    before = random.random(), np.random.rand()
    random.seed(7)
    np.random.seed(7)
    task = load_task("mnist1d")
    assert (random.random(), np.random.rand()) == before
    assert tuple(task.train_inputs[0].shape) == (4000, 40)
    assert tuple(task.test_inputs[0].shape) == (1000, 40)
    assert set(task.train_target.tolist()) == set(range(10))
    assert task.model_kwargs["in_features"] == 40
    assert task.build_model()(task.train_inputs[0][:3]).shape == (3, 10)


def test_tokens_task_is_balanced_and_follows_its_rule():
    task = load_task("tokens", "bert_mini", vocab_size=100, seq_len=9)
    ids, labels = task.train_inputs[0], task.train_target
    assert ids.max() < 100 and ids.shape[1] == 9
    assert torch.equal(labels, ((ids < 50).sum(1) > 4).long())
    assert 0.4 < labels.float().mean() < 0.6



def test_zipf_tokens_task_follows_its_rule_with_zipf_frequencies_and_is_balanced():
    task = load_task("zipf_tokens", "bert_mini", vocab_size=21, seq_len=9, seed=1)
    ids, labels = task.train_inputs[0], task.train_target
    assert 1 <= ids.min() and ids.max() <= 20 and ids.shape[1] == 9
    assert torch.equal(labels, ((ids <= 10).sum(1) > 4).long())
    assert 0.4 < labels.float().mean() < 0.6
    counts = torch.bincount(ids.flatten(), minlength=21).float()
    for first in (1, 11):  # each class: its k-th id drawn about 1/k as often as its first
        assert 8 < counts[first] / counts[first + 9] < 12
    again = load_task("zipf_tokens", "bert_mini", vocab_size=21, seq_len=9, seed=1)
    assert torch.equal(again.test_inputs[0], task.test_inputs[0])
    with pytest.raises(QSyncError, match="needs vocab_size >= 5, got 4"):
        load_task("zipf_tokens", "bert_mini", vocab_size=4, seq_len=9)

def test_synthetic_task_fits_any_zoo_model():
    task = load_task("synthetic", "resnet18", num_classes=10, image_size=32)
    assert tuple(task.train_inputs[0].shape[1:]) == (3, 32, 32)
    assert default_task("resnet18") == "synthetic" and default_task("bert_base") == "tokens"


@pytest.mark.parametrize("args, message", [
    (("cifar",), "unknown task 'cifar'"),
    (("synthetic",), "task 'synthetic' needs a model"),
    (("digits", "digits_mlp"), "task 'digits' trains digits_cnn, not digits_mlp"),
])
def test_task_errors(args, message):
    with pytest.raises(QSyncError, match=message):
        load_task(*args)


def test_digits_mlp_defaults_fit_its_task_and_other_widths_are_refused():
    """A plan made for the default digits_mlp is for the model its default task trains."""
    task = load_task(default_task("digits_mlp"), "digits_mlp")
    assert task.build_model().fc1.in_features == get_model("digits_mlp").fc1.in_features == 40
    with pytest.raises(QSyncError, match="in_features=40, not 64"):
        load_task("mnist1d", "digits_mlp", in_features=64)


def test_uneven_batches_partition_each_global_batch():
    sampler = UnevenBatchSampler(100, (5, 2, 3), seed=1)
    assert sampler.steps_per_epoch == 10
    seen = []
    for step in range(sampler.steps_per_epoch):
        parts = [sampler.indices(step, r) for r in range(3)]
        assert [len(p) for p in parts] == [5, 2, 3]
        assert torch.equal(torch.cat(parts), sampler.global_indices(step))
        seen += torch.cat(parts).tolist()
    assert sorted(seen) == list(range(100))  # one epoch sees every sample once
    next_epoch = sampler.global_indices(10)
    assert not torch.equal(next_epoch, sampler.global_indices(0))  # reshuffled
    assert torch.equal(next_epoch, UnevenBatchSampler(100, (5, 2, 3), seed=1).global_indices(10))


def test_loss_weights_average_to_the_global_mean():
    sizes = (24, 8, 16)
    assert sum(loss_weight(sizes, r) for r in range(3)) / 3 == pytest.approx(1.0)
    assert [loss_weight(sizes, r) for r in range(3)] == pytest.approx([1.5, 0.5, 1.0])


@pytest.mark.parametrize("samples, sizes, message", [
    (10, (8, 4), "fewer than one global batch"),
    (10, (0, 4), "positive integers"),
])
def test_sampler_errors(samples, sizes, message):
    with pytest.raises(QSyncError, match=message):
        UnevenBatchSampler(samples, sizes)


@pytest.mark.parametrize("task, model", [("digits", "digits_cnn"), ("mnist1d", "digits_mlp"),
                                         ("tokens", "bert_mini"), ("zipf_tokens", "bert_mini"),
                                         ("synthetic", "resnet18")])
def test_the_sizes_qsync_lab_run_checks_before_torch_are_the_tasks(task, model):
    """``TRAIN_SAMPLES`` (read without torch) is every bundled task's training-set size."""
    from qsync_lab.runtime.task_sizes import TRAIN_SAMPLES
    from qsync_lab.runtime.tasks import TASKS

    assert set(TRAIN_SAMPLES) == set(TASKS)
    assert load_task(task, model).num_train == TRAIN_SAMPLES[task]
