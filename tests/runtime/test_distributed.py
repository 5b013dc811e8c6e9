"""Real 2-rank gloo DDP runs under torchrun: equivalence with one process, hybrid plans,
a worker SIGKILLed at a random step or after the final checkpoint, and two "nodes" meeting
at a c10d rendezvous on localhost (or refusing each other)."""

import os
import random
import signal
import subprocess
import time

import pytest
import torch

from qsync_lab.models import get_model
from qsync_lab.runtime.checkpoint import checkpoint_path, load_checkpoint
from qsync_lab.runtime.metrics import read_metrics
from qsync_lab.runtime.sampler import UnevenBatchSampler
from qsync_lab.runtime.tasks import load_task
from tests.runtime.conftest import (SHIPPED_PROFILE, cluster_file, final_parameters, free_port,
                                   launch, stop, write_plan)

MLP_STEPS, LR, MOMENTUM = 8, 0.05, 0.9


def _single_process_reference(batch_sizes, steps):
    """digits_mlp trained in one process on the concatenated global batches."""
    task = load_task("synthetic", "digits_mlp")
    torch.manual_seed(0)
    model = get_model("digits_mlp")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    sampler = UnevenBatchSampler(task.num_train, batch_sizes, seed=0)
    loss_fn = task.loss_fn()
    for step in range(steps):
        index = sampler.global_indices(step)
        optimizer.zero_grad()
        loss_fn(model(task.train_inputs[0][index]), task.train_target[index]).backward()
        optimizer.step()
    return model.state_dict()


