"""Build one rank's model for training: :func:`build_rank`.

Every rank builds the same model (seeded), traces it on its own batch size, checks that
every rank agrees on the plan, model, cluster and settings
(:func:`~qsync_lab.runtime.agreement.check_ranks_agree`) and that the plan fits the model,
applies its device kind's precisions as the simulator resolves them
(:func:`~qsync_lab.quant.resolve.apply_resolved_plan_`), sets a CUDA rank's TF32 switches
(on for the whole step where no GEMM op computes in fp32:
:func:`~qsync_lab.quant.resolve.plan_keeps_tf32_on`; else off, and the tf32 ops switch
them on around themselves), and wraps the model in DDP (plain
allreduce, or the plan's gradient compression hooks) with its optimizer and loss scaler
(:func:`~qsync_lab.runtime.optimizer_step.loss_scaler`).
"""

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch.nn.parallel import DistributedDataParallel

from qsync_lab.graph import OpGraph, trace_graph
from qsync_lab.optimizers import make_optimizer
from qsync_lab.quant import apply_resolved_plan_, plan_keeps_tf32_on
from qsync_lab.quant.native import set_tf32
from qsync_lab.runtime.agreement import check_ranks_agree
from qsync_lab.runtime.optimizer_step import loss_scaler
from qsync_lab.runtime.rank_context import RankContext

if TYPE_CHECKING:
    from qsync_lab.compress import CompressionState

__all__ = ["RankModel", "build_rank"]


@dataclasses.dataclass
class RankModel:
    """What :func:`build_rank` builds for one rank."""

    graph: OpGraph  #: the model traced on this rank's batch size
    applied: dict[str, str]  #: what each op not in fp32 runs (op FQN -> config text)
    ddp: DistributedDataParallel
    compression: "CompressionState | None"  #: None: plain allreduce
    optimizer: torch.optim.Optimizer
    loss_scale: torch.amp.GradScaler  #: disabled where the plan needs no loss scaling


def build_rank(ctx: RankContext) -> RankModel:
    """The rank's model, in DDP, with its precisions, hooks, optimizer and loss scaler.

    Raises:
        QSyncError: the ranks disagree (each difference named), or the plan does not fit
            the model or the cluster.
    """
    torch.manual_seed(ctx.config.seed)
    model = ctx.task.build_model()
    inputs, target = ctx.task.example(ctx.batch_sizes[ctx.rank])
    graph = trace_graph(model, inputs, target=target, loss_fn=ctx.task.loss_fn())
    check_ranks_agree(ctx.identity(graph))  # before any check one rank alone could fail
    ctx.plan.validate(graph, ctx.cluster)  # and before DDP's or the hooks' collectives
    device_spec = ctx.cluster.catalog.device(ctx.kind)
    applied = apply_resolved_plan_(model, graph, ctx.plan.precisions[ctx.kind], device_spec)
    if ctx.cuda:
        tf32 = plan_keeps_tf32_on(graph, ctx.plan.precisions[ctx.kind], device_spec)
        set_tf32(tf32)
        if tf32:
            ctx.note("TF32 on for the whole step: no GEMM op of this rank computes in fp32")
    model = model.to(ctx.device)
    ddp = DistributedDataParallel(model, device_ids=[ctx.device] if ctx.cuda else None)
    compression = None
    if ctx.plan.compression_settings:
        from qsync_lab.compress import register_compression

        compression = register_compression(ddp, ctx.plan.compression_settings,
                                           seed=ctx.config.seed)
    optimizer = make_optimizer(ctx.optimizer_name, ddp.parameters(),
                               lr=ctx.config.lr, momentum=ctx.config.momentum)
    return RankModel(graph, applied, ddp, compression, optimizer,
                     loss_scaler(model, cuda=ctx.cuda))
