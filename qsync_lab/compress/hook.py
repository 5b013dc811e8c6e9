"""The DDP comm hook: compress each bucket's gradients as their parameters' specs say.

:func:`register_compression` attaches :func:`compression_hook` to a DDP model. For each
bucket the hook looks its parameters up by FQN (``bucket.parameters()`` and the model's
parameter names, never ``bucket.index()``, which changes when DDP rebuilds its buckets),
splits the bucket into groups of parameters that share a spec (None: a plain fp32
allreduce of the mean), and returns a future at once. One sender thread per state then
runs each bucket's groups in bucket order: encode (with the error-feedback residual added
when the spec asks for it), the method's collectives on the compressors' own process group,
decode, and the mean written back into the bucket, which completes the future.

Why a sender thread rather than chaining the collectives with ``Future.then``: the
scale-synchronising methods need two collectives per bucket (the MAX, then the codes),
and a collective issued from a ``then`` callback runs on whichever thread completed the
previous one, so ranks can issue the buckets' collectives in different orders (gloo then
mismatches them; PowerSGD's hook crashes gloo this way at three ranks). One thread that
takes the buckets in DDP's order issues every collective in the same order on every rank,
and the hook itself never waits. Its kernels run on as many Numba threads as the thread that
created the state was set to (Numba's setting is per thread, so a rank or a profile that
limits its own threads limits the hook's too).

Telemetry (:meth:`CompressionState.telemetry`): per method, the relative error of this
rank's compressed gradient ``||Q(g) - g|| / ||g||``, the bits per element on the wire and
the time spent encoding, communicating and decoding (:mod:`qsync_lab.timers`: the host
clock for CPU buckets; for CUDA buckets, CUDA events on the bucket's stream, read only when
the telemetry is, so they time what the stream spent on each part: its kernels, or the
host launching them where that is slower).

CUDA buckets are reduced without a host synchronisation: no value is read back inside the
hook (:func:`~qsync_lab.compress.codec.on_device`). The error norms of the telemetry stay
device tensors until :meth:`~CompressionState.telemetry` reads them, and a bucket that some
rank's NaN or Inf marked raises nothing there: its mean is not finite, the error-feedback
residuals keep their values, and :meth:`~CompressionState.check_finite`, called once per
step outside the hook, raises :class:`~qsync_lab.compress.codec.NonFiniteGradient` on every
rank (CPU buckets raise it in the hook, on every rank, as they always did).

Example::

    >>> import torch, torch.distributed as dist, tempfile
    >>> from torch.nn.parallel import DistributedDataParallel as DDP
    >>> dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}",
    ...                         rank=0, world_size=1)
    >>> model = DDP(torch.nn.Linear(64, 64))
    >>> state = register_compression(model, "global_qsgd:8")
    >>> model(torch.randn(8, 64)).sum().backward()
    >>> sorted(state.telemetry())
    ['fp32', 'global_qsgd']
    >>> state.close(); dist.destroy_process_group()
"""

import contextlib
import queue
import sys
import threading
import zlib
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn

from qsync_lab.compress.codec import NonFiniteGradient, Workspace, cuda_kernels, on_device
from qsync_lab.compress.comm import Comm
from qsync_lab.compress.methods import METHODS, method_module
from qsync_lab.compress.spec import CompressionSettings, Group, bucket_groups
from qsync_lab.errors import QSyncError
from qsync_lab.kernels import l2norm
from qsync_lab.kernels.plumbing import _arr, _f32, exact_div_
from qsync_lab.timers import timer_for

__all__ = ["CompressionState", "StandaloneBucket", "compression_hook", "register_compression"]

_FP32 = "fp32"


_PARTS = ("encode", "comm", "decode")
_NS_PER_MS = 1e6


class _Stats:
    """Telemetry of one method since the last read (the squared norms of CUDA buckets are
    0-d device tensors, read here only when the telemetry is read; the times are the
    state's timers' totals)."""

    def __init__(self) -> None:
        self.elements = 0
        self.error_sq = 0.0
        self.norm_sq = 0.0
        self.wire_bits = 0.0

    def as_dict(self, totals_ns: dict) -> dict[str, float | None]:
        error_sq, norm_sq = float(self.error_sq), float(self.norm_sq)
        return {"elements": self.elements,
                "relative_error": (error_sq / norm_sq) ** 0.5 if norm_sq > 0 else None,
                "bits_per_element": self.wire_bits / self.elements if self.elements else None,
                **{f"{part}_ms": totals_ns.get(part, 0.0) / _NS_PER_MS for part in _PARTS}}


