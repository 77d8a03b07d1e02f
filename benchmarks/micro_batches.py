"""DDP, DeepSpeed's ZeRO-3, FSDP2 and the scratch FSDP at 1 and M micro-batches per step, against the planner.

    .venv/bin/python benchmarks/micro_batches.py [--repeats 3] [--n-embd 256] [--micro-batches 4]

Each repeat is one launch of ``dtlab.parallel.side_by_side.worker`` (2 gloo processes on a CPU): every strategy
trains the same TinyGPT at 1 and M micro-batches per step; its step time (median) and the bytes one step puts on the
loopback interface are set beside ``side_by_side.predict``, the planner's traffic priced with the collectives'
costs measured in the same processes. Printed: a Markdown table of the medians over the repeats, with the spread
of the measured times (max / min - 1).
"""

import argparse
import statistics

from dtlab.environment import plan
from dtlab.launch import run
from dtlab.parallel import side_by_side


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--time-steps", type=int, default=5)
    args = parser.parse_args()
    where = plan(nprocs=2)
    cfg = {"backend": where.backend, "device": where.device, "n_layer": 2, "n_embd": args.n_embd, "n_head": 4,
           "vocab": 256, "block": 64, "batch": 2 * where.nprocs, "micro_batches": [1, args.micro_batches],
           "time_steps": args.time_steps, "strategies": list(side_by_side.STRATEGIES)}
    env = {} if where.device == "cuda" else {"DS_ACCELERATOR": "cpu"}
    runs = [run(side_by_side.worker, cfg, nprocs=where.nprocs, env=env, timeout=900)[0] for _ in range(args.repeats)]
    print(f"{runs[0]['psi']:,} parameters, {where.nprocs} processes ({where.backend}), {args.repeats} launches, "
          f"one micro-batch's compute {1e3 * statistics.median(r['compute_s'] for r in runs):.1f} ms")
    print("| strategy | M | step ms | spread | predicted ms | measured / predicted | bytes per step | predicted "
          "| error |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in runs[0]["results"]:
        for m in cfg["micro_batches"]:
            times = [r["results"][name][m]["step_s"] for r in runs]
            predicted = [side_by_side.predict(r, cfg, name, m, where.nprocs) for r in runs]
            t, p = statistics.median(times), statistics.median(x["step_s"] for x in predicted)
            wire, p_wire = runs[0]["results"][name][m]["wire"], predicted[0]["wire"]
            bytes_cells = (f"{wire:,} | {p_wire:,.0f} | {wire / p_wire - 1:+.1%}" if wire is not None
                           else "not counted | | ")
            print(f"| {name} | {m} | {1e3 * t:.1f} | {max(times) / min(times) - 1:.0%} | {1e3 * p:.1f} | "
                  f"{t / p:.2f} | {bytes_cells} |")


if __name__ == "__main__":
    main()
