"""Start a plan's training run: checks first, then torchrun, quietly, with a progress bar.

:func:`check_run` refuses a bad run before any process starts (a run directory another
run holds or with a symlinked output, the plan's schema and cluster, the rank count, what
this machine cannot run: more ranks than its cores carry, GPU ranks without CUDA that are
not emulated, a training set smaller than one global batch (:mod:`~qsync_lab.runtime.machine`),
the model and its fingerprint, the options, the profiles), each in one line saying what to do.
:func:`start` then locks the run directory (one run per directory,
:mod:`~qsync_lab.runtime.lock`) and starts ``python -m torch.distributed.run … -m
qsync_lab.runtime …`` (:func:`torchrun_command`) in a session of its own, the launcher's
and the ranks' output in ``<run_dir>/launch.log``; :func:`stop_run` stops it and every
rank. :func:`launch` checks a ``--resume`` first (a refused one is one line, a complete
run a note, and neither starts a process), then starts the run and waits for it, a
progress bar following ``metrics.jsonl``, and shows the ranks' notes (``qsync_lab: …``
lines: a damaged checkpoint skipped); a failed run is one line (the ranks' error,
:func:`rank_error`) naming the log. ``verbose=True`` shows the output instead.

Example::

    >>> cmd = torchrun_command("plan.json", nproc_per_node=2, runtime_args=["--steps", "5"])
    >>> cmd[1:]
    ['-m', 'torch.distributed.run', '--standalone', '--nproc-per-node=2', '--max-restarts=0',
     '-m', 'qsync_lab.runtime', '--plan', 'plan.json', '--steps', '5']
    >>> torchrun_command("plan.json", 1, nnodes=2, rdzv_endpoint="127.0.0.1:29400")[3:6]
    ['--nnodes=2', '--rdzv-backend=c10d', '--rdzv-endpoint=127.0.0.1:29400']
"""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qsync_lab.errors import QSyncError
from qsync_lab.io import check_output_dir, open_log
from qsync_lab.plan import Plan
from qsync_lab.runtime.gpu_share import mps_daemon, shared_gpus
from qsync_lab.runtime.lock import (LOCK_ENV, LOCK_HELD, acquire_run_lock, check_run_dir_free,
                                    forget_ended_holder)
from qsync_lab.runtime.machine import (check_cores, check_data, check_devices, check_threads,
                                       cuda_here)
from qsync_lab.runtime.options import TrainConfig, runtime_argv
from qsync_lab.runtime.outputs import LOG_NAME, METRICS, SUMMARY, check_outputs
from qsync_lab.runtime.task_sizes import default_task_name
from qsync_lab.tomlfile import show

if TYPE_CHECKING:
    from qsync_lab.graph import OpGraph

__all__ = ["check_run", "launch", "rank_error", "start", "stop_run", "torchrun_command"]

STOP_GRACE_S = 20.0  # torchrun's own wait for its workers is 30 s
_POLL_S = 0.2
_NOTE = "qsync_lab: "  # how the ranks mark a note for the user (RankContext.note)
_RUNTIME_ERROR = "qsync_lab.runtime: error: "  # how a rank reports a QSyncError (__main__)
_TRACEBACK = "Traceback (most recent call last):"
_RANK_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]:\s?")  # torchrun's --tee/prefix option


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
    if rdzv_endpoint:
        _check_endpoint(rdzv_endpoint)
    if nnodes == 1 and not rdzv_endpoint:
        rendezvous = ["--standalone"]
    else:
        rendezvous = [f"--nnodes={nnodes}", "--rdzv-backend=c10d",
                      f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}"]
    return [sys.executable, "-m", "torch.distributed.run", *rendezvous,
            f"--nproc-per-node={nproc_per_node}", f"--max-restarts={max_restarts}",
            "-m", "qsync_lab.runtime", "--plan", str(plan), *runtime_args]


def _check_endpoint(endpoint: str) -> None:
    """Raise unless ``endpoint`` is ``HOST:PORT`` with a port from 1 to 65535."""
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise QSyncError(f"--rdzv-endpoint {endpoint!r} is not HOST:PORT with a port from 1 to "
                         "65535; e.g. 10.0.0.1:29400 (the same on every node)")