class CompressionState:
    """The hook's state: settings, parameter names, residuals, telemetry, sender thread.

    Args:
        model: the DDP model's module (its parameter names key the settings).
        settings: a spec for every parameter, or a mapping pattern -> spec
            (:class:`~qsync_lab.compress.spec.CompressionSettings`).
        process_group: the group the compressors' collectives run on (default: a new group
            of DDP's backend, so that they never interleave with DDP's own).
        seed: stochastic rounding streams (each rank and bucket call draws its own).
        telemetry: measure the compression error of every ``error_every``-th bucket call
            (it takes the method's compression error, a decode of the rank's own payload
            for all but CGX, and two norms; the times and bits are counted on every call).
    """

    def __init__(self, model: nn.Module, settings, *, process_group=None, seed: int = 0,
                 telemetry: bool = True, error_every: int = 8) -> None:
        self.settings = CompressionSettings.parse(settings)
        self.names = {id(p): name for name, p in model.named_parameters()}
        group = process_group if process_group is not None else dist.new_group(
            backend=dist.get_backend())
        self.comm = Comm(group)
        if not isinstance(error_every, int) or error_every < 1:
            raise QSyncError(f"error_every must be a positive int, got {error_every!r}")
        self.seed, self.record, self.error_every = seed, telemetry, error_every
        self.calls = 0
        self.residuals: dict[str, torch.Tensor] = {}
        self.workspace = Workspace()  # the methods' buffers, reused from bucket to bucket
        self._layouts: dict[tuple[int, ...], tuple[Group, ...]] = {}
        self._stats: dict[str, _Stats] = defaultdict(_Stats)
        self._timers: dict = {}  # device -> its timer (qsync_lab.timers), keys (method, part)
        self._failed: BaseException | None = None
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._numba_threads = _numba_threads_to_set()

    def groups(self, bucket: dist.GradBucket) -> tuple[Group, ...]:
        """The bucket's parameter groups (cached by the bucket's parameters)."""
        params = bucket.parameters()
        key = tuple(id(p) for p in params)
        if key not in self._layouts:
            self._layouts[key] = bucket_groups([self.names[id(p)] for p in params], params,
                                               self.settings)
        return self._layouts[key]

    def submit(self, buffer: torch.Tensor, groups: tuple[Group, ...]) -> torch.futures.Future:
        """Queue one bucket for the sender thread; its future holds the averaged buffer.

        A CUDA bucket is reduced on the stream that produced it (the caller's current
        stream), and its future is CUDA-aware: whoever waits on it waits for that stream.
        """
        cuda = buffer.is_cuda
        future: torch.futures.Future = torch.futures.Future(
            devices=[buffer.device] if cuda else None)
        stream = torch.cuda.current_stream(buffer.device) if cuda else None
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="qsync-compress",
                                            daemon=True)
            self._thread.start()
        self._queue.put((buffer, groups, future, stream))
        return future

    def telemetry(self, reset: bool = True) -> dict[str, dict[str, float | None]]:
        """Per method since the last read: elements, relative error, bits per element on
        the wire, encode/comm/decode milliseconds."""
        with self._lock:
            totals: dict = defaultdict(dict)
            for timer in self._timers.values():
                for (method, part), ns in timer.totals_ns().items():
                    totals[method][part] = totals[method].get(part, 0.0) + ns
            out = {method: stats.as_dict(totals[method])
                   for method, stats in sorted(self._stats.items())}
            if reset:
                self._stats.clear()
                self._timers.clear()
        return out

    def check_finite(self) -> None:
        """Raise :class:`~qsync_lab.compress.codec.NonFiniteGradient` if a CUDA bucket reduced
        since the last call held NaN or Inf on some rank (every rank sees the same marks, so
        every rank raises). The hook keeps those marks on the device and raises nothing for
        them (see the module's doc); this reads them, one host synchronisation: call it once
        per step on every rank, after the backward pass and before the optimizer step. CPU
        buckets raise in the hook itself."""
        marks = self.workspace.pop_nonfinite()
        if not marks:
            return
        seen = torch.stack([mark.reshape(()) for mark in marks.values()]).cpu().tolist()
        bad = [what for what, flag in zip(marks, seen) if flag]
        if bad:
            raise NonFiniteGradient(f"a gradient of {', '.join(sorted(bad))} holds NaN or Inf "
                                    "on some rank; the step is stopped on every rank (lower "
                                    "the learning rate, or check the data and the loss)")

    @property
    def failure(self) -> BaseException | None:
        """The error that stopped the hook (DDP's backward reports it only as text), or None."""
        return self._failed

    def state_dict(self) -> dict:
        """What a resumed run needs to continue bit-exactly: the call count (it seeds the
        rounding) and the error-feedback residuals. Read it between steps."""
        return {"calls": self.calls,
                "residuals": {name: r.clone() for name, r in self.residuals.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`'s ``state`` (residuals on any device: each moves
        to its bucket's at its first use)."""
        self.calls = int(state["calls"])
        self.residuals = {name: r.clone() for name, r in state["residuals"].items()}

    def close(self) -> None:
        """Stop the sender thread (after the buckets already queued)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        if self._numba_threads is not None:
            sys.modules["numba"].set_num_threads(self._numba_threads)  # see the module doc
        device = None
        while (item := self._queue.get()) is not None:
            buffer, groups, future, stream = item
            if self._failed is not None:  # every rank failed at the same bucket
                future.set_exception(self._failed)
                continue
            if stream is not None and stream.device != device:
                # a new thread's current GPU is the first: entering another GPU's stream
                # would switch to it and back at every bucket (a context on GPU 0 per rank)
                device = stream.device
                torch.cuda.set_device(device)
            try:
                with (torch.cuda.stream(stream) if stream is not None
                      else contextlib.nullcontext()):
                    # uncompressed groups are started first and finished last: their
                    # allreduce is in flight while the compressed groups run
                    finishes = [self._reduce_group(buffer, group) for group in groups]
                    for finish in finishes:
                        finish()
                    future.set_result(buffer)  # records the stream's progress (CUDA)
            except BaseException as err:  # noqa: BLE001 - handed to DDP through the future
                self._failed = err
                future.set_exception(err)

    def _reduce_group(self, buffer: torch.Tensor, group: Group):
        """Start reducing one group into ``buffer``; returns the function that finishes it."""
        whole = len(group.slices) == 1 or _contiguous(group.slices)
        first, numel = group.slices[0][0], group.numel
        x = (buffer[first:first + numel] if whole
             else torch.cat([buffer[s:s + n] for s, n in group.slices]))
        comm = self.comm
        comm.timer = timer_for(x.device)  # marks only: _count adds the spans
        if group.spec is None:
            wait = comm.allreduce_sum_started(exact_div_(x, comm.world))
        else:
            x = self._mean(x, group)

        def finish() -> None:
            if group.spec is None:
                wait()
                self._count(_FP32, numel, 32.0 * numel, x.device, [("comm", comm.take_spans())])
            if not whole:
                offset = 0
                for start, n in group.slices:
                    buffer[start:start + n].copy_(x[offset:offset + n])
                    offset += n

        return finish

    def _mean(self, x: torch.Tensor, group: Group) -> torch.Tensor:
        spec, comm, module = group.spec, self.comm, method_module(group.spec)
        segments = _segments(group)
        timer = comm.timer
        begin = timer.mark()
        if spec.error_feedback:
            for name, (start, n) in zip(group.names, segments):
                if name in self.residuals:
                    x[start:start + n] += self._residual_on(name, x.device)
        seed = zlib.crc32(f"{self.seed}:{comm.rank}:{self.calls}".encode()) & (2**62 - 1)
        measure = self.record and self.calls % self.error_every == 0
        self.calls += 1
        device = on_device(x)  # nothing read back to the host from here on
        self.workspace.last_nonfinite = None
        encoded = module.encode(x, segments, spec, comm, seed,
                                error=spec.error_feedback or measure, workspace=self.workspace)
        parts = [("encode", [(begin, timer.mark())]), ("comm", comm.take_spans())]
        error_sq = norm_sq = 0.0
        if encoded.error is not None and measure:
            error_sq, norm_sq = ((_norm_sq(encoded.error), _norm_sq(x)) if device
                                 else (l2norm(encoded.error) ** 2, l2norm(x) ** 2))
        begin = timer.mark()
        module.reduce(encoded, spec, comm, out=x, workspace=self.workspace)  # the mean
        parts += [("decode", [(begin, timer.mark())]), ("comm", comm.take_spans())]
        # the device path's mark of this bucket (None on the CPU, which raised instead)
        bad = self.workspace.last_nonfinite if device else None
        if encoded.error is not None and spec.error_feedback:  # (the error is still there)
            begin = timer.mark()
            self._keep_residuals(group, segments, encoded.error, bad)
            parts.append(("encode", [(begin, timer.mark())]))
        if bad is not None and measure:  # a marked bucket's error is not counted
            error_sq = torch.where(bad, 0.0, error_sq)
            norm_sq = torch.where(bad, 0.0, norm_sq)
        wire = METHODS[spec.method].wire(x.numel(), segments, spec, comm.world)
        self._count(spec.method, x.numel(), 8 * (wire.payload_bytes + wire.scale_sync_bytes),
                    x.device, parts, error_sq, norm_sq)
        return x

    def _residual_on(self, name: str, device: torch.device) -> torch.Tensor:
        """``name``'s residual, moved to ``device`` once if it is elsewhere (a checkpoint's
        are CPU tensors)."""
        residual = self.residuals[name]
        if residual.device != device:
            residual = self.residuals[name] = residual.to(device)
        return residual

    def _keep_residuals(self, group: Group, segments, errors: torch.Tensor,
                        bad: torch.Tensor | None) -> None:
        """Each parameter's compression error as its residual for the next step; where the
        device path marked the bucket (``bad``, read on the device), the residual it had
        (none: zeros), so one non-finite step does not poison the following ones."""
        for name, (start, n) in zip(group.names, segments):
            error = errors[start:start + n]
            kept = self.residuals.get(name)
            if bad is not None:
                if kept is None:
                    kept = self.residuals[name] = torch.zeros_like(error)
                torch.where(bad, kept, error, out=kept)
            elif kept is not None:  # the residual's memory is reused
                kept.copy_(error)
            else:
                self.residuals[name] = error.clone()

    def _count(self, method: str, elements: int, wire_bits: float, device: torch.device,
               parts: list, error_sq: float = 0.0, norm_sq: float = 0.0) -> None:
        """Add one group's figures; ``parts``: (part, spans) pairs of timer marks. A
        collective's time is communication's: it is taken off the encode or decode that
        ran it."""
        with self._lock:
            stats = self._stats[method]
            stats.elements += elements
            stats.wire_bits += wire_bits
            stats.error_sq += error_sq
            stats.norm_sq += norm_sq
            if device not in self._timers:
                self._timers[device] = timer_for(device)
            timer = self._timers[device]
            for index, (part, spans) in enumerate(parts):
                for begin, end in spans:
                    timer.add((method, part), begin, end)
                    if part == "comm" and index:  # inside the part before it
                        timer.add((method, parts[index - 1][0]), begin, end, sign=-1)


def _norm_sq(x: torch.Tensor) -> torch.Tensor:
    """``l2norm(x) ** 2`` as ``l2norm`` takes it (float64 sum of squares, its square root,
    squared), left on the device as a 0-d float64 tensor."""
    acc = torch.zeros(1, dtype=torch.float64, device=x.device)
    if x.numel():
        cuda_kernels().sum_squares(_arr(_f32(x.detach())), _arr(acc))
    return acc.sqrt().square().reshape(())


def _numba_threads_to_set() -> int | None:
    """The calling thread's Numba thread count where a new thread would not get it by
    default (it gets the whole pool), else None (Numba not loaded, or nothing to set)."""
    numba = sys.modules.get("numba")
    if numba is None or numba.config.NUMBA_NUM_THREADS == 1:
        return None
    threads = numba.get_num_threads()
    return threads if threads != numba.config.NUMBA_NUM_THREADS else None


def _contiguous(slices) -> bool:
    return all(a + n == b for (a, n), (b, _) in zip(slices, slices[1:]))


def _segments(group: Group) -> list[tuple[int, int]]:
    """The group's slices as ``(start, numel)`` in its own flat tensor."""
    out, start = [], 0
    for _, n in group.slices:
        out.append((start, n))
        start += n
    return out


class StandaloneBucket:
    """What the hook reads of a ``GradBucket`` (``buffer()``, ``parameters()``), for one
    parameter whose flat gradient is ``buffer``: the hook run outside DDP's backward
    (profiles, benchmarks).

    Example::

        >>> param = nn.Parameter(torch.zeros(2, 3))
        >>> StandaloneBucket(param, torch.ones(6)).buffer().shape
        torch.Size([6])
    """

    def __init__(self, param: torch.Tensor, buffer: torch.Tensor) -> None:
        if buffer.numel() != param.numel():
            raise QSyncError(f"a bucket of {buffer.numel()} elements cannot hold a parameter "
                             f"of {param.numel()}")
        self._param, self._buffer = param, buffer

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[torch.Tensor]:
        return [self._param]


def compression_hook(state: CompressionState,
                     bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket's mean over the ranks, each group compressed by its spec.

    Returns at once; the future completes when the sender thread has reduced the bucket.
    """
    return state.submit(bucket.buffer(), state.groups(bucket))


def register_compression(ddp_model, settings, *, process_group=None, seed: int = 0,
                         telemetry: bool = True, error_every: int = 8) -> CompressionState:
    """Compress ``ddp_model``'s gradient communication as ``settings`` say; its state.

    Call it on every rank, after wrapping the model in DDP and before the first backward.

    Args:
        ddp_model: a ``DistributedDataParallel`` model.
        settings: a :class:`~qsync_lab.compress.spec.CompressionSpec` or its short form
            (``"global_qsgd:8"``) for every parameter, or a mapping from parameter FQN
            patterns (exact, ``re:...``, ``_default``) to specs or None.
        process_group, seed, telemetry, error_every: see :class:`CompressionState`.
    """
    state = CompressionState(ddp_model.module, settings, process_group=process_group,
                             seed=seed, telemetry=telemetry, error_every=error_every)
    ddp_model.register_comm_hook(state, compression_hook)
    return state
