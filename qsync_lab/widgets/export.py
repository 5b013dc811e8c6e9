"""Export a plan: ``plan.json`` written atomically into a folder inside a root folder, the
torchrun command that trains it on the real cluster and the ``qsync-lab run`` command that
trains it on this machine.

Example::

    >>> import tempfile
    >>> export_plan(None, tempfile.mkdtemp(), "../elsewhere")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    qsync_lab.errors.QSyncError: export folder '../elsewhere' is not inside ...
"""

import os
import shlex
from collections import Counter
from pathlib import Path

from qsync_lab.errors import QSyncError
from qsync_lab.plan import Plan
from qsync_lab.runtime.launch import torchrun_command
from qsync_lab.runtime.machine import check_devices

__all__ = ["PLAN_NAME", "cluster_commands", "export_plan", "local_command"]

PLAN_NAME = "plan.json"
RDZV_PORT = 29400


def export_plan(plan: Plan, root: "str | os.PathLike[str]", folder: str) -> Path:
    """Write ``plan`` as ``root/folder/plan.json`` (atomically) and return its absolute path.

    Raises:
        QSyncError: ``folder`` is not inside ``root`` (a ``..`` part, or an absolute
            path or link elsewhere).
    """
    base = Path(root).resolve()
    target = (base / folder).resolve()
    if ".." in Path(folder).parts or not target.is_relative_to(base):
        raise QSyncError(f"export folder {folder!r} is not inside {base}; name a folder "
                         "inside it")
    path = target / PLAN_NAME
    plan.save(path)
    return path


def cluster_commands(plan_path: "str | os.PathLike[str]", plan: Plan, *,
                     host: str = "HOST") -> list[str]:
    """The command that trains ``plan_path`` on the plan's real cluster: one torchrun per
    node, meeting at a c10d rendezvous on ``host`` (one line for every node when the
    nodes have as many ranks; else one per node, ``# node`` first).

    Example::

        >>> from qsync_lab.cluster import load_cluster
        >>> from qsync_lab.plan import RankPlan
        >>> cluster = load_cluster("qsync-paper")
        >>> plan = Plan("abc", cluster.definition, tuple(RankPlan(r.rank, r.device, 32)
        ...             for r in cluster.ranks), {})
        >>> cluster_commands("/abs/plan.json", plan)  # doctest: +NORMALIZE_WHITESPACE
        ['torchrun --nnodes=4 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 --rdzv-id=qsync
          --nproc-per-node=8 --max-restarts=0 -m qsync_lab.runtime --plan /abs/plan.json']
    """
    cluster = plan.cluster
    per_node = Counter(r.node for r in cluster.ranks)
    nnodes = len(cluster.node_names)

    def command(nproc: int) -> str:
        argv = torchrun_command(str(plan_path), nproc, nnodes=nnodes,
                                rdzv_endpoint=f"{host}:{RDZV_PORT}")
        return shlex.join(["torchrun", *argv[3:]])  # argv[:3]: python -m torch.distributed.run

    if len(set(per_node.values())) == 1:
        return [command(per_node[0])]
    return [f"# {name}\n{command(per_node[node])}" for node, name in enumerate(cluster.node_names)]


def local_command(plan_path: "str | os.PathLike[str]", plan: Plan) -> str:
    """The ``qsync-lab run`` command that trains ``plan_path`` on this machine: with
    ``--emulate`` where the plan's GPU ranks would need a GPU this machine lacks
    (:func:`~qsync_lab.runtime.machine.check_devices`).

    Example::

        >>> from qsync_lab.cluster import load_cluster
        >>> from qsync_lab.plan import RankPlan
        >>> cluster = load_cluster("local-hybrid")
        >>> plan = Plan("abc", cluster.definition, tuple(RankPlan(r.rank, r.device, 16)
        ...             for r in cluster.ranks), {})
        >>> local_command("/abs/plan.json", plan)
        'qsync-lab run --plan /abs/plan.json'
    """
    try:
        check_devices(plan.cluster)
        emulate = []
    except QSyncError:
        emulate = ["--emulate"]
    return shlex.join(["qsync-lab", "run", "--plan", str(plan_path), *emulate])
