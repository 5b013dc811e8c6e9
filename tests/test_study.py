"""The ``Study`` facade's predictions agree with what its runs will predict."""

import pytest

from qsync_lab import Study
from qsync_lab.costs import CostModel, load_cost_model
from qsync_lab.plan import Plan
from qsync_lab.resources import data_file
from qsync_lab.runtime.prediction import predict_plan


@pytest.fixture(scope="module")
def study_and_plan():
    study = Study("digits_cnn", cluster="local-hybrid", progress=False)
    plan = Plan.build(study.graph, study.cluster, {"T4": {"conv2": "int8"}}, strategy="manual",
                      model_name="digits_cnn")
    return study, plan


def test_predict_run_without_profiles_uses_the_runs_costs(study_and_plan):
    """A run's summary predicts with the shipped CPU profile; so does predict_run."""
    study, plan = study_and_plan
    shipped = load_cost_model(str(data_file("profiles", "cpu.csv")))
    expected = predict_plan(plan, study.graph, shipped).iteration_us
    roofline = predict_plan(plan, study.graph, CostModel()).iteration_us
    assert study.predict_run(plan).iteration_us == pytest.approx(expected)
    assert expected != pytest.approx(roofline, rel=0.05)  # the two really differ


def test_a_zoo_model_is_profiled_at_its_ranks_batch_size(study_and_plan):
    """Rows timed on the 2-sample example and scaled to the ranks' 16 predicted the README
    example's BERT-mini run at half its measured step; the run's own batch is timed instead."""
    study, _ = study_and_plan
    (images,), labels = study._profile_batch()
    assert len(images) == len(labels) == 16 == study.cluster.ranks[0].batch_size
    assert len(study.example[1]) == 2  # the traced example stays small


def test_a_module_is_profiled_at_its_example_batch():
    import torch
    from torch import nn

    batch = ((torch.randn(3, 4),), torch.tensor([0, 1, 0]))
    study = Study(nn.Linear(4, 2), batch, cluster="local-hybrid", progress=False)
    assert study._profile_batch() is batch


def test_a_resume_under_another_plan_keeps_the_runs_plan_file(study_and_plan, tmp_path):
    """``run_dir/plan.json`` is what a later resume of that run needs: a resume asked with
    another plan is refused before the file is replaced (a fresh run replaces it)."""
    from qsync_lab.errors import QSyncError

    study, plan = study_and_plan
    other = Plan.build(study.graph, study.cluster, {}, strategy="manual", model_name="digits_cnn")
    path = tmp_path / "plan.json"
    other.save(path)
    before = path.read_bytes()
    with pytest.raises(QSyncError, match=rf"^resume=True: {path} holds another plan, the one "
                       r"its checkpoints continue; resume with Plan.load\("):
        study.run(plan, steps=2, run_dir=tmp_path, resume=True)
    assert path.read_bytes() == before
