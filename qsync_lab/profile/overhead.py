"""What a training step costs beyond its ops timed alone, fitted on held-out models.

An op timed alone (:func:`~qsync_lab.profile.profile_ops`) leaves out what a real
training step adds: a fixed cost per step (``zero_grad``, entering the autograd engine,
the loss call, the optimizer's per-step work) and a cost per op event (one forward,
input-gradient or weight-gradient phase: the engine scheduling a backward node, minus
what the isolated timing over-counts, so it may come out negative). Both are
fitted as a line: for a family of calibration MLPs of growing depth, the median measured
step minus what the model's profile rows take (:func:`rows_step_us`), against the number
of rows. The models are never the ones being predicted (held out), and nothing is pasted
by hand. On a GPU the rows carry host times and the calibration MLPs' small ops are
host-bound: the per-event cost is then the host's work between two ops (module calls,
the autograd engine), which the simulator adds to each op's host time.

The fit travels in a profile's metadata (``step_overhead_us`` and ``event_overhead_us``),
and the cost model applies it to the ranks whose op times are measured
(:attr:`qsync_lab.costs.CostModel.step_overhead_us`, ``event_overhead_us``).

A model profiled for its own run (:mod:`qsync_lab.profile.model_cache`) does better than
the held-out line: beside its op rows, the same processes time the model's whole training
step as the run takes it (:func:`time_training_step`: the run's optimizer and non-finite
gradient check included), and its profile's step overhead is what that step takes beyond
its fp32 op rows and the costed optimizer step (:func:`model_step_overhead_metadata`):
view copies, the optimizer's per-tensor loop, the framework's own work. Better still, the
processes time the step under DDP among themselves, as the ranks will take it, under a
uniform plan of each precision the run uses (:func:`time_ddp_training_steps`), and the
overheads are calibrated so that the simulator predicts those steps
(:func:`ddp_calibrated_metadata`): the fp32 step sets ``step_overhead_us`` (DDP, the
framework, ranks waiting for each other), and each low precision's step sets
``op_overhead_us.<precision>``, the cost per op computed in it that its rows miss. A plan
that mixes precisions is predicted between those calibrated ends. A GPU's profile of one
model is calibrated so too, from the model's uniform steps under DDP on one NCCL rank
(:func:`~qsync_lab.profile.profile_machine`): there the op rows' host times miss the
framework's work around them (DDP's hooks and copies, the optimizer, the gradient check,
the autograd engine), which sets the pace of a host-bound step.

Example::

    >>> fit = fit_step_overhead(depths=(1, 4), width=8, repeats=3, warmup=1)
    >>> fit.samples, sorted(step_overhead_metadata(fit))
    (2, ['event_overhead_us', 'step_overhead_us'])
"""

import copy
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import torch
from torch import nn

from qsync_lab.errors import QSyncError
from qsync_lab.hostmem import keep_freed_memory
from qsync_lab.precision import Precision
from qsync_lab.profile.fit import LineFit, fit_line
from qsync_lab.profile.in_step import loss_root_on
from qsync_lab.profile.ops import profile_ops
from qsync_lab.profile.timing import median_time_us

__all__ = ["EVENT_OVERHEAD_KEY", "OP_OVERHEAD_PREFIX", "STEP_OVERHEAD_KEY",
           "ddp_calibrated_metadata", "fit_step_overhead", "measured_step_overhead_metadata",
           "model_step_overhead_metadata", "rows_step_us", "step_overhead_metadata",
           "time_ddp_training_steps", "time_training_step", "uniform_op_precisions"]

EVENT_OVERHEAD_KEY = "event_overhead_us"
STEP_OVERHEAD_KEY = "step_overhead_us"
#: ``op_overhead_us.<precision>``: µs per op computed in that precision, beyond its rows
OP_OVERHEAD_PREFIX = "op_overhead_us."
DEFAULT_DEPTHS = (2, 4, 8, 16)
MIN_R2 = 0.9  # a calibration line below this was disturbed: measure again


def fit_step_overhead(*, depths=DEFAULT_DEPTHS, width: int = 64, batch_size: int = 16,
                      repeats: int = 20, warmup: int = 3, method: str = "in_step",
                      min_r2: float = MIN_R2, attempts: int = 3,
                      device: "torch.device | str" = "cpu") -> LineFit:
    """Fit ``step_us − Σ profile rows = slope·rows + intercept`` over calibration MLPs of
    ``depths`` Linear+ReLU blocks on ``device`` (see the module docstring): ``slope`` is
    µs per op event, ``intercept`` µs per step. ``method``: the profile method whose rows
    the fit completes (:func:`~qsync_lab.profile.profile_ops`).

    A fit with R² under ``min_r2`` was disturbed by other load on the machine (a quiet one
    gives a near-perfect line): it is measured again, at most ``attempts`` times in all,
    and the best fit returned."""
    if attempts < 1:
        raise QSyncError(f"attempts must be at least 1, got {attempts}")
    best = None
    for _ in range(attempts):
        fit = _fit_once(depths, width, batch_size, repeats, warmup, method, device)
        best = fit if best is None or fit.r2 > best.r2 else best
        if best.r2 >= min_r2:
            break
    return best


