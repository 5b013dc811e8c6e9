"""Training step time of qsync plans on one GPU, measured and predicted, beside plain torch.

For BERT-base (batch 32, sequence 128), ResNet-50 (batch 32, 224 px) and a GPT-style
decoder (6 blocks, width 768, 256 tokens, batch 16), in one process, each model runs:

* the plans ``fp32``; ``tf32`` (every plannable GEMM op: linear, conv, matmul); ``bf16``,
  ``fp16`` (what ``torch.autocast`` runs in 16 bits: the GEMMs and batch norms; layer
  norms stay fp32, as autocast keeps them); ``int8``, ``fp8_e4m3`` (linear ops); and
  ``qsync``, the allocator's plan (:class:`qsync_lab.Study`, costed by ``--profile`` when
  given, else by the catalog) for an iteration halfway between the predicted fp32 and bf16
  ones (fp16 on a device without bf16). Each is applied as ``qsync-lab run`` applies it
  (the runtime trainer's path: the model built on the CPU,
  :func:`~qsync_lab.quant.apply_resolved_plan_`, moved to the device, DDP with world size 1
  on NCCL, gloo on the CPU, its optimizer, its step: the loss in fp32, a GradScaler where
  gradients are fp16 on CUDA, the gradients checked finite before the optimizer steps);
* plain torch at the same batch, also under DDP: ``torch:eager_fp32`` (TF32 off),
  ``torch:tf32`` (TF32 on), ``torch:autocast_bf16``, ``torch:autocast_fp16`` (GradScaler).

A row gives the median step (CUDA events; warm-up steps left out; with ``--rounds``,
every row measured that many times in turn and the median of the rounds kept, their range
as ``spread_pct``: a launch-bound step moves with the host's pace), the simulator's
prediction for a 1-rank cluster of the card's catalog kind (from the catalog, and from
``--profile`` when given: ``MODEL=CSV`` for one model's, such as ``qsync-lab profile
--device cuda --model MODEL`` writes calibrated to that model's own steps), the error,
the ratio to the matching torch row (``vs``: fp32 -> eager fp32, tf32 -> TF32, fp16 ->
autocast fp16, the others -> autocast bf16; below 1 is faster than torch), CUDA kernels
per step (``--kernels``: torch.profiler over one more step; on the CPU, aten op calls),
and peak tensor memory (model build and the first two steps, as the trainer measures it)
against the prediction. A row that raises is printed
as failed with the exception's last line; the others still run. Rows left when
``--budget-s`` runs out are marked skipped. The table is rewritten after every row to
``<out>/gpu_training.csv`` and ``.txt`` (``--out``, default ``$OUT`` or ``./gpu_out``).
``--tiny`` trains small stand-ins (BERT-mini at width 64, the digits CNN, a 2-block GPT
decoder) for 2 warm-up and 3 timed steps: the CPU check of the whole table.
``--repredict TABLE`` trains nothing: it predicts the plan rows of a measured table again
with this code's cost model (on any machine; ``--kind`` names the card's catalog kind),
into ``gpu_training_repredicted.csv`` and ``.txt``. A qsync row's plan is made again too:
``low_precision_ops_now`` says whether it is still the plan that was measured.

The card is mapped to its catalog kind by name and memory (``--kind`` to choose one).
TF32 is switched by torch's legacy flags before each row: for the plans as the trainer sets
it on CUDA (on where no GEMM op computes in fp32, as the tf32 plan; else off, the tf32 ops
switching it on around themselves), torch's defaults for autocast (cuBLAS off, cuDNN on),
off or on for the eager rows.

Example (``benchmarks/gpu_check.sh train`` runs the first)::

    python benchmarks/gpu_training.py --kernels --budget-s 180
    python benchmarks/gpu_training.py --models bert_base --plans fp32,bf16 --profile h200.csv
    python benchmarks/gpu_training.py --profile bert_base=bert.csv --profile resnet50=rn50.csv
    python benchmarks/gpu_training.py --device cpu --tiny --out /tmp/train   # CI, < 1 min
    python benchmarks/gpu_training.py --device cpu --kind H200-SXM-141GB --profile h200.csv \
        --repredict benchmarks/results/gpu_training_h200.csv
"""

