import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from qsync_lab.errors import QSyncError
from qsync_lab.graph import bucket_assignment, ddp_buckets, trace_graph

from qsync_lab.models import example_batch, get_model

from tests.graph.sample_models import TinyEncoder, cnn, mlp


def wide_mlp() -> nn.Module:  # 2.5 MB of parameters: crosses DDP's 1 MiB first bucket
    return nn.Sequential(nn.Linear(300, 400), nn.ReLU(), nn.Linear(400, 500), nn.ReLU(),
                         nn.Linear(500, 600), nn.ReLU(), nn.Linear(600, 10))


CASES = {
    "wide_mlp": (wide_mlp, lambda: torch.randn(4, 300)),
    "mlp": (mlp, lambda: torch.randn(4, 64)),
    "cnn": (cnn, lambda: torch.randn(4, 1, 8, 8)),
    "encoder": (TinyEncoder, lambda: torch.randint(0, 50, (2, 6))),
    "resnet18": (lambda: get_model("resnet18", num_classes=10),
                 lambda: example_batch("resnet18", 2, image_size=32)[0][0]),
    "bert": (lambda: get_model("bert_mini", num_layers=2, hidden=64, heads=2, intermediate=128,
                               vocab_size=200, max_positions=32),
             lambda: example_batch("bert_mini", 2, seq_len=8, vocab_size=200)[0][0]),
}


@pytest.fixture(scope="module")
def gloo_group(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("ddp") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def real_ddp_buckets(model, x, bucket_cap_mb):
    """The parameter names of each bucket DDP reduces, in iteration 0 and iteration 2."""
    names = {id(p): n for n, p in model.named_parameters()}
    seen: dict[int, dict[int, list[str]]] = {}
    state = {"iteration": 0}

    def record(state, bucket):
        seen.setdefault(state["iteration"], {})[bucket.index()] = [
            names[id(p)] for p in bucket.parameters()]
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    kwargs = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    ddp = DDP(model, **kwargs)
    ddp.register_comm_hook(state, record)
    for iteration in range(3):
        state["iteration"] = iteration
        out = ddp(x)
        (out[0] if isinstance(out, tuple) else out).float().sum().backward()
    as_lists = lambda it: [seen[it][i] for i in sorted(seen[it])]  # noqa: E731
    return as_lists(0), as_lists(2)


def predicted(graph, bucket_cap_mb, iteration):
    frame = ddp_buckets(graph, bucket_cap_mb=bucket_cap_mb, iteration=iteration)
    return [list(group["param"]) for _, group in frame.groupby("bucket", sort=True)]


@pytest.mark.parametrize("bucket_cap_mb", [None, 0.02])
@pytest.mark.parametrize("case", sorted(CASES))
def test_buckets_equal_the_ones_ddp_builds(gloo_group, case, bucket_cap_mb):
    build, make_input = CASES[case]
    torch.manual_seed(0)
    model, x = build(), make_input()
    graph = trace_graph(model, x)
    first, steady = real_ddp_buckets(model, x, bucket_cap_mb)
    assert predicted(graph, bucket_cap_mb, "first") == first
    assert predicted(graph, bucket_cap_mb, "steady") == steady


def test_wide_mlp_gets_a_small_first_bucket_by_default():
    graph = trace_graph(wide_mlp(), torch.randn(4, 300))
    frame = ddp_buckets(graph)
    sizes = frame.groupby("bucket")["bytes"].sum().tolist()
    assert sizes == [40 + 24000 + 2400 + 1_200_000, 2000 + 800_000 + 1600 + 480_000]


def test_bucket_assignment_closes_at_the_limit_and_separates_dtypes():
    assert bucket_assignment([5, 5, 5, 5], [10]) == [[0, 1], [2, 3]]
    assert bucket_assignment([3, 8, 4, 4, 4], [2, 8]) == [[0], [1], [2, 3], [4]]
    keys = ["f32", "f16", "f32", "f16"]
    assert bucket_assignment([6, 6, 6, 1], [10], keys) == [[0, 2], [1, 3]]
    assert bucket_assignment([], [10]) == []


def test_frozen_parameters_are_not_bucketed():
    model = mlp()
    model[0].weight.requires_grad_(False)
    frame = ddp_buckets(trace_graph(model, torch.randn(2, 64)))
    assert "0.weight" not in set(frame["param"]) and "0.bias" in set(frame["param"])


@pytest.mark.parametrize("kwargs,message", [
    ({"bucket_cap_mb": 0}, "bucket_cap_mb must be positive"),
    ({"iteration": "last"}, "iteration must be"),
])
def test_bad_bucket_arguments(kwargs, message):
    graph = trace_graph(mlp(), torch.randn(2, 64))
    with pytest.raises(QSyncError, match=message):
        ddp_buckets(graph, **kwargs)
