"""``Study``: one model on one cluster, from trace to run, each expensive step done once.

A study traces the model (with its loss) into an :class:`~qsync_lab.graph.OpGraph`, scores
its ops with the sensitivity indicator, allocates plans, simulates them and runs them on
local DDP ranks, caching the graph, the prepared graph, the cost model, the indicator and
the qsync :class:`~qsync_lab.allocate.Allocator` so that a notebook can re-plan and
re-simulate cheaply (``benchmarks/replan.py`` times a slider's re-plans). The same study
on another cluster (:meth:`Study.on_cluster`) shares all of that but the allocator, and the
study keeps it. The command line and the widgets go through it; nothing here decides
anything the functions it wires do not. Its methods are thin: the arguments are checked in
:mod:`qsync_lab.study_inputs`, what it keeps between calls in :mod:`qsync_lab.study_memo`
and what runs the model on this machine in :mod:`qsync_lab.study_run`.

Example::

    >>> import qsync_lab
    >>> study = qsync_lab.Study("resnet18", cluster="local-hybrid", progress=False)
    >>> plan = study.plan()
    >>> plan.low_precision_ops()
    {'V100-SXM2-32GB': 0, 'T4': 14}
    >>> study.simulate(plan)  # doctest: +ELLIPSIS
    SimResult(2 ranks: 1 x V100-SXM2-32GB, 1 x T4; iteration ... ms, ...)
"""

import functools
import os
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd
from torch import nn

from qsync_lab.cluster import Cluster
from qsync_lab.costs import CostModel, load_cost_model
from qsync_lab.optimizers import DEFAULT_OPTIMIZER
from qsync_lab.plan import Plan
from qsync_lab.precision import Precision
from qsync_lab.study_inputs import (allocation_strategy, as_cluster, calibration_count,
                                    cluster_low_precisions, constraints_from, precision_set,
                                    study_model)
from qsync_lab.study_memo import cluster_variant, current_allocator, kept_allocator
from qsync_lab.study_run import (predict_local_run, profile_batch, profile_model,
                                 profiles_with, score_model, train_plan)

__all__ = ["Study"]


