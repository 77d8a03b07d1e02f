"""The data path at a learner's scale: a table of millions of rows written to shards, streamed by 2 and 4 ranks.

    .venv/bin/python benchmarks/data_scale.py [--rows 4000000] [--small-rows 500000] [--shards 16] [--ranks 2 4]

1. A table of ``rows`` samples of 129 tokens (int32: 516 bytes a row, 2.06 GB of tokens at 4 million rows) is
   made by Spark from ``spark.range`` (tokens from a hash of the row and position) and written as Parquet: the
   stand-in for your Delta table (delta-rs, which writes Delta here, would pass the rows through this process).
2. ``dtlab.shards.write_shards_from_dataframe`` writes it to ``shards`` shards, in a fresh driver process for
   the small and then the full table: the driver's peak memory (the Python process's ``ru_maxrss``; Spark's JVM
   is its child and not counted) must not grow with the table.
3. For each N in ``ranks``: N processes, each a ``ShardStream`` over the whole epoch (``batch`` samples per rank
   per step, prefetch on): the bytes it read from storage (its own count, and the kernel's ``rchar`` from
   ``/proc/self/io`` as an independent one) against its share (the stored bytes of the samples it was handed),
   the samples per second it delivers, and its peak memory. Then the same ranks run ``--paced-steps`` steps paced
   at what an H100 consumes (below), and the time each waited for data is measured.

What training consumes: an H100 (989 dense bf16 TFLOP/s, NVIDIA's datasheet) at 40% model FLOPs utilization
training a 125M-parameter model on 128-token samples takes 6 x 125M x 128 FLOPs a sample: about 4,100 samples/s per
GPU; a larger model consumes fewer. Ratios and memory are what this measures; the seconds are this machine's.
"""

import argparse
import json
import multiprocessing as mp
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

SEQ = 128
MFU, PARAMS = 0.40, 125e6


def h100_samples_per_second() -> float:
    from dtlab.planner.hardware import gpu

    return MFU * gpu("H100").peak_flops("bf16") / (6 * PARAMS * SEQ)


def rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def make_table(rows: int, out: Path) -> float:
    from dtlab import spark as dtspark

    spark = dtspark.session(cores=2)
    t0 = time.perf_counter()
    (spark.range(rows, numPartitions=max(2, rows // 250_000))
     .selectExpr("id", f"transform(sequence(0, {SEQ}), x -> cast(pmod(xxhash64(id, x), 50000) as int)) as tokens")
     .write.mode("overwrite").parquet(str(out)))
    dtspark.stop(spark)
    return time.perf_counter() - t0


def write_phase(source: str, folder: str, shards: int, block_size: int) -> dict:
    """Runs in its own process: the driver of one write."""
    from dtlab import shards as dshards
    from dtlab import spark as dtspark

    spark = dtspark.session(cores=2)
    df = spark.read.parquet(source)
    df.schema                                          # noqa: B018  the session and the reader are up
    before = rss_peak()
    t0 = time.perf_counter()
    index = dshards.write_shards_from_dataframe(df, folder, seq_len=SEQ, tokenizer="benchmark", shards=shards,
                                                block_size=block_size)
    seconds = time.perf_counter() - t0
    dtspark.stop(spark)
    return {"seconds": seconds, "rss_before": before, "rss_peak": rss_peak(), "rows": index["num_samples"],
            "bytes": index["bytes"]}


def io_read() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def rank_phase(args: tuple) -> dict:
    folder, rank, world, batch, paced_steps, step_seconds = args
    os.environ["OMP_NUM_THREADS"] = "1"
    import pyarrow.parquet  # noqa: F401  imported before the count: rchar counts the data, not the modules
    import torch

    from dtlab.shards import ShardStream

    torch.set_num_threads(1)
    stream = ShardStream(folder, batch, rank=rank, world_size=world)
    r0, t0, samples = io_read(), time.perf_counter(), 0
    for b in stream:
        samples += len(b["id"])
    seconds = time.perf_counter() - t0
    out = {"rank": rank, "samples": samples, "seconds": seconds, "read": stream.read_bytes, "share": stream.share_bytes,
           "rchar": io_read() - r0, "waited_full_speed": stream.waited, "rss_peak": rss_peak()}
    paced = ShardStream(folder, batch, rank=rank, world_size=world)
    t0, waited0, step = time.perf_counter(), 0.0, 0
    for step, _ in enumerate(paced):
        if step == 1:
            waited0 = paced.waited                     # the first batch waits for the first blocks: left out
        if step == paced_steps:
            break
        time.sleep(step_seconds)                       # the training step
    out["paced"] = {"steps": step, "waited": paced.waited - waited0, "seconds": time.perf_counter() - t0}
    return out


def stream_phase(folder: str, world: int, batch: int, paced_steps: int, step_seconds: float) -> list[dict]:
    with mp.get_context("spawn").Pool(world) as pool:
        return pool.map(rank_phase, [(folder, r, world, batch, paced_steps, step_seconds) for r in range(world)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--small-rows", type=int, default=500_000)
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=1024)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    ap.add_argument("--paced-steps", type=int, default=200)
    ap.add_argument("--work", default="/tmp/dtlab-data-scale")
    ap.add_argument("--phase", choices=["all", "write"], default="all", help=argparse.SUPPRESS)
    ap.add_argument("--source", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase == "write":
        print(json.dumps(write_phase(args.source, args.folder, args.shards, args.block_size)))
        return

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    writes = {}
    for rows in (args.small_rows, args.rows):
        source = work / f"table-{rows}"
        made = make_table(rows, source)
        shards = max(1, round(args.shards * rows / args.rows))
        out = subprocess.run([sys.executable, __file__, "--phase", "write", "--source", str(source), "--folder",
                              str(work / f"shards-{rows}"), "--shards", str(shards), "--block-size",
                              str(args.block_size)], capture_output=True, text=True, check=False)
        if out.returncode:
            sys.exit(out.stderr[-4000:])
        writes[rows] = {**json.loads(out.stdout.strip().splitlines()[-1]), "table_seconds": made, "shards": shards}
        if rows != args.rows:
            shutil.rmtree(source)
    consume = h100_samples_per_second()
    step_seconds = args.batch / consume
    streams = {n: stream_phase(str(work / f"shards-{args.rows}"), n, args.batch, args.paced_steps, step_seconds)
               for n in args.ranks}

    print(f"machine: {os.cpu_count()} cores; {args.rows:,} rows x {SEQ + 1} tokens = "
          f"{args.rows * (SEQ + 1) * 4 / 1e9:.2f} GB of int32 tokens\n")
    print("| table rows | token bytes | shards | stored | write seconds | driver RSS before | driver RSS peak |")
    print("|---|---|---|---|---|---|---|")
    for rows, w in writes.items():
        print(f"| {rows:,} | {rows * (SEQ + 1) * 4 / 1e9:.2f} GB | {w['shards']} | {w['bytes'] / 1e9:.2f} GB | "
              f"{w['seconds']:.0f} | {w['rss_before'] / 2**20:.0f} MiB | {w['rss_peak'] / 2**20:.0f} MiB |")
    print(f"\nconsumed by an H100 (40% MFU, 125M parameters, {SEQ}-token samples): {consume:,.0f} samples/s; "
          f"paced step of {args.batch} samples: {step_seconds * 1e3:.1f} ms\n")
    print("| N | rank | samples | read / share (own count) | read / share (rchar) | delivered samples/s | "
          "x consumed | waited, paced steps | rank RSS peak |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n, ranks in streams.items():
        for r in ranks:
            rate = r["samples"] / r["seconds"]
            p = r["paced"]
            print(f"| {n} | {r['rank']} | {r['samples']:,} | {r['read'] / r['share']:.3f} | "
                  f"{r['rchar'] / r['share']:.3f} | {rate:,.0f} | {rate / consume:.1f} | "
                  f"{p['waited'] * 1e3:.0f} ms of {p['seconds']:.1f} s ({p['steps']} steps) | "
                  f"{r['rss_peak'] / 2**20:.0f} MiB |")
    print("\n" + json.dumps({"writes": writes, "streams": streams, "consume": consume}))


if __name__ == "__main__":
    main()
