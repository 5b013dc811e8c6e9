"""Measure this machine: op times per precision and phase, casts, allreduces; write profiles.

* :func:`profile_ops` times every op of a model (forward, input gradient, weight
  gradient) in each precision, as the runtime runs it: alone, or inside training steps of
  the whole model (:mod:`qsync_lab.profile.in_step`);
* :func:`profile_casts` / :func:`fit_casts` time the runtime's precision conversions and
  fit ``a·numel + b`` per pair with R²;
* :func:`profile_allreduce` / :func:`fit_alpha_beta` time allreduces on the real backend
  and fit the link's α–β; :func:`measure_ddp_overhead` / :func:`fit_ddp_link` fit it to
  what real DDP steps of calibration models add (the link the simulator should use);
* :func:`profile_machine` runs all of it and writes one profile CSV
  (:func:`qsync_lab.costs.load_cost_model` turns profiles into a cost model);
* on a GPU, ``device="cuda"`` (ops, casts, step overhead, :func:`profile_machine`) runs them
  there, times them with CUDA events (:mod:`qsync_lab.profile.timing`) and names the rows
  after the GPU's catalog kind.

Example::

    >>> from qsync_lab.profile import fit_line
    >>> fit_line([0, 1], [2, 4]).slope
    2.0
"""

from qsync_lab.profile.allreduce import (AlphaBetaFit, default_sizes, fit_alpha_beta,
                                         profile_allreduce)
from qsync_lab.profile.casts import (default_cast_sizes, default_copy_sizes, fit_casts,
                                     profile_casts)
from qsync_lab.profile.compression import (DEFAULT_COMPRESSION_SPECS, default_compression_sizes,
                                           profile_compression)
from qsync_lab.profile.concurrent import median_over_processes, profile_ops_concurrently
from qsync_lab.profile.ddp_link import (copy_pass_us, fit_buffer_broadcast,
                                       fit_compressed_steps, fit_ddp_link,
                                       measure_buffer_broadcast, measure_compressed_steps,
                                       measure_ddp_overhead)
from qsync_lab.profile.fit import LineFit, fit_line
from qsync_lab.profile.machine import LINK_METHODS, ProfileJob, ProfileWritten, profile_machine
from qsync_lab.profile.ops import METHODS, autograd_call_overhead_us, profile_ops
from qsync_lab.profile.overhead import fit_step_overhead, step_overhead_metadata
from qsync_lab.profile.timing import intra_op_threads, median_time_us, run_metadata

__all__ = [
    "DEFAULT_COMPRESSION_SPECS", "LINK_METHODS", "METHODS", "AlphaBetaFit", "LineFit",
    "ProfileJob", "ProfileWritten", "autograd_call_overhead_us", "copy_pass_us",
    "default_cast_sizes", "default_compression_sizes", "default_copy_sizes", "default_sizes",
    "fit_alpha_beta", "fit_buffer_broadcast", "fit_casts", "fit_compressed_steps",
    "fit_ddp_link", "fit_line", "fit_step_overhead", "intra_op_threads",
    "measure_buffer_broadcast", "measure_compressed_steps", "measure_ddp_overhead",
    "median_over_processes", "median_time_us", "profile_allreduce", "profile_casts",
    "profile_compression", "profile_machine", "profile_ops", "profile_ops_concurrently",
    "run_metadata", "step_overhead_metadata",
]
