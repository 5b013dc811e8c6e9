"""How a cluster is shown: one row per device kind (:func:`cluster_summary`, behind
:meth:`Cluster.summary <qsync_lab.cluster.Cluster.summary>`) and a few lines of text
(:func:`cluster_text`, behind ``str(cluster)``).

Example::

    >>> from qsync_lab.cluster import load_cluster
    >>> print(cluster_text(load_cluster("local-hybrid")))
    local-hybrid: 2 ranks on 1 node, global batch 32
      1 x V100-SXM2-32GB on 1 node (loopback), batch 16/rank, 32 GiB, 15.7 TFLOPS fp32, 125 TFLOPS fp16, 1 emulated on cpu
      1 x T4 on 1 node (loopback), batch 16/rank, 16 GiB, 8.1 TFLOPS fp32, 130 TFLOPS int8, 1 emulated on cpu
"""

import math

import pandas as pd

from qsync_lab.devices import (BYTES_PER_GB, BYTES_PER_GIB, FLOPS_PER_TFLOPS, US_PER_SECOND,
                               DeviceSpec, LinkSpec)
from qsync_lab.precision import Precision

__all__ = ["cluster_summary", "cluster_text"]


def cluster_summary(cluster) -> pd.DataFrame:
    """One row per device kind of a :class:`~qsync_lab.cluster.Cluster`, indexed by device
    name (the columns: :meth:`Cluster.summary <qsync_lab.cluster.Cluster.summary>`).

    Example::

        >>> from qsync_lab.cluster import load_cluster
        >>> cluster_summary(load_cluster("qsync-paper"))["ranks"].tolist()
        [16, 16]
    """
    rows = [_summary_row(cluster, kind) for kind in cluster.device_kinds]
    frame = pd.DataFrame(rows).set_index("device")
    frame["batch_size_per_rank"] = frame["batch_size_per_rank"].astype("Int64")
    return frame


def cluster_text(cluster) -> str:
    """A :class:`~qsync_lab.cluster.Cluster` in a few lines: its size, then one line per
    device kind (see the module's example)."""
    nodes = "node" if len(cluster.node_names) == 1 else "nodes"
    head = (
        f"{cluster.name}: {cluster.world_size} ranks on {len(cluster.node_names)} {nodes}, "
        f"global batch {cluster.global_batch_size}"
    )
    if cluster.inter_node_link is not None:
        head += f", between nodes {_describe_link(cluster.inter_node_link)}"
    lines = [head]
    for device, row in cluster_summary(cluster).iterrows():
        batch = (
            "mixed batch sizes"
            if pd.isna(row.batch_size_per_rank)
            else f"batch {row.batch_size_per_rank}/rank"
        )
        line = (
            f"  {row.ranks} x {device} on {row.nodes} {'node' if row.nodes == 1 else 'nodes'}"
            f" ({row.intra_node_links}), {batch}, {row.memory_gib:g} GiB,"
            f" {row.fp32_tflops:g} TFLOPS fp32"
        )
        if isinstance(row.low_precision, str):
            line += f", {row.low_precision_tflops:g} TFLOPS {row.low_precision}"
        if row.emulated_ranks:
            line += f", {row.emulated_ranks} emulated on cpu"
        lines.append(line)
    return "\n".join(lines)


def _summary_row(cluster, kind: str) -> dict[str, object]:
    spec = cluster.catalog.device(kind)
    ranks = [r for r in cluster.ranks if r.device == kind]
    batch_sizes = {r.batch_size for r in ranks}
    batch_total = sum(r.batch_size for r in ranks)
    fp32_tflops = spec.peak_flops.get(Precision.FP32, math.nan) / FLOPS_PER_TFLOPS
    low_precision, low_tflops = _fastest_low_precision(spec)
    return {
        "device": kind,
        "ranks": len(ranks),
        "nodes": len({r.node for r in ranks}),
        "emulated_ranks": sum(r.emulate_on is not None for r in ranks),
        "intra_node_links": ", ".join(
            dict.fromkeys(cluster.intra_node_links[r.node].name for r in ranks)
        ),
        "batch_size_per_rank": batch_sizes.pop() if len(batch_sizes) == 1 else pd.NA,
        "batch_size_total": batch_total,
        "batch_share": batch_total / cluster.global_batch_size,
        "memory_gib": spec.memory_bytes / BYTES_PER_GIB,
        "fp32_tflops": fp32_tflops,
        "low_precision": low_precision,
        "low_precision_tflops": low_tflops,
        "fp32_tflops_total": fp32_tflops * len(ranks),
        "low_precision_tflops_total": low_tflops * len(ranks),
        "precisions": ", ".join(spec.precision_list),
    }


def _describe_link(link: LinkSpec) -> str:
    bandwidth_GBps = link.bandwidth_Bps / BYTES_PER_GB
    return f"{link.name} ({bandwidth_GBps:g} GB/s, {link.latency_s * US_PER_SECOND:g} us)"


def _fastest_low_precision(spec: DeviceSpec) -> tuple[str | None, float]:
    """The supported precision other than fp32 with the highest peak (first on ties)."""
    low = [p for p in spec.precision_list if p is not Precision.FP32]
    if not low:
        return None, math.nan
    best = max(low, key=lambda p: spec.peak_flops[p])
    return str(best), spec.peak_flops[best] / FLOPS_PER_TFLOPS
