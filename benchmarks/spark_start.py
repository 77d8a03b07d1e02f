"""What does a local Spark session cost to start, and how much of it is the JVM's optimizing compiler?

    .venv/bin/python benchmarks/spark_start.py [--repeats 5]

Each repeat starts a fresh Python that makes a local SparkSession (2 task slots, no UI), counts a
10-row range and stops, once with the JVM's defaults and once with ``SPARK_SUBMIT_OPTS=-XX:TieredStopAtLevel=1``
(the client compiler only: the JVM compiles less, which costs a long job peak speed but saves a short one
most of its start-up), the two side by side in each repeat (the machine is noisy: only ratios taken together
mean something). It reports the wall time and the CPU the whole machine spent (``/proc/stat``, Linux), so run
it on an idle machine. The Makefile exports that setting for every target (CONTRIBUTING, "Tests").
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

SESSION = ("from pyspark.sql import SparkSession\n"
           "s = SparkSession.builder.master('local[2]').config('spark.ui.enabled', 'false').getOrCreate()\n"
           "assert s.range(10).count() == 10\n"
           "s.stop()\n")
SETTINGS = {"JVM defaults": "", "-XX:TieredStopAtLevel=1": "-XX:TieredStopAtLevel=1"}


def busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (all cores): user, nice, system, irq, softirq and
    steal, as ``scripts/test_phases.sh`` counts them (guest time is already inside user)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def one(opts: str) -> tuple[float, float]:
    env = {**os.environ, "SPARK_SUBMIT_OPTS": opts, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable}
    cpu, start = busy_seconds(), time.perf_counter()
    subprocess.run([sys.executable, "-c", SESSION], check=True, capture_output=True, env=env)
    return time.perf_counter() - start, busy_seconds() - cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in SETTINGS}
    for _ in range(args.repeats):
        for name, opts in SETTINGS.items():
            runs[name].append(one(opts))
    print(f"{args.repeats} repeats, side by side, {os.cpu_count()} cores\n")
    print("| JVM | wall, median (s) | CPU, median (core-s) |\n|---|---:|---:|")
    for name, r in runs.items():
        print(f"| {name} | {statistics.median(w for w, _ in r):.1f} | {statistics.median(c for _, c in r):.1f} |")
    base, fast = (runs[n] for n in SETTINGS)
    print(f"\nwall {statistics.median(w for w, _ in fast) / statistics.median(w for w, _ in base):.2f}x, "
          f"CPU {statistics.median(c for _, c in fast) / statistics.median(c for _, c in base):.2f}x")


if __name__ == "__main__":
    main()