def _fit_once(depths, width: int, batch_size: int, repeats: int, warmup: int,
              method: str, device) -> LineFit:
    keep_freed_memory()  # as the ranks whose steps this completes
    events, residual_us = [], []
    generator = torch.Generator().manual_seed(0)
    for depth in depths:
        torch.manual_seed(depth)
        model = nn.Sequential(*[layer for _ in range(depth)
                                for layer in (nn.Linear(width, width), nn.ReLU())]).to(device)
        inputs = torch.randn(batch_size, width, generator=generator).to(device)
        target = torch.randn(batch_size, width, generator=generator).to(device)
        loss_fn = nn.MSELoss()
        rows = profile_ops(model, (inputs,), target, loss_fn, ["fp32"], repeats=repeats,
                           warmup=warmup, method=method, progress=False, device=device)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

        def step():
            optimizer.zero_grad()
            loss_fn(model(inputs), target).backward()
            optimizer.step()

        step_us = median_time_us(step, repeats=repeats, warmup=warmup, device=device)
        events.append(len(rows))
        residual_us.append(step_us - rows_step_us(rows))
    return fit_line(events, residual_us)


def rows_step_us(rows: pd.DataFrame) -> float:
    """What the ops of profile ``rows`` take in a step: their times back to back, or their
    host times (``host_us``, a GPU's) where issuing them takes longer. The simulator's
    eager stream (:mod:`qsync_lab.simulate.schedule`) gives this where one of the two
    paces the whole step, as in the calibration MLPs.

    Example::

        >>> rows_step_us(pd.DataFrame({"time_us": [5.0, 5.0], "host_us": [20.0, 20.0]}))
        40.0
        >>> rows_step_us(pd.DataFrame({"time_us": [5.0, 5.0], "host_us": [float("nan")] * 2}))
        10.0
    """
    host_us = rows["host_us"].sum() if "host_us" in rows else 0.0  # older frames: none
    return float(max(rows["time_us"].sum(), host_us))


def step_overhead_metadata(fit: LineFit) -> dict[str, str]:
    """The profile metadata lines of ``fit``.

    Example::

        >>> step_overhead_metadata(LineFit(-2.5, 240.0, 0.99, 4))["step_overhead_us"]
        '240.000; r2=0.9900; samples=4'
    """
    tail = f"; r2={fit.r2:.4f}; samples={fit.samples}"
    return {STEP_OVERHEAD_KEY: f"{fit.intercept:.3f}{tail}",
            EVENT_OVERHEAD_KEY: f"{fit.slope:.3f}{tail}"}


def time_training_step(model: nn.Module, example_inputs, target: torch.Tensor,
                       loss_fn: nn.Module, optimizer: str, *, repeats: int = 10,
                       warmup: int = 3, device: "torch.device | str" = "cpu") -> float:
    """Median µs of one training step as a run takes it, on a copy of ``model`` on
    ``device``:
    ``zero_grad``, forward (``model(**inputs)`` for a dict batch), loss, backward, the
    non-finite gradient check and ``optimizer``'s step (a small learning rate: the timed
    steps see nearly the same weights).

    Example::

        >>> step_us = time_training_step(nn.Linear(8, 2), (torch.randn(4, 8),),
        ...                              torch.tensor([0, 1, 0, 1]), nn.CrossEntropyLoss(),
        ...                              "sgd_momentum", repeats=3, warmup=1)
        >>> step_us > 0
        True
    """
    root, inputs, target = loss_root_on(model, loss_fn, example_inputs, target, device)
    return _median_step_us(root, inputs, target, optimizer, repeats, warmup, device)