import argparse
import gc
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from qsync_lab import Study
from qsync_lab.cluster import Cluster, cluster_from_definition
from qsync_lab.costs import CostModel, load_cost_model
from qsync_lab.devices import DeviceSpec, load_catalog
from qsync_lab.models import example_batch, get_model, model_spec
from qsync_lab.models.families import GPTDecoder, SequenceCrossEntropy
from qsync_lab.optimizers import make_optimizer
from qsync_lab.plan import Plan
from qsync_lab.policy import PLANNABLE_KINDS, kind_allows
from qsync_lab.quant import apply_resolved_plan_, plan_keeps_tf32_on
from qsync_lab.quant.native import fp32_inputs, set_tf32
from qsync_lab.runtime.memory import MemoryWindow
from qsync_lab.runtime.optimizer_step import finish_step, loss_scaler
from qsync_lab.simulate import simulate

GEMM_KINDS = ("linear", "conv1d", "conv2d", "conv3d", "matmul")
#: what torch.autocast runs in 16 bits: the GEMMs, and batch norms (in their input's dtype)
AUTOCAST_KINDS = (*GEMM_KINDS, "batch_norm")
#: plan -> (precision, the op kinds it sets)
PLANS = {"fp32": ("fp32", ()), "tf32": ("tf32", GEMM_KINDS), "bf16": ("bf16", AUTOCAST_KINDS),
         "fp16": ("fp16", AUTOCAST_KINDS), "int8": ("int8", ("linear",)),
         "fp8_e4m3": ("fp8_e4m3", ("linear",)), "qsync": None}
TORCH_RUNS = ("eager_fp32", "tf32", "autocast_bf16", "autocast_fp16")
#: plan -> the torch row it is compared with
VERSUS = {"fp32": "eager_fp32", "tf32": "tf32", "fp16": "autocast_fp16"}
#: row order per model: each plan beside its torch row
ORDER = ("torch:eager_fp32", "fp32", "torch:autocast_bf16", "bf16", "torch:tf32", "tf32",
         "torch:autocast_fp16", "fp16", "int8", "fp8_e4m3", "qsync")
OPTIMIZER, LR, SEED = "sgd_momentum", 1e-4, 0
MEMORY_STEPS = 2  # the trainer's window: model build and the first steps
TRACE_BATCH = 2  # the graph is traced small and scaled to the batch, as the study does
MIB = 2**20
COLUMNS = ["model", "batch", "plan", "status", "step_ms", "spread_pct", "rounds",
           "pred_catalog_ms", "err_catalog_pct",
           "pred_profile_ms", "err_profile_pct", "vs", "ratio", "kernels", "mem_mib",
           "pred_catalog_mib", "mem_err_pct", "low_precision_ops", "warmup_steps", "timed_steps",
           "row_s"]


@dataclass(frozen=True)
class Workload:
    """A model to train: how to build it, a seeded batch of n samples, its loss."""

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[int], tuple]
    loss_fn: Callable[[], nn.Module]
    batch_size: int


def zoo(name: str, batch_size: int, **kwargs) -> Workload:
    """A zoo model with its example batches (seed 0) and loss."""
    return Workload(name, lambda: get_model(name, **kwargs),
                    lambda n: example_batch(name, n, **kwargs), model_spec(name).loss_fn,
                    batch_size)


def gpt(name: str, batch_size: int, vocab: int, dim: int, heads: int, layers: int,
        seq: int) -> Workload:
    """The GPT-style decoder of :mod:`qsync_lab.models.families` at a chosen size, trained on
    next-token prediction of random token ids."""
    def batch(n: int) -> tuple:
        ids = torch.randint(vocab, (n, seq + 1), generator=torch.Generator().manual_seed(SEED))
        return (ids[:, :-1],), ids[:, 1:]

    return Workload(name, lambda: GPTDecoder(vocab, dim, heads, layers, seq), batch,
                    SequenceCrossEntropy, batch_size)


