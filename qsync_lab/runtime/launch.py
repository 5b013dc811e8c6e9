"""Start a plan's training run: checks first, then torchrun, quietly, with a progress bar.

:func:`check_run` refuses a bad run before any process starts (the plan's schema and
cluster, the model and its fingerprint, the options, the rank count), each in one line.
:func:`launch` then runs ``python -m torch.distributed.run … -m qsync_lab.runtime …``
(:func:`torchrun_command`): by default the launcher's and the ranks' output go to
``<run_dir>/launch.log`` and a progress bar follows ``metrics.jsonl``; a failed run is
one line (the ranks' error) naming the log. ``verbose=True`` shows everything instead.

Example::

    >>> cmd = torchrun_command("plan.json", nproc_per_node=2, runtime_args=["--steps", "5"])
    >>> cmd[1:]
    ['-m', 'torch.distributed.run', '--standalone', '--nproc-per-node=2', '--max-restarts=0',
     '-m', 'qsync_lab.runtime', '--plan', 'plan.json', '--steps', '5']
    >>> torchrun_command("plan.json", 1, nnodes=2, rdzv_endpoint="127.0.0.1:29400")[3:6]
    ['--nnodes=2', '--rdzv-backend=c10d', '--rdzv-endpoint=127.0.0.1:29400']
"""

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qsync_lab.errors import QSyncError
from qsync_lab.plan import Plan
from qsync_lab.runtime.options import TrainConfig, runtime_argv

__all__ = ["check_run", "launch", "torchrun_command"]

LOG_NAME = "launch.log"
_POLL_S = 0.2


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


def check_run(config: TrainConfig, *, nproc_per_node: int | None = None,
              nnodes: int = 1) -> Plan:
    """The run's plan, after every check that needs no process: the plan file, the rank
    count, the model and the data. A model other than the plan's own (``--model``,
    ``--model-kwargs``) is built and traced here: the plan must be for it (each rank checks
    the plan's own model again when it builds it).

    Raises:
        QSyncError: the first problem, in one line.
    """
    plan = Plan.load(config.plan)
    ranks = (nproc_per_node or plan.world_size // nnodes) * nnodes
    if ranks != plan.world_size:
        raise QSyncError(f"the plan is for {plan.world_size} ranks, --nnodes {nnodes} x "
                         f"--nproc-per-node {nproc_per_node} start {ranks}; start "
                         f"{plan.world_size}")
    from qsync_lab.models import list_models, model_spec  # torch: after the other checks
    from qsync_lab.runtime.tasks import TASKS, default_task

    name = config.model or plan.model_name
    if not name:
        raise QSyncError(f"plan {config.plan} names no model; pass --model (a zoo model: "
                         f"{', '.join(list_models())})")
    kwargs = dict(config.model_kwargs if config.model_kwargs is not None else plan.model_kwargs)
    data = config.data or default_task(name)
    if data not in TASKS:
        raise QSyncError(f"unknown --data {data!r}; choose one of: {', '.join(TASKS)}")
    model_spec(name)  # a zoo model
    if config.model is not None or config.model_kwargs is not None:
        from qsync_lab.graph import trace_graph
        from qsync_lab.models import example_batch, get_model

        inputs, target = example_batch(name, 2, **kwargs)
        plan.validate(trace_graph(get_model(name, **kwargs), inputs, target=target,
                                  loss_fn=model_spec(name).loss_fn()))
    return plan


def launch(config: TrainConfig, *, nproc_per_node: int | None = None, nnodes: int = 1,
           rdzv_endpoint: str | None = None, max_restarts: int = 0, threads: int | None = None,
           verbose: bool = False, progress: bool = True,
           env: dict[str, str] | None = None) -> dict[str, Any] | None:
    """Check the run (:func:`check_run`), run it under torchrun and return rank 0's summary
    (None on a node that does not hold rank 0).

    Raises:
        QSyncError: a check failed (nothing started), or the run failed: the ranks' error
            and where the full log is, in one line.
    """
    plan = check_run(config, nproc_per_node=nproc_per_node, nnodes=nnodes)
    nproc = nproc_per_node or plan.world_size // nnodes
    command = torchrun_command(config.plan, nproc, nnodes=nnodes, rdzv_endpoint=rdzv_endpoint,
                               max_restarts=max_restarts,
                               runtime_args=runtime_argv(config, threads=threads)[2:])
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    environment = {**os.environ, **(env or {})}
    if verbose:
        returncode = subprocess.run(command, env=environment, check=False).returncode
        log = None
    else:
        log = run_dir / LOG_NAME
        returncode = _quiet_run(command, environment, log, run_dir / "metrics.jsonl",
                                config.steps, progress)
    if returncode:
        where = f"; the full log is {log}" if log else ""
        raise QSyncError(f"the run failed (torchrun exit {returncode}): "
                         f"{_rank_error(log)}{where}")
    summary = run_dir / "summary.json"
    return json.loads(summary.read_text()) if summary.exists() else None


def _quiet_run(command: list[str], env: dict[str, str], log: Path, metrics: Path, steps: int,
               progress: bool) -> int:
    """Run ``command`` with its output in ``log``, a bar following ``metrics``' lines; the
    whole process group is stopped if this process is interrupted."""
    from tqdm.auto import tqdm

    with open(log, "w", encoding="utf-8") as out, \
            tqdm(total=steps, desc="train", unit="step", disable=not progress) as bar:
        job = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                               start_new_session=True)
        try:
            while job.poll() is None:
                time.sleep(_POLL_S)
                _advance(bar, _count_lines(metrics))
            _advance(bar, _count_lines(metrics))
        except BaseException:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
            raise
    return job.returncode


def _advance(bar, done: int) -> None:
    if done > bar.n:
        bar.update(done - bar.n)


def _count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as handle:
            return sum(1 for _ in handle)
    except FileNotFoundError:
        return 0


def _rank_error(log: Path | None) -> str:
    """The ranks' one-line error from the log (the runtime prints ``… error: …``)."""
    if log is None:
        return "see the ranks' output above"
    lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    for marker in ("qsync_lab.runtime: error: ", "Error: ", "error: "):
        found = [line.split(marker, 1)[1] for line in lines if marker in line]
        if found:
            return found[-1].strip()
    return lines[-1].strip() if lines else "no output"
