"""Build the torchrun command that trains a plan (``qsync-lab run``).

Example::

    >>> cmd = torchrun_command("plan.json", nproc_per_node=2, runtime_args=["--steps", "5"])
    >>> cmd[1:]
    ['-m', 'torch.distributed.run', '--standalone', '--nproc-per-node=2', '--max-restarts=0',
     '-m', 'qsync_lab.runtime', '--plan', 'plan.json', '--steps', '5']
    >>> torchrun_command("plan.json", 1, nnodes=2, rdzv_endpoint="127.0.0.1:29400")[3:6]
    ['--nnodes=2', '--rdzv-backend=c10d', '--rdzv-endpoint=127.0.0.1:29400']
"""

import sys
from collections.abc import Sequence

from qsync_lab.errors import QSyncError

__all__ = ["torchrun_command"]


def torchrun_command(plan: str, nproc_per_node: int, *, nnodes: int = 1,
                     rdzv_endpoint: str | None = None, rdzv_id: str = "qsync",
                     max_restarts: int = 0, runtime_args: Sequence[str] = ()) -> list[str]:
    """``python -m torch.distributed.run … -m qsync_lab.runtime --plan plan …``.

    One node: ``--standalone``. Several: a c10d rendezvous at ``rdzv_endpoint``
    (``host:port``; run the same command on every node).
    """
    if nproc_per_node < 1 or nnodes < 1 or max_restarts < 0:
        raise QSyncError("--nproc-per-node and --nnodes must be positive and --max-restarts "
                         "non-negative")
    if nnodes > 1 and not rdzv_endpoint:
        raise QSyncError(f"{nnodes} nodes need a rendezvous: pass --rdzv-endpoint HOST:PORT "
                         "(the same on every node)")
    if nnodes == 1 and not rdzv_endpoint:
        rendezvous = ["--standalone"]
    else:
        rendezvous = [f"--nnodes={nnodes}", "--rdzv-backend=c10d",
                      f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}"]
    return [sys.executable, "-m", "torch.distributed.run", *rendezvous,
            f"--nproc-per-node={nproc_per_node}", f"--max-restarts={max_restarts}",
            "-m", "qsync_lab.runtime", "--plan", str(plan), *runtime_args]
