"""What each bucket's gradient communication costs, compressed as the settings say.

A bucket's parameters are grouped by spec as the hook groups them
(:func:`qsync_lab.compress.spec.bucket_groups`) and the groups run one after the other on
the sender thread, so a bucket's communication lasts the sum of:

* uncompressed parameters: a ring allreduce of their fp32 bytes;
* each compressed group (its method's :attr:`~qsync_lab.compress.methods.Method.wire`, from
  the registry, so the simulator never loads the hook): the scale all-reduce (MAX) if the method
  has one, the encode, the collective of the payload (a ring allreduce of the codes, or a
  ring all-gather of every rank's payload) and the decode of each payload the rank receives
  (one for an allreduce, one per rank for an all-gather: the profile's decode line, measured
  on one rank, counted once per payload; for CGX, APS and QSGD, which sum the ranks' values
  in one pass over the sum (``cgx_decode_mean``, ``float_decode_sum``, ``qsgd_decode_sum``),
  that counts its write once per rank, an overestimate of (ranks - 1) writes). Encode
  (error feedback included) and decode times come from the profile's lines measured through
  the hook
  (:meth:`~qsync_lab.costs.CostModel.compression_time_us`, keyed by the spec's
  ``cost_label``), else from the roofline of the bytes they touch, on the slowest device
  of the cluster; where the profile calibrated the spec on real DDP steps, what the hook
  added there beyond this estimate is added too
  (:meth:`~qsync_lab.costs.CostModel.compression_in_step_us`,
  :func:`~qsync_lab.profile.ddp_link.fit_compressed_steps`).

Example::

    >>> import torch, torch.nn as nn
    >>> from qsync_lab.cluster import load_cluster
    >>> from qsync_lab.costs import CostModel
    >>> from qsync_lab.graph import trace_graph
    >>> from qsync_lab.simulate import prepare_graph
    >>> linear = nn.Linear(2048, 2048, bias=False)
    >>> prepared = prepare_graph(trace_graph(linear, torch.randn(2, 2048)))
    >>> cluster = load_cluster("v100-t4-small")
    >>> plain, = bucket_comm(prepared, cluster, CostModel(), None)
    >>> compressed, = bucket_comm(prepared, cluster, CostModel(), "global_qsgd:8")
    >>> round(plain.cost.us), round(compressed.cost.us), compressed.cost.source
    (1616, 675, 'compress:global_qsgd:8 + alpha-beta:pcie3_x16')
    >>> round(float(plain.sent_bytes / compressed.sent_bytes), 3), compressed.label
    (4.0, 'global_qsgd:8')
"""

from dataclasses import dataclass

from qsync_lab.cluster import Cluster
from qsync_lab.compress.methods import METHODS
from qsync_lab.compress.spec import CompressionSettings, CompressionSpec, bucket_groups
from qsync_lab.costs import Cost, CostModel, ring_wire_bytes
from qsync_lab.devices import DeviceSpec
from qsync_lab.simulate.prepare import PreparedGraph

__all__ = ["BucketComm", "bucket_comm", "compressor_costs"]

_FP32_BYTES = 4
#: error feedback's bytes per element: the residual added (read 8, write 4), the error
#: written (4 where the method's encode writes it in its own pass; where it decodes its payload
#: and subtracts, 12 more) and copied into the residual (read 4, write 4)
_FEEDBACK_BYTES = 24.0
_DECODED_ERROR_BYTES = 12.0


@dataclass(frozen=True)
class BucketComm:
    """One bucket's communication: its cost, the bytes each rank sends, and what it sends
    (``fp32``, or the compression specs of its groups)."""

    cost: Cost
    sent_bytes: float
    label: str


