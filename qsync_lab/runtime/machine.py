"""Whether this machine can run a plan's local ranks, decided before any process starts and
without importing torch (``qsync-lab run`` refuses in a fraction of a second):

* **cores**: at most :data:`RANKS_PER_CORE` local ranks per core (``os.cpu_count()``). A
  CPU rank computes on its own core; two per core still run (each waits in the allreduce
  for part of its step), more make every step many times its prediction and a 32-rank
  plan on 2 cores ran for a minute before its first step. ``--oversubscribe`` starts them
  anyway;
* **devices**: a rank whose kind is a GPU runs on CUDA; with no CUDA here it can only
  *emulate* its kind on the CPU (its precisions' exact numerics, at the CPU's speed), which
  the cluster says with ``emulate_on = "cpu"`` (``local-hybrid``) or ``--emulate`` asks for.
  Such a run is predicted with this machine's costs (:func:`emulated_on_cpu`);
* **data**: the bundled task's training set holds at least one global batch.

Example::

    >>> from qsync_lab.cluster import load_cluster
    >>> check_cores(32, cores=2)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    qsync_lab.errors.QSyncError: the plan starts 32 ranks here and this machine has 2 cores ...
    >>> emulated = emulated_on_cpu(load_cluster("v100-t4-small"))
    >>> [r.emulate_on for r in emulated.ranks], emulated.intra_node_links[0].name
    (['cpu', 'cpu', 'cpu', 'cpu'], 'loopback')
"""

import dataclasses
import os
from pathlib import Path

from qsync_lab.cluster import Cluster, RankSpec
from qsync_lab.errors import QSyncError
from qsync_lab.limits import RANKS_PER_CORE
from qsync_lab.runtime.task_sizes import TRAIN_SAMPLES

__all__ = ["LOCAL_LINK", "RANKS_PER_CORE", "check_cores", "check_data", "check_devices",
           "check_threads", "cuda_here", "emulated_kinds", "emulated_on_cpu"]

#: the link between ranks on one machine's CPU (gloo over localhost)
LOCAL_LINK = "loopback"
#: where a loaded NVIDIA driver shows itself on Linux (no driver: no CUDA, torch not asked)
_NVIDIA_DRIVER = Path("/proc/driver/nvidia")


def check_cores(local_ranks: int, *, oversubscribe: bool = False,
                cores: int | None = None) -> None:
    """Refuse more than :data:`RANKS_PER_CORE` local ranks per core (``cores``: default
    ``os.cpu_count()``), unless ``oversubscribe``."""
    cores = cores or os.cpu_count() or 1
    if oversubscribe or local_ranks <= cores * RANKS_PER_CORE:
        return
    raise QSyncError(
        f"the plan starts {local_ranks} ranks here and this machine has {cores} cores (at "
        f"most {cores * RANKS_PER_CORE}: {RANKS_PER_CORE} per core); re-plan for a smaller "
        "cluster (qsync-lab plan --cluster local-hybrid), run it on its own nodes (--nnodes, "
        "--nproc-per-node, --rdzv-endpoint), or pass --oversubscribe to start them anyway")


def check_threads(threads: int, *, oversubscribe: bool = False,
                  cores: int | None = None) -> None:
    """Refuse more intra-op threads per rank than this machine has cores (``cores``:
    default ``os.cpu_count()``), unless ``oversubscribe``.

    Example::

        >>> check_threads(1000, cores=2)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        qsync_lab.errors.QSyncError: --threads 1000 per rank: this machine has 2 cores; ...
    """
    cores = cores or os.cpu_count() or 1
    if oversubscribe or threads <= cores:
        return
    raise QSyncError(f"--threads {threads} per rank: this machine has {cores} cores; pass at "
                     f"most {cores} (the default divides them among the ranks), or "
                     "--oversubscribe to start them anyway")


def check_data(task: str, global_batch: int) -> None:
    """Refuse a bundled task whose training set is smaller than one global batch (a task
    not bundled is left to the run).

    Example::

        >>> check_data("synthetic", 1024)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        qsync_lab.errors.QSyncError: the synthetic task's training set has 512 samples, ...
    """
    samples = TRAIN_SAMPLES.get(task)
    if samples is None or samples >= global_batch:
        return
    raise QSyncError(
        f"the {task} task's training set has {samples} samples, fewer than the plan's global "
        f"batch ({global_batch}); re-plan for a cluster with fewer ranks or smaller batch "
        "sizes (qsync-lab plan --cluster local-hybrid)")


def check_devices(cluster: Cluster, *, emulate: bool = False) -> None:
    """Refuse ranks of GPU kinds that are not emulated when this machine has no CUDA."""
    if emulate:
        return
    missing = [rank for rank in cluster.ranks if _needs_gpu(cluster, rank)]
    if not missing or cuda_here():
        return
    kinds = "/".join(dict.fromkeys(rank.device for rank in missing))
    raise QSyncError(
        f"the plan runs {len(missing)} of its {cluster.world_size} ranks as {kinds} GPUs and "
        "this machine has no CUDA; pass --emulate to run its numerics on the CPU (each rank "
        "emulating its kind, predicted with this machine's costs), or re-plan for this "
        "machine's emulated hybrid (qsync-lab plan --cluster local-hybrid)")


def cuda_here() -> bool:
    """Whether torch has a CUDA device here; without a loaded NVIDIA driver the answer is
    no, and torch is not imported to give it."""
    if not _NVIDIA_DRIVER.exists():
        return False
    import torch

    return torch.cuda.is_available()


def emulated_on_cpu(cluster: Cluster) -> Cluster:
    """``cluster`` as a run on CPUs has it: every GPU rank emulated on the CPU
    (``emulate_on = "cpu"``) and the ranks of a node talking over gloo on localhost (the
    ``loopback`` link), not over the links of the GPUs they play."""
    ranks = tuple(dataclasses.replace(rank, emulate_on="cpu") if _needs_gpu(cluster, rank)
                  else rank for rank in cluster.ranks)
    links = tuple(cluster.catalog.link(LOCAL_LINK) for _ in cluster.intra_node_links)
    return dataclasses.replace(cluster, ranks=ranks, intra_node_links=links)


def emulated_kinds(cluster: Cluster) -> tuple[str, ...]:
    """The device kinds of ``cluster`` that its ranks emulate, in rank order.

    Example::

        >>> from qsync_lab.cluster import load_cluster
        >>> emulated_kinds(load_cluster("local-hybrid")), emulated_kinds(load_cluster("local-cpu"))
        (('V100-SXM2-32GB', 'T4'), ())
    """
    return tuple(dict.fromkeys(rank.device for rank in cluster.ranks if rank.emulate_on))


def _needs_gpu(cluster: Cluster, rank: RankSpec) -> bool:
    """A rank of a GPU kind that the cluster does not emulate."""
    return rank.emulate_on is None and cluster.catalog.device(rank.device).kind != "cpu"
