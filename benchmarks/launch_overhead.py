"""How much does starting 2 workers cost? dtlab.launch.run against torchrun and the import floor.

    .venv/bin/python benchmarks/launch_overhead.py [--repeats 3]

Everything is measured side by side in this one run (the machine is noisy; only ratios taken
together mean something). The floor is the cost of the work no launcher can avoid: two Python
interpreters importing torch, started together.
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

PY = sys.executable


def wall(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - start


def floor_two_imports() -> float:
    start = time.perf_counter()
    procs = [subprocess.Popen([PY, "-c", "import torch"]) for _ in range(2)]
    for p in procs:
        p.wait()
    return time.perf_counter() - start


LAUNCH = textwrap.dedent("""
    import json, time
    t0 = time.perf_counter()
    import torch
    from dtlab import launch
    t1 = time.perf_counter()
    launch.run(abs, -1, nprocs=2)
    t2 = time.perf_counter()
    launch.run(abs, -1, nprocs=2)
    t3 = time.perf_counter()
    print(json.dumps({"import": t1 - t0, "first": t2 - t1, "again": t3 - t2}))
""")


def dtlab_launch() -> dict[str, float]:
    out = subprocess.run([PY, "-c", LAUNCH], check=True, capture_output=True, text=True).stdout
    import json

    return json.loads(out.strip().splitlines()[-1])


def torchrun(script: str) -> float:
    return wall([PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write("import torch\n")
        script = f.name
    rows: dict[str, list[float]] = {"floor": [], "first": [], "again": [], "torchrun": []}
    for _ in range(args.repeats):  # interleaved, so drift hits every variant alike
        rows["floor"].append(floor_two_imports())
        d = dtlab_launch()
        rows["first"].append(d["first"])
        rows["again"].append(d["again"])
        rows["torchrun"].append(torchrun(script))
    med = {k: statistics.median(v) for k, v in rows.items()}
    floor = med["floor"]
    labels = {"floor": "2 x `python -c 'import torch'`, in parallel (floor)",
              "first": "dtlab.launch.run, 2 trivial workers, first launch",
              "again": "dtlab.launch.run, 2 trivial workers, next launches",
              "torchrun": "torchrun --nproc_per_node 2, trivial script"}
    print(f"median of {args.repeats} runs, interleaved\n")
    print("| launcher | seconds | x floor |\n|---|---:|---:|")
    for k, label in labels.items():
        print(f"| {label} | {med[k]:.2f} | {med[k] / floor:.2f} |")


if __name__ == "__main__":
    main()