def check_run(config: TrainConfig, *, nproc_per_node: int | None = None,
              nnodes: int = 1, oversubscribe: bool = False) -> Plan:
    """The run's plan, after every check that needs no process: the run directory (no
    other run holds it, no output in it is a symlink), the plan file in full
    (:meth:`Plan.load`), the rank count, whether this machine can run them (its cores,
    unless ``oversubscribe``; CUDA for GPU ranks, unless emulated: ``config.emulate``; the
    bundled task's size: :mod:`~qsync_lab.runtime.machine`; all before torch is imported),
    the data, the model: built from the zoo and traced here, the plan must be for it (its
    fingerprint, op FQNs and compressed parameters), and the ``--profile`` files.

    Example: ``check_run(TrainConfig(plan="paper_plan.json"))`` on a 2-core laptop raises
    ``QSyncError: the plan starts 32 ranks here and this machine has 2 cores …``.

    Raises:
        QSyncError: the first problem, in one line.
    """
    check_output_dir(config.run_dir, "--run-dir")
    if Path(config.run_dir).exists():  # first, at once: a second launch builds no model
        check_run_dir_free(config.run_dir)
        check_outputs(config.run_dir)
    for profile in config.profiles:  # read in full after the model's checks
        if not Path(profile).is_file():
            raise QSyncError(f"cannot read profile {profile}: no such file; give the path to "
                             "a profile CSV")
    plan = Plan.load(config.plan)
    local_ranks = nproc_per_node or plan.world_size // nnodes
    if local_ranks * nnodes != plan.world_size:
        raise QSyncError(f"the plan is for {plan.world_size} ranks, --nnodes {nnodes} x "
                         f"--nproc-per-node {nproc_per_node} start {local_ranks * nnodes}; "
                         f"start {plan.world_size}")
    check_cores(local_ranks, oversubscribe=oversubscribe)
    check_devices(plan.cluster, emulate=config.emulate)
    name = config.model or plan.model_name
    data = config.data or (default_task_name(name) if name else None)
    if data is not None:
        check_data(data, sum(plan.batch_sizes))
    from qsync_lab.models import list_models  # torch: after the other checks
    from qsync_lab.runtime.tasks import TASKS, check_task

    if not name:
        raise QSyncError(f"plan {config.plan} names no model; pass --model (a zoo model: "
                         f"{', '.join(list_models())})")
    kwargs = dict(config.model_kwargs if config.model_kwargs is not None else plan.model_kwargs)
    if data not in TASKS:
        raise QSyncError(f"unknown --data {data!r}; choose one of: {', '.join(TASKS)}")
    check_task(data, name)  # a zoo model, and one the task's data fits
    graph = _model_graph(name, kwargs)
    try:
        plan.validate(graph)
    except QSyncError as err:
        raise QSyncError(f"plan {config.plan}: {err}") from None
    if config.profiles:  # read by the prediction at the end of the run: check them now
        from qsync_lab.costs import load_cost_model

        load_cost_model(*config.profiles)
    return plan


