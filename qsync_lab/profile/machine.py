"""Profile this machine end to end into one profile CSV, with a progress bar per stage.

:func:`profile_machine` runs the stages ``qsync-lab profile`` and :meth:`qsync_lab.Study.profile`
need, in order, and writes what it measured (:func:`~qsync_lab.costs.write_device_profile`):

1. ``ops``: every op of each model in each precision and phase
   (:func:`~qsync_lab.profile.profile_ops`, in ``processes`` processes at once as that
   many local ranks will run);
2. ``casts`` (optional): the runtime's precision conversions and DDP's in-place copies;
3. ``step overhead``: the framework's cost of a training step: for one model with a
   ``step_optimizer``, that model's own (its whole training step timed beside the op rows,
   :func:`~qsync_lab.profile.overhead.measured_step_overhead_metadata`; on a GPU its
   steps under a uniform plan of each precision, on one DDP rank over NCCL, calibrate the
   step and per-precision op overheads,
   :func:`~qsync_lab.profile.overhead.ddp_calibrated_metadata`), else fitted on
   calibration MLPs;
4. ``links`` (optional): gloo allreduces fitted α–β, refitted to what real DDP steps add
   (``"ddp"``), and DDP's buffer broadcast;
5. ``compression`` (optional): the gradient compressors' encode and decode per spec
   (:func:`~qsync_lab.profile.compression.profile_compression`) and, with the DDP link,
   what each spec's hook adds to real DDP steps of calibration MLPs beyond that
   (:func:`~qsync_lab.profile.ddp_link.fit_compressed_steps`).

With ``device="cuda"`` the ops, casts, step overhead and compressors' encode and decode
are measured on the GPU torch sees (CUDA events, :mod:`qsync_lab.timers`; the native
low-precision path, the hook's CUDA kernels) and the rows and the ``device`` metadata line
name its catalog kind (``H100-SXM5-80GB``), else the name it reports, so ``qsync-lab run
--profile`` on CUDA ranks of that kind costs them with it. Links are not measured there
(they are measured through gloo, the link on several ranks), nor the compressors inside
real DDP steps, which run on those links; the written profile says so (``skipped``
metadata line): keep them from a CPU profile.

Example::

    >>> import tempfile, pathlib, torch, torch.nn as nn
    >>> out = pathlib.Path(tempfile.mkdtemp()) / "cpu.csv"
    >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    >>> job = ProfileJob("mlp", model, (torch.randn(4, 8),), torch.randn(4, 8), nn.MSELoss())
    >>> written = profile_machine([job], out, precisions=["fp32"], repeats=2, casts=False,
    ...                           links=None, progress=False)
    >>> written.ops_rows > 0, out.exists()
    (True, True)

On a GPU: ``profile_machine([job], "gpu.csv", precisions=["fp32", "bf16", "int8"],
device="cuda")``.
"""

import functools
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from torch import nn
from tqdm.auto import tqdm

from qsync_lab.cluster import load_cluster
from qsync_lab.costs.profile_links import link_metadata, load_cost_model, write_device_profile
from qsync_lab.devices import load_catalog
from qsync_lab.errors import QSyncError
from qsync_lab.limits import RANKS_PER_CORE
from qsync_lab.precision import Precision
from qsync_lab.profile.allreduce import default_sizes, fit_alpha_beta, profile_allreduce
from qsync_lab.profile.casts import (default_cast_sizes, default_copy_sizes, fit_casts,
                                     profile_casts)
from qsync_lab.profile.compression import default_compression_sizes, profile_compression
from qsync_lab.profile.concurrent import profile_ops_concurrently
from qsync_lab.profile.ddp_link import (copy_pass_us, fit_buffer_broadcast,
                                       fit_compressed_steps, fit_ddp_link,
                                       measure_buffer_broadcast, measure_compressed_steps,
                                       measure_ddp_overhead)
from qsync_lab.profile.device import profile_device, profile_device_name
from qsync_lab.profile.ops import profile_ops
from qsync_lab.profile.overhead import (ddp_calibrated_metadata, fit_step_overhead,
                                        measured_step_overhead_metadata, step_overhead_metadata,
                                        time_ddp_training_steps, time_training_step)
from qsync_lab.profile.timing import intra_op_threads, run_metadata

__all__ = ["LINK_METHODS", "SINGLE_GPU_NOTE", "ProfileJob", "ProfileWritten", "profile_machine"]