@pytest.mark.parametrize("batch_sizes", [(16, 16), (24, 8)], ids=["even", "uneven"])
def test_fp32_ddp_equals_one_process_on_the_global_batch(tmp_path, batch_sizes):
    groups = [f'{{ kind = "cpu", count = 1, batch_size = {b} }}' for b in batch_sizes]
    plan = write_plan(tmp_path / "plan.json", cluster_file(tmp_path, groups), {},
                      model="digits_mlp", task="synthetic")
    summary = launch(plan, tmp_path / "run", "--data", "synthetic", "--steps", str(MLP_STEPS),
                     "--lr", str(LR), "--momentum", str(MOMENTUM), "--profile", SHIPPED_PROFILE)
    assert len({r["params_sha256"] for r in summary["ranks"]}) == 1
    ddp, reference = final_parameters(tmp_path / "run"), _single_process_reference(
        batch_sizes, MLP_STEPS)
    for name, value in reference.items():
        torch.testing.assert_close(ddp[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_unweighted_uneven_batches_would_differ(tmp_path):
    """The reference can tell: equal weights on (24, 8) batches are not the global gradient."""
    weighted = _single_process_reference((24, 8), 2)
    task = load_task("synthetic", "digits_mlp")
    torch.manual_seed(0)
    model = get_model("digits_mlp")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    sampler = UnevenBatchSampler(task.num_train, (24, 8), seed=0)
    for step in range(2):
        optimizer.zero_grad()
        loss = sum(task.loss_fn()(model(task.train_inputs[0][i]), task.train_target[i]) / 2
                   for i in (sampler.indices(step, 0), sampler.indices(step, 1)))
        loss.backward()
        optimizer.step()
    assert not torch.allclose(model.state_dict()["fc1.weight"], weighted["fc1.weight"], atol=1e-6)


def test_a_mixed_plan_trains_on_the_emulated_hybrid(tmp_path):
    plan = write_plan(tmp_path / "plan.json", "local-hybrid",
                      {"T4": {"conv2": "int8", "fc1": "int8", "fc2": "fp16"}})
    summary = launch(plan, tmp_path / "run", "--steps", "40")
    losses = [r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert sum(losses[-5:]) < 0.6 * sum(losses[:5]), losses
    v100, t4 = summary["ranks"]
    assert (v100["kind"], t4["kind"]) == ("V100-SXM2-32GB", "T4")
    assert v100["applied_plan"] == {} and t4["applied_plan"]["conv2"] == "int8/fp16 nearest tensor"
    assert v100["params_sha256"] == t4["params_sha256"]
    assert summary["test_accuracy"] > 0.8
    assert summary["predicted_step_ms"] > 0 and summary["measured_step_ms"] > 0


FAULT_STEPS, FAULT_EVERY = 300, 20
FAULT_ARGS = ("--data", "synthetic", "--steps", str(FAULT_STEPS), "--checkpoint-every",
              str(FAULT_EVERY), "--deterministic", "--resume", "--profile", SHIPPED_PROFILE)
#: torchrun runs this instead of ``-m qsync_lab.runtime``: on the first attempt, rank 0 is
#: SIGKILLed after the final checkpoint and weights, just before it writes summary.json
KILLED_BEFORE_THE_SUMMARY = """
import os, signal
from qsync_lab.runtime import summary
from qsync_lab.runtime.__main__ import main
from qsync_lab.runtime.rank_exit import exit_rank

write = summary.atomic_write_text

def killed_before_the_summary(path, text, **options):
    if path.name == "summary.json" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    write(path, text, **options)

summary.atomic_write_text = killed_before_the_summary
exit_rank(main())
"""


@pytest.fixture(scope="module")
def fault_plan(tmp_path_factory):
    return write_plan(tmp_path_factory.mktemp("fault") / "plan.json", "local-cpu",
                      {"cpu": {"fc1": "int8"}}, model="digits_mlp", task="synthetic")


@pytest.fixture(scope="module")
def uninterrupted(fault_plan):
    """The final parameters of the fault tests' run, never interrupted."""
    launch(fault_plan, fault_plan.parent / "clean", *FAULT_ARGS)
    return final_parameters(fault_plan.parent / "clean")


def test_a_worker_killed_at_a_random_step_resumes_and_ends_identical(tmp_path, fault_plan,
                                                                     uninterrupted):
    """The step and the rank are drawn from a seed printed here (QSYNC_FAULT_SEED repeats
    a draw); steps early enough that the run is still going when the kill lands."""
    seed = int(os.environ.get("QSYNC_FAULT_SEED", random.SystemRandom().randrange(2**32)))
    draw = random.Random(seed)
    kill_step, rank = draw.randrange(1, FAULT_STEPS - 3 * FAULT_EVERY), draw.randrange(2)
    seen = f"QSYNC_FAULT_SEED={seed}: SIGKILL of rank {rank} after step {kill_step}"
    print(seen)
    run = tmp_path / "faulty"
    job = launch(fault_plan, run, *FAULT_ARGS, max_restarts=1, wait=False)
    try:
        os.kill(_pid_after_step(run, kill_step, rank=rank, job=job), signal.SIGKILL)
        output, _ = job.communicate(timeout=240)
    finally:
        stop(job)
    assert job.returncode == 0, f"{seen}\n{output[-3000:]}"
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(FAULT_STEPS)), seen
    assert max(r["attempt"] for r in records) == 1, f"{seen}: killed after the run ended"
    assert not list(run.glob(".*.tmp")), f"{seen}: a half-written checkpoint was left behind"
    assert load_checkpoint(checkpoint_path(run, FAULT_STEPS)).step == FAULT_STEPS
    faulty = final_parameters(run)
    assert all(torch.equal(uninterrupted[k], faulty[k]) for k in uninterrupted), seen


def test_a_worker_killed_after_the_final_checkpoint_finds_the_run_complete(tmp_path, fault_plan,
                                                                          uninterrupted):
    """Killed before summary.json: torchrun restarts the ranks, which train nothing again
    and exit 0, saying the run is complete; the weights are the uninterrupted run's."""
    script = tmp_path / "killed_before_the_summary.py"
    script.write_text(KILLED_BEFORE_THE_SUMMARY)
    run = tmp_path / "faulty"
    job = launch(fault_plan, run, *FAULT_ARGS, max_restarts=1, wait=False, script=script)
    try:
        output, _ = job.communicate(timeout=240)
    finally:
        stop(job)
    assert job.returncode == 0, output[-3000:]
    assert _read_json(run / "ranks" / "rank0.json")["attempt"] == 1, "no restart"
    assert (f"qsync_lab: run already complete at step {FAULT_STEPS}; nothing to do (its "
            "summary.json is missing") in output
    assert not (run / "summary.json").exists()
    records = read_metrics(run / "metrics.jsonl")
    assert [(r["step"], r["attempt"]) for r in records] == [(s, 0) for s in range(FAULT_STEPS)]
    faulty = final_parameters(run)
    assert all(torch.equal(uninterrupted[k], faulty[k]) for k in uninterrupted)


def _pid_after_step(run_dir, step: int, rank: int, job: subprocess.Popen) -> int:
    """The pid of ``rank`` once ``metrics.jsonl`` holds ``step`` steps."""
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 180
    while time.monotonic() < deadline and job.poll() is None:
        if metrics.exists() and metrics.read_bytes().count(b"\n") >= step:
            return int(_read_json(run_dir / "ranks" / f"rank{rank}.json")["pid"])
        time.sleep(0.01)
    raise AssertionError(f"step {step} was not reached (job exit {job.poll()}): "
                         f"{job.stdout.read()[-3000:] if job.poll() is not None else ''}")


def _read_json(path):
    import json

    return json.loads(path.read_text())


def test_two_nodes_meet_at_a_c10d_rendezvous(tmp_path):
    plan = write_plan(tmp_path / "plan.json", "local-cpu", {}, model="digits_mlp",
                      task="synthetic")
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [launch(plan, tmp_path / "run", "--data", "synthetic", "--steps", "10", nproc=1,
                    nnodes=2, rdzv_endpoint=endpoint, wait=False) for _ in range(2)]
    try:
        outputs = [node.communicate(timeout=240)[0] for node in nodes]
    finally:
        for node in nodes:
            stop(node)
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    summary = _read_json(tmp_path / "run" / "summary.json")
    assert summary["world_size"] == 2 and len({r["params_sha256"] for r in summary["ranks"]}) == 1
    assert len(read_metrics(tmp_path / "run" / "metrics.jsonl")) == 10


def test_ranks_started_with_different_plans_and_lr_refuse_before_the_first_step(tmp_path):
    plans = [write_plan(tmp_path / f"plan{i}.json", "local-cpu", {}, model="digits_mlp",
                        task="synthetic", compression=compression)
             for i, compression in enumerate((None, "fp16"))]
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [launch(plan, tmp_path / "run", "--data", "synthetic", "--steps", "10", "--lr", lr,
                    nproc=1, nnodes=2, rdzv_endpoint=endpoint, wait=False)
             for plan, lr in zip(plans, ("0.05", "0.1"))]
    try:
        outputs = [node.communicate(timeout=240)[0] for node in nodes]
    finally:
        for node in nodes:
            stop(node)
    assert all(n.returncode != 0 for n in nodes), "\n".join(o[-2000:] for o in outputs)
    for output in outputs:  # each field named: the plan, and the settings one by one
        assert "ranks disagree before the first step: plan differs (ranks 0 vs 1)" in output
        assert "lr differs (ranks 0 vs 1)" in output and "compression differs" in output
    assert not (tmp_path / "run" / "metrics.jsonl").exists(), "a rank trained"
