"""The ``dtlab`` command line.

    dtlab env [--json]                          what this machine has, and the course's plan for it
    dtlab memory --params 7e9 --gpus 16 --gpu-mem-gb 24
                                                model-state memory per GPU for DDP and ZeRO 1-3
    dtlab course list                           the notebooks, in order, with their parameters
    dtlab course run [NOTEBOOK ...] [-p name=value ...] [--ci] [--runs DIR]
                                                run notebooks headless into runs/<timestamp>/
    dtlab clusters validate [PATH ...]          check cluster files and databricks.yml offline
                                                (default: clusters/*.yml and databricks.yml)

Exit codes: 0 success, 1 a notebook failed or a cluster file is invalid, 2 bad input (unknown
notebook, malformed -p, a path that does not exist, databricks-bundles not installed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _env(args: argparse.Namespace) -> int:
    from dtlab import environment

    info = environment.report()
    print(json.dumps(info, indent=2) if args.json else environment.format_report(info))
    return 0


def _memory(args: argparse.Namespace) -> int:
    from dtlab import memory

    print(memory.format_table(args.params, args.gpus, args.gpu_mem_gb, args.headroom, args.cpu_mem_gb_per_gpu))
    return 0


def _course_list(args: argparse.Namespace) -> int:
    from dtlab import course

    for nb in course.find_notebooks(args.notebooks):
        params = course.notebook_parameters(nb)
        print(f"{nb.stem:<32} {', '.join(f'{k}={v}' for k, v in params.items())}")
    return 0


def _course_run(args: argparse.Namespace) -> int:
    from dtlab import course

    try:
        params = course.parse_params(args.param)
        run_dir, results = course.run(args.notebook, params, ci=args.ci, root=args.runs,
                                      notebook_dir=args.notebooks, stream=not args.quiet)
    except course.CourseError as exc:
        print(f"dtlab course run: {exc}", file=sys.stderr)
        return 2
    print()
    print(course.format_summary(results))
    print(f"\nexecuted notebooks and summary: {run_dir}")
    return 0 if all(r.status == "ok" for r in results) else 1


def _clusters_validate(args: argparse.Namespace) -> int:
    from dtlab import clusters

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
    print(f"{len(paths) - invalid} valid, {invalid} invalid")
    return 1 if invalid else 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dtlab", description="Helpers for the distributed-training course.")
    sub = p.add_subparsers(dest="command", required=True)

    env = sub.add_parser("env", help="report GPUs, backends, library versions and the course's plan")
    env.add_argument("--json", action="store_true", help="print the report as JSON")
    env.set_defaults(func=_env)

    mem = sub.add_parser("memory", help="per-GPU memory of DDP and ZeRO stages, and which fits")
    mem.add_argument("--params", type=float, required=True, help="model parameters, e.g. 7e9")
    mem.add_argument("--gpus", type=int, required=True, help="total GPUs, e.g. 16")
    mem.add_argument("--gpu-mem-gb", type=float, default=24.0, help="memory per GPU (default 24: A10G)")
    mem.add_argument("--cpu-mem-gb-per-gpu", type=float, default=48.0,
                     help="CPU memory per GPU for offload (default 48: g5.12xlarge)")
    mem.add_argument("--headroom", type=float, default=0.8, help="share of memory for model states")
    mem.set_defaults(func=_memory)

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
    run.add_argument("--runs", default="runs", help="where run folders go (default: ./runs)")
    run.add_argument("--notebooks", default=None, help="notebook folder (default: ./notebooks)")
    run.add_argument("-q", "--quiet", action="store_true", help="do not stream cell output")
    run.set_defaults(func=_course_run)

    clu = sub.add_parser("clusters", help="check Databricks cluster files and the bundle offline")
    clusub = clu.add_subparsers(dest="clusters_command", required=True)
    val = clusub.add_parser("validate", help="validate with databricks-bundles' strict models and GPU rules")
    val.add_argument("paths", nargs="*", help="YAML files (default: clusters/*.yml and databricks.yml)")
    val.set_defaults(func=_clusters_validate)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
