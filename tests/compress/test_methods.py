"""Each method's compressed mean over 2, 3 and 4 gloo ranks against the true mean: the
unbiased ones are unbiased within a stated statistical bound and their variance is within
the method's theoretical bound; the rounding ones stay within their formats' rounding error.
"""

import numpy as np
import pytest
import torch

from qsync_lab.compress.codec import Workspace
from qsync_lab.compress.comm import Comm
from qsync_lab.compress.methods import METHODS, method_module
from qsync_lab.compress.spec import CompressionSpec
from tests.compress.ranks import run_ranks

N = 4096
SEGMENTS = [(0, 1024), (1024, 3072)]  # two "parameters" of very different scales
SAMPLES = 200
UNBIASED = ["global_qsgd:8", "global_qsgd:16",
            {"method": "global_qsgd", "dithering": "exponential"}, "qsgd:8",
            "cgx:4", {"method": "cgx", "bits": 2, "group_size": 256}]
ROUNDING = ["fp16", "bf16", "aps:fp8_e5m2", "aps:fp8_e4m3",
            {"method": "cgx", "bits": 8, "rounding": "nearest"}]


def gradient(rank: int) -> torch.Tensor:
    """Rank ``rank``'s fixed gradient: a first parameter 1000x smaller than the second."""
    g = torch.randn(N, generator=torch.Generator().manual_seed(rank))
    g[:1024] *= 1e-3
    return g


def _means(rank, world, specs, samples):
    comm = Comm(None)
    out = []
    for spec in map(CompressionSpec.parse, specs):
        module = method_module(spec)
        first = second = None
        for t in range(samples):
            encoded = module.encode(gradient(rank), SEGMENTS, spec, comm, seed=t * world + rank)
            mean = module.reduce(encoded, spec, comm).double()
            first = mean if first is None else first + mean
            second = mean**2 if second is None else second + mean**2
        out.append(((first / samples).numpy(), (second / samples - (first / samples)**2).numpy(),
                    comm.sent_bytes))
    return out


def _variance_bound(spec: CompressionSpec, world: int) -> np.ndarray:
    """Per element, the method's bound on the variance of the compressed mean."""
    g = torch.stack([gradient(r) for r in range(world)]).double()
    if spec.method == "global_qsgd" and spec.dithering == "standard":
        levels = (2 ** (spec.bits - 1) - 1) // world
        unit = float(g.abs().max()) / levels
        return np.full(N, unit**2 / (4 * world))
    if spec.method == "global_qsgd":  # neighbouring powers of two: (hi - x)(x - lo) <= x²/4
        return (g**2).sum(0).numpy() / (4 * world**2) + 1e-30
    if spec.method == "qsgd":
        s = 2 ** (spec.bits - 1) - 1
        return np.full(N, float(((g.norm(dim=1) / s) ** 2).sum()) / (4 * world**2))
    groups = g.reshape(world, -1, spec.group_size)  # cgx: max-min unit per group and rank
    unit = (groups.amax(2) - groups.amin(2)) / (2**spec.bits - 1)
    per_group = (unit**2).sum(0) / (4 * world**2)
    return per_group.repeat_interleave(spec.group_size).numpy()


@pytest.fixture(scope="module", params=[2, 3, 4])
def world(request):
    return request.param


@pytest.fixture(scope="module")
def unbiased_results(world):
    return world, run_ranks(_means, world, UNBIASED, SAMPLES)


@pytest.mark.parametrize("index", range(len(UNBIASED)))
def test_unbiased_methods_average_to_the_true_mean_within_their_variance(unbiased_results,
                                                                         index):
    world, results = unbiased_results
    spec = CompressionSpec.parse(UNBIASED[index])
    true_mean = torch.stack([gradient(r) for r in range(world)]).double().mean(0).numpy()
    bound = _variance_bound(spec, world)
    for estimate, variance, _ in (result[index] for result in results):
        # the mean of SAMPLES draws: within 6 standard errors of the truth, every element
        assert np.all(np.abs(estimate - true_mean) <= 6 * np.sqrt(bound / SAMPLES) + 1e-12)
        assert variance.mean() <= 1.1 * bound.mean()  # the method's bound holds
        assert variance.mean() > 0.05 * bound.mean()  # and the draws do vary
    assert all(np.array_equal(r[index][0], results[0][index][0]) for r in results)


