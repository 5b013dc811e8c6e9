"""The ``qsync-lab`` command line.

Example::

    $ qsync-lab graph --model resnet18 --batch 8
    $ qsync-lab cluster qsync-paper
    $ qsync-lab demo
"""

import argparse
import sys
import time
from pathlib import Path

import pandas as pd

from qsync_lab.errors import QSyncError

_OP_COLUMNS = ["kind", "output_shapes", "fwd_gflops", "bwd_gflops", "saved_mb", "depth"]


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 2 bad input)."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "run":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.runtime_args = extra
    if args.command is None:
        parser.print_help()
        return 0
    try:
        args.run(args)
    except QSyncError as err:
        print(f"qsync-lab: error: {err}", file=sys.stderr)
        return 2
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qsync-lab", description="Plan and run quantization-minimized synchronous "
        "data-parallel training across hybrid devices.")
    sub = parser.add_subparsers(dest="command")

    graph = sub.add_parser("graph", help="trace a zoo model and print its operator table")
    graph.add_argument("--model", required=True, help="zoo model name (see `qsync-lab models`)")
    graph.add_argument("--batch", type=int, default=2, help="example batch size (default 2)")
    graph.add_argument("--rows", type=int, default=30,
                       help="operator rows to print (default 30; 0 = all)")
    graph.add_argument("--csv", help="also write the full operator table to this CSV file")
    graph.set_defaults(run=_cmd_graph)

    cluster = sub.add_parser("cluster", help="print a cluster's ranks and device summary")
    cluster.add_argument("cluster", help="a shipped cluster name or a path to a TOML file")
    cluster.set_defaults(run=_cmd_cluster)

    sub.add_parser("models", help="list the zoo models").set_defaults(run=_cmd_models)
    sub.add_parser("clusters", help="list the shipped clusters").set_defaults(run=_cmd_clusters)

    _add_profile_parser(sub)
    _add_simulate_parser(sub)
    _add_plan_parser(sub)

    run = sub.add_parser("run", help="train a plan on DDP ranks with torchrun; other options "
                         "go to `python -m qsync_lab.runtime` (--steps, --run-dir, --resume, ...)")
    run.add_argument("--plan", required=True, help="plan JSON (qsync-lab plan --out)")
    run.add_argument("--nproc-per-node", type=int,
                     help="ranks on this node (default: the plan's world size / --nnodes)")
    run.add_argument("--nnodes", type=int, default=1, help="nodes (default 1)")
    run.add_argument("--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous (several nodes)")
    run.add_argument("--max-restarts", type=int, default=0,
                     help="restarts after a worker fails (use with --resume)")
    run.set_defaults(run=_cmd_run)

    demo = sub.add_parser("demo", help="the main job on built-in defaults")
    demo.add_argument("--model", default="bert_base")
    demo.add_argument("--cluster", default="qsync-paper")
    demo.add_argument("--out", default="qsync_demo",
                      help="folder for plans, traces, the profile and the run "
                      "(default ./qsync_demo)")
    demo.add_argument("--steps", type=int, default=30, help="training steps of the local run")
    demo.set_defaults(run=_cmd_demo)
    return parser


def _add_profile_parser(sub) -> None:
    profile = sub.add_parser("profile", help="measure this machine: op times per precision, "
                             "casts and gloo allreduces, written as a profile table")
    profile.add_argument("--model", action="append", required=True,
                         help="zoo model to profile (repeatable)")
    profile.add_argument("--batch", type=int, default=16, help="per-rank batch size (16)")
    profile.add_argument("--precisions", default="fp32,bf16,int8",
                         help="comma-separated precisions (default fp32,bf16,int8)")
    profile.add_argument("--threads", type=int, default=1,
                         help="threads per op (= the cores one DDP rank will have; default 1)")
    profile.add_argument("--repeats", type=int, default=10, help="timed repeats (median)")
    profile.add_argument("--processes", type=int, default=1,
                         help="profile in N processes at once, as N local DDP ranks run "
                         "(they share caches and memory bandwidth; default 1)")
    profile.add_argument("--method", default="in_step", choices=["in_step", "isolated"],
                         help="time ops inside training steps (in_step) or one at a time")
    profile.add_argument("--ddp-link", action=argparse.BooleanOptionalAction, default=True,
                         help="fit the link to real DDP steps of calibration MLPs (about a "
                         "minute; else the allreduce microbenchmark's fit is written)")
    profile.add_argument("--out", required=True, help="profile CSV to write")
    profile.set_defaults(run=_cmd_profile)


