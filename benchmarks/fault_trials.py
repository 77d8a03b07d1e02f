"""Fault trials, many more than the test suite runs: how often does recovery work?

    .venv/bin/python benchmarks/fault_trials.py [--kills 100] [--restarts 10] [--stuck 5]

1. kill -9 a checkpoint writer at a random moment (``--kills`` times): is the newest checkpoint
   complete, never older than before, and are at most ``keep`` files left?
2. a torchrun job whose rank 0 or 1 is killed at a random step (``--restarts`` times) under
   ``--max-restarts 1``: does it finish, equal bitwise to a fault-free run, having recomputed
   fewer steps than one checkpoint interval?
3. a stuck peer (``--stuck`` times): does rank 0 raise within the collective timeout?

Prints one line per trial and a summary table (Markdown).
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dtlab import checkpoint, faults, launch, resumable

STEPS, EVERY = 40, 5


def kill_trials(n: int, rng: random.Random) -> dict:
    ok = regressions = 0
    newest = 0
    with tempfile.TemporaryDirectory() as d:
        for trial in range(n):
            size = rng.choice([10_000, 1_000_000, 4_000_000])
            state = faults.kill_checkpoint_writer(d, size, delay=rng.uniform(0.02, 0.5))
            good = state is not None and bool(torch.all(state["model"]["w"] == state["step"]))
            good = good and len(faults.checkpoint_files(d)) <= 3  # keep=2 (+1 if killed before pruning)
            regressions += state is not None and state["step"] < newest
            newest = max(newest, state["step"] if state else 0)
            ok += good
            print(f"kill {trial + 1:>3}: {'ok' if good else 'LOST'} (newest step {state and state['step']})")
    return {"trials": n, "ok": ok, "regressions": regressions}


def restart_trials(n: int, rng: random.Random) -> dict:
    with tempfile.TemporaryDirectory() as d:
        reference = launch.run(resumable.train, {"steps": STEPS, "every_steps": EVERY, "ckpt_dir": f"{d}/ref"},
                               nprocs=2)[0]["weights"]
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        outcomes = []
        for trial in range(n):
            crash_at, crash_rank = rng.randint(EVERY + 1, STEPS - 1), rng.choice([0, 1])
            ckpt, out = f"{d}/t{trial}", f"{d}/t{trial}.pt"
            start = time.perf_counter()
            proc = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", "--max-restarts", "1",
                                   "-m", "dtlab.resumable", "--steps", str(STEPS), "--every-steps", str(EVERY),
                                   "--ckpt-dir", ckpt, "--crash-at-step", str(crash_at), "--crash-rank",
                                   str(crash_rank), "--out", out], capture_output=True, text=True, timeout=300,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
            seconds = time.perf_counter() - start
            exact, recomputed = False, None
            if proc.returncode == 0:
                attempt = json.loads(Path(ckpt, "attempts.jsonl").read_text().splitlines()[-1])
                recomputed = crash_at - attempt["resumed_from"]
                exact = torch.equal(checkpoint.load(out)["weights"], reference)
            good = proc.returncode == 0 and exact and recomputed is not None and recomputed < EVERY
            outcomes.append({"good": good, "seconds": seconds, "recomputed": recomputed})
            print(f"restart {trial + 1:>2}: rank {crash_rank} killed after step {crash_at}: exit {proc.returncode}, "
                  f"bitwise equal {exact}, recomputed {recomputed}, {seconds:.1f} s")
    return {"trials": n, "ok": sum(o["good"] for o in outcomes),
            "max_recomputed": max((o["recomputed"] or 0) for o in outcomes),
            "median_seconds": sorted(o["seconds"] for o in outcomes)[n // 2]}


def stuck_trials(n: int, timeout_s: float = 3.0) -> dict:
    results = [launch.run(faults.all_reduce_with_failing_peer, timeout_s, nprocs=2, timeout=60)[0] for _ in range(n)]
    for i, r in enumerate(results):
        print(f"stuck {i + 1}: raised {r['error'] is not None} after {r['seconds']:.2f} s (timeout {timeout_s} s)")
    return {"trials": n, "ok": sum(r["error"] is not None for r in results),
            "max_seconds": max(r["seconds"] for r in results), "timeout": timeout_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=100)
    p.add_argument("--restarts", type=int, default=10)
    p.add_argument("--stuck", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    kills = kill_trials(args.kills, rng)
    restarts = restart_trials(args.restarts, rng)
    stuck = stuck_trials(args.stuck)
    print("\n| trial | runs | recovered | detail |\n|---|---:|---:|---|")
    print(f"| kill -9 during checkpoint writes | {kills['trials']} | {kills['ok']} | "
          f"newest checkpoint went back in time: {kills['regressions']} |")
    print(f"| torchrun restart after a random kill | {restarts['trials']} | {restarts['ok']} | most steps recomputed "
          f"{restarts['max_recomputed']} (interval {EVERY}); median {restarts['median_seconds']:.1f} s per job |")
    print(f"| stuck peer | {stuck['trials']} | {stuck['ok']} | slowest error {stuck['max_seconds']:.2f} s "
          f"(timeout {stuck['timeout']:.0f} s) |")


if __name__ == "__main__":
    main()
