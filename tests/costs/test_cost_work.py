"""Per-op work: batch inference, batch scaling, per-precision bytes, backward rules."""

import numpy as np
import pytest
import torch
import torch.nn as nn

from qsync_lab.costs import batch_scales, op_work, phase_work, shape_key
from qsync_lab.errors import QSyncError
from qsync_lab.graph import trace_graph
from qsync_lab.models.families import GPTDecoder, SequenceCrossEntropy


class _WithPositions(nn.Module):
    """Token + position embeddings; the positions come from a buffer, not the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos, self.fc = nn.Embedding(20, 8), nn.Embedding(5, 8), nn.Linear(8, 8)
        self.register_buffer("positions", torch.arange(5)[None])

    def forward(self, ids):
        return self.fc(self.tok(ids) + self.pos(self.positions))


def test_traced_batch_and_unbatched_ops():
    work = op_work(trace_graph(_WithPositions(), torch.randint(0, 20, (3, 5))))
    assert work.traced_batch_size == 3
    batched = dict(zip(work.names, work.batched.tolist()))
    assert batched == {"tok": True, "pos": False, "add": True, "fc": True}
    scales = dict(zip(work.names, batch_scales(work, 12).tolist()))
    assert scales == {"tok": 4.0, "pos": 1.0, "add": 4.0, "fc": 4.0}
    with pytest.raises(QSyncError, match="batch size must be a positive integer"):
        batch_scales(work, 0)


def test_a_loss_over_batch_times_tokens_scales_with_the_batch():
    """A GPT's loss reads ``(batch * tokens, vocab)`` logits, no dimension of which is the
    batch: it is batched as it reads batched ops' outputs, its work 8x at 8x the batch."""
    torch.manual_seed(0)
    model = GPTDecoder(vocab=64, dim=32, heads=4, layers=1, max_len=16)
    ids = torch.randint(0, 64, (2, 17))
    work = op_work(trace_graph(model, (ids[:, :-1],), target=ids[:, 1:],
                               loss_fn=SequenceCrossEntropy()))
    loss = work.kinds.index("loss")
    assert work.traced_batch_size == 2 and work.input_shapes[loss] == ((32, 64), (32,))
    assert work.batched[loss] and batch_scales(work, 16)[loss] == 8.0
    for phase in ("forward", "backward_input"):
        (flops, nbytes), (flops16, nbytes16) = (
            phase_work(work, ["fp32"] * len(work), phase, batch_size=b) for b in (2, 16))
        assert flops[loss] > 0 and flops16[loss] == 8 * flops[loss]
        assert nbytes[loss] > 0 and nbytes16[loss] == 8 * nbytes[loss]


def test_override_traced_batch_size():
    graph = trace_graph(nn.Linear(4, 4), torch.randn(6, 4))
    assert op_work(graph, traced_batch_size=3).traced_batch_size == 3
    with pytest.raises(QSyncError, match="positive integer"):
        op_work(graph, traced_batch_size=0)


def test_phase_work_hand_count():
    # Linear(64, 32) at batch 8: 2*8*64*32 MACs-FLOPs + 8*32 bias
    work = op_work(trace_graph(nn.Sequential(nn.ReLU(), nn.Linear(64, 32)), torch.randn(8, 64)))
    act_in, weight, out = 8 * 64 * 4, (64 * 32 + 32) * 4, 8 * 32 * 4
    flops, nbytes = phase_work(work, ["fp32", "fp16"], "forward", batch_size=16)
    assert flops[1] == 2 * (2 * 8 * 64 * 32 + 8 * 32)
    assert nbytes[1] == (2 * act_in + weight) / 2 + 2 * out / 2
    flops, nbytes = phase_work(work, ["fp32", "int8"], "forward", batch_size=8)
    assert nbytes[1] == (act_in + weight) / 4 + out  # int8 reads int8, writes fp32
    flops, nbytes = phase_work(work, ["fp32", "fp16"], "backward_input", batch_size=8)
    assert flops[1] == 2 * 8 * 64 * 32 and nbytes[1] == (out + weight + 2 * act_in) / 2
    flops, nbytes = phase_work(work, ["fp32", "fp32"], "backward_weight", batch_size=8)
    assert flops[1] == 2 * 8 * 64 * 32 + 8 * 32 and nbytes[1] == out + act_in + weight
    # the ReLU reads data: no input gradient, so no kernel and no bytes
    flops, nbytes = phase_work(work, ["fp32", "fp32"], "backward_input", batch_size=8)
    assert flops[0] == 0 and nbytes[0] == 0
    with pytest.raises(QSyncError, match="unknown phase"):
        phase_work(work, ["fp32", "fp32"], "sideways", batch_size=8)


def test_views_cost_nothing_and_shape_keys():
    graph = trace_graph(nn.Sequential(nn.Flatten(), nn.Linear(12, 2)), torch.randn(4, 3, 4))
    work = op_work(graph)
    for phase in ("forward", "backward_input", "backward_weight"):
        flops, nbytes = phase_work(work, ["fp32", "fp32"], phase, batch_size=4)
        assert flops[0] == 0 and nbytes[0] == 0
    assert shape_key(work, 1, 32) == "linear|32x12|w:2x12,2"
    assert np.array_equal(work.weight_numel, [0, 26])
