"""Predicted vs measured 2-process speed-up for several configurations, and the best tuned one.

    .venv/bin/python benchmarks/speedup.py [--steps 20] [--repeats 2]

For each configuration: one process and two processes train the same MLP (1 thread each), back to
back in this run; the model (dtlab.planner.speedup) predicts the 2-process speed-up from the compute of the
two processes (a DDP step whose hook sends nothing) and the all-reduce of the gradient bytes, both
measured interleaved with the DDP steps in the same processes. Repeats are interleaved launches;
the median is reported, with the spread of the measured speed-up.
"""

import argparse
import statistics

from dtlab.environment import plan
from dtlab.planner.speedup import measure_speedup

CONFIGS = {
    "batch 8": dict(batch=8),
    "batch 64": dict(batch=64),
    "batch 512": dict(batch=512),
    "batch 64, fp16 compression": dict(batch=64, compression=True),
    "batch 64, accumulate 8": dict(batch=64, accumulation=8),
    "batch 256, accumulate 4": dict(batch=256, accumulation=4),
    "batch 1024, accumulate 4": dict(batch=1024, accumulation=4),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--depth", type=int, default=4)
    args = ap.parse_args()
    rows = {name: [] for name in CONFIGS}
    p = plan()
    for _ in range(args.repeats):
        for name, extra in CONFIGS.items():
            cfg = dict(hidden=args.hidden, depth=args.depth, steps=args.steps, device=p.device, backend=p.backend,
                       **extra)
            rows[name].append(measure_speedup(cfg, nprocs=p.nprocs))
    print(f"MLP 64-{args.hidden}x{args.depth}-10, {p.nprocs} processes vs 1, median of {args.repeats}\n")
    print("| configuration | 1-proc step ms | N-proc compute ms | all-reduce ms | measured | spread | predicted "
          "| error |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    within, best = 0, ("", 0.0)
    for name, results in rows.items():
        med = {k: statistics.median(r[k] for r in results)
               for k in ("one_step_s", "alone_step_s", "allreduce_s", "measured", "predicted")}
        measured = [r["measured"] for r in results]
        spread = (max(measured) - min(measured)) / med["measured"]
        err = med["predicted"] / med["measured"] - 1
        within += abs(err) <= 0.2
        best = max(best, (name, med["measured"]), key=lambda t: t[1])
        print(f"| {name} | {1e3 * med['one_step_s']:.1f} | {1e3 * med['alone_step_s']:.1f} | "
              f"{1e3 * med['allreduce_s']:.2f} | {med['measured']:.2f}x | {spread:.0%} | {med['predicted']:.2f}x | "
              f"{err:+.0%} |")
    print(f"\n{within} of {len(rows)} configurations predicted within ±20%")
    print(f"best measured speed-up: {best[1]:.2f}x ({best[0]})")


if __name__ == "__main__":
    main()
