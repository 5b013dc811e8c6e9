"""``Study``: one model on one cluster, from trace to run, each expensive step done once.

A study traces the model (with its loss) into an :class:`~qsync_lab.graph.OpGraph`, scores
its ops with the sensitivity indicator, allocates plans, simulates them and runs them on
local DDP ranks, caching the graph, the prepared graph, the cost model, the indicator and
the qsync :class:`~qsync_lab.allocate.Allocator` so that a notebook can re-plan and
re-simulate cheaply (``benchmarks/replan.py`` times a slider's re-plans). The same study
on another cluster (:meth:`Study.on_cluster`) shares all of that but the allocator, and the
study keeps it. The command line and the widgets go through it; nothing here decides
anything the functions it wires do not.

Example::

    >>> import qsync_lab
    >>> study = qsync_lab.Study("resnet18", cluster="local-hybrid", progress=False)
    >>> plan = study.plan()
    >>> plan.low_precision_ops()
    {'V100-SXM2-32GB': 0, 'T4': 14}
    >>> study.simulate(plan)  # doctest: +ELLIPSIS
    SimResult(2 ranks: 1 x V100-SXM2-32GB, 1 x T4; iteration ... ms, ...)
"""

import copy
import functools
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import nn

from qsync_lab.cluster import Cluster, load_cluster
from qsync_lab.costs import CostModel, load_cost_model
from qsync_lab.errors import QSyncError
from qsync_lab.optimizers import DEFAULT_OPTIMIZER
from qsync_lab.plan import Plan
from qsync_lab.precision import Precision

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
        from qsync_lab.models import example_batch as zoo_batch
        from qsync_lab.models import get_model, model_spec

        self.model_kwargs = dict(model_kwargs or {})
        if isinstance(model, str):
            spec = model_spec(model)
            self.name, self.zoo_name = spec.name, spec.name
            torch.manual_seed(0)
            self.model = get_model(spec.name, **self.model_kwargs)
            self.loss_fn = loss_fn or spec.loss_fn()
            self._batch = functools.partial(zoo_batch, spec.name, batch_size,
                                            **self.model_kwargs)
        elif isinstance(model, nn.Module):
            if example_batch is None:
                raise QSyncError("a Study of your own module needs its example_batch: "
                                 "(inputs, target)")
            self.name, self.zoo_name, self.model = type(model).__name__, "", model
            self.loss_fn = loss_fn or nn.CrossEntropyLoss()
            self._batch = lambda seed=0: example_batch
        else:
            raise QSyncError(f"model must be a zoo model name or an nn.Module, got "
                             f"{type(model).__name__}")
        self.example = example_batch if example_batch is not None else self._batch(seed=0)
        self.cluster = cluster if isinstance(cluster, Cluster) else load_cluster(cluster)
        self.profiles = tuple(str(p) for p in profiles)
        self.costs = load_cost_model(*profiles) if profiles else CostModel()
        if calibration_batches < 1:
            raise QSyncError(f"calibration_batches must be at least 1, got {calibration_batches}")
        self.calibration_batches = calibration_batches if self.zoo_name else 1
        self.optimizer = optimizer
        self.progress = progress
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
        kinds = [self.cluster.catalog.device(k) for k in self.cluster.device_kinds]
        return tuple(p for p in Precision
                     if p is not Precision.FP32 and any(d.supports(p) for d in kinds))

    def indicator(self, precisions: Sequence["Precision | str"] | None = None) -> pd.DataFrame:
        """The sensitivity indicator per op and precision (default: the cluster's low
        precisions), computed once per set of precisions and kept on disk for the same
        model, batches and software (:mod:`qsync_lab.indicator.cache`)."""
        from qsync_lab.indicator import indicator
        from qsync_lab.indicator.cache import cached_indicator, indicator_key

        wanted = tuple(sorted({Precision.parse(p) for p in (precisions or self.low_precisions)},
                              key=list(Precision).index))
        if wanted not in self._indicators:
            batches = [self._batch(seed=s) for s in range(self.calibration_batches)]
            key = indicator_key(self.model, self.graph, batches, self.loss_fn, wanted)
            self._indicators[wanted] = cached_indicator(key, lambda: indicator(
                self.model, self.graph, batches, loss_fn=self.loss_fn, precisions=wanted,
                num_batches=len(batches), progress=self.progress))
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
        from qsync_lab.allocate import STRATEGIES

        if strategy not in STRATEGIES:
            raise QSyncError(f"unknown strategy {strategy!r}; choose one of: "
                             f"{', '.join(STRATEGIES)}")
        constraints = self._constraints(memory_limit, throughput_target)
        if strategy == "qsync":
            plan = self._allocator(compression).allocate(constraints).plan
        else:
            plan = STRATEGIES[strategy](self.prepared, self.cluster, self.costs,
                                        self.indicator(), constraints,
                                        optimizer=self.optimizer, compression=compression)
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

        kept = self._kept()
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
        cluster = cluster if isinstance(cluster, Cluster) else load_cluster(cluster)
        if cluster is self.cluster:
            return self
        variants = self._variants
        variants.setdefault(_cluster_key(self.cluster), self)
        key = _cluster_key(cluster)
        if key not in variants:
            self.prepared  # traced and prepared once, for every variant
            variant = copy.copy(self)
            variant.cluster, variant._kept_allocator = cluster, None
            variants[key] = variant
        return variants[key]

    def compare(self, *, memory_limit: "Mapping[str, float] | float | None" = None,
                throughput_target: float | None = None,
                compressions: Sequence = ()) -> pd.DataFrame:
        """Every strategy side by side, and the qsync plan with each of ``compressions``
        (:func:`~qsync_lab.allocate.compare_strategies`)."""
        from qsync_lab.allocate import compare_strategies

        return compare_strategies(self.prepared, self.cluster, self.costs, self.indicator(),
                                  self._constraints(memory_limit, throughput_target),
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

        ``device="cuda"`` measures the ops and the step on this machine's GPU instead, in
        one process (a rank has a GPU of its own), with CUDA events; the rows are named
        after the GPU's catalog kind (:func:`~qsync_lab.profile.profile_machine`), e.g.
        ``study.profile("h100.csv", device="cuda")``."""
        from qsync_lab.compress import CompressionSpec
        from qsync_lab.profile import ProfileJob, profile_machine
        from qsync_lab.resources import data_file

        inputs, target = self._profile_batch()
        inputs = inputs if isinstance(inputs, tuple | list) else (inputs,)
        names = ["fp32", *(str(p) for p in (precisions or self.low_precisions))]
        written = profile_machine([ProfileJob(self.name, self.model, tuple(inputs), target,
                                              self.loss_fn)], out, precisions=names,
                                  threads=threads, repeats=repeats,
                                  processes=(self.cluster.world_size
                                             if torch.device(device).type == "cpu" else 1),
                                  casts=False, links=None,
                                  compression=[str(CompressionSpec.parse(c)) for c in compression],
                                  step_optimizer=self.optimizer, progress=self.progress,
                                  device=device)
        self.profiles = (str(out), str(data_file("profiles", "cpu.csv")))
        self.costs = load_cost_model(*self.profiles)
        self.run_threads = threads
        self._variants = {}  # made again, with these costs
        return written

    def _profile_batch(self):
        """The batch the ops are timed at: a zoo model's at its ranks' batch size when they
        share one (the rows then are the run's own, not scaled from the small example),
        else the example batch."""
        from qsync_lab.models import example_batch as zoo_batch

        sizes = {rank.batch_size for rank in self.cluster.ranks}
        if self.zoo_name and len(sizes) == 1:
            return zoo_batch(self.zoo_name, sizes.pop(), **self.model_kwargs)
        return self.example

    def predict_run(self, plan: Plan):
        """What a local run of ``plan`` is predicted to measure: emulated device kinds
        costed as this machine (:func:`~qsync_lab.runtime.prediction.predict_plan`), with
        the costs the run's own summary uses (the study's profiles, else the shipped CPU
        profile)."""
        from qsync_lab.runtime.prediction import predict_plan, run_profiles

        costs = self.costs if self.profiles else load_cost_model(*run_profiles())
        return predict_plan(plan, self.graph, costs)

    def run(self, plan: Plan, *, steps: int = 100, run_dir: "str | os.PathLike[str]" = "qsync_run",
            verbose: bool = False, **options) -> dict[str, Any] | None:
        """Train ``plan`` on the local ranks of its cluster (torchrun, gloo on the CPU) and
        return the summary: measured against predicted step time and memory (None when
        ``resume=True`` finds the run already complete: nothing was trained).

        ``options`` are :class:`~qsync_lab.runtime.options.TrainConfig` fields (``lr``,
        ``optimizer``, ``data``, ...); the prediction uses the study's profiles. The plan is
        saved as ``run_dir/plan.json`` first.
        """
        from qsync_lab.runtime.launch import launch
        from qsync_lab.runtime.lock import check_run_dir_free
        from qsync_lab.runtime.options import TrainConfig

        if not plan.model_name:
            raise QSyncError("Study.run trains zoo models; for your own module call "
                             "qsync_lab.runtime.train(..., task=Task(...)) on every rank "
                             "under torchrun")
        check_run_dir_free(run_dir)  # the plan of a run still going there is kept
        path = Path(run_dir) / "plan.json"
        plan.save(path)
        config = TrainConfig(plan=str(path), run_dir=str(run_dir), steps=steps,
                             profiles=self.profiles, **options)
        threads = self.run_threads
        env = {"OMP_NUM_THREADS": str(threads)} if threads else None
        return launch(config, threads=threads, env=env, verbose=verbose, progress=self.progress)

    def _allocator(self, compression):
        """The qsync :class:`~qsync_lab.allocate.Allocator` of the study's current inputs,
        kept while they stay the same: a re-plan under new constraints reuses it."""
        from qsync_lab.allocate import Allocator

        kept, indicator = self._kept(), self.indicator()
        if kept is None or kept.indicator is not indicator or (
                kept.optimizer, kept.compression) != (self.optimizer, compression):
            kept = self._kept_allocator = Allocator(
                self.prepared, self.cluster, self.costs, indicator, optimizer=self.optimizer,
                compression=compression)
        return kept

    def _kept(self):
        """The kept allocator while the study's graph, cluster and costs are still its own."""
        kept = self._kept_allocator
        if kept is None or any(a is not b for a, b in zip(
                (kept.prepared, kept.cluster, kept.costs),
                (self.prepared, self.cluster, self.costs))):
            return None
        return kept

    def _constraints(self, memory_limit, throughput_target):
        from qsync_lab.allocate import Constraints

        if memory_limit is None or isinstance(memory_limit, Mapping):
            memory = dict(memory_limit or {})
        else:
            memory = dict.fromkeys(self.cluster.device_kinds, memory_limit)
        return Constraints(memory, throughput_target)


def _cluster_key(cluster: Cluster) -> tuple:
    """What tells clusters apart for :meth:`Study.on_cluster`: the definition, and the ranks
    (a plan's batch sizes change them, not the definition)."""
    return cluster.fingerprint(), cluster.ranks
