"""How much does starting 2 workers cost? dtlab.launch.run against torchrun, TorchDistributor, Ray Train
and the import floor.

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


RAY = textwrap.dedent("""
    import json, os, tempfile, time
    t0 = time.perf_counter()
    from dtlab import raytrain
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    raytrain.start(num_cpus=2)
    t1 = time.perf_counter()
    def fit():
        TorchTrainer(lambda cfg: None, scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
                     run_config=RunConfig(storage_path=tempfile.mkdtemp())).fit()
    fit()
    t2 = time.perf_counter()
    fit()
    t3 = time.perf_counter()
    raytrain.stop()
    print(json.dumps({"start": t1 - t0, "first": t2 - t1, "again": t3 - t2}))
""")

SPARK = textwrap.dedent("""
    import json, time
    from dtlab import spark as dtspark
    from pyspark.ml.torch.distributor import TorchDistributor
    t0 = time.perf_counter()
    spark = dtspark.session(cores=2)
    t1 = time.perf_counter()
    TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(abs, -1)
    t2 = time.perf_counter()
    TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(abs, -1)
    t3 = time.perf_counter()
    dtspark.stop(spark)
    print(json.dumps({"start": t1 - t0, "first": t2 - t1, "again": t3 - t2}))
""")


def _timed(code: str) -> dict[str, float]:
    import json

    out = subprocess.run([PY, "-c", code], check=True, capture_output=True, text=True).stdout
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
    rows: dict[str, list[float]] = {k: [] for k in ("floor", "first", "again", "torchrun", "spark_start", "spark_first",
                                                    "spark_again", "ray_start", "ray_first", "ray_again")}
    for _ in range(args.repeats):  # interleaved, so drift hits every variant alike
        rows["floor"].append(floor_two_imports())
        d = dtlab_launch()
        rows["first"].append(d["first"])
        rows["again"].append(d["again"])
        rows["torchrun"].append(torchrun(script))
        for name, code in (("spark", SPARK), ("ray", RAY)):
            for k, v in _timed(code).items():
                rows[f"{name}_{k}"].append(v)
    med = {k: statistics.median(v) for k, v in rows.items()}
    floor = med["floor"]
    labels = {"floor": "2 x `python -c 'import torch'`, in parallel (floor)",
              "first": "dtlab.launch.run, 2 trivial workers, first launch",
              "again": "dtlab.launch.run, 2 trivial workers, next launches",
              "torchrun": "torchrun --nproc_per_node 2, trivial script",
              "spark_start": "local Spark session start (once per notebook)",
              "spark_first": "TorchDistributor(local_mode=True), 2 trivial processes, first run",
              "spark_again": "TorchDistributor(local_mode=True), 2 trivial processes, next runs",
              "ray_start": "local Ray start, `ray.init` (once per notebook)",
              "ray_first": "Ray Train TorchTrainer, 2 trivial workers, first fit",
              "ray_again": "Ray Train TorchTrainer, 2 trivial workers, next fits"}
    print(f"median of {args.repeats} runs, interleaved\n")
    print("| launcher | seconds | x floor |\n|---|---:|---:|")
    for k, label in labels.items():
        print(f"| {label} | {med[k]:.2f} | {med[k] / floor:.2f} |")


if __name__ == "__main__":
    main()