def workloads(tiny: bool) -> list[Workload]:
    if tiny:
        return [zoo("bert_mini", 4, seq_len=16, vocab_size=512, num_layers=2,
                    hidden=64, heads=2, intermediate=128), zoo("digits_cnn", 4),
                gpt("gpt_decoder", 4, vocab=256, dim=64, heads=4, layers=2, seq=32)]
    return [zoo("bert_base", 32, seq_len=128), zoo("resnet50", 32),
            gpt("gpt_decoder", 16, vocab=16384, dim=768, heads=12, layers=6, seq=256)]


def catalog_kind(name: str, total_bytes: int) -> DeviceSpec:
    """The catalog GPU a CUDA device name stands for: its first name token in the name
    (``H100`` in ``NVIDIA H100 80GB HBM3``), then most tokens shared, then closest memory."""
    tokens = set(name.replace("-", " ").split())
    gpus = [d for d in load_catalog().devices.values() if d.kind == "gpu"
            and d.name.split("-")[0] in tokens]
    if not gpus:
        raise SystemExit(f"no catalog device matches {name!r}; pass --kind")
    return max(gpus, key=lambda d: (len(tokens & set(d.name.split("-"))),
                                    -abs(d.memory_bytes - total_bytes)))


def one_rank_cluster(device: DeviceSpec, batch_size: int) -> Cluster:
    link = "loopback" if device.kind == "cpu" else "nvlink4"
    return cluster_from_definition({
        "name": f"one-{device.name}", "batch_size": batch_size,
        "node": [{"name": "n0", "intra_node_link": link,
                  "devices": [{"kind": device.name, "count": 1}]}]})


def torch_tf32(matmul: bool, conv: bool) -> None:
    """TF32 for cuBLAS matmuls and cuDNN convolutions (torch's defaults: False, True)."""
    torch.backends.cuda.matmul.allow_tf32 = matmul
    torch.backends.cudnn.allow_tf32 = conv


