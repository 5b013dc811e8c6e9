"""The tuner's plan summary as HTML: predicted step time and throughput, what the plan was
made under (:meth:`~qsync_lab.plan.Plan.made_under`: what an export records), then per
device kind its ranks, peak memory against its budget and low-precision ops; or a one-line
error above the last feasible plan's summary.

Example::

    >>> error_html("best reachable 0.450 ms, target 0.409 ms\\nmore", None)
    '<div style="color:#c0392b"><b>best reachable 0.450 ms, target 0.409 ms</b></div>'
"""

import html

from qsync_lab.devices import BYTES_PER_GIB
from qsync_lab.widgets.replan import TunerResult

__all__ = ["error_html", "summary_html"]

_ERROR_STYLE = "color:#c0392b"
_TARGET_RTOL = 1e-9


def summary_html(result: TunerResult) -> str:
    """The summary of ``result``."""
    plan, sim, settings = result.plan, result.sim, result.settings
    cluster = plan.cluster
    low_ops = plan.low_precision_ops()
    rows = []
    for kind in cluster.device_kinds:
        ranks = [r.rank for r in cluster.ranks if r.device == kind]
        batches = "/".join(str(b) for b in sorted({cluster.ranks[r].batch_size for r in ranks}))
        peak_gib = sim.tensor_peak_bytes.iloc[ranks].max() / BYTES_PER_GIB
        limit_gib = sim.memory_budget_bytes.iloc[ranks].max() / BYTES_PER_GIB
        rows.append(f"<tr><td>{html.escape(kind)}</td><td>{len(ranks)} x {batches}</td>"
                    f"<td>{peak_gib:.3f} / {limit_gib:.2f} GiB</td><td>{low_ops[kind]}</td></tr>")
    target = settings.throughput_samples_per_s
    note = (f'<div style="{_ERROR_STYLE}">below the throughput target ({target:.1f} samples/s)'
            '</div>' if target and sim.throughput_samples_per_s < target * (1 - _TARGET_RTOL)
            else "")
    return (f"<div><b>{html.escape(plan.strategy)}</b> on {html.escape(cluster.name)}, "
            f"compression {html.escape(str(plan.compression_settings))} "
            f"(re-planned in {result.seconds:.2f} s)<br>"
            f"step time predicted <b>{sim.iteration_us / 1e3:.3f} ms</b>, "
            f"{sim.throughput_samples_per_s:.1f} samples/s<br>"
            f"made under {html.escape(plan.made_under())}</div>"
            "<table><tr><th>device kind</th><th>ranks x batch</th><th>peak memory / budget"
            f"</th><th>low-precision ops</th></tr>{''.join(rows)}</table>{note}")


def error_html(message: str, last: TunerResult | None) -> str:
    """``message``'s first line, above the summary of ``last`` (the plan still shown)."""
    line = f'<div style="{_ERROR_STYLE}"><b>{html.escape(message.splitlines()[0])}</b></div>'
    if last is None:
        return line
    return f"{line}<div><i>still showing the last feasible plan:</i></div>{summary_html(last)}"