class Study:
    """A model, its example batch and a cluster, with the pipeline's results cached.

    Args:
        model: a zoo model name (:func:`qsync_lab.models.list_models`) or an ``nn.Module``.
        example_batch: ``(inputs, target)``, ``inputs`` a tensor or tuple of tensors
            (default for a zoo model: its example batch of ``batch_size``; required for a
            module).
        cluster: a shipped cluster name, a TOML path or a :class:`~qsync_lab.cluster.Cluster`.
        loss_fn: the training loss (default: the zoo model's, else cross-entropy).
        model_kwargs: a zoo model's keyword arguments.
        batch_size: the example batch size of a zoo model (the graph scales to each rank's).
        profiles: measured profile CSVs for the cost model (default: the catalog roofline).
        calibration_batches: batches the indicator averages over (zoo models: seeded
            example batches; a module: the example batch).
        optimizer: what runs train with (the memory model counts its state).
        progress: show progress bars.
    """

    def __init__(self, model: "str | nn.Module", example_batch: tuple | None = None, *,
                 cluster: "str | os.PathLike[str] | Cluster" = "local-hybrid",
                 loss_fn: nn.Module | None = None,
                 model_kwargs: Mapping[str, Any] | None = None, batch_size: int = 2,
                 profiles: Sequence["str | os.PathLike[str]"] = (),
                 calibration_batches: int = 2, optimizer: str = DEFAULT_OPTIMIZER,
                 progress: bool = True) -> None:
        self.model_kwargs = dict(model_kwargs or {})
        self.name, self.zoo_name, self.model, self.loss_fn, self._batch = study_model(
            model, example_batch, loss_fn=loss_fn, model_kwargs=self.model_kwargs,
            batch_size=batch_size)
        self.example = example_batch if example_batch is not None else self._batch(seed=0)
        self.cluster = as_cluster(cluster)
        self.profiles = tuple(str(p) for p in profiles)
        self.costs = load_cost_model(*profiles) if profiles else CostModel()
        self.calibration_batches = calibration_count(calibration_batches, self.zoo_name)
        self.optimizer, self.progress = optimizer, progress
        self.run_threads: int | None = None  # per rank: what the profile measured with
        self._indicators: dict[tuple, pd.DataFrame] = {}
        self._kept_allocator = None
        self._variants: dict[tuple, Study] = {}  # this study on other clusters

    def __repr__(self) -> str:
        return (f"Study({self.name!r} on {self.cluster.name!r}: {self.cluster.world_size} "
                f"ranks, {', '.join(self.cluster.device_kinds)})")

    @functools.cached_property
    def graph(self):
        """The model's :class:`~qsync_lab.graph.OpGraph`, traced with its loss."""
        from qsync_lab.graph import trace_graph

        inputs, target = self.example
        return trace_graph(self.model, inputs, target=target, loss_fn=self.loss_fn)

    @functools.cached_property
    def prepared(self):
        """The graph prepared for simulating many plans
        (:func:`~qsync_lab.simulate.prepare_graph`)."""
        from qsync_lab.simulate import prepare_graph

        return prepare_graph(self.graph)

    @property
    def low_precisions(self) -> tuple[Precision, ...]:
        """Every precision other than fp32 that some device kind of the cluster runs."""
        return cluster_low_precisions(self.cluster)

    def indicator(self, precisions: Sequence["Precision | str"] | None = None) -> pd.DataFrame:
        """The sensitivity indicator per op and precision (default: the cluster's low
        precisions), computed once per set of precisions and kept on disk for the same
        model, batches and software (:mod:`qsync_lab.indicator.cache`)."""
        wanted = precision_set(precisions or self.low_precisions)
        if wanted not in self._indicators:
            batches = [self._batch(seed=s) for s in range(self.calibration_batches)]
            self._indicators[wanted] = score_model(self.model, self.graph, batches, self.loss_fn,
                                                   wanted, progress=self.progress)
        return self._indicators[wanted]

    def plan(self, *, memory_limit: "Mapping[str, float] | float | None" = None,
             throughput_target: float | None = None, strategy: str = "qsync",
             compression=None) -> Plan:
        """A plan from ``strategy`` (``qsync``, ``uniform-low``, ``dynamic-batching``,
        ``joint``, ``fp32``) under the constraints.

        Args:
            memory_limit: per-rank memory budget in GiB, per device kind or one for every
                kind (default: each device's memory).
            throughput_target: the least samples/s (default: the fastest kind at fp32 sets
                the pace).
            compression: gradient compression for the run: a spec (``"global_qsgd:8"``) or
                a mapping parameter pattern -> spec (:mod:`qsync_lab.compress`); the
                allocation costs its communication.
        """
        allocate = allocation_strategy(strategy)
        constraints = constraints_from(memory_limit, throughput_target, self.cluster.device_kinds)
        if strategy == "qsync":
            plan = self._allocator(compression).allocate(constraints).plan
        else:
            plan = allocate(self.prepared, self.cluster, self.costs, self.indicator(),
                            constraints, optimizer=self.optimizer, compression=compression)
        return plan.for_model(self.zoo_name, self.model_kwargs) if self.zoo_name else plan

    def simulate(self, plan: "Plan | Mapping[str, Mapping[str, str]] | None" = None, *,
                 optimizer: str | None = None, compression=None):
        """The simulated iteration of ``plan`` on the study's cluster
        (:func:`~qsync_lab.simulate.simulate`).

        Args:
            plan: a :class:`~qsync_lab.plan.Plan` (one just allocated is simulated from the
                allocator's memo), device kind -> {op FQN -> precision} (the ops left out
                run fp32), or None: all fp32.
            optimizer: overrides a plan's (default: a Plan's own, else the study's).
            compression: a gradient compression spec overriding a plan's (default: a
                Plan's own, else none).

        Example::

            >>> study = Study("digits_mlp", cluster="local-hybrid", progress=False)
            >>> study.simulate({"T4": {"fc1": "fp16"}}, optimizer="adam").world_size
            2
        """
        from qsync_lab.simulate import simulate

        kept = kept_allocator(self._kept_allocator, self.prepared, self.cluster, self.costs)
        if isinstance(plan, Plan):
            if kept is not None and optimizer is None and compression is None:
                return kept.simulate(plan)
        else:
            plan, optimizer = plan or {}, optimizer or self.optimizer
        return simulate(self.prepared, plan, self.cluster, self.costs, optimizer=optimizer,
                        compression=compression)

    def on_cluster(self, cluster: "str | os.PathLike[str] | Cluster") -> "Study":
        """This study on ``cluster`` (a name, a TOML path or a
        :class:`~qsync_lab.cluster.Cluster`): itself for its own cluster, else a study
        sharing its model, traced graph, costs and indicators, made once per cluster
        (definition and ranks) and kept, so that re-plans on it reuse its allocator. A
        study made before :meth:`profile` keeps the costs it was made with.

        Example::

            >>> study = Study("digits_mlp", cluster="local-hybrid", progress=False)
            >>> small = study.on_cluster("v100-t4-small")
            >>> small.cluster.world_size, small.graph is study.graph
            (4, True)
            >>> study.on_cluster("v100-t4-small") is small, small.on_cluster(study.cluster)
            (True, Study('digits_mlp' on 'local-hybrid': 2 ranks, V100-SXM2-32GB, T4))
        """
        cluster = as_cluster(cluster)
        return self if cluster is self.cluster else cluster_variant(self._variants, self, cluster)

    def compare(self, *, memory_limit: "Mapping[str, float] | float | None" = None,
                throughput_target: float | None = None,
                compressions: Sequence = ()) -> pd.DataFrame:
        """Every strategy side by side, and the qsync plan with each of ``compressions``
        (:func:`~qsync_lab.allocate.compare_strategies`)."""
        from qsync_lab.allocate import compare_strategies

        return compare_strategies(
            self.prepared, self.cluster, self.costs, self.indicator(),
            constraints_from(memory_limit, throughput_target, self.cluster.device_kinds),
            optimizer=self.optimizer, compressions=compressions)

    def profile(self, out: "str | os.PathLike[str]", *, repeats: int = 5, threads: int = 1,
                precisions: Sequence["Precision | str"] | None = None,
                compression: Sequence[str] = (), device: str = "cpu"):
        """Measure this machine's op costs for the model (a zoo model at its ranks' batch
        size), as many processes at once as the cluster has local ranks (``threads`` each;
        :meth:`run` then uses as many), the model's own step overhead (its training step
        with the study's optimizer, timed beside them) and the encode and decode of each
        ``compression`` spec, into ``out``; the study's costs then read it before the
        shipped CPU profile (casts, links and the default compressors). Returns what was
        written.

        ``device="cuda"`` measures the ops, the step and the compressors on this machine's
        GPU instead, in one process (a rank has a GPU of its own), with CUDA events; the
        rows are named after the GPU's catalog kind
        (:func:`~qsync_lab.profile.profile_machine`), e.g.
        ``study.profile("h100.csv", device="cuda")``."""
        written = profile_model(
            self.name, self.model, self._profile_batch(), self.loss_fn, out,
            precisions=precisions or self.low_precisions, ranks=self.cluster.world_size,
            threads=threads, repeats=repeats, compression=compression,
            optimizer=self.optimizer, progress=self.progress, device=device)
        self.profiles = profiles_with(out)
        self.costs = load_cost_model(*self.profiles)
        self.run_threads = threads
        self._variants = {}  # made again, with these costs
        return written

    def _profile_batch(self):
        """The batch :meth:`profile` times the ops at
        (:func:`~qsync_lab.study_run.profile_batch`)."""
        return profile_batch(self.zoo_name, self.model_kwargs, self.cluster, self.example)

    def predict_run(self, plan: Plan):
        """What a local run of ``plan`` is predicted to measure: emulated device kinds
        costed as this machine (:func:`~qsync_lab.runtime.prediction.predict_plan`), with
        the costs the run's own summary uses (the study's profiles, else the shipped CPU
        profile)."""
        return predict_local_run(plan, self.graph, self.costs, self.profiles)

    def run(self, plan: Plan, *, steps: int = 100, run_dir: "str | os.PathLike[str]" = "qsync_run",
            verbose: bool = False, **options) -> dict[str, Any] | None:
        """Train ``plan`` on the local ranks of its cluster (torchrun, gloo on the CPU) and
        return the summary: measured against predicted step time and memory (None when
        ``resume=True`` finds the run already complete: nothing was trained).

        ``options`` are :class:`~qsync_lab.runtime.options.TrainConfig` fields (``lr``,
        ``optimizer``, ``data``, ...); the prediction uses the study's profiles. The plan is
        saved as ``run_dir/plan.json`` first (with ``resume=True``, a different plan already
        there is refused instead: the run it belongs to can still resume).
        """
        return train_plan(plan, steps=steps, run_dir=run_dir, profiles=self.profiles,
                          threads=self.run_threads, verbose=verbose, progress=self.progress,
                          **options)

    def _allocator(self, compression):
        """The qsync :class:`~qsync_lab.allocate.Allocator` of the study's current inputs,
        kept while they stay the same: a re-plan under new constraints reuses it."""
        self._kept_allocator = current_allocator(
            self._kept_allocator, self.prepared, self.cluster, self.costs, self.indicator(),
            optimizer=self.optimizer, compression=compression)
        return self._kept_allocator
