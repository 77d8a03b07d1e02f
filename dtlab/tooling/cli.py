"""The ``dtlab`` command line.

    dtlab env [--json]                          what this machine has, and the course's plan for it
    dtlab advise --params 7e9 [--cluster "g5.12xlarge x4"] [--recompute full] [...]
                                                memory per GPU and step time of every strategy
                                                (DDP, ZeRO, FSDP, offload, TP x PP x DP), the fastest
                                                that fits and why (dtlab advise -h); dtlab memory is
                                                its old name (data parallelism only)
    dtlab course list                           the notebooks, in order, with their parameters
    dtlab course run [NOTEBOOK ...] [-p name=value ...] [--ci] [--solutions] [--runs DIR]
                                                run notebooks headless into runs/<timestamp>/
    dtlab clusters validate [PATH ...]          check cluster files and databricks.yml offline
                                                (default: clusters/*.yml and databricks.yml)
    dtlab clusters pin-wheel WHEEL --volume DIR FILE ...
                                                write the wheel's exact path in DIR and its sha256 into
                                                cluster files (what their init script installs as root)
    dtlab site [RUN] [--out site] [--no-check]  the newest course run (or RUN) as a website in site/,
                                                then every page checked in headless Chromium

Exit codes: 0 success, 1 a notebook failed, a cluster file is invalid or the site check found a
problem, 2 bad input (unknown notebook, malformed -p, a path that does not exist, databricks-bundles
not installed, a planning question with a non-positive size or an unknown GPU or cluster, a site with
no run to publish and no way to run the course).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys


def _env(args: argparse.Namespace) -> int:
    from dtlab import environment

    info = environment.report()
    print(json.dumps(info, indent=2) if args.json else environment.format_report(info))
    return 0


def _memory(rest: list[str]) -> int:
    """``dtlab memory`` was a second planner; it is now a view of ``dtlab advise`` (data parallelism only)."""
    renamed = {"--cpu-mem-gb-per-gpu": "--host-mem-gb-per-gpu"}
    argv = [renamed.get(a.split("=")[0], a.split("=")[0]) + (f"={a.split('=', 1)[1]}" if "=" in a else "")
            for a in rest]
    print("dtlab memory is now `dtlab advise --data-parallel-only` (one planner, one set of flags; "
          "--cpu-mem-gb-per-gpu is --host-mem-gb-per-gpu)", file=sys.stderr)
    return main(["advise", "--data-parallel-only", *argv])


def _parse_layout(text: str) -> dict:
    """``"dp=4,tp=4,pp=1,zero=1"`` as a dict, or ValueError naming the fix."""
    layout = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if key not in ("dp", "tp", "pp", "cp", "zero", "virtual", "shard") or not value.isdigit():
            raise ValueError(f"--layout {text!r}: write it as dp=4,tp=4,pp=1 (keys dp, tp, pp, cp, zero, virtual, "
                             "shard: HSDP's shard group, with zero=3)")
        layout[key] = int(value)
    return layout


def _advise(args: argparse.Namespace) -> int:
    from dtlab.planner import advise

    try:
        if args.mfu is not None:
            raise ValueError("--mfu is now --efficiency: the fraction of peak FLOP/s the GPU's kernels reach while "
                             "computing; MFU is what the advisor reports. Fix: --efficiency "
                             f"{args.mfu:g}")
        shape = None
        if args.hf_config:
            from dtlab.planner import formulas

            try:
                with open(args.hf_config) as f:
                    shape = formulas.shape_from_hf(json.load(f))
            except (OSError, json.JSONDecodeError) as err:
                raise ValueError(f"cannot read the Hugging Face config {args.hf_config} ({err}). Fix: the path of a "
                                 "model's config.json (model.config.to_json_file(path) writes one)") from None
        result = advise.advise(args.params, shape=shape, n_layer=args.layers, n_embd=args.hidden, n_head=args.heads,
                               n_kv_head=args.kv_heads, vocab=args.vocab, cluster=args.cluster, gpus=args.gpus,
                               gpu=args.gpu, gpu_mem_gb=args.gpu_mem_gb, gpus_per_node=args.gpus_per_node,
                               tflops=args.tflops, intra_node_gbs=args.intra_node_gbs,
                               inter_node_gbs=args.inter_node_gbs, host_memory_gb_per_gpu=args.host_mem_gb_per_gpu,
                               micro_batch=args.micro_batch, seq_len=args.seq_len, global_batch=args.global_batch,
                               precision=args.precision, optimizer=args.optimizer, recompute=args.recompute,
                               efficiency=args.efficiency, headroom=args.headroom, grad_reduce=args.grad_reduce,
                               sequence_parallel=not args.no_sequence_parallel, schedule=args.schedule,
                               pipeline_split=args.pipeline_split, framework=args.framework,
                               eager_norms=args.eager_norms,
                               bucket_bytes=None if args.bucket_mb == "megatron" else float(args.bucket_mb) * 1e6,
                               layout=_parse_layout(args.layout) if args.layout else None,
                               layouts=not args.data_parallel_only)
    except ValueError as exc:  # also dtlab.planner.hardware.UnknownHardware
        print(f"dtlab advise: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result.as_dict(), indent=2) if args.json else result.table())
    return 0


def _advise_parser(sub) -> argparse.ArgumentParser:
    from dtlab.planner import cost, formulas, hardware

    shapes = ", ".join(f"{s.name} = {s.n_layer}/{s.n_embd}/{s.n_head}" for s in formulas.KNOWN_SHAPES.values())
    adv = sub.add_parser(
        "advise", help="which strategy for a model on a cluster: memory per GPU and step time of each, ranked",
        description="Memory per GPU (parameters, gradients, optimizer state, activations) and step time (compute, "
                    "communication, bubble, offload) of DDP, ZeRO 1-3 / FSDP, offloading and TP x PP x DP layouts, "
                    "and the fastest that fits. GB = 10^9 bytes. Exit 2 on bad input.")
    adv.add_argument("--params", type=_number(float, 0, low_ok=False, example="7e9"), default=None,
                     help="model parameters, e.g. 7e9 (or give --layers, --hidden, --heads). With --params alone the "
                          f"shape is a published one within 1.25x ({shapes} layers/hidden/heads) or follows the "
                          "published families (128-wide heads)")
    adv.add_argument("--hf-config", default=None, metavar="CONFIG_JSON",
                     help="a Hugging Face model's config.json: its shape (layers, hidden, heads, KV heads, MLP, "
                          "vocabulary) instead of --layers/--hidden/--heads")
    adv.add_argument("--layers", type=_number(int, 1, example="32"), default=None, help="the model's layers")
    adv.add_argument("--hidden", type=_number(int, 1, example="4096"), default=None, help="the model's hidden size")
    adv.add_argument("--heads", type=_number(int, 1, example="32"), default=None, help="attention heads")
    adv.add_argument("--kv-heads", type=_number(int, 1, example="8"), default=None,
                     help="key/value heads (grouped-query attention; default: --heads)")
    adv.add_argument("--vocab", type=_number(int, 1, example="32000"), default=None,
                     help="vocabulary size (adds the embedding to the parameters derived from the shape)")
    adv.add_argument("--cluster", default=None,
                     help=f"a cluster from dtlab.planner.hardware: {', '.join(hardware.CLUSTERS)}, "
                          f"or '<node type> xN' with a node type from {', '.join(hardware.NODE_TYPES)} "
                          f"(default: {hardware.DEFAULT_CLUSTER}, "
                          "unless --gpus with --gpu or --gpu-mem-gb describe one)")
    adv.add_argument("--gpus", type=_number(int, 1, example="64"), default=None, help="GPUs of a cluster described "
                     "by hand (with --gpu or --gpu-mem-gb)")
    adv.add_argument("--gpu", default=None, help=f"a GPU type for --gpus: {', '.join(hardware.GPUS)}")
    adv.add_argument("--gpu-mem-gb", type=_number(float, 0, low_ok=False, example="32"), default=None,
                     help="memory per GPU in GB (a cluster described by hand)")
    adv.add_argument("--gpus-per-node", type=_number(int, 1, example="8"), default=None, help="default 8")
    adv.add_argument("--tflops", type=_number(float, 0, example="125"), default=None,
                     help="peak dense 16-bit TFLOP/s per GPU (without it no step time is computed)")
    adv.add_argument("--intra-node-gbs", type=_number(float, 0, example="150"), default=None,
                     help="GPU-to-GPU GB/s inside a node")
    adv.add_argument("--inter-node-gbs", type=_number(float, 0, example="50"), default=None,
                     help="a node's network in GB/s (all its NICs together; 400 Gbps = 50)")
    adv.add_argument("--host-mem-gb-per-gpu", type=_number(float, 0, example="48"), default=None,
                     help="CPU memory per GPU in GB, for offloading")
    adv.add_argument("--headroom", type=_number(float, 0, 1, example=str(formulas.HEADROOM)),
                     default=formulas.HEADROOM, help="share of GPU and host memory left free for the CUDA context, "
                     f"buffers, fragmentation (default {formulas.HEADROOM})")
    adv.add_argument("--micro-batch", type=_number(int, 1), default=1, help="sequences per GPU per micro-step")
    adv.add_argument("--seq-len", type=_number(int, 1, example="2048"), default=2048, help="tokens per sequence")
    adv.add_argument("--global-batch", type=_number(int, 1, example="512"), default=None,
                     help="sequences per optimizer step (default: >= 512, a multiple of micro-batch x GPUs)")
    adv.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    adv.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    adv.add_argument("--grad-reduce", choices=("fp32", "bf16", "fp16"), default="fp32",
                     help="format of the gradients the data-parallel collectives send (default fp32: DDP under "
                     "autocast, Megatron-LM, torchtitan; bf16: DeepSpeed's default)")
    adv.add_argument("--framework", choices=("pytorch", "megatron", "deepspeed", "megatron-deepspeed"),
                     default="pytorch", help="whose code trains: how model states, the loss and buffers are kept "
                     "(default pytorch: DDP, FSDP, torchtitan, Hugging Face)")
    adv.add_argument("--eager-norms", action="store_true",
                     help="the model's RMSNorm upcasts to fp32 in eager PyTorch (Hugging Face's Llama): an fp32 copy "
                     "of each norm's input is kept for backward")
    adv.add_argument("--no-sequence-parallel", action="store_true",
                     help="tensor parallelism without sequence parallelism: norms, dropouts and layer inputs stay "
                     "whole on every TP rank (Megatron-LM without --sequence-parallel)")
    adv.add_argument("--schedule", choices=cost.SCHEDULES, default="1f1b",
                     help="pipeline schedule (default 1f1b: Megatron-LM, torchtitan); gpipe holds every micro-batch")
    adv.add_argument("--pipeline-split", choices=cost.PIPELINE_SPLITS, default="even",
                     help="layers per pipeline stage: even (default) or lighter_ends (first and last stage one "
                     "layer fewer, as Llama 3)")
    adv.add_argument("--bucket-mb", default="25", type=_bucket,
                     help="gradient bucket in MB (default 25, PyTorch DDP's bucket_cap_mb), or 'megatron' for "
                     "Megatron-LM's max(40M, 1M x DP) parameters")
    adv.add_argument("--recompute", choices=formulas.RECOMPUTE, default="selective",
                     help="activation recomputation (default selective); full costs one more forward pass")
    adv.add_argument("--efficiency", type=_number(float, 0, 1.000001, low_ok=False,
                                                  example=str(cost.DEFAULT_EFFICIENCY)),
                     default=None, help="fraction of peak FLOP/s the GPU's kernels reach while computing (default: "
                     f"fitted to published runs, {', '.join(f'{k} {v}' for k, v in cost.EFFICIENCY.items())}, other "
                     f"GPUs {cost.DEFAULT_EFFICIENCY}); MFU is reported, not assumed")
    adv.add_argument("--mfu", type=float, default=None, help=argparse.SUPPRESS)
    adv.add_argument("--layout", default=None, help="price one layout only, e.g. dp=4,tp=4,pp=1,zero=1 "
                                                    "(HSDP: dp=16,zero=3,shard=4)")
    adv.add_argument("--data-parallel-only", action="store_true", help="leave out TP x PP x DP layouts")
    adv.add_argument("--json", action="store_true", help="print everything as JSON (bytes, seconds)")
    return adv


def _site(args: argparse.Namespace) -> int:
    import time

    from dtlab.tooling import runner as course
    from dtlab.tooling import website

    try:
        run_dir = args.run or website.newest_run(args.runs)
        if run_dir is None:
            problem = website.course_cannot_run()
            if problem:
                raise website.SiteError(f"no course run in {args.runs}/ to publish, and the course cannot run here: "
                                        f"{problem}. Fix: `make site` (it runs `make setup` first), or `make setup` "
                                        "then `dtlab site`.")
            print(f"[site] no course run in {args.runs}/: running the course with its CI parameters first", flush=True)
            run_dir, _ = course.run(ci=True, root=args.runs, stream=False)
        start = time.perf_counter()
        out = website.build(run_dir, args.out)
        print(f"[site] built {out}/ from {run_dir} in {time.perf_counter() - start:.0f} s; open {out}/index.html "
              f"or serve it: python -m http.server -d {out}", flush=True)
        if args.no_check:
            return 0
        start = time.perf_counter()
        report = website.check(out)
    except (website.SiteError, course.CourseError) as exc:
        print(f"dtlab site: {exc}", file=sys.stderr)
        return 2
    print(f"[site] browser check in {time.perf_counter() - start:.0f} s: {report.pages} pages, {report.links} "
          f"internal links, {report.plots} plots, {report.search_results} search results for 'dtlab'; "
          f"screenshots {', '.join(report.screenshots)}")
    for problem in report.problems:
        print(f"[site] PROBLEM {problem}", file=sys.stderr)
    return 0 if report.ok else 1


def _course_list(args: argparse.Namespace) -> int:
    from dtlab.tooling import runner as course

    for nb in course.find_notebooks(args.notebooks):
        params = course.notebook_parameters(nb)
        print(f"{nb.stem:<32} {', '.join(f'{k}={v}' for k, v in params.items())}")
    return 0


def _course_run(args: argparse.Namespace) -> int:
    from dtlab.tooling import runner as course

    try:
        params = course.parse_params(args.param)
        run_dir, results = course.run(args.notebook, params, ci=args.ci, root=args.runs,
                                      notebook_dir=args.notebooks, stream=not args.quiet, solutions=args.solutions)
    except course.CourseError as exc:
        print(f"dtlab course run: {exc}", file=sys.stderr)
        return 2
    print()
    print(course.format_summary(results))
    print(f"\nexecuted notebooks and summary: {run_dir}")
    return 0 if all(r.status == "ok" for r in results) else 1


def _clusters_validate(args: argparse.Namespace) -> int:
    from dtlab.tooling import clusters

    paths = args.paths or [os.path.relpath(p) for p in clusters.default_paths()]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing or not paths:
        print(f"dtlab clusters validate: no such file: {', '.join(map(str, missing)) or 'no clusters/*.yml here'}",
              file=sys.stderr)
        return 2
    invalid = 0
    for path in paths:
        try:
            problems = clusters.validate(path)
        except clusters.ClusterConfigError as exc:
            print(f"dtlab clusters validate: {exc}", file=sys.stderr)
            return 2
        invalid += bool(problems)
        print(f"ok       {path}" if not problems else f"INVALID  {path}")
        for problem in problems:
            print(f"  - {problem}")
        for note in clusters.bundle_notes(path):
            print(f"  note: {note}")
    print(f"{len(paths) - invalid} valid, {invalid} invalid")
    return 1 if invalid else 0


def _clusters_pin_wheel(args: argparse.Namespace) -> int:
    from dtlab.tooling import clusters

    try:
        lines = clusters.pin_wheel(args.wheel, args.volume, args.files)
    except (ValueError, FileNotFoundError) as exc:
        print(f"dtlab clusters pin-wheel: {exc}", file=sys.stderr)
        return 2
    for path in args.files:
        print(f"pinned   {path}: " + ", ".join(lines))
    print(f"then: databricks fs cp {args.wheel} dbfs:{args.volume.rstrip('/')}/  (the same file: its sha256 is "
          "checked on every node)")
    return 0


def _bucket(text: str) -> str:
    """``--bucket-mb``: a positive number of MB, or "megatron"."""
    if text == "megatron":
        return text
    try:
        if float(text) > 0:
            return text
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r}: give a positive number of MB (25 is DDP's) or 'megatron'")


def _number(kind: type, low: float, high: float = math.inf, low_ok: bool = True, example: str = "1"):
    """An argparse type: a finite ``kind`` in [low, high) (or (low, high)), else a message naming the fix."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}. Fix: e.g. {example}") from None
        if not (math.isfinite(value) and (value >= low if low_ok else value > low) and value < high):
            bounds = f"{'>=' if low_ok else '>'} {low:g}" + (f" and < {high:g}" if high < math.inf else "")
            raise argparse.ArgumentTypeError(f"{text} is out of range. Fix: a finite value {bounds}, e.g. {example}")
        return value
    parse.__name__ = kind.__name__
    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dtlab", description="Helpers for the distributed-training course.")
    sub = p.add_subparsers(dest="command", required=True)

    env = sub.add_parser("env", help="report GPUs, backends, library versions and the course's plan")
    env.add_argument("--json", action="store_true", help="print the report as JSON")
    env.set_defaults(func=_env)

    sub.add_parser("memory", help="the old name of dtlab advise --data-parallel-only")

    adv = _advise_parser(sub)
    adv.set_defaults(func=_advise)

    course = sub.add_parser("course", help="list or run the course notebooks")
    csub = course.add_subparsers(dest="course_command", required=True)
    lst = csub.add_parser("list", help="list the notebooks and their parameters")
    lst.add_argument("--notebooks", default=None, help="notebook folder (default: ./notebooks)")
    lst.set_defaults(func=_course_list)
    run = csub.add_parser("run", help="execute notebooks headless with papermill")
    run.add_argument("notebook", nargs="*", help="names or numbers (e.g. 01 03_ddp); default: all")
    run.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE",
                     help="override a notebook parameter (repeatable), e.g. -p epochs=2")
    run.add_argument("--ci", action="store_true", help="use each notebook's small CI parameters")
    run.add_argument("--solutions", action="store_true", help="also run the exercise solutions (skipped by default)")
    run.add_argument("--runs", default="runs", help="where run folders go (default: ./runs)")
    run.add_argument("--notebooks", default=None, help="notebook folder (default: ./notebooks)")
    run.add_argument("-q", "--quiet", action="store_true", help="do not stream cell output")
    run.set_defaults(func=_course_run)

    site = sub.add_parser("site", help="publish a course run as a website and check it in headless Chromium")
    site.add_argument("run", nargs="?", default=None, help="a run folder (default: the newest under --runs)")
    site.add_argument("--runs", default="runs", help="where run folders are (default: ./runs)")
    site.add_argument("--out", default="site", help="where the website goes (default: ./site)")
    site.add_argument("--no-check", action="store_true", help="build only; skip the browser check")
    site.set_defaults(func=_site)

    clu = sub.add_parser("clusters", help="check Databricks cluster files and the bundle offline")
    clusub = clu.add_subparsers(dest="clusters_command", required=True)
    val = clusub.add_parser("validate", help="validate with databricks-bundles' strict models and GPU rules")
    val.add_argument("paths", nargs="*", help="YAML files (default: clusters/*.yml and databricks.yml)")
    val.set_defaults(func=_clusters_validate)
    pin = clusub.add_parser("pin-wheel", help="pin the dtlab wheel (exact file and sha256) in cluster files")
    pin.add_argument("wheel", help="the wheel you built: dist/dtlab-<version>-py3-none-any.whl")
    pin.add_argument("--volume", required=True, help="the Unity Catalog volume folder it goes to, /Volumes/<c>/<s>/<v>")
    pin.add_argument("files", nargs="+", help="cluster files whose DTLAB_SOURCE and DTLAB_WHEEL_SHA256 to write")
    pin.set_defaults(func=_clusters_pin_wheel)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["memory"]:
        return _memory(argv[1:])
    args = parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