class Bench:
    """One device, its catalog kind and cost models, and the table so far."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            self.device = torch.device("cuda", self.device.index or 0)
            props = torch.cuda.get_device_properties(self.device)
            self.spec = (load_catalog().device(args.kind) if args.kind
                         else catalog_kind(props.name, props.total_memory))
            self.card = props.name
            torch.cuda.set_device(self.device)
        else:
            self.spec, self.card = load_catalog().device(args.kind or "cpu"), "cpu"
        self.sources = ("catalog", "profile") if args.profile else ("catalog",)
        self._costs = {None: CostModel()}  # profile path -> its cost model (None: catalog)
        self.rows: list[dict] = []
        self.deadline = time.monotonic() + args.budget_s
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)

    # -- measuring -------------------------------------------------------------------

    def measure(self, build: Callable[[], tuple[nn.Module, Callable[[], None]]], *,
                kernels: bool) -> dict:
        """Median step of what ``build`` returns (model, step), its peak memory and (with
        ``kernels``) its kernels per step."""
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
        window = MemoryWindow(self.cuda)
        try:
            model, step = build()
            times = [self._timed(step) for _ in range(MEMORY_STEPS)]
        finally:
            peak = window.close()
        while len(times) < self.args.warmup and sum(times) < self.args.row_s * 1e3 / 2:
            times.append(self._timed(step))
        timed = [self._timed(step) for _ in range(self._timed_steps(times))]
        row = {"step_ms": statistics.median(timed), "warmup_steps": len(times),
               "timed_steps": len(timed), "mem_mib": peak / MIB}
        if kernels:
            row["kernels"] = self._kernels(step)
        del model, step
        return row

    def _timed(self, step: Callable[[], None]) -> float:
        if not self.cuda:
            begin = time.perf_counter()
            step()
            return (time.perf_counter() - begin) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def _timed_steps(self, warm_ms: list[float]) -> int:
        """``--steps``, fewer (at least 3) when they would take over half ``--row-s``."""
        per_step_s = statistics.median(warm_ms[-3:]) / 1e3
        return max(3, min(self.args.steps, int(self.args.row_s / 2 / max(per_step_s, 1e-9))))

    def _kernels(self, step: Callable[[], None]) -> int:
        """CUDA kernels one step launches (memory copies and sets left out); on the CPU,
        its aten op calls. Counted in the profiler's raw events (building torch's event
        tree would take seconds a row)."""
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        with profile(activities=activities) as prof:
            step()
            if self.cuda:
                torch.cuda.synchronize()
        events = prof.profiler.kineto_results.events()
        if self.cuda:
            return sum(e.device_type() == DeviceType.CUDA
                       and not e.name().startswith(("Memcpy", "Memset")) for e in events)
        return sum(e.name().startswith("aten::") for e in events)

    # -- what runs -------------------------------------------------------------------

    def plan_runner(self, work: Workload, study: Study, plan: Plan):
        """The trainer's build and step for ``plan`` (runtime/build.py's ``build_rank`` and
        step_loop.py's ``StepLoop._step`` on one rank, whose loss weight is 1): the loss in
        fp32, a GradScaler on CUDA when some op's gradients are fp16, the finite check before
        the optimizer."""
        def build():
            torch.manual_seed(SEED)
            model = work.build()
            device_plan = plan.precisions[self.spec.name]
            apply_resolved_plan_(model, study.graph, device_plan, self.spec)
            set_tf32(plan_keeps_tf32_on(study.graph, device_plan, self.spec))  # as build_rank
            ddp = self._ddp(model.to(self.device))
            optimizer = make_optimizer(OPTIMIZER, ddp.parameters(), lr=LR)
            scaler = loss_scaler(model, cuda=self.cuda)
            inputs, target, loss_fn = self._data(work)

            def step():
                optimizer.zero_grad()
                loss = loss_fn(fp32_inputs(None, (ddp(*inputs),))[0], target)
                scaler.scale(loss).backward()
                finish_step(loss, optimizer, scaler, model)
            return ddp, step
        return build

    def torch_runner(self, work: Workload, how: str):
        """Plain torch under DDP: eager fp32 or TF32, or autocast bf16 / fp16 (GradScaler)."""
        dtype = {"autocast_bf16": torch.bfloat16, "autocast_fp16": torch.float16}.get(how)

        def build():
            torch.manual_seed(SEED)
            ddp = self._ddp(work.build().to(self.device))
            optimizer = make_optimizer(OPTIMIZER, ddp.parameters(), lr=LR)
            scaler = torch.amp.GradScaler(self.device.type, enabled=how == "autocast_fp16")
            inputs, target, loss_fn = self._data(work)

            def step():
                optimizer.zero_grad()
                with torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None):
                    loss = loss_fn(ddp(*inputs), target)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            return ddp, step
        return build

    def _ddp(self, model: nn.Module) -> DistributedDataParallel:
        return DistributedDataParallel(model, device_ids=[self.device] if self.cuda else None)

    def _data(self, work: Workload):
        inputs, target = work.batch(work.batch_size)
        return (tuple(t.to(self.device) for t in inputs), target.to(self.device),
                work.loss_fn())

    # -- plans and predictions -------------------------------------------------------

    def study(self, work: Workload) -> Study:
        torch.manual_seed(SEED)
        return Study(work.build(), work.batch(TRACE_BATCH),
                     cluster=one_rank_cluster(self.spec, work.batch_size),
                     loss_fn=work.loss_fn(), calibration_batches=1, optimizer=OPTIMIZER,
                     profiles=[p for p in [self.profile_for(work.name)] if p], progress=False)

    def plan(self, study: Study, name: str) -> Plan:
        if PLANS[name] is None:
            return self._qsync_plan(study)
        precision, kinds = PLANS[name]
        ops = study.graph.ops
        chosen = {fqn: precision for fqn, kind, refusal in
                  zip(ops.index, ops["kind"], ops["plan_refusal"])
                  if kind in kinds and kind in PLANNABLE_KINDS and not refusal
                  and kind_allows(kind, precision)}
        return Plan.build(study.graph, study.cluster, {self.spec.name: chosen}, strategy=name,
                          optimizer=OPTIMIZER)

    def _qsync_plan(self, study: Study) -> Plan:
        """The allocator's plan for an iteration halfway between fp32's and bf16's (fp16's
        on a device without bf16), as the study's costs predict them (the profile, else the
        catalog): a slower bf16 makes that fp32's own pace, so the plan stays fp32."""
        low = "bf16" if self.spec.supports("bf16") else "fp16"
        fp32, fast = (simulate(study.prepared, self.plan(study, p), study.cluster, study.costs,
                               optimizer=OPTIMIZER).iteration_us for p in ("fp32", low))
        target_s = (fp32 + fast) / 2 / 1e6
        return study.plan(throughput_target=study.cluster.global_batch_size / target_s)

    def profile_for(self, model: str) -> str | None:
        """The ``--profile`` CSV that costs ``model``: its own (``MODEL=CSV``), else one
        given for every model, else None."""
        return self.args.profile.get(model, self.args.profile.get(None))

    def predict(self, study: Study, plan: Plan, model: str) -> dict[str, tuple[float, float]]:
        """Cost model name (catalog, profile: ``model``'s) -> (predicted step ms, predicted
        peak MiB)."""
        predicted = {}
        for name, path in {"catalog": None, "profile": self.profile_for(model)}.items():
            if name == "profile" and path is None:
                continue
            if path not in self._costs:
                self._costs[path] = load_cost_model(path)
            sim = simulate(study.prepared, plan, study.cluster, self._costs[path],
                           optimizer=OPTIMIZER)
            predicted[name] = (sim.iteration_us / 1e3, float(sim.tensor_peak_bytes.max()) / MIB)
        return predicted

    # -- the table -------------------------------------------------------------------

    def run(self, work: Workload) -> None:
        """Measure the model's rows, ``--rounds`` times in turn (each round every row once,
        so a slow spell of the host touches all rows alike); a row's step is the median
        of its rounds' medians, ``spread_pct`` their range over it."""
        wanted = [r for r in ORDER if r.removeprefix("torch:") in
                  (self.args.torch_runs if r.startswith("torch:") else self.args.plans)]
        rows = [{"model": work.name, "batch": work.batch_size, "plan": name, "rounds_ms": [],
                 "row_s": 0.0} for name in wanted]
        self.rows += rows
        study, plans = None, {}
        for round_ in range(self.args.rounds):
            for row in rows:
                name = row["plan"]
                if row.get("status", "ok") != "ok":
                    continue
                if time.monotonic() > self.deadline:
                    row.setdefault("status", "skipped: --budget-s spent")
                    continue
                begin = time.monotonic()
                try:
                    if name.startswith("torch:"):
                        torch_tf32(matmul=name == "torch:tf32", conv=name != "torch:eager_fp32")
                        runner = self.torch_runner(work, name.removeprefix("torch:"))
                    else:
                        study = study or self.study(work)
                        if name not in plans:
                            plans[name] = self.plan(study, name)
                            row["low_precision_ops"] = \
                                plans[name].low_precision_ops()[self.spec.name]
                            for source, (ms, mib) in self.predict(study, plans[name],
                                                                  work.name).items():
                                row[f"pred_{source}_ms"], row[f"pred_{source}_mib"] = ms, mib
                        runner = self.plan_runner(work, study, plans[name])
                    measured = self.measure(runner, kernels=round_ == 0 and self.args.kernels)
                    row["rounds_ms"].append(measured.pop("step_ms"))
                    if round_ == 0:
                        row.update(measured)
                    row["status"] = "ok"
                except Exception as err:  # one failed row never stops the others; it keeps
                    # what it had (a plan that fails to run still shows its prediction)
                    row["status"] = "failed: " + traceback.format_exception_only(err)[-1].strip()
                row["row_s"] += time.monotonic() - begin
                self.write(row)

    def write(self, last: dict) -> None:
        """Rewrite the table files and print the row just measured."""
        table = self.table()
        table.to_csv(self.out / "gpu_training.csv", index=False)
        (self.out / "gpu_training.txt").write_text(f"{self.header()}\n{_text(table)}\n")
        row = table.iloc[self.rows.index(last)]
        print(f"{row['model']} {row['plan']}: {row['status']}, step {row['step_ms']} ms, "
              f"predicted {row['pred_catalog_ms']} ms, x torch {row['ratio']}, "
              f"{row['row_s']} s", flush=True)

    def table(self) -> pd.DataFrame:
        """The rows in :data:`COLUMNS` (profile and kernel columns when asked for), with the
        errors and the ratios to torch filled in."""
        table = pd.DataFrame(self.rows)
        rounds = table.pop("rounds_ms") if "rounds_ms" in table else pd.Series(dtype=object)
        table["step_ms"] = [statistics.median(r) if r else float("nan") for r in rounds]
        table["spread_pct"] = [100 * (max(r) - min(r)) / statistics.median(r) if r else
                               float("nan") for r in rounds]
        table["rounds"] = [len(r) for r in rounds]
        table = table.reindex(columns=COLUMNS)
        for source in ("catalog", "profile"):
            table[f"err_{source}_pct"] = _error_pct(table[f"pred_{source}_ms"], table["step_ms"])
        table["mem_err_pct"] = _error_pct(table["pred_catalog_mib"], table["mem_mib"])
        table["vs"] = [None if p.startswith("torch:") else "torch:" + VERSUS.get(p, "autocast_bf16")
                       for p in table["plan"]]
        torch_ms = table.set_index(["model", "plan"])["step_ms"].to_dict()
        table["ratio"] = [ms / torch_ms.get((m, v), float("nan")) if v else float("nan")
                          for m, v, ms in zip(table["model"], table["vs"], table["step_ms"])]
        unused = [c for c in ("pred_profile_ms", "err_profile_pct") if not self.args.profile]
        unused += [] if self.args.kernels else ["kernels"]
        for column in ("batch", "rounds", "kernels", "low_precision_ops", "warmup_steps",
                       "timed_steps"):
            table[column] = table[column].astype("Int64")
        return table.drop(columns=unused).round(3)

    def header(self) -> str:
        return (f"# benchmarks/gpu_training.py on {self.card} as catalog kind {self.spec.name}; "
                f"torch {torch.__version__}; up to {self.args.warmup} warm-up and "
                f"{self.args.steps} timed steps a row (fewer past {self.args.row_s} s); "
                f"optimizer {OPTIMIZER}; costs: catalog{profiles_text(self.args.profile)}")