#: how the allreduce link is fitted: real DDP steps ("ddp"), the microbenchmark, or not
LINK_METHODS = ("ddp", "allreduce", None)
#: why a profile on a GPU has no link fits (nor the compressors' in-step fits)
SINGLE_GPU_NOTE = ("links not profiled on a GPU: they are measured through gloo (the link on "
                   "several ranks), as are the compressors inside real DDP steps; take them "
                   "from a CPU profile")


@dataclass(frozen=True)
class ProfileJob:
    """One model to profile: its name (the op rows' model), the module, an example batch
    and the loss."""

    name: str
    model: nn.Module
    inputs: tuple
    target: object
    loss_fn: nn.Module


@dataclass(frozen=True)
class ProfileWritten:
    """What :func:`profile_machine` wrote: the file, its row counts and the link fit."""

    path: Path
    ops_rows: int
    cast_rows: int
    link: str

    def __str__(self) -> str:
        return (f"wrote {self.path}: {self.ops_rows} op rows, {self.cast_rows} cast rows"
                + (f"; {self.link}" if self.link else ""))


def profile_machine(jobs: Sequence[ProfileJob], out: "str | os.PathLike[str]", *,
                    precisions: Sequence["Precision | str"], threads: int = 1,
                    repeats: int = 10, processes: int = 1, method: str = "in_step",
                    casts: bool = True, links: str | None = "ddp",
                    compression: Sequence[str] = (), step_optimizer: str | None = None,
                    progress: bool = True, device: str = "cpu") -> ProfileWritten:
    """Run the stages of the module docstring on ``device`` (``cpu`` or ``cuda``) and write
    the profile to ``out``.

    Raises:
        QSyncError: a non-positive count, an unknown link method or device, or a GPU that
            is no catalog kind with ``step_optimizer`` (its optimizer step cannot be
            costed), before measuring.
    """
    if min(threads, repeats, processes) < 1:
        raise QSyncError("threads, repeats and processes must be positive integers")
    cores = os.cpu_count() or 1
    if processes * threads > cores * RANKS_PER_CORE:  # as qsync-lab run allows its ranks
        raise QSyncError(f"{processes} processes x {threads} threads on this machine's {cores} "
                         f"cores (at most {cores * RANKS_PER_CORE}) would time contention, not "
                         "ops; profile with fewer processes or threads")
    if links not in LINK_METHODS:
        raise QSyncError(f"unknown link method {links!r}; choose one of: "
                         f"{', '.join(map(str, LINK_METHODS))}")
    device = profile_device(device)
    device_name = profile_device_name(device)
    skipped = device.type == "cuda" and bool(links)
    if skipped:
        links = None
    names = [str(Precision.parse(p)) for p in precisions]
    stages = ([f"ops: {job.name}" for job in jobs] + (["casts"] if casts else [])
              + ["step overhead"] + ([f"links ({links})"] if links else [])
              + (["compression"] if compression else []))
    bar = tqdm(stages, desc="profile", unit="stage", disable=not progress)
    own_step = step_optimizer if len(jobs) == 1 else None  # several models: one shared fit
    if own_step:
        load_catalog().device(device_name)  # the optimizer step is costed on its kind
    measure = (functools.partial(profile_ops_concurrently, processes=processes, threads=threads,
                                 step_optimizer=own_step, device=device)
               if processes > 1 else functools.partial(profile_ops, progress=False,
                                                       device=device))
    frames, metadata = [], {**run_metadata(device_name, threads=threads),
                            "profile_method": method}
    if skipped:
        metadata["skipped"] = SINGLE_GPU_NOTE
    if processes > 1:
        metadata["concurrent_processes"] = str(processes)
    with intra_op_threads(threads):
        for job in jobs:
            bar.set_postfix_str(f"ops of {job.name}")
            rows = measure(job.model, job.inputs, job.target, job.loss_fn, names,
                           repeats=repeats, method=method)
            if own_step and device.type == "cuda":
                rows.attrs.update(ddp_step_us=_uniform_steps_us(job, own_step, names, repeats,
                                                                device), ddp_processes=1)
            elif own_step and processes == 1:
                rows.attrs["training_step_us"] = time_training_step(
                    job.model, job.inputs, job.target, job.loss_fn, own_step, repeats=repeats,
                    device=device)
            # several models share op names (conv1, fc): match their rows by kind and shape
            frames.append(rows.assign(op="") if len(jobs) > 1 else rows)
            bar.update()
        cast_rows = pd.DataFrame()
        if casts:
            bar.set_postfix_str("casts")
            cast_rows = _casts(names, repeats, device)
            metadata.update({f"cast_r2.{pair}": f"{fit.r2:.4f}"
                             for pair, fit in fit_casts(cast_rows).items()})
            bar.update()
        bar.set_postfix_str("step overhead")
        if own_step and device.type == "cuda":
            from qsync_lab.graph import trace_graph

            job = jobs[0]
            graph = trace_graph(job.model, job.inputs, target=job.target, loss_fn=job.loss_fn)
            metadata.update(ddp_calibrated_metadata(frames, graph, own_step))
        elif own_step:
            metadata.update(measured_step_overhead_metadata(frames, jobs[0].model, own_step,
                                                            device_name))
        else:
            metadata.update(step_overhead_metadata(fit_step_overhead(
                repeats=repeats, method=method, device=device)))
        bar.update()
    link_text = SINGLE_GPU_NOTE if skipped else ""
    if links:
        bar.set_postfix_str(f"links ({links})")
        link_meta, link_text = _links(links, cast_rows, threads, repeats, Path(out).name)
        metadata.update(link_meta)
        bar.update()
    compress_rows = pd.DataFrame()
    if compression:
        bar.set_postfix_str("compression")
        with intra_op_threads(threads):
            compress_rows = profile_compression(compression, default_compression_sizes(),
                                                device=device, repeats=repeats)
        if links == "ddp":  # the hook inside real DDP steps, against the estimate so far
            write_device_profile(out, [*frames, cast_rows, compress_rows], metadata)
            in_step = fit_compressed_steps(measure_compressed_steps(compression, threads=threads),
                                           load_cost_model(out), load_cluster("local-cpu"))
            compress_rows = pd.concat([compress_rows, in_step])
        bar.update()
    bar.close()
    write_device_profile(out, [*frames, cast_rows, compress_rows], metadata)
    return ProfileWritten(Path(out), sum(len(f) for f in frames), len(cast_rows), link_text)