def test_a_biased_rounding_fails_the_unbiasedness_check():
    """The check above can fail: cgx's round-to-nearest on 1 bit is far off on average."""
    spec = CompressionSpec("cgx", bits=1, rounding="nearest", group_size=256)
    [[(estimate, _, _)], _] = run_ranks(_means, 2, [spec.to_dict()], 20)
    true_mean = torch.stack([gradient(r) for r in range(2)]).double().mean(0).numpy()
    bound = _variance_bound(CompressionSpec("cgx", bits=1, group_size=256), 2)
    assert np.any(np.abs(estimate - true_mean) > 6 * np.sqrt(bound / 20))


def _rounded(rank, world, specs):
    comm = Comm(None)
    out = []
    for spec in map(CompressionSpec.parse, specs):
        module = method_module(spec)
        means = [module.reduce(module.encode(gradient(rank), SEGMENTS, spec, comm, seed=s),
                               spec, comm).double().numpy() for s in (1, 2)]
        out.append(means)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_rounding_methods_are_within_their_formats_error(world):
    results = run_ranks(_rounded, world, ROUNDING)
    g = torch.stack([gradient(r) for r in range(world)]).double()
    true_mean = g.mean(0).numpy()
    # half an ulp, relative: fp16 2^-11, bf16 2^-8 (per rank, and per addition of the
    # allreduce, which sums in the format), e5m2 2^-3, e4m3 2^-4 (per rank; summed in fp32);
    # 8-bit cgx: half a unit of its group's range
    relative = {0: 2.0**-11, 1: 2.0**-8, 2: 2.0**-3, 3: 2.0**-4}
    for index, spec in enumerate(map(CompressionSpec.parse, ROUNDING)):
        first, second = results[0][index]
        assert np.array_equal(first, second)  # deterministic: no stochastic rounding
        if index in relative:
            roundings = world if spec.method in ("fp16", "bf16") else 1
            allowed = (roundings * (g.abs().sum(0).numpy() / world) * relative[index] * 1.01
                       + roundings * 2.0**-24)
        else:
            groups = g.reshape(world, -1, spec.group_size)
            unit = ((groups.amax(2) - groups.amin(2)) / 255).max(0).values
            allowed = unit.repeat_interleave(spec.group_size).numpy() / 2 * 1.01
        assert np.all(np.abs(first - true_mean) <= allowed), spec
        assert np.any(first != true_mean)  # it does round


def _edge_cases(rank, world):
    comm = Comm(None)
    out = {}
    for text in ("global_qsgd:8", "aps", "cgx:4", "qsgd:8", "fp16", "bf16"):
        spec = CompressionSpec.parse(text)
        module = method_module(spec)
        zeros = torch.zeros(N)
        out[text, "zeros"] = module.reduce(module.encode(zeros, SEGMENTS, spec, comm, seed=1),
                                           spec, comm).abs().max().item()
        x = gradient(rank)
        if rank == world - 1:
            x[7] = float("nan")
        try:
            module.reduce(module.encode(x, SEGMENTS, spec, comm, seed=2), spec, comm)
            out[text, "nan"] = "no error"
        except Exception as err:  # noqa: BLE001 - the test looks at it
            out[text, "nan"] = type(err).__name__
    return out


def test_zero_gradients_give_zero_and_a_nan_on_one_rank_stops_every_rank():
    for result in run_ranks(_edge_cases, 3):
        for (method, case), value in result.items():
            if case == "zeros":
                assert value == 0.0, method
            else:
                assert value == "NonFiniteGradient", (method, value)


def test_wire_bytes_are_what_the_methods_send():
    """Payload bytes per element: ~1 for the 8-bit methods, 2 for fp16, b/8 + meta for cgx;
    packed payloads are padded to a multiple of 8 bytes (qsgd: its 4-byte norm + 4)."""
    texts = ("global_qsgd:8", "aps", "cgx:4", "qsgd:8", "fp16")
    wire = {text: METHODS[spec.method].wire(N, SEGMENTS, spec, 2).payload_bytes / N
            for text, spec in zip(texts, map(CompressionSpec.parse, texts))}
    assert wire["global_qsgd:8"] == 1 and wire["aps"] == 1 and wire["fp16"] == 2
    assert wire["cgx:4"] == pytest.approx(0.5 + 8 / 1024)
    assert N % 8 == 0 and wire["qsgd:8"] == pytest.approx(1 + 8 / N)