def repredict(bench: Bench, measured: pd.DataFrame) -> pd.DataFrame:
    """``measured`` (a table this script wrote) with its plan rows predicted again by
    ``bench``'s cost models, and a qsync row's plan made again (``low_precision_ops_now``)."""
    table = measured.copy()
    works = {(w.name, w.batch_size): w for tiny in (False, True) for w in workloads(tiny)}
    for source in bench.sources:
        table[f"pred_{source}_ms"] = float("nan")
    table["pred_catalog_mib"] = table["low_precision_ops_now"] = float("nan")
    for (model, batch), index in table.groupby(["model", "batch"], sort=False).groups.items():
        study = None
        for i in index:
            name = table.at[i, "plan"]
            if name not in PLANS:
                continue
            study = study or bench.study(works[(model, batch)])
            plan = bench.plan(study, name)
            table.at[i, "low_precision_ops_now"] = plan.low_precision_ops()[bench.spec.name]
            for source, (ms, mib) in bench.predict(study, plan, model).items():
                table.at[i, f"pred_{source}_ms"] = ms
                table.at[i, "pred_catalog_mib"] = mib if source == "catalog" else \
                    table.at[i, "pred_catalog_mib"]
    for source in bench.sources:
        table[f"err_{source}_pct"] = _error_pct(table[f"pred_{source}_ms"], table["step_ms"])
    table["mem_err_pct"] = _error_pct(table["pred_catalog_mib"], table["mem_mib"])
    table["low_precision_ops_now"] = table["low_precision_ops_now"].astype("Int64")
    return table.round(3)


