"""What the simulator predicts for a run, emulated device kinds included.

A cluster may let this machine play other devices (``emulate_on = "cpu"`` in its file:
``local-hybrid``'s rank 0 plays a V100, rank 1 a T4). Such a rank runs its kind's
numerics at the host's speed, so its prediction must use the host's measured costs:
:func:`emulation_view` gives each emulated kind the host's hardware numbers (keeping its
own precisions, so the plan still validates) and costs it as the host.

A run whose ranks all compute on this machine's CPU (no CUDA, or ``--emulate``) emulates
every GPU kind, whatever its cluster says: ``predict_plan(..., on_cpu=True)`` costs them as
the host (:func:`~qsync_lab.runtime.machine.emulated_on_cpu`).

Example::

    >>> from qsync_lab.cluster import load_cluster
    >>> from qsync_lab.costs import CostModel
    >>> cluster, costs = emulation_view(load_cluster("local-hybrid"), CostModel())
    >>> t4 = cluster.catalog.device("T4")
    >>> t4.memory_bandwidth_Bps == cluster.catalog.device("cpu").memory_bandwidth_Bps
    True
    >>> t4.supports("bf16")   # the T4's own precisions
    False
"""

import dataclasses
from types import MappingProxyType

from qsync_lab.cluster import Cluster
from qsync_lab.costs import CostModel
from qsync_lab.graph import OpGraph
from qsync_lab.plan import Plan
from qsync_lab.runtime.machine import emulated_on_cpu
from qsync_lab.simulate import SimResult, simulate

__all__ = ["emulation_view", "predict_plan", "run_profiles"]


def run_profiles(profiles: "tuple[str, ...]" = (), *, cuda: bool = False) -> tuple[str, ...]:
    """The profile CSVs a local run's prediction reads: ``profiles``, else the shipped CPU
    profile (none on CUDA ranks, whose kinds are costed by the catalog).

    Example::

        >>> [p.rsplit("/", 1)[-1] for p in run_profiles()], run_profiles(cuda=True)
        (['cpu.csv'], ())
    """
    from qsync_lab.resources import data_file

    if profiles or cuda:
        return tuple(profiles)
    return (str(data_file("profiles", "cpu.csv")),)


def emulation_view(cluster: Cluster, costs: CostModel) -> tuple[Cluster, CostModel]:
    """``cluster`` and ``costs`` with every emulated device kind running at its host's
    speed (unchanged when no rank is emulated)."""
    hosts = {r.device: r.emulate_on for r in cluster.ranks if r.emulate_on}
    catalog = cluster.catalog
    devices = dict(catalog.devices)
    for kind, host in hosts.items():
        own, host_spec = catalog.device(kind), catalog.device(host)
        devices[own.name] = dataclasses.replace(
            host_spec, name=own.name, precisions=own.precisions,
            source=f"{host_spec.source} (emulating {own.name})")
        costs = costs.emulating(own.name, host_spec.name)
    catalog = dataclasses.replace(catalog, devices=MappingProxyType(devices))
    return dataclasses.replace(cluster, catalog=catalog), costs


def predict_plan(plan: Plan, graph: OpGraph, costs: CostModel, *,
                 optimizer: str | None = None, on_cpu: bool = False) -> SimResult:
    """The simulated iteration of ``plan`` on its cluster, emulated kinds costed as their
    host (``optimizer``: the run's, default the plan's; ``on_cpu``: every rank runs on this
    machine's CPU, so every GPU kind is emulated)."""
    cluster = emulated_on_cpu(plan.cluster) if on_cpu else plan.cluster
    cluster, costs = emulation_view(cluster, costs)
    return simulate(graph, plan, cluster, costs, optimizer=optimizer)