ALL_METHODS = ["fp16", "bf16", "global_qsgd:8", "global_qsgd:16",
               {"method": "global_qsgd", "dithering": "exponential"}, "aps:fp8_e5m2", "cgx:4",
               {"method": "cgx", "bits": 3, "group_size": 100}, "qsgd:8"]


def _one_rank_encodes(rank, world, specs):
    """Per spec: whether the compression error equals ``x`` minus the 1-rank mean (this rank's
    gradient as compressed) bit for bit, its norm relative to ``x``'s, and the bytes of the
    payload against those the registry's ``wire`` names."""
    comm, out = Comm(None), []
    x = gradient(rank)
    segments = [(0, 1024), (1024, N - 1024)]
    for spec in map(CompressionSpec.parse, specs):
        module = method_module(spec)
        encoded = module.encode(x.clone(), segments, spec, comm, seed=1, error=True,
                                workspace=Workspace())
        error = encoded.error.clone()
        payload_bytes = encoded.payload.numel() * encoded.payload.element_size()
        mean = module.reduce(encoded, spec, comm, out=torch.empty(N))
        wire = METHODS[spec.method].wire(N, segments, spec, world)
        out.append((spec.key, torch.equal(error, x - mean), float(error.norm() / x.norm()),
                    payload_bytes, wire.payload_bytes))
    return out


@pytest.fixture(scope="module")
def one_rank_rows():
    (rows,) = run_ranks(_one_rank_encodes, 1, ALL_METHODS)
    return rows


def test_the_compression_error_is_the_gradient_minus_its_compressed_value(one_rank_rows):
    """What error feedback keeps and the telemetry measures: every method's ``error`` is
    ``x - Q(x)``, with ``Q(x)`` what the method's reduce gives on one rank."""
    for key, exact, relative, *_ in one_rank_rows:
        assert exact and 0 < relative < 0.5, (key, relative)


def test_the_registry_wire_carries_the_payload_each_method_encodes(one_rank_rows):
    """The simulator's bytes (the registry's ``wire``) are the bytes the module sends."""
    for key, *_, payload_bytes, wire_bytes in one_rank_rows:
        assert payload_bytes == wire_bytes, key


def _with_and_without_workspace(rank, world, specs):
    """Per spec, the mean and compression error of three calls (sizes N, N/2 + 3, N) through
    one shared workspace and through fresh buffers, and the workspace's size after each
    call."""
    comm, workspace = Comm(None), Workspace()
    out = []
    for spec in map(CompressionSpec.parse, specs):
        module = method_module(spec)
        for call, numel in enumerate((N, N // 2 + 3, N)):
            x = gradient(rank)[:numel]
            segments = [(0, min(1024, numel)), (min(1024, numel), numel - min(1024, numel))]
            results = []
            for ws in (workspace, None):
                encoded = module.encode(x.clone(), segments, spec, comm, seed=call, error=True,
                                        workspace=ws)
                error = None if encoded.error is None else encoded.error.clone()
                mean = module.reduce(encoded, spec, comm, out=torch.empty(numel), workspace=ws)
                results.append((mean.clone(), error))
            (mean_ws, error_ws), (mean_new, error_new) = results
            out.append((spec.key, call, torch.equal(mean_ws, mean_new),
                        error_new is None or torch.equal(error_ws, error_new), workspace.nbytes))
    return out


def test_a_shared_workspace_gives_the_results_of_fresh_buffers():
    """Buffers reused across calls, sizes and methods change no bit of any result, and a
    call no larger than an earlier one takes no new memory."""
    results = run_ranks(_with_and_without_workspace, 3, ALL_METHODS)
    for rows in results:
        for key, call, same_mean, same_error, _ in rows:
            assert same_mean and same_error, (key, call)
        sizes = [nbytes for *_, nbytes in rows]
        assert sizes[-1] > 0
        for before, after, (_, call, *_) in zip(sizes, sizes[1:], rows[1:]):
            if call > 0:  # the second and third call of a method fit the first's buffers
                assert after == before