def _cmd_profile(args) -> None:
    import functools

    from qsync_lab.models import example_batch, get_model, model_spec
    from qsync_lab.precision import Precision
    from qsync_lab.profile import (copy_pass_us, default_cast_sizes, default_copy_sizes,
                                   default_sizes, fit_alpha_beta, fit_buffer_broadcast,
                                   fit_casts, fit_ddp_link,
                                   fit_step_overhead, intra_op_threads, link_metadata,
                                   measure_buffer_broadcast, measure_ddp_overhead,
                                   profile_allreduce,
                                   profile_casts, profile_ops, profile_ops_concurrently,
                                   run_metadata, step_overhead_metadata, write_device_profile)

    if min(args.batch, args.threads, args.repeats, args.processes) < 1:
        raise QSyncError("--batch, --threads, --repeats and --processes must be positive "
                         "integers")
    precisions = [str(Precision.parse(p)) for p in args.precisions.split(",")]
    frames = []
    pairs = ([("fp32", p) for p in precisions if p != "fp32"]
             + [(p, "fp32") for p in precisions if p not in ("fp32", "int8")])
    profile = (functools.partial(profile_ops_concurrently, processes=args.processes,
                                 threads=args.threads) if args.processes > 1 else profile_ops)
    profile = functools.partial(profile, method=args.method)
    with intra_op_threads(args.threads):
        for name in args.model:
            inputs, target = example_batch(name, args.batch)
            rows = profile(get_model(name), inputs, target, model_spec(name).loss_fn(),
                           precisions, repeats=args.repeats)
            # several models share op names (conv1, fc): match their rows by kind and shape
            frames.append(rows.assign(op="") if len(args.model) > 1 else rows)
        casts = pd.concat([profile_casts(pairs, default_cast_sizes(), repeats=args.repeats),
                           profile_casts([("fp32", "fp32")], default_copy_sizes(),  # DDP's copies
                                         repeats=args.repeats)])
        overhead = fit_step_overhead(repeats=args.repeats, method=args.method)
    allreduce = profile_allreduce(default_sizes(), repeats=args.repeats)
    link = fit_alpha_beta(allreduce["bytes"], allreduce["time_us"], world_size=2,
                          link="loopback")
    if args.ddp_link:
        link = fit_ddp_link(measure_ddp_overhead(threads=args.threads),
                            copy_pass_us(fit_casts(casts)), link="loopback",
                            source=f"profile:{Path(args.out).name} ddp-calibration")
    metadata = {**run_metadata("cpu", threads=args.threads), "profile_method": args.method,
                **step_overhead_metadata(overhead),
                **link_metadata(link.link, r2=link.line.r2, world_size=2, backend="gloo"),
                **{f"cast_r2.{pair}": f"{fit.r2:.4f}" for pair, fit in fit_casts(casts).items()}}
    if args.ddp_link:  # DDP's broadcast of BatchNorm buffers before every forward
        broadcast = fit_buffer_broadcast(measure_buffer_broadcast(threads=args.threads),
                                         link.link)
        metadata.update(link_metadata(broadcast, r2=float("nan"), world_size=2,
                                      backend="gloo"))
    write_device_profile(args.out, [*frames, casts], metadata)
    print(f"wrote {args.out}: {sum(len(f) for f in frames)} op rows, {len(casts)} cast rows; "
          f"allreduce alpha {link.link.latency_s * 1e6:.1f} us, beta "
          f"{link.link.bandwidth_Bps / 1e9:.2f} GB/s (R2 {link.line.r2:.3f})")


def _add_simulate_parser(sub) -> None:
    simulate = sub.add_parser("simulate", help="simulate one DDP iteration of a zoo model on a "
                              "cluster under a precision plan")
    simulate.add_argument("--model", required=True, help="zoo model name (see `qsync-lab models`)")
    simulate.add_argument("--cluster", default="qsync-paper",
                          help="a shipped cluster name or a path to a TOML file")
    simulate.add_argument("--batch", type=int, default=2, help="batch size to trace the model "
                          "at (ranks run their cluster batch sizes; default 2)")
    simulate.add_argument("--plan", help="JSON file {device kind: {op FQN: precision}} "
                          "(default: everything fp32)")
    simulate.add_argument("--uniform", action="append", default=[], metavar="DEVICE=PRECISION",
                          help="run every linear and conv op of DEVICE in PRECISION, e.g. "
                          "T4=fp16 (repeatable; --plan entries override it)")
    simulate.add_argument("--profile", action="append", default=[], metavar="CSV",
                          help="measured profile table(s) overriding the roofline")
    simulate.add_argument("--optimizer", default="sgd",
                          choices=["sgd", "sgd_momentum", "adam", "adamw"])
    simulate.add_argument("--trace", help="write the Chrome/Perfetto trace JSON here")
    simulate.set_defaults(run=_cmd_simulate)