def _uniform_steps_us(job: ProfileJob, optimizer: str, precisions: list[str], repeats: int,
                      device) -> dict[str, float]:
    """``job``'s training step under a uniform plan of each of ``precisions`` on ``device``,
    under DDP on one rank (NCCL on a GPU): precision name -> median µs."""
    with tempfile.TemporaryDirectory(prefix="qsync_steps_") as folder:
        return time_ddp_training_steps(job.model, job.inputs, job.target, job.loss_fn,
                                       optimizer, precisions, store=str(Path(folder) / "store"),
                                       rank=0, world_size=1, repeats=repeats, device=device)


def _casts(precisions: list[str], repeats: int, device) -> pd.DataFrame:
    pairs = ([("fp32", p) for p in precisions if p != "fp32"]
             + [(p, "fp32") for p in precisions if p not in ("fp32", "int8")])
    return pd.concat([profile_casts(pairs, default_cast_sizes(), repeats=repeats, device=device),
                      profile_casts([("fp32", "fp32")], default_copy_sizes(),  # DDP's copies
                                    repeats=repeats, device=device)])


def _links(method: str, cast_rows: pd.DataFrame, threads: int, repeats: int,
           profile_name: str) -> tuple[dict[str, str], str]:
    """The link metadata lines and a one-line description of the fit."""
    allreduce = profile_allreduce(default_sizes(), repeats=repeats)
    fit = fit_alpha_beta(allreduce["bytes"], allreduce["time_us"], world_size=2,
                         link="loopback")
    if method == "ddp":
        if cast_rows.empty:
            raise QSyncError("fitting the link to DDP steps needs the casts stage (copy costs)")
        fit = fit_ddp_link(measure_ddp_overhead(threads=threads),
                           copy_pass_us(fit_casts(cast_rows)), link="loopback",
                           source=f"profile:{profile_name} ddp-calibration")
    metadata = link_metadata(fit.link, r2=fit.line.r2, world_size=2, backend="gloo")
    if method == "ddp":  # DDP's broadcast of BatchNorm buffers before every forward
        broadcast = fit_buffer_broadcast(measure_buffer_broadcast(threads=threads), fit.link)
        metadata.update(link_metadata(broadcast, r2=float("nan"), world_size=2,
                                      backend="gloo"))
    text = (f"allreduce alpha {fit.link.latency_s * 1e6:.1f} us, beta "
            f"{fit.link.bandwidth_Bps / 1e9:.2f} GB/s (R2 {fit.line.r2:.3f})")
    return metadata, text
