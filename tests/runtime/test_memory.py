"""The CPU peak tensor memory window against hand counts, and a run's peak against the
memory model."""

import json
import queue
import threading

import pytest
import torch

from qsync_lab.models import get_model
from qsync_lab.runtime.memory import MemoryWindow, _accounting_flag, peak_cpu_bytes
from tests.runtime.conftest import LAUNCH_TIMEOUT_S, SHIPPED_PROFILE, launch, one_rank_plan

MIB = 2**20


def _floats(mib: float) -> torch.Tensor:
    return torch.zeros(int(mib * MIB) // 4)


def test_peak_is_the_largest_live_set_of_the_window():
    before = _floats(8)  # allocated before the window: not counted
    window = MemoryWindow(cuda=False)
    a, b = _floats(4), _floats(2)      # live 6
    del a
    c = _floats(1)                      # live 3
    del before                          # freed inside, allocated outside: ignored
    assert window.close() == 6 * MIB
    assert window.close() == 6 * MIB and not window.is_open
    del b, c


def test_a_free_on_another_thread_ends_the_tensor():
    """gloo's worker can drop the last reference to a tensor the training thread made."""
    assert _accounting_flag() is not None, "this torch build should export c10's flag"
    inbox: queue.Queue = queue.Queue()
    worker = threading.Thread(target=inbox.get)
    worker.start()
    window = MemoryWindow(cuda=False)
    a = _floats(4)
    inbox.put(a)
    del a
    worker.join()                       # the worker held the last reference: freed there
    b = _floats(4)
    assert window.close() == 4 * MIB    # a running sum of this thread's events says 8
    del b


def test_the_window_restores_the_accounting_flag():
    flag = _accounting_flag()
    assert flag is not None and not flag.value
    window = MemoryWindow(cuda=False)
    assert flag.value
    window.close()
    assert not flag.value


@pytest.mark.parametrize("mib", [1, 16])
def test_fallback_running_sum_matches_on_one_thread(mib):
    window = MemoryWindow(cuda=False)
    profiler = window._profiler
    x = _floats(mib)
    del x
    y = _floats(mib / 2)
    assert window.close() == mib * MIB
    assert peak_cpu_bytes(profiler, all_threads=False) == mib * MIB
    del y


@pytest.mark.parametrize("all_threads", [True, False])
def test_a_tensor_of_an_earlier_window_freed_in_this_one_is_not_counted(all_threads):
    """An earlier run's tensors, collected while a later run measures, lower neither peak."""
    earlier = MemoryWindow(cuda=False)
    leftover = _floats(32)             # accounted by c10 from the earlier window on
    earlier.close()
    window = MemoryWindow(cuda=False)
    profiler = window._profiler
    del leftover                        # an event of -32 MiB inside this window
    x = _floats(8)
    assert window.close() == 8 * MIB   # was 0: the -32 MiB hid the 8 MiB
    assert peak_cpu_bytes(profiler, all_threads=all_threads) == 8 * MIB
    del x


def test_a_runs_peak_counts_its_optimizer(tmp_path):
    """For SGD, SGD with momentum and AdamW a run's measured peak tensor memory (model build
    and first steps) is within 10 % of the prediction, and the measured differences between
    them are the optimizers' fp32 state, as the memory model counts it (+1 and +2 copies of
    the parameters). Each run is its own process, as under ``qsync-lab run``: the window is
    the process's first (see :mod:`qsync_lab.runtime.memory` on later windows)."""
    plan = one_rank_plan(tmp_path, model="bert_mini", task="tokens", vocab_size=2000,
                          seq_len=32)
    optimizers = ("sgd", "sgd_momentum", "adamw")
    jobs = {optimizer: launch(plan, tmp_path / optimizer, "--steps", "3", "--checkpoint-every",
                              "0", "--optimizer", optimizer, "--lr", "1e-3",
                              "--profile", SHIPPED_PROFILE, nproc=1, wait=False)
            for optimizer in optimizers}  # side by side
    measured = {}
    for optimizer, job in jobs.items():
        output, _ = job.communicate(timeout=LAUNCH_TIMEOUT_S)
        assert job.returncode == 0, output[-3000:]
        summary = json.loads((tmp_path / optimizer / "summary.json").read_text())
        assert summary["optimizer"] == optimizer
        assert abs(summary["tensor_peak_error_pct"]) < 10, (optimizer, summary)
        measured[optimizer] = summary["measured_tensor_peak_mib"]
    params_mib = 4 * sum(p.numel() for p in get_model("bert_mini", vocab_size=2000,
                                                      seq_len=32).parameters()) / MIB
    assert measured["sgd_momentum"] - measured["sgd"] == pytest.approx(params_mib, rel=0.05)
    assert measured["adamw"] - measured["sgd"] == pytest.approx(2 * params_mib, rel=0.05)


def test_an_emulated_bf16_steps_peak_is_the_emulating_memory_models():
    """A bf16 MLP's forward and backward on the CPU (the emulation): the measured peak of the
    tensors the step makes is within 20 % of the memory model's count for an emulating rank,
    while the count for a rank that runs bf16 natively is more than 30 % below it."""
    from torch import nn

    from qsync_lab.costs import op_work
    from qsync_lab.devices import load_catalog
    from qsync_lab.graph import trace_graph
    from qsync_lab.policy import resolve_precisions
    from qsync_lab.quant import apply_plan_
    from qsync_lab.simulate.memory import MemoryModel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                          nn.Linear(1024, 10))
    x, target, loss_fn = torch.randn(512, 256), torch.randint(0, 10, (512,)), nn.CrossEntropyLoss()
    graph = trace_graph(model, x, target=target, loss_fn=loss_fn)
    plan = {"0": "bf16", "2": "bf16", "4": "bf16"}
    apply_plan_(model, plan)
    window = MemoryWindow(cuda=False)
    loss_fn(model(x), target).backward()
    measured = window.close()
    work = op_work(graph)
    memory = MemoryModel(work, graph.params, optimizer="sgd", bucket_bytes=0)
    assignment = resolve_precisions(work, plan, load_catalog().device("cpu"))
    step_parts = ("activations", "low_precision_weights", "gradients", "workspace")

    def predicted(emulated: bool) -> float:
        parts = memory.breakdown(assignment, batch_size=512, emulated=emulated)
        return sum(parts[k] for k in step_parts)

    assert abs(predicted(True) / measured - 1) < 0.2, (predicted(True) / MIB, measured / MIB)
    assert predicted(False) / measured - 1 < -0.3
