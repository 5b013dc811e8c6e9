"""The op-chain cost model: per-op times and memory, and casts between neighbouring ops.

The allocator needs cheap estimates for two jobs: finding the fastest plan that fits
memory (:mod:`qsync_lab.allocate.fastest`) and ranking recovery moves
(:mod:`qsync_lab.allocate.recover`). Both use the candidates as a *chain* in graph order:

* node cost of op ``i`` in ``p``: its forward at ``p`` plus both backward phases at the
  backward precision, the weight cast from the fp32 master copy and the weight-gradient
  cast back, and an int8 op's ``grad_out``/``saved`` casts (as
  :mod:`qsync_lab.simulate.schedule` schedules them);
* edge cost between consecutive candidates: when the earlier op's output storage
  precision differs from the later op's, a cast of the later op's activation input
  forward and its gradient back (the first candidate reads fp32);
* memory of op ``i`` in ``p``: what the simulator's memory model
  (:class:`~qsync_lab.simulate.memory.MemoryModel`) has the ops from ``i`` up to the next
  candidate hold for backward (saved activations and low-precision weight copies; the
  ops before the first candidate count at it) when the candidates run ``p``: those that
  may and that keep their saved operands in ``p`` (a layer norm computes on fp32 inputs,
  so 16 bits saves it nothing of its own and it stays fp32: a 16-bit GEMM after it keeps
  its own copy). A tensor several ops keep as it is counts in even parts at each (``q``,
  ``k`` and ``v`` sharing their input). Lower precision does not always hold less: an
  int8 GEMM after a ReLU keeps an int8 copy of the fp32 output the ReLU keeps anyway,
  where an fp32 GEMM shares it.

Casts through residual branches and the precision inherited by the activations between
candidates are left out, so the estimates only rank choices; every accepted plan is
checked by :class:`~qsync_lab.simulate.PlanEvaluator`.

Example::

    >>> import torch, torch.nn as nn
    >>> from qsync_lab.costs import CostModel, op_work
    >>> from qsync_lab.devices import load_catalog
    >>> from qsync_lab.graph import trace_graph
    >>> from qsync_lab.simulate.memory import MemoryModel, keep_format
    >>> graph = trace_graph(nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 8)),
    ...                     torch.randn(2, 512))
    >>> work, t4 = op_work(graph), load_catalog().device("T4")
    >>> memory = MemoryModel(work, graph.params, optimizer="sgd", bucket_bytes=0.0)
    >>> chain = chain_costs(work, (0, 2), t4, CostModel(), batch_size=256, memory=memory)
    >>> [str(p) for p in chain.precisions], bool(chain.node_us[0, 2] < chain.node_us[0, 0])
    (['fp32', 'fp16', 'int8'], True)
    >>> chain.mem_bytes[1].tolist()  # fp32, fp16 share the ReLU's output; int8 keeps a copy
    [0.0, 8208.0, 135176.0]
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from qsync_lab.allocate.choices import op_may_run
from qsync_lab.costs import CostModel, OpWork, batch_scales
from qsync_lab.devices import DeviceSpec
from qsync_lab.precision import Precision
from qsync_lab.simulate.memory import MemoryModel, keep_format
from qsync_lab.policy import (DEFAULT_BACKWARD, output_precision, resolve_precisions,
                              storage_precision)

__all__ = ["ChainCosts", "chain_costs"]

_FP32_BYTES = 4


@dataclass(frozen=True, eq=False)
class ChainCosts:
    """Chain estimates for the candidates of one device kind at one batch size.

    Attributes:
        ops: candidate op indices, graph order.
        precisions: the device's precisions (columns of the arrays).
        node_us: [op, precision] node cost (inf where the device cannot run it).
        mem_bytes: [op, precision] saved activations plus low-precision weight copies
            (the memory model's, see the module docstring).
        input_numel: per candidate, the activation elements it reads.
        cast_us: (src, dst) -> per candidate, a forward cast of its input plus the
            gradient cast back (0 when src is dst).
    """

    ops: tuple[int, ...]
    precisions: tuple[Precision, ...]
    node_us: np.ndarray
    mem_bytes: np.ndarray
    input_numel: np.ndarray
    cast_us: Mapping[tuple[Precision, Precision], np.ndarray]

    def column(self, precision: Precision) -> int:
        return self.precisions.index(precision)

    def edge_us(self, k: int, previous: Precision | None, precision: Precision) -> float:
        """Cast cost into candidate ``k`` (position in ``ops``) when the previous candidate
        ran in ``previous`` (None: ``k`` is the first and reads fp32 data)."""
        src = Precision.FP32 if previous is None else output_precision(previous)
        return float(self.cast_us[(src, storage_precision(precision))][k])

    def move_us(self, k: int, plan: Sequence[Precision], precision: Precision) -> float:
        """Estimated time change when candidate ``k`` moves from ``plan[k]`` to ``precision``
        (``plan``: the precision of every candidate, in order)."""
        before = plan[k - 1] if k > 0 else None
        old = plan[k]
        delta = (self.node_us[k, self.column(precision)] - self.node_us[k, self.column(old)]
                 + self.edge_us(k, before, precision) - self.edge_us(k, before, old))
        if k + 1 < len(self.ops):
            after = plan[k + 1]
            delta += self.edge_us(k + 1, precision, after) - self.edge_us(k + 1, old, after)
        return float(delta)


def chain_costs(work: OpWork, ops: Sequence[int], device: DeviceSpec, costs: CostModel, *,
                batch_size: int, memory: MemoryModel) -> ChainCosts:
    """Build the chain estimates of ``ops`` on ``device`` (see the module docstring);
    ``memory``: the graph's memory model (``PlanEvaluator.memory_model``)."""
    ops = tuple(ops)
    index = np.array(ops, np.int64)
    scale = batch_scales(work, batch_size)[index]
    precisions = device.precision_list
    node = np.full((len(ops), len(precisions)), np.inf)
    weight_numel = work.weight_numel[index].astype(float)
    out_numel = work.out_numel[index] * scale
    input_numel = work.act_read_bytes[index] * scale / _FP32_BYTES
    for c, p in enumerate(precisions):
        q = DEFAULT_BACKWARD[p]
        phase_us = {phase: costs.op_times_us(work, [p if phase == "forward" else q] * len(work),
                                             device, batch_size=batch_size, phase=phase,
                                             plan_precisions=[p] * len(work))[0][index]
                    for phase in ("forward", "backward_input", "backward_weight")}
        stored, stored_q = storage_precision(p), storage_precision(q)
        total = sum(phase_us.values())
        total = total + _cast(costs, weight_numel, Precision.FP32, stored, device)
        has_weight_grad = phase_us["backward_weight"] > 0
        total = total + np.where(has_weight_grad,
                                 _cast(costs, weight_numel, stored_q, Precision.FP32, device), 0)
        if p is Precision.INT8:
            total = total + _cast(costs, out_numel, Precision.FP32, stored_q, device)
            total = total + _cast(costs, input_numel + weight_numel, Precision.INT8, stored_q,
                                  device)
        node[:, c] = total
    storages = {output_precision(p) for p in precisions} | {storage_precision(p) for p in precisions}
    cast_us = {(src, dst): (_cast(costs, input_numel, src, dst, device)
                            + _cast(costs, input_numel, dst, src, device))
               if src is not dst else np.zeros(len(ops))
               for src in storages for dst in storages}
    held = _held_bytes(work, ops, device, memory, batch_size)
    return ChainCosts(ops, precisions, node, held, input_numel, cast_us)


def _held_bytes(work: OpWork, ops: tuple[int, ...], device: DeviceSpec, memory: MemoryModel,
                batch_size: int) -> np.ndarray:
    """[candidate, precision] bytes held for backward by the ops from the candidate up to
    the next one (the first from op 0) when the candidates run the precision (those that
    may, and keep their saved operands in it)."""
    held = np.zeros((len(ops), len(device.precision_list)))
    if not ops:
        return held
    starts = np.array([0, *ops[1:]], np.int64)
    for c, p in enumerate(device.precision_list):
        uniform = resolve_precisions(
            work, {op: p for op in ops if op_may_run(work, op, p, device)
                   and keep_format(work.kinds[op], p) is storage_precision(p)}, device)
        per_op = (memory.saved(uniform, batch_size=batch_size, split_shared=True,
                               emulated=device.emulated)
                  + memory.weight_copies(uniform))
        held[:, c] = np.add.reduceat(per_op, starts)
    return held


def _cast(costs: CostModel, numel: np.ndarray, src: Precision, dst: Precision,
          device: DeviceSpec) -> np.ndarray:
    if src is dst:
        return np.zeros(len(numel))
    times, _ = costs.cast_times_us(np.asarray(numel, float), src, dst, device)
    return np.where(numel > 0, times, 0.0)