def profiles_text(profiles: dict[str | None, str]) -> str:
    """``, profile X`` (``, profile bert_base=X, ...``) of the ``--profile`` CSVs."""
    return "".join(f", profile {p}" if m is None else f", profile {m}={p}"
                   for m, p in profiles.items())


def _text(table: pd.DataFrame) -> str:
    """The table as text, missing figures as ``-``."""
    return table.astype(object).where(table.notna(), "-").to_string(index=False)


def _error_pct(predicted: pd.Series, measured: pd.Series) -> pd.Series:
    return 100 * (predicted - measured) / measured


def init_process_group(cuda: bool) -> None:
    """A one-rank group in this process (NCCL on CUDA, gloo on the CPU)."""
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--kind", help="catalog device kind (default: from the card's name)")
    parser.add_argument("--tiny", action="store_true", help="small models (CI on the CPU)")
    parser.add_argument("--models", help="comma-separated workload names (default: all)")
    parser.add_argument("--plans", default=",".join(PLANS), help="comma-separated plans")
    parser.add_argument("--torch-runs", default=",".join(TORCH_RUNS),
                        help="comma-separated plain-torch rows (empty: none)")
    parser.add_argument("--steps", type=int, help="timed steps (default 20; --tiny 3)")
    parser.add_argument("--warmup", type=int, help="warm-up steps, at least the 2 of the "
                        "memory window (default 10; --tiny 2)")
    parser.add_argument("--row-s", type=float, default=4.0,
                        help="a row's steps: fewer warm-up (at least 2) and timed (at least 3) "
                        "ones when each half would take longer (default 4)")
    parser.add_argument("--budget-s", type=float, default=1e9,
                        help="rows starting after this many seconds are skipped")
    parser.add_argument("--kernels", action="store_true", help="count kernels per step")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure every row this many times in turn (the median counts)")
    parser.add_argument("--profile", action="append", default=[], metavar="[MODEL=]CSV",
                        help="a measured profile CSV: a second prediction, of MODEL's rows "
                        "only when named (repeatable: a GPU profile of one model is "
                        "calibrated to that model's steps)")
    parser.add_argument("--repredict", metavar="TABLE",
                        help="a gpu_training.csv measured earlier: predict its rows again")
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_out"))
    args = parser.parse_args(argv)
    args.steps = args.steps or (3 if args.tiny else 20)
    args.warmup = max(args.warmup or (2 if args.tiny else 10), MEMORY_STEPS)
    args.profile = dict(_profile_arg(text) for text in args.profile)
    args.plans = [p for p in args.plans.split(",") if p]
    args.torch_runs = [r for r in args.torch_runs.split(",") if r]
    unknown = set(args.plans) - set(PLANS) | set(args.torch_runs) - set(TORCH_RUNS)
    if unknown:
        parser.error(f"unknown plan or torch run {sorted(unknown)[0]!r}; choose from "
                     f"{', '.join(PLANS)} / {', '.join(TORCH_RUNS)}")
    return args


def _profile_arg(text: str) -> tuple[str | None, str]:
    """``MODEL=CSV`` -> (MODEL, CSV); ``CSV`` -> (None, CSV)."""
    model, sep, path = text.partition("=")
    return (model, path) if sep and model.isidentifier() else (None, text)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = Bench(args)
    if args.repredict:
        table = repredict(bench, pd.read_csv(args.repredict))
        header = (f"# {args.repredict} predicted again by benchmarks/gpu_training.py as "
                  f"catalog kind {bench.spec.name}; costs: catalog"
                  f"{profiles_text(args.profile)}")
        table.to_csv(bench.out / "gpu_training_repredicted.csv", index=False)
        (bench.out / "gpu_training_repredicted.txt").write_text(f"{header}\n{_text(table)}\n")
        print(f"{header}\n{_text(table)}")
        return 0
    chosen = [w for w in workloads(args.tiny)
              if not args.models or w.name in args.models.split(",")]
    print(bench.header(), flush=True)
    init_process_group(bench.cuda)
    try:
        for work in chosen:
            bench.run(work)
    finally:
        dist.destroy_process_group()
    table = bench.table()
    print(f"\n{bench.header()}\n{_text(table)}")
    print(f"wrote {bench.out / 'gpu_training.csv'} and .txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
