"""The bodies of the ``qsync-lab`` commands: each takes the parsed arguments, prints its
result and raises :class:`~qsync_lab.errors.QSyncError` on bad input. The commands about one
model go through :class:`~qsync_lab.study.Study`; heavy modules are imported by the command
that needs them, so that ``qsync-lab --help`` stays quick.

Example::

    >>> import argparse
    >>> models_command(argparse.Namespace())  # doctest: +ELLIPSIS
    bert_base ...
"""

import time

from qsync_lab.errors import QSyncError

__all__ = ["cluster_command", "clusters_command", "demo_command", "graph_command",
           "models_command", "plan_command", "profile_command", "report_command", "run_command",
           "simulate_command"]

_OP_COLUMNS = ["kind", "output_shapes", "fwd_gflops", "bwd_gflops", "saved_mb", "depth"]


def graph_command(args) -> None:
    """Trace a zoo model; print its operator table, optionally written as CSV too."""
    from qsync_lab.io import atomic_write_text, check_output_file

    if args.csv is not None:
        check_output_file(args.csv, "--csv")
    study = _study(args.model, args.batch)
    graph, seconds = _traced(study)
    _print_graph(args.model, graph, seconds, args.rows)
    if args.csv is not None:
        atomic_write_text(args.csv, graph.ops.to_csv())
        print(f"\nwrote {len(graph.ops)} operators to {args.csv}")


def cluster_command(args) -> None:
    """Print a cluster and its device summary."""
    from qsync_lab.cluster import load_cluster

    cluster = load_cluster(args.cluster)
    print(cluster)
    print()
    print(cluster.summary().to_string())


def models_command(args) -> None:
    """List the zoo models."""
    from qsync_lab.models import list_models, model_spec

    for name in list_models():
        print(f"{name:12s} {model_spec(name).description}")


def clusters_command(args) -> None:
    """List the shipped clusters."""
    from qsync_lab.cluster import list_clusters, load_cluster

    for name in list_clusters():
        cluster = load_cluster(name)
        print(f"{name:14s} {cluster.world_size:3d} ranks  {', '.join(cluster.device_kinds)}")


def profile_command(args) -> None:
    """Measure this machine for the models into one profile table; print its path."""
    from qsync_lab.io import check_output_file

    check_output_file(args.out, "--out")  # before minutes of measuring
    from qsync_lab.compress import CompressionSpec
    from qsync_lab.profile import DEFAULT_COMPRESSION_SPECS, ProfileJob, profile_machine

    studies = [_study(name, args.batch) for name in args.model]
    jobs = [ProfileJob(name, study.model, *study.example, study.loss_fn)
            for name, study in zip(args.model, studies)]
    compression = ([] if args.compress is None else
                   [str(CompressionSpec.parse(s)) for s in args.compress or
                    DEFAULT_COMPRESSION_SPECS])
    written = profile_machine(jobs, args.out, precisions=args.precisions.split(","),
                              threads=args.threads, repeats=args.repeats,
                              processes=args.processes, method=args.method,
                              links=None if args.links == "none" else args.links,
                              compression=compression, device=args.device,
                              step_optimizer=args.optimizer if _calibrates(args, jobs) else None)
    print(written)


def _calibrates(args, jobs) -> bool:
    """Whether ``qsync-lab profile`` calibrates the step to the model's own: one model on a
    GPU of a catalog kind (on the CPU, runs calibrate their own profiles)."""
    if args.device != "cuda" or len(jobs) != 1:
        return False
    from qsync_lab.devices import load_catalog
    from qsync_lab.profile.device import profile_device, profile_device_name

    return profile_device_name(profile_device("cuda")) in load_catalog().devices


def plan_command(args) -> None:
    """Allocate a plan, save it and print its simulated iteration."""
    from qsync_lab.io import check_output_file

    check_output_file(args.out, "--out", inputs=(args.cluster, *args.profile))
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
    for line in _unmet_constraints(plan, sim, study.cluster):
        print(f"note: the {args.strategy} plan does not meet {line}")


def _unmet_constraints(plan, sim, cluster) -> list[str]:
    """The constraints ``plan`` was made under that its simulation ``sim`` misses (the
    baseline strategies plan without them): each kind's memory budget, the throughput."""
    peaks = sim.rank_summary().groupby("device")["tensor_peak_gib"].max()
    unmet = []
    for kind, peak_gib in peaks.items():
        budget_gib = plan.constraints.memory_budget_bytes(cluster, kind) / 2**30
        if peak_gib > budget_gib:
            unmet.append(f"{kind}'s memory budget of {budget_gib:.3g} GiB (its ranks' tensors "
                         f"peak at {peak_gib:.3g} GiB)")
    target = plan.constraints.throughput_samples_per_s
    if target is not None and sim.throughput_samples_per_s < target:
        unmet.append(f"the throughput target of {target:g} samples/s (it reaches "
                     f"{sim.throughput_samples_per_s:.0f})")
    return unmet