def time_ddp_training_steps(model: nn.Module, example_inputs, target: torch.Tensor,
                            loss_fn: nn.Module, optimizer: str, precisions: Sequence[str], *,
                            store: str, rank: int, world_size: int, repeats: int = 10,
                            warmup: int = 3, device: "torch.device | str" = "cpu"
                            ) -> dict[str, float]:
    """:func:`time_training_step` under DDP, on a copy of ``model`` with a uniform plan of
    each of ``precisions`` (:func:`uniform_op_precisions`) on ``device``: precision name ->
    median µs. This process is ``rank`` of ``world_size`` that meet in a group (gloo; NCCL
    on a GPU, as the ranks run) through the file ``store`` (a path none has used) and call
    this at once; the group is left after. TF32 is on in a tf32 plan's steps only, as on
    its ranks."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from qsync_lab.graph import trace_graph
    from qsync_lab.quant import apply_plan_
    from qsync_lab.quant.native import tf32_math

    device = torch.device(device)
    cuda = device.type == "cuda"
    if cuda and device.index is None:  # DDP's device_ids and NCCL name one GPU
        device = torch.device("cuda", torch.cuda.current_device())
    ops = trace_graph(model, example_inputs, target=target, loss_fn=loss_fn).ops
    dist.init_process_group("nccl" if cuda else "gloo", init_method=Path(store).resolve().as_uri(),
                            rank=rank, world_size=world_size)
    try:
        steps = {}
        for precision in precisions:
            copied = copy.deepcopy(model)
            apply_plan_(copied, uniform_op_precisions(ops, precision))
            root, inputs, target_on = loss_root_on(copied, loss_fn, example_inputs, target, device)
            ddp = DistributedDataParallel(root, device_ids=[device] if cuda else None)
            with tf32_math(Precision.parse(precision) is Precision.TF32):
                steps[str(precision)] = _median_step_us(ddp, inputs, target_on, optimizer,
                                                        repeats, warmup, device)
            del copied, root, ddp
        return steps
    finally:
        dist.destroy_process_group()


def uniform_op_precisions(ops: pd.DataFrame, precision: "Precision | str") -> dict[str, str]:
    """Every op of a traced graph's ``ops`` table that a plan may set to ``precision``:
    op FQN -> precision name (empty for fp32).

    Example::

        >>> from qsync_lab.graph import trace_graph
        >>> graph = trace_graph(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)),
        ...                     (torch.randn(4, 8),))
        >>> uniform_op_precisions(graph.ops, "int8")
        {'0': 'int8'}
    """
    from qsync_lab.policy import PLANNABLE_KINDS, kind_allows

    precision = Precision.parse(precision)
    if precision is Precision.FP32:
        return {}
    return {name: str(precision) for name, kind, refusal in
            zip(ops.index, ops["kind"], ops["plan_refusal"])
            if kind in PLANNABLE_KINDS and not refusal and kind_allows(kind, precision)}


def _median_step_us(root: nn.Module, inputs: tuple, target: torch.Tensor, optimizer: str,
                    repeats: int, warmup: int, device="cpu") -> float:
    """Median µs of ``root``'s training step (``root(*inputs, target)`` is the loss)."""
    from qsync_lab.optimizers import gradient_sums_finite, make_optimizer

    opt = make_optimizer(optimizer, root.parameters(), lr=1e-6)

    def step():
        opt.zero_grad()
        root(*inputs, target).backward()
        if gradient_sums_finite([p.grad for p in root.parameters() if p.grad is not None]):
            opt.step()

    keep_freed_memory()  # as the ranks whose steps this predicts
    return median_time_us(step, repeats=repeats, warmup=warmup, device=device)


def model_step_overhead_metadata(step_us: float, fp32_rows_us: float,
                                 optimizer_us: float) -> dict[str, str]:
    """The step-overhead metadata of a model's own profile: its measured training step
    minus its fp32 op rows and the optimizer step the cost model adds; no separate cost
    per op event (the step's remainder holds it).

    Example::

        >>> model_step_overhead_metadata(1200.0, 900.0, 50.0)["step_overhead_us"]
        '250.000; training step 1200.0 us - fp32 op rows 900.0 us - optimizer 50.0 us'
    """
    residual = step_us - fp32_rows_us - optimizer_us
    return {STEP_OVERHEAD_KEY: f"{residual:.3f}; training step {step_us:.1f} us - fp32 op "
                               f"rows {fp32_rows_us:.1f} us - optimizer {optimizer_us:.1f} us",
            EVENT_OVERHEAD_KEY: "0.000; held in step_overhead_us (measured on this model)"}


def measured_step_overhead_metadata(frames, model: nn.Module, optimizer: str,
                                    device: str = "cpu") -> dict[str, str]:
    """:func:`model_step_overhead_metadata` of profile ``frames`` (one per batch size, each
    with ``attrs["training_step_us"]``), the mean over them: each measured training step
    minus its fp32 op rows and the optimizer step as the cost model costs it on catalog
    kind ``device``."""
    from qsync_lab.costs import CostModel
    from qsync_lab.devices import load_catalog
    from qsync_lab.resources import data_file

    param_bytes = 4.0 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    optimizer_us = CostModel.from_profiles(data_file("profiles", "cpu.csv")).optimizer_time_us(
        param_bytes, optimizer, load_catalog().device(device)).us
    steps_us = [frame.attrs["training_step_us"] for frame in frames]
    rows_us = [rows_step_us(frame[frame["precision"] == "fp32"]) for frame in frames]
    return model_step_overhead_metadata(statistics.fmean(steps_us), statistics.fmean(rows_us),
                                        optimizer_us)


