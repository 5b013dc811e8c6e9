"""The tuner's controls for one study, and the :class:`TunerSettings` they say.

Per device kind: its rank count, its per-rank batch size (kinds whose ranks all have one)
and its memory budget in GiB; then the throughput target (0: the fastest kind's fp32
pace), the strategy and the gradient compression.

Example::

    >>> from qsync_lab import Study
    >>> controls = TunerControls.for_study(Study("digits_cnn", cluster="local-hybrid",
    ...                                          progress=False), throughput_max=1000.0)
    >>> controls.counts["T4"].value = 3
    >>> controls.settings().counts, controls.settings().compression
    ({'V100-SXM2-32GB': 1, 'T4': 3}, None)
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import ipywidgets as widgets

from qsync_lab.allocate import STRATEGIES
from qsync_lab.devices import BYTES_PER_GIB
from qsync_lab.widgets.replan import TunerSettings
from qsync_lab.widgets.shape import kind_batch_sizes, kind_counts

if TYPE_CHECKING:
    from qsync_lab.study import Study

__all__ = ["COMPRESSIONS", "TunerControls"]

#: (label, spec) of the compression dropdown; "" is none
COMPRESSIONS = (("none", ""), ("fp16", "fp16"), ("global_qsgd:8", "global_qsgd:8"),
                ("cgx:4", "cgx:4"), ("qsgd:4", "qsgd:4"), ("aps:fp8_e4m3", "aps:fp8_e4m3"))
MAX_RANKS = 4096
MAX_BATCH = 65536
MEMORY_STEP_GIB = 0.01
_STYLE = {"description_width": "250px"}
_LAYOUT = {"width": "520px"}  # labels of 250 px ("V100-SXM2-32GB batch per rank")


@dataclass
class TunerControls:
    """The controls (set a control's ``.value`` to re-plan).

    Attributes:
        counts: device kind -> ranks (``BoundedIntText``).
        batch_sizes: device kind -> per-rank batch (``BoundedIntText``).
        memory_gib: device kind -> per-rank memory budget (``FloatSlider``, GiB).
        throughput: the least samples/s (``FloatSlider``; 0: the default pace).
        strategy: ``Dropdown`` over :data:`qsync_lab.allocate.STRATEGIES`.
        compression: ``Dropdown`` over :data:`COMPRESSIONS`.
    """

    counts: dict[str, widgets.BoundedIntText]
    batch_sizes: dict[str, widgets.BoundedIntText]
    memory_gib: dict[str, widgets.FloatSlider]
    throughput: widgets.FloatSlider
    strategy: widgets.Dropdown
    compression: widgets.Dropdown

    @classmethod
    def for_study(cls, study: "Study", *, throughput_max: float) -> "TunerControls":
        """Controls at ``study``'s cluster and the default constraints; the throughput
        slider reaches ``throughput_max`` samples/s."""
        cluster = study.cluster
        memory_max = {k: cluster.catalog.device(k).memory_bytes / BYTES_PER_GIB
                      for k in cluster.device_kinds}
        return cls(
            counts={k: widgets.BoundedIntText(n, min=0, max=MAX_RANKS, description=f"{k} ranks",
                                              style=_STYLE, layout=_LAYOUT)
                    for k, n in kind_counts(cluster).items()},
            batch_sizes={k: widgets.BoundedIntText(b, min=1, max=MAX_BATCH,
                                                   description=f"{k} batch per rank",
                                                   style=_STYLE, layout=_LAYOUT)
                         for k, b in kind_batch_sizes(cluster).items()},
            memory_gib={k: widgets.FloatSlider(gib, min=MEMORY_STEP_GIB, max=gib,
                                               step=MEMORY_STEP_GIB, continuous_update=False,
                                               description=f"{k} memory (GiB)", style=_STYLE,
                                               layout=_LAYOUT)
                        for k, gib in memory_max.items()},
            throughput=widgets.FloatSlider(
                0.0, min=0.0, max=throughput_max, step=throughput_max / 1000,
                continuous_update=False, readout_format=".1f", style=_STYLE, layout=_LAYOUT,
                description="throughput target (samples/s)",
                tooltip="0: the fastest device kind's fp32 pace"),
            strategy=widgets.Dropdown(options=list(STRATEGIES), value="qsync",
                                      description="strategy", style=_STYLE, layout=_LAYOUT),
            compression=widgets.Dropdown(options=COMPRESSIONS, value="",
                                         description="gradient compression", style=_STYLE,
                                         layout=_LAYOUT),
        )

    def settings(self) -> TunerSettings:
        """What the controls say now."""
        return TunerSettings(
            counts={k: w.value for k, w in self.counts.items()},
            batch_sizes={k: w.value for k, w in self.batch_sizes.items()},
            memory_gib={k: w.value for k, w in self.memory_gib.items()},
            throughput_samples_per_s=self.throughput.value or None,
            strategy=self.strategy.value, compression=self.compression.value or None)

    def all(self) -> list[widgets.ValueWidget]:
        """Every control."""
        return [*self.counts.values(), *self.batch_sizes.values(), *self.memory_gib.values(),
                self.throughput, self.strategy, self.compression]

    def box(self) -> widgets.VBox:
        """The controls, one group per line of concern."""
        def group(title: str, items) -> widgets.VBox:
            return widgets.VBox([widgets.HTML(f"<b>{title}</b>"), *items])

        # never narrower than its controls: a wide summary beside it wraps instead
        return widgets.VBox([
            group("cluster", [*self.counts.values(), *self.batch_sizes.values()]),
            group("memory budget per rank", self.memory_gib.values()),
            group("plan", [self.throughput, self.strategy, self.compression]),
        ], layout=widgets.Layout(flex="0 0 auto", min_width=_LAYOUT["width"]))