def simulate_command(args) -> None:
    """Simulate one iteration of a plan file, or of a zoo model under ``--uniform``
    precisions; print it by class of ranks and optionally write its trace."""
    from qsync_lab.compress import CompressionSettings
    from qsync_lab.io import check_output_file
    from qsync_lab.optimizers import DEFAULT_OPTIMIZER
    from qsync_lab.plan import Plan
    from qsync_lab.report import rank_classes

    if args.trace is not None:
        check_output_file(args.trace, "--trace", inputs=(args.plan, args.cluster, *args.profile))
    CompressionSettings.parse(args.compress)  # a bad spec fails before any work
    plan = Plan.load(args.plan) if args.plan else None
    if plan is not None and args.uniform:
        raise QSyncError("--uniform applies without --plan; the plan says what each op runs")
    name = args.model or (plan.model_name if plan else None)
    if not name:
        raise QSyncError("name the model: --model (a zoo model), or --plan of a zoo model")
    uniform = [_key_value(item, "--uniform", "DEVICE=PRECISION", "T4=fp16")
               for item in args.uniform]
    kwargs = plan.model_kwargs if plan is not None and not args.model else {}
    cluster = args.cluster or (plan.cluster if plan is not None else "qsync-paper")
    study = _study(name, args.batch, model_kwargs=kwargs, cluster=cluster, profiles=args.profile,
                   optimizer=args.optimizer or DEFAULT_OPTIMIZER)
    graph, seconds = _traced(study)
    if plan is not None:
        plan.validate(graph, study.cluster)
    sim = study.simulate(plan if plan is not None else _uniform_plan(graph, uniform),
                         optimizer=args.optimizer, compression=args.compress)
    print(f"{name} on {study.cluster.name} ({sim.world_size} ranks, traced in {seconds:.1f} s)")
    print(f"iteration {sim.iteration_us / 1e3:.2f} ms, {sim.throughput_samples_per_s:.0f} "
          f"samples/s, {sim.wire_bytes.iloc[0] / 2**20:.1f} MiB sent per rank\n")
    print(rank_classes(sim).round(2).to_string())
    sources = sim.events.groupby("source")["dur_us"].sum() / 1e3
    print("\ntime by cost source (ms, all ranks): "
          + ", ".join(f"{source} {ms:.1f}" for source, ms in sources.items()))
    if args.trace is not None:
        sim.write_perfetto(args.trace)
        print(f"wrote the trace to {args.trace} (open it in ui.perfetto.dev)")


def report_command(args) -> None:
    """Write a plan's HTML report."""
    from qsync_lab.report import write_report

    path = write_report(args.plan, args.out, profiles=args.profile,
                        calibration_batches=args.calibration_batches)
    print(f"wrote {path}")


def run_command(args) -> None:
    """Train a plan file on DDP ranks (torchrun) and print measured against predicted."""
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


def demo_command(args) -> None:
    """The main job on built-in defaults (:func:`~qsync_lab.demo.run_demo`)."""
    from qsync_lab.io import check_output_dir

    if args.steps < 1:
        raise QSyncError(f"--steps must be a positive integer, got {args.steps}")
    check_output_dir(args.out, "--out")
    from qsync_lab.demo import run_demo

    run_demo(args.out, model=args.model, cluster=args.cluster, steps=args.steps)


def _key_value(item: str, flag: str, form: str, example: str, convert=str):
    """Parse ``KEY=VALUE`` of a repeatable flag, or raise a one-line error."""
    key, sep, value = item.partition("=")
    try:
        if not sep or not key or not value:
            raise ValueError
        return key, convert(value)
    except ValueError:
        raise QSyncError(f"{flag} expects {form}, got {item!r}; e.g. {example}") from None


def _study(name: str, batch: int, **options):
    """The :class:`~qsync_lab.study.Study` of zoo model ``name`` traced at ``batch``."""
    from qsync_lab.limits import MAX_BATCH_SIZE
    from qsync_lab.study import Study

    if not 1 <= batch <= MAX_BATCH_SIZE:
        raise QSyncError(f"--batch must be an integer from 1 to {MAX_BATCH_SIZE}, got {batch}")
    return Study(name, batch_size=batch, progress=False, **options)


def _traced(study):
    """The study's graph and the seconds its trace took."""
    start = time.perf_counter()
    graph = study.graph
    return graph, time.perf_counter() - start


def _uniform_plan(graph, uniform: list[tuple[str, str]]) -> dict[str, dict[str, str]]:
    """Device kind -> {op -> precision}: every plannable linear and conv op of each kind in
    its ``--uniform`` precision."""
    from qsync_lab.policy import GEMM_KINDS, WEIGHTED_KINDS

    gemms = graph.ops.index[graph.ops["kind"].isin(GEMM_KINDS & WEIGHTED_KINDS)
                            & (graph.ops["plan_refusal"] == "")]
    plan: dict[str, dict[str, str]] = {}
    for device, precision in uniform:
        plan.setdefault(device, {}).update(dict.fromkeys(gemms, precision))
    return plan


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