def ddp_calibrated_metadata(frames, graph, optimizer: str) -> dict[str, str]:
    """The step overheads of a model's own profile ``frames`` (one per batch size, each with
    ``attrs["ddp_step_us"]``, precision name -> measured DDP step under a uniform plan, and
    ``attrs["ddp_processes"]``), means over them. Each frame's steps are simulated on as
    many local ranks of its rows' device, costed with its rows and the shipped profile's
    fits: ``step_overhead_us`` is the fp32 step minus its simulation without one;
    ``op_overhead_us.<p>`` the uniform-p step minus its simulation (with that step
    overhead), per forward event the simulation computes in p from a measured row."""
    calibrated = [_calibrate(frame, graph, optimizer) for frame in frames]
    step_us = statistics.fmean(c[STEP_OVERHEAD_KEY] for c in calibrated)
    first = frames[0].attrs
    fp32_us = first["ddp_step_us"]["fp32"]
    metadata = {STEP_OVERHEAD_KEY: f"{step_us:.3f}; fp32 DDP step {fp32_us:.1f} us on "
                                   f"{first['ddp_processes']} processes - its simulation",
                EVENT_OVERHEAD_KEY: "0.000; held in step_overhead_us (measured on this model)"}
    for key in calibrated[0]:
        if key.startswith(OP_OVERHEAD_PREFIX):
            name = key.removeprefix(OP_OVERHEAD_PREFIX)
            metadata[key] = (f"{statistics.fmean(c[key] for c in calibrated):.3f}; uniform "
                             f"{name} DDP step {first['ddp_step_us'][name]:.1f} us - its "
                             "simulation, per op in it")
    return metadata


def _calibrate(frame: pd.DataFrame, graph, optimizer: str) -> dict[str, float]:
    """:func:`ddp_calibrated_metadata` of one frame: metadata key -> µs."""
    from qsync_lab.cluster import cluster_from_definition
    from qsync_lab.plan import Plan

    steps_us = frame.attrs["ddp_step_us"]
    device = str(frame["device"].iloc[0])
    cluster = cluster_from_definition({
        "name": "profiling-processes", "batch_size": int(frame["batch_size"].iloc[0]),
        "node": [{"name": "localhost",
                  "intra_node_link": "loopback" if device == "cpu" else "nvlink4",
                  "devices": [{"kind": device, "count": int(frame.attrs["ddp_processes"])}]}]})
    fp32 = _simulate(frame, graph, Plan.build(graph, cluster, {}), optimizer, 0.0)
    calibrated = {STEP_OVERHEAD_KEY: steps_us["fp32"] - fp32.iteration_us}
    for name, step_us in steps_us.items():
        if name == "fp32":
            continue
        try:
            plan = Plan.build(graph, cluster, {device: uniform_op_precisions(graph.ops, name)})
        except QSyncError:  # a precision this device kind's plans may not take
            continue
        sim = _simulate(frame, graph, plan, optimizer, calibrated[STEP_OVERHEAD_KEY])
        compute = sim.compute[0]
        events = sum(category == "op" and phase == "forward" and precision == name
                     and source.startswith("profile:") for category, phase, precision, source
                     in zip(compute.category, compute.phase, compute.precision, compute.source))
        if events:
            calibrated[f"{OP_OVERHEAD_PREFIX}{name}"] = (step_us - sim.iteration_us) / events
    return calibrated


def _simulate(frame: pd.DataFrame, graph, plan, optimizer: str, step_overhead_us: float):
    """The simulated step of ``plan`` costed with ``frame``'s rows (on their device), the
    shipped profile's fits and ``step_overhead_us``."""
    from qsync_lab.costs import load_cost_model, write_profile
    from qsync_lab.resources import data_file
    from qsync_lab.simulate import simulate

    with tempfile.TemporaryDirectory(prefix="qsync_calibrate_") as folder:
        rows = Path(folder) / "rows.csv"
        write_profile(rows, frame, {"device": str(frame["device"].iloc[0]),
                                    STEP_OVERHEAD_KEY: str(step_overhead_us),
                                    EVENT_OVERHEAD_KEY: "0"})
        costs = load_cost_model(rows, data_file("profiles", "cpu.csv"))
    return simulate(graph, plan, plan.cluster, costs, optimizer=optimizer)
