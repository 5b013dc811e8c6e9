"""A plan trained on this machine's emulated ranks in the background: torchrun started as
``qsync-lab run`` starts it (:func:`qsync_lab.runtime.launch.start`), ``metrics.jsonl``
read as it grows, and a cancel that leaves no process behind
(:func:`~qsync_lab.runtime.launch.stop_run`).

Example::

    >>> import json, pathlib, tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "metrics.jsonl"
    >>> _ = path.write_text(json.dumps({"step": 0}) + "\\n" + '{"step": 1')  # line 2 unfinished
    >>> read_new_metrics(path, 0)
    ([{'step': 0}], 12)
    >>> read_new_metrics(path, 12)
    ([], 12)
"""

import json
import os
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qsync_lab.cluster import Cluster
from qsync_lab.errors import QSyncError
from qsync_lab.plan import Plan
from qsync_lab.runtime.launch import LOG_NAME, STOP_GRACE_S, rank_error, start, stop_run
from qsync_lab.runtime.lock import check_run_dir_free
from qsync_lab.runtime.metrics import summary_line
from qsync_lab.runtime.options import TrainConfig
from qsync_lab.widgets.export import PLAN_NAME

if TYPE_CHECKING:
    from qsync_lab.study import Study

__all__ = ["LocalRun", "read_new_metrics", "runs_here"]

POLL_S = 0.5


def read_new_metrics(path: "str | os.PathLike[str]", offset: int) -> tuple[list[dict], int]:
    """The records of ``path``'s complete lines after byte ``offset``, and the offset after
    them (a line still being written is read by a later call; a missing file has none)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            data = handle.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    records = []
    for line in data[:end].splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records, offset + end


def runs_here(cluster: Cluster) -> bool:
    """Whether this machine runs every rank of ``cluster`` (CPU ranks, or emulated ones)."""
    return all(r.emulate_on is not None or cluster.catalog.device(r.device).kind == "cpu"
               for r in cluster.ranks)


class LocalRun:
    """``plan`` training for ``steps`` steps on this machine, started on construction.

    Attributes:
        run_dir: the run's folder (``plan.json``, ``launch.log``, ``metrics.jsonl``,
            ``summary.json``).
        steps: the steps asked for.
        predicted_step_ms: what the simulator predicts a local step takes
            (:meth:`~qsync_lab.study.Study.predict_run`).
        records: the ``metrics.jsonl`` records read so far (:meth:`poll`).
        process: torchrun.

    Raises:
        QSyncError: the cluster has ranks this machine does not run, or a check of
            :func:`~qsync_lab.runtime.launch.check_run` failed (nothing started).
    """

    def __init__(self, study: "Study", plan: Plan, run_dir: "str | os.PathLike[str]", *,
                 steps: int) -> None:
        if not runs_here(plan.cluster):
            raise QSyncError(f"cluster {plan.cluster.name!r} has ranks this machine does not "
                             "emulate; export the plan and run it there (or plan on "
                             "local-hybrid)")
        self.run_dir, self.steps = Path(run_dir), steps
        check_run_dir_free(self.run_dir)  # the plan of a run still going there is kept
        path = self.run_dir / PLAN_NAME
        plan.save(path)
        self.predicted_step_ms = study.predict_run(plan).iteration_us / 1e3
        self.records: list[dict[str, Any]] = []
        self.cancelled = False
        self._offset = 0
        threads = study.run_threads
        self.process = start(TrainConfig(plan=str(path), run_dir=str(self.run_dir), steps=steps,
                                         profiles=study.profiles), threads=threads,
                             env={"OMP_NUM_THREADS": str(threads)} if threads else None)

    def poll(self) -> list[dict[str, Any]]:
        """The records written since the last call (also appended to :attr:`records`)."""
        new, self._offset = read_new_metrics(self.run_dir / "metrics.jsonl", self._offset)
        self.records += new
        return new

    def follow(self, on_change: Callable[["LocalRun"], None]) -> threading.Thread:
        """Call ``on_change(self)`` from a background thread whenever records arrive, and
        once more when the run has ended; returns the (started) thread."""
        def loop() -> None:
            while True:
                try:
                    ended = self.process.wait(POLL_S) is not None
                except subprocess.TimeoutExpired:
                    ended = False
                if self.poll() or ended:
                    on_change(self)
                if ended:
                    return

        thread = threading.Thread(target=loop, name=f"qsync-run {self.run_dir.name}",
                                  daemon=True)
        thread.start()
        return thread

    def cancel(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop the run and every process it started (nothing to do once it ended)."""
        if self.process.poll() is not None:
            return
        self.cancelled = True
        stop_run(self.process, self.run_dir, grace_s=grace_s)

    def outcome(self) -> str:
        """One line on the ended run: measured against predicted, or why it stopped."""
        code = self.process.returncode
        if self.cancelled:
            return f"cancelled after {len(self.records)} of {self.steps} steps"
        if code:
            log = self.run_dir / LOG_NAME
            return f"the run failed (torchrun exit {code}): {rank_error(log)}; see {log}"
        summary = json.loads((self.run_dir / "summary.json").read_text(encoding="utf-8"))
        return f"{summary_line(summary)}; wrote {self.run_dir / 'summary.json'}"
