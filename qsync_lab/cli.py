"""The ``qsync-lab`` command line.

Every command that takes a plan takes the file ``qsync-lab plan`` writes. Bad input is
one line on stderr and exit status 2, before any process starts.

Example::

    $ qsync-lab graph --model resnet18 --batch 8
    $ qsync-lab plan --model resnet18 --cluster local-hybrid --out local_plan.json
    $ qsync-lab simulate --plan local_plan.json
    $ qsync-lab run --plan local_plan.json --steps 30 --run-dir run
    $ qsync-lab report --plan local_plan.json --out local_report.html
    $ qsync-lab lab --port 8866
"""

import argparse
import importlib.util
import os
import secrets
import sys
import time
import warnings
from pathlib import Path

from qsync_lab.errors import QSyncError
from qsync_lab.resources import data_file

_OP_COLUMNS = ["kind", "output_shapes", "fwd_gflops", "bwd_gflops", "saved_mb", "depth"]
#: what ``qsync-lab lab`` serves by default (the repository's notebooks folder)
LAB_NOTEBOOK = Path(str(data_file("lab.ipynb")))  # the lab app: the tuner's panel alone
#: seconds a lab kernel may sit idle with no page attached before Voila stops it, and how
#: often Voila looks
LAB_KERNEL_IDLE_S, LAB_CULL_INTERVAL_S = 60, 15
LAB_TEMPLATE = "qsync"  # data/voila/templates/qsync
LAB_PORT = 8866


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 2 bad input)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _note
            args.run(args)
    except QSyncError as err:
        print(f"qsync-lab: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader (``| head``) left: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return 0


def _note(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings (a plan migrated, a tracer fallback) as one ``note:`` line each."""
    print(f"qsync-lab: note: {message}", file=sys.stderr)


class _Parser(argparse.ArgumentParser):
    """Usage mistakes as one line (``qsync-lab: error: ...``), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"qsync-lab: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    from qsync_lab.runtime.options import runtime_parser

    parser = _Parser(
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
    _add_plan_parser(sub)
    _add_simulate_parser(sub)
    _add_report_parser(sub)
    _add_lab_parser(sub)

    run = sub.add_parser("run", parents=[runtime_parser(add_help=False)],
                         help="train a plan on DDP ranks (torchrun): checks first, then a "
                         "progress bar and measured against predicted step time")
    run.add_argument("--nproc-per-node", type=int,
                     help="ranks on this node (default: the plan's world size / --nnodes)")
    run.add_argument("--nnodes", type=int, default=1, help="nodes (default 1)")
    run.add_argument("--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous (several nodes)")
    run.add_argument("--max-restarts", type=int, default=0,
                     help="restarts after a worker fails (use with --resume)")
    run.add_argument("--oversubscribe", action="store_true",
                     help="start the ranks even when they are more than twice this machine's "
                     "cores (each step then takes many times its prediction)")
    run.add_argument("--verbose", action="store_true",
                     help="show torchrun's and the ranks' output (default: in run-dir/launch.log)")
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
    profile.add_argument("--links", default="ddp",
                         help="fit the allreduce link to real DDP steps of calibration MLPs "
                         "(ddp, the default: about a minute) or to the allreduce "
                         "microbenchmark (allreduce)")
    profile.add_argument("--compress", nargs="*", metavar="SPEC",
                         help="also time gradient compressors' encode and decode through "
                         "the hook: these specs (e.g. global_qsgd:8 cgx:4,error_feedback=true)"
                         ", or without a spec the defaults")
    profile.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                         help="where the ops run: this CPU (default), or this machine's GPU, "
                         "timed with CUDA events, its rows named after its catalog kind "
                         "(links and compressors are then not profiled)")
    profile.add_argument("--out", required=True, help="profile CSV to write")
    profile.set_defaults(run=_cmd_profile)


def _cmd_profile(args) -> None:
    from qsync_lab.compress import CompressionSpec
    from qsync_lab.models import example_batch, get_model, model_spec
    from qsync_lab.profile import DEFAULT_COMPRESSION_SPECS, ProfileJob, profile_machine

    if args.batch < 1:
        raise QSyncError(f"--batch must be a positive integer, got {args.batch}")
    jobs = [ProfileJob(name, get_model(name), *example_batch(name, args.batch),
                       model_spec(name).loss_fn()) for name in args.model]
    compression = ([] if args.compress is None else
                   [str(CompressionSpec.parse(s)) for s in args.compress or
                    DEFAULT_COMPRESSION_SPECS])
    written = profile_machine(jobs, args.out, precisions=args.precisions.split(","),
                              threads=args.threads, repeats=args.repeats,
                              processes=args.processes, method=args.method, links=args.links,
                              compression=compression, device=args.device)
    print(written)


def _add_plan_parser(sub) -> None:
    from qsync_lab.optimizers import OPTIMIZER_STATES

    plan = sub.add_parser("plan", help="allocate a quantization-minimized plan for a zoo model")
    plan.add_argument("--model", required=True, help="zoo model name (see `qsync-lab models`)")
    plan.add_argument("--cluster", default="qsync-paper",
                      help="a shipped cluster name or a path to a TOML file")
    plan.add_argument("--memory-gb", action="append", default=[], metavar="KIND=GIB",
                      help="per-rank memory budget of a device kind (repeatable)")
    plan.add_argument("--throughput", type=float, help="least samples/s (default: the fastest "
                      "kind at fp32 sets the pace)")
    plan.add_argument("--strategy", default="qsync",
                      help="qsync (default), uniform-low, dynamic-batching, joint or fp32")
    plan.add_argument("--optimizer", default="sgd_momentum", choices=list(OPTIMIZER_STATES),
                      help="what the run will train with (its state counts in memory)")
    plan.add_argument("--compress", metavar="SPEC",
                      help="compress gradient communication, e.g. global_qsgd:8, cgx:4, aps, "
                      "qsgd:8, fp16 (the allocation costs it; the run registers it)")
    _add_calibration_option(plan)
    _add_profile_option(plan)
    plan.add_argument("--out", required=True, help="write the plan JSON here")
    plan.set_defaults(run=_cmd_plan)


def _add_profile_option(parser) -> None:
    parser.add_argument("--profile", action="append", default=[], metavar="CSV",
                        help="measured profile table(s) overriding the roofline")


def _add_calibration_option(parser) -> None:
    parser.add_argument("--calibration-batches", type=int, default=2,
                        help="batches for the sensitivity indicator (default 2)")


def _cmd_plan(args) -> None:
    from qsync_lab.compress import CompressionSettings
    from qsync_lab.study import Study

    memory = dict(_key_value(item, "--memory-gb", "KIND=GIB", "T4=12", float)
                  for item in args.memory_gb)
    CompressionSettings.parse(args.compress)  # a bad spec fails before any work
    study = Study(args.model, cluster=args.cluster, profiles=args.profile,
                  calibration_batches=args.calibration_batches, optimizer=args.optimizer)
    begin = time.perf_counter()
    plan = study.plan(memory_limit=memory, throughput_target=args.throughput,
                      strategy=args.strategy, compression=args.compress)
    seconds = time.perf_counter() - begin
    plan.save(args.out)
    sim = study.simulate(plan)
    low = ", ".join(f"{kind}: {n}" for kind, n in plan.low_precision_ops().items())
    print(f"{args.model} on {study.cluster.name} ({args.strategy}, compression "
          f"{plan.compression_settings}): iteration {sim.iteration_us / 1e3:.1f} ms, "
          f"{sim.throughput_samples_per_s:.0f} samples/s, low-precision ops {low}, planned in "
          f"{seconds:.2f} s; wrote {args.out}")


def _add_simulate_parser(sub) -> None:
    from qsync_lab.optimizers import OPTIMIZER_STATES


    simulate = sub.add_parser("simulate", help="simulate one DDP iteration of a plan, or of a "
                              "zoo model under a uniform precision")
    simulate.add_argument("--plan", help="plan JSON (qsync-lab plan --out): its model, cluster, "
                          "batches and optimizer")
    simulate.add_argument("--model", help="zoo model name (default: the plan's)")
    simulate.add_argument("--cluster", help="a shipped cluster name or a TOML path (default: "
                          "the plan's, else qsync-paper)")
    simulate.add_argument("--batch", type=int, default=2, help="batch size to trace the model "
                          "at (ranks run their cluster batch sizes; default 2)")
    simulate.add_argument("--uniform", action="append", default=[], metavar="DEVICE=PRECISION",
                          help="without --plan: run every linear and conv op of DEVICE in "
                          "PRECISION, e.g. T4=fp16 (repeatable)")
    _add_profile_option(simulate)
    simulate.add_argument("--optimizer", choices=list(OPTIMIZER_STATES),
                          help="default: the plan's, else sgd_momentum")
    simulate.add_argument("--compress", metavar="SPEC",
                          help="gradient compression, e.g. global_qsgd:8 (default: the plan's, "
                          "else none)")
    simulate.add_argument("--trace", help="write the Chrome/Perfetto trace JSON here")
    simulate.set_defaults(run=_cmd_simulate)


def _cmd_simulate(args) -> None:
    from qsync_lab.cluster import load_cluster
    from qsync_lab.compress import CompressionSettings
    from qsync_lab.costs import load_cost_model
    from qsync_lab.plan import Plan
    from qsync_lab.report import rank_classes
    from qsync_lab.simulate import simulate

    CompressionSettings.parse(args.compress)  # a bad spec fails before any work
    plan = Plan.load(args.plan) if args.plan else None
    if plan is not None and args.uniform:
        raise QSyncError("--uniform applies without --plan; the plan says what each op runs")
    name = args.model or (plan.model_name if plan else None)
    if not name:
        raise QSyncError("name the model: --model (a zoo model), or --plan of a zoo model")
    kwargs = dict(plan.model_kwargs) if plan and not args.model else {}
    graph, seconds = _trace_zoo_model(name, args.batch, kwargs)
    if plan is not None:
        cluster = load_cluster(args.cluster) if args.cluster else None
        plan.validate(graph, cluster)
        what = plan
    else:
        cluster = load_cluster(args.cluster or "qsync-paper")
        what = _uniform_plan(graph, args.uniform)
    sim = simulate(graph, what, cluster, load_cost_model(*args.profile) if args.profile
                   else None, optimizer=args.optimizer, compression=args.compress)
    cluster_name = cluster.name if cluster is not None else plan.cluster_name
    print(f"{name} on {cluster_name} ({sim.world_size} ranks, traced in {seconds:.1f} s)")
    print(f"iteration {sim.iteration_us / 1e3:.2f} ms, {sim.throughput_samples_per_s:.0f} "
          f"samples/s, {sim.wire_bytes.iloc[0] / 2**20:.1f} MiB sent per rank\n")
    print(rank_classes(sim).round(2).to_string())
    sources = sim.events.groupby("source")["dur_us"].sum() / 1e3
    print("\ntime by cost source (ms, all ranks): "
          + ", ".join(f"{source} {ms:.1f}" for source, ms in sources.items()))
    if args.trace:
        sim.write_perfetto(args.trace)
        print(f"wrote the trace to {args.trace} (open it in ui.perfetto.dev)")


def _add_report_parser(sub) -> None:
    report = sub.add_parser("report", help="write a plan's report: one self-contained HTML "
                            "file with its summary, the strategies compared and the figures")
    report.add_argument("--plan", required=True, help="plan JSON (qsync-lab plan --out)")
    report.add_argument("--out", required=True, help="HTML file to write (its folder must exist)")
    _add_calibration_option(report)
    _add_profile_option(report)
    report.set_defaults(run=_cmd_report)


def _cmd_report(args) -> None:
    from qsync_lab.report import write_report

    path = write_report(args.plan, args.out, profiles=args.profile,
                        calibration_batches=args.calibration_batches)
    print(f"wrote {path}")


def _add_lab_parser(sub) -> None:
    lab = sub.add_parser("lab", help="serve the plan tuner as an app (Voila) on 127.0.0.1, "
                         "behind a fresh token; prints its URL")
    lab.add_argument("--port", type=int, default=LAB_PORT, help=f"port (default {LAB_PORT})")
    lab.add_argument("--model", default="resnet18", help="zoo model to plan (resnet18)")
    lab.add_argument("--cluster", default="local-hybrid",
                     help="shipped cluster or TOML path to plan for (local-hybrid: this "
                     "machine's emulated V100 + T4, so an exported plan runs here)")
    lab.add_argument("--root", type=Path, default=Path.cwd(),
                     help="folder exports are written into (default: the current one)")
    lab.add_argument("--notebook", type=Path, default=LAB_NOTEBOOK,
                     help="notebook to serve instead of the lab app (e.g. a tutorial)")
    lab.set_defaults(run=_cmd_lab)


def voila_command(notebook: "str | os.PathLike[str]", *, port: int) -> list[str]:
    """The command that serves ``notebook`` with Voila on 127.0.0.1:``port`` (that port or
    none), opening no browser, behind the token in ``$JUPYTER_TOKEN`` (an environment
    variable: other users of the machine cannot read it from the process list), stopping
    the kernel of a closed page once it has been idle :data:`LAB_KERNEL_IDLE_S` seconds, in
    the shipped page template (Voila's lab page without its stylesheets from a CDN; Voila
    finds it through :func:`lab_environment`'s ``JUPYTER_PATH``).

    Example::

        >>> voila_command("tuner.ipynb", port=8866)[1:]
        ['-m', 'voila', 'tuner.ipynb', '--no-browser', '--Voila.ip=127.0.0.1',
         '--Voila.port=8866', '--Voila.port_retries=0', '--Voila.auto_token=True',
         '--MappingKernelManager.cull_idle_timeout=60', '--MappingKernelManager.cull_interval=15',
         '--template=qsync']
    """
    return [sys.executable, "-m", "voila", str(notebook), "--no-browser", "--Voila.ip=127.0.0.1",
            f"--Voila.port={port}", "--Voila.port_retries=0", "--Voila.auto_token=True",
            f"--MappingKernelManager.cull_idle_timeout={LAB_KERNEL_IDLE_S}",
            f"--MappingKernelManager.cull_interval={LAB_CULL_INTERVAL_S}",
            f"--template={LAB_TEMPLATE}"]


def lab_environment(model: str, cluster: str, root: "str | os.PathLike[str]") -> dict[str, str]:
    """What the lab app reads (the model, the cluster and the export folder, absolute) and
    where Voila finds the lab's page template.

    Example::

        >>> lab_environment("resnet18", "local-hybrid", "/home/me/plans")["QSYNC_LAB_ROOT"]
        '/home/me/plans'
    """
    templates = str(Path(str(data_file("voila"))).parent)
    paths = os.pathsep.join(filter(None, (templates, os.environ.get("JUPYTER_PATH"))))
    return {"QSYNC_LAB_MODEL": model, "QSYNC_LAB_CLUSTER": cluster,
            "QSYNC_LAB_ROOT": str(Path(root).resolve()), "JUPYTER_PATH": paths}


def _cmd_lab(args) -> None:
    if not args.notebook.is_file():
        raise QSyncError(f"notebook {args.notebook} not found; pass --notebook PATH")
    if not 0 < args.port < 2**16:
        raise QSyncError(f"--port must be in 1..65535, got {args.port}")
    if importlib.util.find_spec("voila") is None:
        raise QSyncError("qsync-lab lab needs voila: pip install -e '.[notebook]' in the "
                         "repository (the notebook extra)")
    if not args.root.is_dir():
        raise QSyncError(f"--root {args.root} is not a folder; pass an existing one")
    token = secrets.token_urlsafe(32)
    print(f"serving {args.notebook} at http://127.0.0.1:{args.port}/?token={token} "
          f"(exports go to {args.root.resolve()}; Ctrl-C stops it)", flush=True)
    command = voila_command(args.notebook, port=args.port)
    os.execve(command[0], command, {**os.environ, "JUPYTER_TOKEN": token,
                                    **lab_environment(args.model, args.cluster, args.root)})


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
    gemms = graph.ops.index[graph.ops["kind"].isin(["linear", "conv1d", "conv2d", "conv3d"])
                            & (graph.ops["plan_refusal"] == "")]
    plan: dict[str, dict[str, str]] = {}
    for item in items:
        device, precision = _key_value(item, "--uniform", "DEVICE=PRECISION", "T4=fp16")
        plan.setdefault(device, {}).update(dict.fromkeys(gemms, precision))
    return plan


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
    from qsync_lab.runtime.options import config_from_args

    config = config_from_args(args)
    if args.nnodes < 1 or (args.nproc_per_node is not None and args.nproc_per_node < 1):
        raise QSyncError("--nnodes and --nproc-per-node must be positive integers")
    from qsync_lab.runtime.launch import launch

    summary = launch(config, nproc_per_node=args.nproc_per_node, nnodes=args.nnodes,
                     rdzv_endpoint=args.rdzv_endpoint, max_restarts=args.max_restarts,
                     threads=args.threads, verbose=args.verbose,
                     oversubscribe=args.oversubscribe)
    if summary is not None:
        from qsync_lab.runtime.metrics import summary_line

        print(f"{summary_line(summary)}; wrote {config.run_dir}/summary.json")
    elif args.nnodes > 1:  # on one node, no summary: the run was complete (a note said so)
        print("this node's ranks finished; rank 0's node has the run's result")


def _cmd_demo(args) -> None:
    from qsync_lab.demo import run_demo

    if args.steps < 1:
        raise QSyncError(f"--steps must be a positive integer, got {args.steps}")
    run_demo(args.out, model=args.model, cluster=args.cluster, steps=args.steps)


def _trace_zoo_model(name: str, batch: int, kwargs: dict | None = None):
    from qsync_lab.graph import trace_graph
    from qsync_lab.models import example_batch, get_model, model_spec

    if batch < 1:
        raise QSyncError(f"--batch must be a positive integer, got {batch}")
    spec = model_spec(name)
    model = get_model(name, **(kwargs or {}))
    inputs, target = example_batch(name, batch, **(kwargs or {}))
    start = time.perf_counter()
    graph = trace_graph(model, inputs, target=target, loss_fn=spec.loss_fn())
    return graph, time.perf_counter() - start


def _print_graph(name: str, graph, seconds: float, rows: int) -> None:
    import pandas as pd

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


def _write_csv(frame, path: str) -> None:
    from qsync_lab.io import atomic_write_text

    atomic_write_text(path, frame.to_csv())


if __name__ == "__main__":
    sys.exit(main())
