"""``qsync-lab lab``: the plan tuner served as an app (Voila) on 127.0.0.1, behind a fresh
token.

Example::

    >>> voila_command("tuner.ipynb", port=LAB_PORT)[2:4]
    ['voila', 'tuner.ipynb']
"""

import importlib.util
import os
import secrets
import sys
from pathlib import Path

from qsync_lab.errors import QSyncError
from qsync_lab.resources import data_file

__all__ = ["LAB_KERNEL_IDLE_S", "LAB_NOTEBOOK", "LAB_PORT", "LAB_TEMPLATE", "cull_interval_s",
           "lab_command", "lab_environment", "voila_command"]

#: what ``qsync-lab lab`` serves by default: the lab app, the tuner's panel alone
LAB_NOTEBOOK = Path(str(data_file("lab.ipynb")))
#: seconds a lab kernel may sit idle with no page attached before Voila stops it (by default)
LAB_KERNEL_IDLE_S = 60
LAB_TEMPLATE = "qsync"  # data/voila/templates/qsync
LAB_PORT = 8866


def cull_interval_s(idle_s: int) -> int:
    """How often Voila looks for kernels idle ``idle_s`` seconds: a quarter of it, at least
    every second."""
    return max(1, idle_s // 4)


def voila_command(notebook: "str | os.PathLike[str]", *, port: int,
                  idle_s: int = LAB_KERNEL_IDLE_S) -> list[str]:
    """The command that serves ``notebook`` with Voila on 127.0.0.1:``port`` (that port or
    none), opening no browser, behind the token in ``$JUPYTER_TOKEN`` (an environment
    variable: other users of the machine cannot read it from the process list), stopping
    the kernel of a closed page once it has been idle ``idle_s`` seconds (0: never), in
    the shipped page template (Voila's lab page without its stylesheets from a CDN; Voila
    finds it through :func:`lab_environment`'s ``JUPYTER_PATH``).

    Example::

        >>> voila_command("tuner.ipynb", port=8866)[1:]
        ['-m', 'voila', 'tuner.ipynb', '--no-browser', '--Voila.ip=127.0.0.1',
         '--Voila.port=8866', '--Voila.port_retries=0', '--Voila.auto_token=True',
         '--MappingKernelManager.cull_idle_timeout=60', '--MappingKernelManager.cull_interval=15',
         '--template=qsync']
    """
    return [sys.executable, "-m", "voila", str(notebook), "--no-browser", "--Voila.ip=127.0.0.1",
            f"--Voila.port={port}", "--Voila.port_retries=0", "--Voila.auto_token=True",
            f"--MappingKernelManager.cull_idle_timeout={idle_s}",
            f"--MappingKernelManager.cull_interval={cull_interval_s(idle_s)}",
            f"--template={LAB_TEMPLATE}"]


def lab_environment(model: str, cluster: str, root: "str | os.PathLike[str]") -> dict[str, str]:
    """What the lab app reads (the model, the cluster and the export folder, absolute) and
    where Voila finds the lab's page template.

    Example::

        >>> lab_environment("resnet18", "local-hybrid", "/home/me/plans")["QSYNC_LAB_ROOT"]
        '/home/me/plans'
    """
    templates = str(Path(str(data_file("voila"))).parent)
    paths = os.pathsep.join(filter(None, (templates, os.environ.get("JUPYTER_PATH"))))
    return {"QSYNC_LAB_MODEL": model, "QSYNC_LAB_CLUSTER": cluster,
            "QSYNC_LAB_ROOT": str(Path(root).resolve()), "JUPYTER_PATH": paths}


def lab_command(args) -> None:
    """Check the lab's arguments, print its URL and become the Voila server.

    Example: ``qsync-lab lab --port 8866``.
    """
    if not args.notebook.is_file():
        raise QSyncError(f"notebook {args.notebook} not found; pass --notebook PATH")
    if args.notebook.suffix != ".ipynb":
        raise QSyncError(f"--notebook {args.notebook} is not a notebook (.ipynb); pass one")
    if not 0 < args.port < 2**16:
        raise QSyncError(f"--port must be in 1..65535, got {args.port}")
    if importlib.util.find_spec("voila") is None:
        raise QSyncError("qsync-lab lab needs voila: pip install -e '.[notebook]' in the "
                         "repository (the notebook extra)")
    if not args.root.is_dir():
        raise QSyncError(f"--root {args.root} is not a folder; pass an existing one")
    if args.idle_s < 0:
        raise QSyncError(f"--idle-s must be 0 (never stop) or more seconds, got {args.idle_s}")
    if args.notebook.resolve() == LAB_NOTEBOOK.resolve():  # the lab app opens them
        from qsync_lab.cluster import load_cluster
        from qsync_lab.models import model_spec

        model_spec(args.model)
        load_cluster(args.cluster)
    token = secrets.token_urlsafe(32)
    print(f"serving {args.notebook} at http://127.0.0.1:{args.port}/?token={token} "
          f"(exports go to {args.root.resolve()}; Ctrl-C stops it)", flush=True)
    command = voila_command(args.notebook, port=args.port, idle_s=args.idle_s)
    os.execve(command[0], command, {**os.environ, "JUPYTER_TOKEN": token,
                                    **lab_environment(args.model, args.cluster, args.root)})
