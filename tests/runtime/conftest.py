"""Fixtures of the training-runtime tests: plans on files, torchrun launches, a 1-rank group."""

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from qsync_lab.cluster import load_cluster
from qsync_lab.graph import trace_graph
from qsync_lab.plan import Plan
from qsync_lab.resources import data_file
from qsync_lab.runtime.checkpoint import load_checkpoint
from qsync_lab.runtime.launch import stop_run, torchrun_command
from qsync_lab.runtime.tasks import load_task

LAUNCH_TIMEOUT_S = 240
#: the shipped CPU profile: a run given it predicts from it instead of first timing its
#: model's ops (10-50 s here), for the tests whose subject is not the predicted step
SHIPPED_PROFILE = str(data_file("profiles", "cpu.csv"))


def cluster_file(tmp_path: Path, groups: list[str], name: str = "test") -> Path:
    """A one-node cluster TOML with ``groups`` (inline tables of the ``devices`` list)."""
    path = tmp_path / f"{name}.toml"
    path.write_text(f'name = "{name}"\nbatch_size = 16\n\n[[node]]\nname = "localhost"\n'
                    f'intra_node_link = "loopback"\ndevices = [{", ".join(groups)}]\n')
    return path


def write_plan(path: Path, cluster, precisions: dict, model: str = "digits_cnn",
               task: str = "digits", compression=None, **model_kwargs) -> Path:
    """Plan ``precisions`` (and ``compression``) for ``model(**model_kwargs)`` on ``cluster``
    (a name or a TOML path)."""
    data = load_task(task, model, **model_kwargs)
    torch.manual_seed(0)
    inputs, target = data.example(4)
    graph = trace_graph(data.build_model(), inputs, target=target, loss_fn=data.loss_fn())
    plan = Plan.build(graph, load_cluster(cluster), precisions, strategy="test",
                      compression=compression)
    plan.for_model(model, model_kwargs).save(path)
    return path


def one_rank_plan(tmp_path: Path, precisions=None, batch: int = 32, **plan_args) -> Path:
    """A plan on a one-rank CPU cluster (digits CNN by default; see :func:`write_plan`)."""
    cluster = cluster_file(tmp_path, [f'{{ kind = "cpu", count = 1, batch_size = {batch} }}'])
    return write_plan(tmp_path / "plan.json", cluster, precisions or {}, **plan_args)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(plan: Path, run_dir: Path, *args: str, nproc: int = 2, max_restarts: int = 0,
           wait: bool = True, script: Path | None = None, **torchrun):
    """Start ``torchrun -m qsync_lab.runtime`` (``script``: torchrun runs that file instead,
    with the same arguments); wait for it (check exit 0) or return the Popen."""
    command = torchrun_command(str(plan), nproc, max_restarts=max_restarts, runtime_args=[
        "--run-dir", str(run_dir), "--threads", "1", *args], **torchrun)
    if script is not None:
        at = command.index("qsync_lab.runtime")
        command[at - 1:at + 1] = [str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not wait:  # its own session: stop() ends torchrun and every worker it started
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    done = subprocess.run(command, env=env, capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text())


def stop(job: subprocess.Popen) -> None:
    """Stop a launch started with ``wait=False`` and all its workers, if still running
    (:func:`~qsync_lab.runtime.launch.stop_run`: SIGTERM first, SIGKILL as a last resort)."""
    stop_run(job, job.args[job.args.index("--run-dir") + 1])
    job.communicate()


def final_parameters(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(run_dir / "final.safetensors").state["model"]


@pytest.fixture
def single_rank_group(tmp_path):
    """A 1-rank gloo process group in this process (for in-process ``train`` calls)."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _no_device_override(monkeypatch):
    monkeypatch.delenv("QSYNC_DEVICE_KIND", raising=False)