def bucket_comm(prepared: PreparedGraph, cluster: Cluster, costs: CostModel, settings,
                links=None) -> list[BucketComm]:
    """Per bucket (in reduction order) its communication (see the module docstring).

    Args:
        settings: compression settings (a spec, a mapping, or None: plain fp32 allreduce).
        links: the ring's links (default: :meth:`~qsync_lab.cluster.Cluster.ring_links`).
    """
    world = cluster.world_size
    if world == 1:
        return []
    links = links if links is not None else cluster.ring_links()
    settings = CompressionSettings.parse(settings)
    if not settings:
        return [BucketComm(costs.allreduce_time_us(size, world, links),
                           ring_wire_bytes(size, world), "fp32")
                for size in prepared.bucket_bytes]
    device = min((cluster.catalog.device(kind) for kind in cluster.device_kinds),
                 key=lambda d: d.memory_bandwidth_Bps)
    params = prepared.graph.params
    out = []
    for _, members in prepared.buckets.groupby("bucket", sort=True):
        names = list(members["param"])
        shapes = [_Shape(int(params.at[n, "numel"]), len(params.at[n, "shape"])) for n in names]
        total_us, sent, sources, labels = 0.0, 0.0, [], []
        for group in bucket_groups(names, shapes, settings):
            if group.spec is None:
                cost = costs.allreduce_time_us(_FP32_BYTES * group.numel, world, links)
                total_us += cost.us
                sent += ring_wire_bytes(_FP32_BYTES * group.numel, world)
                sources.append(cost.source)
                labels.append("fp32")
                continue
            segments = [(0, n) for _, n in group.slices]
            wire = METHODS[group.spec.method].wire(group.numel, segments, group.spec, world)
            spec, label = str(group.spec), group.spec.cost_label
            collective = (costs.allreduce_time_us if wire.collective == "allreduce"
                          else costs.allgather_time_us)(wire.payload_bytes, world, links)
            encode, decode = compressor_costs(costs, group.spec, group.numel, segments, world,
                                              device)
            sync_us = (costs.allreduce_time_us(wire.scale_sync_bytes, world, links).us
                       if wire.scale_sync_bytes else 0.0)
            in_step = costs.compression_in_step_us(label, group.numel, device)
            total_us += max(0.0, sync_us + encode.us + collective.us + decode.us + in_step.us)
            sent += (ring_wire_bytes(wire.payload_bytes, world) if wire.collective == "allreduce"
                     else (world - 1) * wire.payload_bytes)
            sent += ring_wire_bytes(wire.scale_sync_bytes, world)
            sources.append(f"compress:{spec} + {collective.source}")
            labels.append(spec)
        out.append(BucketComm(Cost(float(total_us), " + ".join(dict.fromkeys(sources))),
                              float(sent), " + ".join(labels)))
    return out


def compressor_costs(costs: CostModel, spec: CompressionSpec, numel: int,
                     segments: list[tuple[int, int]], world: int,
                     device: DeviceSpec) -> tuple[Cost, Cost]:
    """One compressed group's encode (error feedback included) and its decodes (one per
    payload the rank receives) on ``device`` (see the module docstring).

    Example::

        >>> from qsync_lab.devices import load_catalog
        >>> spec = CompressionSpec.parse("cgx:8")
        >>> encode, decode = compressor_costs(CostModel(), spec, 2**20, [(0, 2**20)], 4,
        ...                                   load_catalog().device("T4"))
        >>> encode.us > 0, decode.us > 0
        (True, True)
    """
    method = METHODS[spec.method]
    wire = method.wire(numel, segments, spec, world)
    feedback_bytes = (_FEEDBACK_BYTES + (not method.error_from_encode) * _DECODED_ERROR_BYTES
                      if spec.error_feedback else 0.0)
    encode = costs.compression_time_us(spec.cost_label, "encode", numel,
                                       wire.encode_bytes + feedback_bytes, device)
    decode = costs.compression_time_us(spec.cost_label, "decode", numel, wire.decode_bytes,
                                       device)
    decodes = world if wire.collective == "allgather" else 1
    return encode, Cost(decodes * decode.us, decode.source)


class _Shape:
    """What :func:`~qsync_lab.compress.spec.bucket_groups` reads of a parameter."""

    def __init__(self, numel: int, ndim: int) -> None:
        self._numel, self._ndim = numel, ndim

    def numel(self) -> int:
        return self._numel

    def dim(self) -> int:
        return self._ndim
