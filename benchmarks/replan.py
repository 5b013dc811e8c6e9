"""Re-planning speed: a slider change on ResNet-50 and the QSync paper cluster (issue #20).

A widget re-plans and redraws when the user moves a memory-limit or throughput-target
slider. This builds ``Study("resnet50", cluster="qsync-paper")`` (16 V100 + 16 T4, batch 32
per rank, catalog roofline costs; tracing and the indicator's two calibration batches are
timed apart), times a cold ``allocate`` (a fresh allocator: evaluator, candidates,
frontiers, nothing memoized; median of 3), then the first ``study.plan()`` (it fills the
study's allocator) and 20 slider changes as a user drags: the throughput target down from
past the best reachable to slower than the default pace, then the memory limit of every
rank down past what any plan fits. A change is ``study.plan(...)`` plus
``study.simulate(plan)`` (the data a redraw needs); a change no plan meets raises its
one-line error, which is what the redraw shows. Every re-plan is then checked against a
cold ``allocate`` of the same constraints (outside the timing).

Target: <= 300 ms median per change.

Run: ``.venv/bin/python benchmarks/replan.py [--out FILE]``.
"""

import argparse
import datetime
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

import qsync_lab
from qsync_lab.allocate import Constraints, allocate
from qsync_lab.errors import QSyncError
from reporting import finish_report, load_line

TARGET_MS = 300.0
COLD_REPEATS = 3
#: (slider, value) in the order a user drags them; the other slider keeps its last value
CHANGES = ([("throughput_target", t) for t in (9800, 9400, 9000, 8800, 8600, 8400, 8200, 8000,
                                               7700, 7400)]
           + [("memory_limit", m) for m in (12.0, 8.0, 6.0, 5.0, 4.5, 4.2, 4.0, 3.8, 3.65, 3.5)])


def study_ready() -> tuple[qsync_lab.Study, list[str]]:
    """The study with its graph, prepared graph and indicator computed, and what they took."""
    lines, start = [], time.perf_counter()
    study = qsync_lab.Study("resnet50", cluster="qsync-paper", progress=False)
    _ = study.prepared
    lines.append(f"traced and prepared resnet50 ({len(study.graph.ops)} ops) in "
                 f"{time.perf_counter() - start:.1f} s")
    start = time.perf_counter()
    scores = study.indicator()
    lines.append(f"indicator: {len(scores)} ops scored in {time.perf_counter() - start:.1f} s "
                 f"(not part of any timing below)")
    return study, lines


def cold_allocate(study: qsync_lab.Study, *, memory_limit: float | None = None,
                  throughput_target: float | None = None):
    """A cold allocation of the study's inputs (a fresh allocator) under the sliders'
    constraints: ``memory_limit`` GiB on every rank, ``throughput_target`` samples/s."""
    memory = dict.fromkeys(study.cluster.device_kinds, memory_limit) if memory_limit else {}
    return allocate(study.prepared, study.cluster, study.costs, study.indicator(),
                    Constraints(memory, throughput_target), optimizer=study.optimizer)


def timed(call) -> tuple[float, float, object]:
    """``call()``'s wall time and this process's CPU time in ms, and its result or its
    one-line error."""
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        result = call()
    except QSyncError as err:
        result = f"error: {err}"
    return (time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3, result


def redraw(study: qsync_lab.Study, **constraints):
    """A slider change: the plan under ``constraints`` and its simulated iteration."""
    plan = study.plan(**constraints)
    return plan, study.simulate(plan)


def outcome(result) -> str:
    """A change's plan in a few words."""
    if isinstance(result, str):
        return result[:110]
    plan, sim = result
    return (f"low-precision ops {plan.low_precision_ops()}, "
            f"{sim.throughput_samples_per_s:.0f} samples/s")


def cold_lines(study: qsync_lab.Study) -> tuple[float, list[str]]:
    """The median cold allocate (wall ms) and the report's lines on it and the first plan."""
    cold = [timed(lambda: cold_allocate(study))[:2] for _ in range(COLD_REPEATS)]
    wall_ms, cpu_ms = (statistics.median(column) for column in zip(*cold))
    first_ms, _, _ = timed(lambda: redraw(study))
    return wall_ms, [f"cold allocate: median {wall_ms:.0f} ms wall, {cpu_ms:.0f} ms CPU, of "
                     f"{COLD_REPEATS}; first study.plan() + simulate (fills the allocator): "
                     f"{first_ms:.0f} ms"]


def drag(study: qsync_lab.Study) -> list[tuple[dict, float, float, object]]:
    """Each of :data:`CHANGES` in turn: (the sliders' values, wall ms, CPU ms, result)."""
    state: dict[str, float] = {}
    changes = []
    for slider, value in CHANGES:
        state[slider] = value
        changes.append((dict(state), *timed(lambda: redraw(study, **state))))
    return changes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the report here")
    args = parser.parse_args()
    report = [f"# benchmarks/replan.py, {datetime.datetime.now(datetime.UTC):%Y-%m-%dT%H:%MZ}, "
              f"{platform.machine()} CPU ({os.cpu_count()} cores, shared with other jobs), "
              f"torch {torch.__version__}; {load_line('before')}"]
    study, lines = study_ready()
    cold_ms, cold = cold_lines(study)
    changes = drag(study)
    report += [*lines, *cold, f"\n{'change':>24} {'wall ms':>8} {'CPU ms':>7}  plan"]
    report += [f"{slider + ' ' + format(value, 'g'):>24} {ms:8.0f} {cpu_ms:7.0f}  "
               f"{outcome(result)}"
               for (slider, value), (_, ms, cpu_ms, result) in zip(CHANGES, changes)]
    times = [ms for _, ms, _, _ in changes]
    median, p90 = statistics.median(times), float(np.percentile(times, 90))
    cpu_median = statistics.median(cpu_ms for _, _, cpu_ms, _ in changes)
    same = sum(_same_as_cold(study, state, result) for state, _, _, result in changes)
    report += [f"\nslider change (re-plan + simulate): median {median:.0f} ms, p90 {p90:.0f} ms "
               f"wall over {len(times)} changes (CPU median {cpu_median:.0f} ms); cold allocate "
               f"{cold_ms:.0f} ms ({cold_ms / median:.1f}x the median change); target <= "
               f"{TARGET_MS:g} ms median: {'ok' if median <= TARGET_MS else 'MISS'}",
               f"every re-plan identical to a cold allocate of its constraints: "
               f"{same}/{len(changes)}"]
    finish_report(report, args.out)


def _same_as_cold(study: qsync_lab.Study, constraints: dict, result) -> bool:
    """Whether a change's plan (or error) is what a cold allocation gives."""
    *_, cold = timed(lambda: cold_allocate(study, **constraints))
    if isinstance(result, str) or isinstance(cold, str):
        return result == cold
    return result[0] == cold.for_model(study.zoo_name, study.model_kwargs)


if __name__ == "__main__":
    main()