def _cmd_simulate(args) -> None:
    from qsync_lab.cluster import load_cluster
    from qsync_lab.profile import load_cost_model
    from qsync_lab.simulate import simulate

    graph, seconds = _trace_zoo_model(args.model, args.batch)
    cluster = load_cluster(args.cluster)
    plan = _uniform_plan(graph, args.uniform)
    if args.plan:
        for device, ops in _read_plan_json(args.plan).items():
            plan.setdefault(device, {}).update(ops)
    sim = simulate(graph, plan, cluster, load_cost_model(*args.profile),
                   optimizer=args.optimizer)
    print(f"{args.model} on {cluster.name} ({cluster.world_size} ranks, traced in "
          f"{seconds:.1f} s)")
    print(f"iteration {sim.iteration_us / 1e3:.2f} ms, {sim.throughput_samples_per_s:.0f} "
          f"samples/s, {sim.wire_bytes.iloc[0] / 2**20:.1f} MiB sent per rank\n")
    summary = sim.rank_summary().groupby(["device", "batch_size"]).agg(
        ranks=("busy_us", "size"), busy_ms=("busy_us", "max"), idle_ms=("idle_us", "max"),
        tensor_peak_gib=("tensor_peak_gib", "max"))
    summary[["busy_ms", "idle_ms"]] /= 1e3
    print(summary.round(2).to_string())
    sources = sim.events.groupby("source")["dur_us"].sum() / 1e3
    print("\ntime by cost source (ms, all ranks): "
          + ", ".join(f"{name} {ms:.1f}" for name, ms in sources.items()))
    if args.trace:
        sim.to_perfetto(args.trace)
        print(f"wrote the trace to {args.trace} (open it in ui.perfetto.dev)")


def _add_plan_parser(sub) -> None:
    plan = sub.add_parser("plan", help="allocate a quantization-minimized plan for a zoo model")
    plan.add_argument("--model", required=True, help="zoo model name (see `qsync-lab models`)")
    plan.add_argument("--cluster", default="qsync-paper",
                      help="a shipped cluster name or a path to a TOML file")
    plan.add_argument("--memory-gb", action="append", default=[], metavar="KIND=GIB",
                      help="per-rank memory budget of a device kind (repeatable)")
    plan.add_argument("--throughput", type=float, help="least samples/s (default: the fastest "
                      "kind at fp32 sets the pace)")
    plan.add_argument("--calibration-batches", type=int, default=2,
                      help="batches for the sensitivity indicator (default 2)")
    plan.add_argument("--profile", action="append", default=[], metavar="CSV",
                      help="measured profile table(s) overriding the roofline")
    plan.add_argument("--out", required=True, help="write the plan JSON here")
    plan.set_defaults(run=_cmd_plan)


def _cmd_plan(args) -> None:
    from qsync_lab.allocate import Constraints, allocate_detailed
    from qsync_lab.cluster import load_cluster
    from qsync_lab.indicator import indicator
    from qsync_lab.profile import load_cost_model
    from qsync_lab.models import example_batch, get_model, model_spec

    memory = dict(_key_value(item, "--memory-gb", "KIND=GIB", "T4=12", float)
                  for item in args.memory_gb)
    if args.calibration_batches < 1:
        raise QSyncError(f"--calibration-batches must be at least 1, got "
                         f"{args.calibration_batches}")
    graph, _ = _trace_zoo_model(args.model, 2)
    model = get_model(args.model)
    batches = [example_batch(args.model, 2, seed=s) for s in range(args.calibration_batches)]
    scores = indicator(model, graph, batches, loss_fn=model_spec(args.model).loss_fn(),
                       precisions=("fp16", "int8"), num_batches=args.calibration_batches)
    cluster = load_cluster(args.cluster)
    result = allocate_detailed(graph, cluster, load_cost_model(*args.profile), scores,
                               Constraints(memory, args.throughput))
    result.plan.for_model(args.model).save(args.out)
    low = ", ".join(f"{kind}: {n}" for kind, n in result.plan.low_precision_ops().items())
    print(f"{args.model} on {cluster.name}: iteration {result.iteration_us / 1e3:.1f} ms "
          f"(target {result.target_us / 1e3:.1f}), low-precision ops {low or 'none'}, "
          f"allocated in {result.seconds:.2f} s; wrote {args.out}")


def _key_value(item: str, flag: str, form: str, example: str, convert=str):
    """Parse ``KEY=VALUE`` of a repeatable flag, or raise a one-line error."""
    key, sep, value = item.partition("=")
    try:
        if not sep or not key or not value:
            raise ValueError
        return key, convert(value)
    except ValueError:
        raise QSyncError(f"{flag} expects {form}, got {item!r}; e.g. {example}") from None


def _uniform_plan(graph, items: list[str]) -> dict[str, dict[str, str]]:
    gemms = graph.ops.index[graph.ops["kind"].isin(["linear", "conv1d", "conv2d", "conv3d"])]
    plan: dict[str, dict[str, str]] = {}
    for item in items:
        device, precision = _key_value(item, "--uniform", "DEVICE=PRECISION", "T4=fp16")
        plan.setdefault(device, {}).update(dict.fromkeys(gemms, precision))
    return plan