def _model_graph(name: str, kwargs: dict[str, Any]) -> "OpGraph":
    """The traced graph of zoo model ``name(**kwargs)``; arguments it cannot be built with
    (too large for memory, of the wrong kind) are a one-line error."""
    from qsync_lab.graph import trace_graph
    from qsync_lab.models import example_batch, get_model, model_spec

    try:
        inputs, target = example_batch(name, 2, **kwargs)
        model = get_model(name, **kwargs)
    except (RuntimeError, MemoryError, OverflowError, TypeError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise QSyncError(f"cannot build model {name} with kwargs {show(kwargs)} ({first}); "
                         "fix --model-kwargs or the plan's model kwargs") from None
    return trace_graph(model, inputs, target=target, loss_fn=model_spec(name).loss_fn())


def start(config: TrainConfig, *, nproc_per_node: int | None = None, nnodes: int = 1,
          rdzv_endpoint: str | None = None, max_restarts: int = 0, threads: int | None = None,
          env: dict[str, str] | None = None, log: bool = True,
          oversubscribe: bool = False) -> subprocess.Popen:
    """Check the run (:func:`check_run`), lock its run directory and start torchrun on it
    in a session of its own (stop it with :func:`stop_run`; ``oversubscribe``: start more
    ranks than this machine's cores carry), its output and the ranks' in
    ``<run_dir>/launch.log`` (``log=False``: in this process's), with ``env`` added to this
    process's environment.

    On one node torchrun inherits the run directory's lock
    (:func:`~qsync_lab.runtime.lock.acquire_run_lock`), which the OS releases when it ends;
    the ranks see ``QSYNC_RUN_LOCK=held``. On several nodes the directory may be shared, so
    rank 0 takes the lock instead (:func:`~qsync_lab.runtime.lock.lock_for_this_process`).

    Example: ``start(TrainConfig(plan="plan.json", run_dir="run", steps=5)).wait()``.

    Raises:
        QSyncError: a check failed, or another run holds the run directory (nothing
            started).
    """
    plan = check_run(config, nproc_per_node=nproc_per_node, nnodes=nnodes,
                     oversubscribe=oversubscribe)
    return _start_checked(config, plan, nproc_per_node=nproc_per_node, nnodes=nnodes,
                          rdzv_endpoint=rdzv_endpoint, max_restarts=max_restarts,
                          threads=threads, env=env, log=log, oversubscribe=oversubscribe)


def _start_checked(config: TrainConfig, plan: Plan, *, nproc_per_node: int | None,
                   nnodes: int, rdzv_endpoint: str | None, max_restarts: int,
                   threads: int | None, env: dict[str, str] | None, log: bool,
                   oversubscribe: bool) -> subprocess.Popen:
    """:func:`start` once :func:`check_run` has passed ``plan``."""
    if threads is not None:
        check_threads(threads, oversubscribe=oversubscribe)
    command = torchrun_command(config.plan, nproc_per_node or plan.world_size // nnodes,
                               nnodes=nnodes, rdzv_endpoint=rdzv_endpoint,
                               max_restarts=max_restarts,
                               runtime_args=runtime_argv(config, threads=threads)[2:])
    run_dir = Path(config.run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise QSyncError(f"cannot create --run-dir {run_dir}: {err.strerror}; choose another "
                         "--run-dir") from None
    environment = {**os.environ, **(env or {})}
    with contextlib.ExitStack() as stack:
        lock = stack.enter_context(acquire_run_lock(run_dir)) if nnodes == 1 else None
        out = stack.enter_context(open_log(run_dir / LOG_NAME)) if log else None
        if lock is not None:
            environment[LOCK_ENV] = LOCK_HELD
        else:  # rank 0 takes it
            environment.pop(LOCK_ENV, None)
        process = subprocess.Popen(command, env=environment, stdout=out,
                                   stderr=None if out is None else subprocess.STDOUT,
                                   start_new_session=True,
                                   pass_fds=() if lock is None else (lock.fd,))
        if lock is not None:
            lock.hand_over(process.pid)  # torchrun holds it now
    return process


def stop_run(process: subprocess.Popen, run_dir: "str | os.PathLike[str] | None" = None, *,
             grace_s: float = STOP_GRACE_S) -> None:
    """Stop torchrun ``process``, started in a session of its own (:func:`start`), and its
    ranks; nothing to do once it has ended.

    torchrun starts each rank in a session of its own, so a SIGKILL to its process group
    would leave them running: it gets SIGTERM, on which it stops its ranks (in about
    1.5 s); only if it is still running after ``grace_s`` does it get SIGKILL, and so do
    the ranks that ``run_dir/ranks/rank<N>.json`` name.

    Example: ``stop_run(start(config), config.run_dir)``.
    """
    if process.poll() is not None:
        return
    _signal_group(process.pid, signal.SIGTERM)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        _signal_group(process.pid, signal.SIGKILL)
        process.wait()
        for pid in _rank_pids(run_dir):
            _signal_group(pid, signal.SIGKILL)


def launch(config: TrainConfig, *, nproc_per_node: int | None = None, nnodes: int = 1,
           rdzv_endpoint: str | None = None, max_restarts: int = 0, threads: int | None = None,
           verbose: bool = False, progress: bool = True, env: dict[str, str] | None = None,
           oversubscribe: bool = False) -> dict[str, Any] | None:
    """Check the run (:func:`check_run`, and a ``resume`` against its checkpoint), start it
    (:func:`start`), wait for it, show the ranks' notes on stderr and return the summary
    this run wrote (None when it wrote none: the run was already complete, as a note said,
    or rank 0 runs on another node); an interrupt (Ctrl-C) stops it (:func:`stop_run`).

    Raises:
        QSyncError: a check failed or the resume is refused (nothing started), or the run
            failed: the ranks' error and where the full log is, in one line.
    """
    run_dir = Path(config.run_dir)
    summary = run_dir / SUMMARY
    before = _stamp(summary)
    plan = check_run(config, nproc_per_node=nproc_per_node, nnodes=nnodes,
                     oversubscribe=oversubscribe)
    # a resumed run's steps show as done; an earlier run's metrics count once rewritten
    steps_before = _resumed_steps(config, plan) if nnodes == 1 else 0
    if steps_before >= config.steps:
        return None
    metrics_before = _stamp(run_dir / METRICS)
    with mps_daemon(_shared_gpus(config) if nnodes == 1 else []):
        job = _start_checked(config, plan, nproc_per_node=nproc_per_node, nnodes=nnodes,
                             rdzv_endpoint=rdzv_endpoint, max_restarts=max_restarts,
                             threads=threads, env=env, log=not verbose,
                             oversubscribe=oversubscribe)
        log = None if verbose else run_dir / LOG_NAME
        try:
            returncode = _follow(job, run_dir, config.steps, steps_before, metrics_before,
                                 progress=progress and not verbose)
        finally:
            if nnodes == 1:  # torchrun has ended: the next run needs no takeover note
                forget_ended_holder(run_dir)
    if log is not None:
        _show_notes(log)
    if returncode:
        where = f"; the full log is {log}" if log else ""
        raise QSyncError(f"the run failed (torchrun exit {returncode}): "
                         f"{rank_error(log)}{where}")
    written = _stamp(summary)
    return json.loads(summary.read_text()) if written not in (None, before) else None


def _resumed_steps(config: TrainConfig, plan: Plan) -> int:
    """The steps a ``--resume`` of ``config`` finds done (0 without one), checked before any
    rank starts (:func:`~qsync_lab.runtime.run_state.launch_resume_point`); a complete run
    is said so, with what the check found on the way (damaged newer checkpoints).

    Raises:
        QSyncError: the resume is refused (the checkpoint is another run's, or changes a
            setting that ``--allow-change`` does not name); one line.
    """
    if not config.resume:
        return 0
    from qsync_lab.runtime.run_state import complete_note, launch_resume_point

    warnings: list[str] = []
    point = launch_resume_point(config, plan, warn=warnings.append)
    if point.step >= config.steps:  # the ranks would only say so
        for line in (*warnings, complete_note(Path(config.run_dir), point.step)):
            print(f"{_NOTE}{line}", file=sys.stderr)
    return point.step


def _shared_gpus(config: TrainConfig) -> list[int]:
    """The GPUs of this node that several of the plan's ranks share (they run at once only
    under MPS: :func:`~qsync_lab.runtime.gpu_share.mps_daemon`); none on the CPU."""
    if config.emulate or not cuda_here():
        return []
    try:
        ranks = Plan.load(config.plan).cluster.ranks
    except QSyncError:
        return []  # check_run says what is wrong with it
    return shared_gpus([r.gpu_index for r in ranks if r.node == 0])


def _stamp(path: Path) -> tuple[int, int] | None:
    """``path``'s inode and modification time (None: absent): a file written since differs."""
    try:
        stat = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return stat.st_ino, stat.st_mtime_ns


def _show_notes(log: Path) -> None:
    """Print the ranks' notes in ``log`` (lines marked ``qsync_lab: ``) on stderr."""
    for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
        if _NOTE in line:  # after a progress bar's carriage returns, maybe
            print(line[line.index(_NOTE):], file=sys.stderr)


def _follow(job: subprocess.Popen, run_dir: Path, steps: int, steps_before: int,
            metrics_before: tuple[int, int] | None, *, progress: bool) -> int:
    """Wait for ``job``, a bar following ``metrics.jsonl``'s lines once the ranks have
    written it (``metrics_before``: its :func:`_stamp` at the start, an earlier run's
    lines), from ``steps_before`` (a resumed run's steps); its rate and time count from
    the first step the ranks log, not the seconds they take to start. The run is stopped
    if this process is interrupted (Ctrl-C) or terminated (SIGTERM: ``timeout``, a job
    scheduler)."""
    from tqdm.auto import tqdm

    metrics = run_dir / METRICS
    stepping = False  # whether the ranks have logged a step yet

    def follow(bar) -> None:
        nonlocal stepping
        if _stamp(metrics) == metrics_before:
            return
        done = min(_count_lines(metrics), steps)
        if done > bar.n and not stepping:  # the first steps: the time so far was start-up
            stepping = True
            if not bar.disable:
                bar.n = bar.last_print_n = done
                bar.unpause()  # start-up out of the rate and the elapsed time
                bar.refresh()
        elif done > bar.n:
            bar.update(done - bar.n)

    with tqdm(total=steps, initial=steps_before, desc="train", unit="step",
              disable=not progress) as bar, \
            _terminate_raises():
        try:
            while job.poll() is None:
                time.sleep(_POLL_S)
                follow(bar)
            follow(bar)
        except BaseException:
            stop_run(job, run_dir)
            raise
    return job.returncode


@contextlib.contextmanager
def _terminate_raises():
    """While it lasts, SIGTERM raises ``SystemExit(143)`` in the main thread (as Ctrl-C
    raises KeyboardInterrupt), so the code it interrupts can clean up; nothing elsewhere
    (only the main thread may set a handler)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as handle:
            return sum(1 for _ in handle)
    except (FileNotFoundError, NotADirectoryError):
        return 0


def rank_error(log: Path | None) -> str:
    """The ranks' one-line error from ``log`` (None: the output went to the terminal): the
    runtime's own (``qsync_lab.runtime: error: …``), else the last line of the first
    exception a rank raised (torchrun's ``ChildFailedError`` that follows it is left out),
    else the log's last line; never empty.

    Example::

        >>> import pathlib, tempfile
        >>> log = pathlib.Path(tempfile.mkdtemp()) / "launch.log"
        >>> _ = log.write_text("W0101 warning\\nqsync_lab.runtime: error: no such file\\n")
        >>> rank_error(log), rank_error(None)
        ('no such file', "see the ranks' output above")
        >>> _ = log.write_text("[rank1]: Traceback (most recent call last):\\n"
        ...                    '[rank1]:   File "x.py", line 1, in <module>\\n'
        ...                    "[rank1]: ValueError: bad batch\\nTraceback (most recent call "
        ...                    "last):\\n  File \\"run.py\\"\\n"
        ...                    "torch.distributed.elastic.multiprocessing.errors."
        ...                    "ChildFailedError: \\n"
        ...                    "=====\\n")
        >>> rank_error(log)
        'ValueError: bad batch'
    """
    if log is None:
        return "see the ranks' output above"
    text = log.read_text(encoding="utf-8", errors="replace")
    lines = [_RANK_PREFIX.sub("", line).rstrip() for line in text.splitlines()]
    # the last on its line: two ranks' messages written at once may share one
    own = [line.rsplit(_RUNTIME_ERROR, 1)[1].strip() for line in lines if _RUNTIME_ERROR in line]
    own = [error for error in own if error]
    if own:
        return own[-1]
    raised = _raised(lines)
    if raised:  # the first: a later rank's is often its peer's loss ("Connection closed")
        return raised[0]
    shown = [line.strip() for line in lines if line.strip(" =-")]
    return shown[-1] if shown else "no output"


def _raised(lines: list[str]) -> list[str]:
    """The last line of each Python traceback in ``lines`` (the exception raised), in order,
    but torchrun's ``ChildFailedError``, whose details follow on lines of their own.

    Example::

        >>> _raised(["Traceback (most recent call last):", '  File "a.py", line 1',
        ...          "KeyError: 'x'", "MemoryError"])
        ["KeyError: 'x'"]
    """
    raised, inside = [], False
    for line in lines:
        if line.startswith(_TRACEBACK):
            inside = True
        elif inside and line and not line.startswith(" "):  # frames are indented
            inside = False
            if not line.partition(":")[0].endswith("ChildFailedError"):
                raised.append(line.strip())
    return raised


def _rank_pids(run_dir: "str | os.PathLike[str] | None") -> list[int]:
    """The pids the ranks wrote to ``run_dir/ranks/rank<N>.json`` (none without a folder)."""
    if run_dir is None:
        return []
    return [json.loads(p.read_text(encoding="utf-8"))["pid"]
            for p in sorted((Path(run_dir) / "ranks").glob("rank*.json"))]


def _signal_group(leader: int, sig: int) -> None:
    """Send ``sig`` to the process group that ``leader`` leads, if it still does."""
    try:
        if os.getpgid(leader) == leader:
            os.killpg(leader, sig)
    except ProcessLookupError:
        pass