def _read_plan_json(path: str) -> dict:
    import json

    try:
        plan = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise QSyncError(f"cannot read plan {path}: {_first_line(err)}; give a JSON file "
                         "{device kind: {op FQN: precision}}") from None
    if not isinstance(plan, dict) or not all(isinstance(v, dict) for v in plan.values()):
        raise QSyncError(f"plan {path} must be a JSON object {{device kind: {{op FQN: "
                         "precision}}}}")
    return plan


def _first_line(err: BaseException) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def _cmd_graph(args) -> None:
    graph, seconds = _trace_zoo_model(args.model, args.batch)
    _print_graph(args.model, graph, seconds, args.rows)
    if args.csv:
        _write_csv(graph.ops, args.csv)
        print(f"\nwrote {len(graph.ops)} operators to {args.csv}")


def _cmd_cluster(args) -> None:
    from qsync_lab.cluster import load_cluster

    cluster = load_cluster(args.cluster)
    print(cluster)
    print()
    print(cluster.summary().to_string())


def _cmd_models(args) -> None:
    from qsync_lab.models import list_models, model_spec

    for name in list_models():
        print(f"{name:12s} {model_spec(name).description}")


def _cmd_clusters(args) -> None:
    from qsync_lab.cluster import list_clusters, load_cluster

    for name in list_clusters():
        cluster = load_cluster(name)
        print(f"{name:14s} {cluster.world_size:3d} ranks  {', '.join(cluster.device_kinds)}")


def _cmd_run(args) -> None:
    import subprocess

    from qsync_lab.plan import Plan
    from qsync_lab.runtime.launch import torchrun_command

    plan = Plan.load(args.plan)
    nproc = args.nproc_per_node or max(1, plan.world_size // args.nnodes)
    command = torchrun_command(args.plan, nproc, nnodes=args.nnodes,
                               rdzv_endpoint=args.rdzv_endpoint, max_restarts=args.max_restarts,
                               runtime_args=args.runtime_args)
    print(" ".join(command), flush=True)
    returncode = subprocess.run(command, check=False).returncode
    if returncode:
        raise QSyncError(f"torchrun exited with status {returncode}; see the ranks' errors above")


def _cmd_demo(args) -> None:
    from qsync_lab.demo import run_demo

    if args.steps < 1:
        raise QSyncError(f"--steps must be a positive integer, got {args.steps}")
    run_demo(args.out, model=args.model, cluster=args.cluster, steps=args.steps)


def _trace_zoo_model(name: str, batch: int):
    from qsync_lab.graph import trace_graph
    from qsync_lab.models import example_batch, get_model, model_spec

    if batch < 1:
        raise QSyncError(f"--batch must be a positive integer, got {batch}")
    spec = model_spec(name)
    model = get_model(name)
    inputs, target = example_batch(name, batch)
    start = time.perf_counter()
    graph = trace_graph(model, inputs, target=target, loss_fn=spec.loss_fn())
    return graph, time.perf_counter() - start


def _print_graph(name: str, graph, seconds: float, rows: int) -> None:
    table = graph.ops.assign(
        fwd_gflops=graph.ops["fwd_flops"] / 1e9,
        bwd_gflops=(graph.ops["bwd_input_flops"] + graph.ops["bwd_weight_flops"]) / 1e9,
        saved_mb=graph.ops["saved_bytes"] / 2**20,
    )[_OP_COLUMNS]
    totals = graph.totals()
    print(f"{name}: {graph.num_ops} operators, {totals['param_count']:,} parameters, "
          f"traced with {graph.traced_with} in {seconds:.2f} s")
    shown = table if rows <= 0 else table.head(rows)
    with pd.option_context("display.width", 160, "display.max_colwidth", 40):
        print(shown.round(4).to_string())
    if len(shown) < len(table):
        print(f"... {len(table) - len(shown)} more operators (use --rows 0 to show all)")
    print("\nper operator kind:")
    print(graph.kind_summary().round(4).to_string())
    print(f"\nforward {totals['fwd_flops'] / 1e9:.3f} GFLOP, backward "
          f"{(totals['bwd_input_flops'] + totals['bwd_weight_flops']) / 1e9:.3f} GFLOP, "
          f"activations saved for backward {graph.saved_activation_bytes() / 2**20:.1f} MiB "
          f"(CUDA), parameters {totals['param_bytes'] / 2**20:.1f} MiB")


def _write_csv(frame: pd.DataFrame, path: str) -> None:
    from qsync_lab.io import atomic_write_text

    atomic_write_text(path, frame.to_csv())


if __name__ == "__main__":
    sys.exit(main())
