"""When does data parallelism pay? A speed-up model you can check against measurements.

Each of N processes computes a step on its own batch (time ``t_compute``), then the gradients
(``grad_bytes``) are all-reduced. A ring all-reduce sends ``2(N-1)/N x bytes`` per process in
``2(N-1)`` messages, so with link bandwidth ``bw`` and per-message latency ``alpha``::

    t_comm = 2(N-1)/N * bytes / bw + 2(N-1) * alpha

Per optimizer step of ``k`` accumulated micro-batches, with gradients compressed by a factor
``c`` (0.5 for fp16) and a fraction ``o`` of the communication hidden behind backward::

    T_1 = k * t_compute                         (one process, same work per process)
    T_N = k * t_compute + (1 - o) * t_comm(c * bytes)
    speed-up S = N * T_1 / T_N                  (samples per second, N processes vs one)

With ``r = t_comm / t_compute`` and N = 2 this is the seed tutorials' ``S = N / (1 + r (N-1))``.
The ResNet-50 example there (r = 0.8, N = 4) gives 4 / 3.4 = 1.18: four GPUs, barely faster
than one.
"""

from __future__ import annotations

from dataclasses import dataclass


def allreduce_seconds(nbytes: float, n: int, bandwidth: float, latency: float = 0.0) -> float:
    """Ring all-reduce time for ``nbytes`` on ``n`` processes (bandwidth in bytes/s, latency in s)."""
    if n < 1 or bandwidth <= 0 or nbytes < 0 or latency < 0:
        raise ValueError("need n >= 1, bandwidth > 0, nbytes >= 0 and latency >= 0")
    if n == 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


@dataclass(frozen=True)
class Prediction:
    """A predicted N-process step: compute, exposed communication, step time and speed-up."""

    n: int
    compute_s: float
    comm_s: float
    step_s: float
    speedup: float

    @property
    def efficiency(self) -> float:
        """Speed-up per process (1.0 = perfect scaling)."""
        return self.speedup / self.n


def predict(t_compute: float, grad_bytes: float, n: int, bandwidth: float, latency: float = 0.0,
            accumulation: int = 1, compression: float = 1.0, overlap: float = 0.0) -> Prediction:
    """Predict the N-process step time and speed-up over one process (see the module docstring).

    Args:
        t_compute: seconds of forward + backward + optimizer for one micro-batch on one process.
        grad_bytes: bytes of gradients all-reduced per optimizer step (4 x parameters in fp32).
        n: processes. bandwidth: bytes/s of the all-reduce's links. latency: seconds per message.
        accumulation: micro-batches per optimizer step (one all-reduce per step, with ``no_sync``).
        compression: fraction of the bytes actually sent (0.5 with an fp16/bf16 compression hook).
        overlap: fraction (0-1) of the communication hidden behind backward computation.
    """
    if t_compute <= 0 or accumulation < 1 or not 0 < compression <= 1 or not 0 <= overlap <= 1:
        raise ValueError("need t_compute > 0, accumulation >= 1, 0 < compression <= 1, 0 <= overlap <= 1")
    compute = accumulation * t_compute
    comm = (1 - overlap) * allreduce_seconds(compression * grad_bytes, n, bandwidth, latency)
    step = compute + comm
    return Prediction(n=n, compute_s=compute, comm_s=comm, step_s=step, speedup=n * compute / step)


def seed_formula(n: int, comm_over_compute: float) -> float:
    """The seed tutorials' ``S = N / (1 + r (N - 1))`` with ``r = t_comm / t_compute``."""
    return n / (1 + comm_over_compute * (n - 1))


def break_even_ratio(n: int, target_speedup: float = 1.0) -> float:
    """The largest ``t_comm / t_compute`` at which N processes still reach ``target_speedup``.

    From the seed formula: ``r = (N / S - 1) / (N - 1)``. At r above this, distributing is slower
    than the target (for ``target_speedup=1``: slower than one device).
    """
    if n < 2 or target_speedup <= 0:
        raise ValueError("need n >= 2 and a positive target")
    return (n / target_speedup - 1) / (n - 1)


def measure_step(cfg: dict) -> dict:
    """Worker for ``dtlab.launch.run``: time DDP training steps of an MLP under ``cfg``.

    ``cfg`` keys: ``hidden``, ``depth``, ``batch`` (per process), ``accumulation``, ``compression``
    (True: fp16 hook), ``steps``, ``device`` ("cpu"/"cuda"), ``bucket_cap_mb``, ``no_comm`` (True:
    N processes train independently, to time compute alone). Runs on 1 process as well. Returns
    the median seconds per optimizer step, the gradient bytes, and — on N > 1 with communication —
    the measured all-reduce time of the bytes actually sent.
    """
    import contextlib
    import os
    import statistics
    import time

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    from dtlab import data, models
    from dtlab.bandwidth import time_all_reduce

    cuda = cfg.get("device") == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = models.MLP(64, cfg["hidden"], 10, depth=cfg["depth"]).to(dev)
    grad_bytes = 4 * sum(p.numel() for p in model.parameters())
    net = model
    if world > 1 and not cfg.get("no_comm"):
        net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cfg.get("bucket_cap_mb", 25))
        if cfg.get("compression"):
            net.register_comm_hook(None, fp16_compress_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = data.synthetic_classification(cfg["batch"], 64, 10, seed=dist.get_rank()).tensors
    x, y = x.to(dev), y.to(dev)
    k = cfg.get("accumulation", 1)

    def step() -> None:
        for m in range(k):
            sync = net is model or m == k - 1
            with (contextlib.nullcontext() if sync else net.no_sync()):
                (F.cross_entropy(net(x), y) / k).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    times = []
    for _ in range(cfg["steps"]):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    sent = grad_bytes * (0.5 if cfg.get("compression") else 1.0)
    allreduce = time_all_reduce(int(sent), dev, iters=5) if world > 1 and not cfg.get("no_comm") else 0.0
    dist.destroy_process_group()
    return {"step_s": statistics.median(times), "grad_bytes": grad_bytes, "allreduce_s": allreduce, "world": world}


def measure_speedup(cfg: dict, nprocs: int = 2) -> dict:
    """Measure one process and ``nprocs`` processes on ``cfg`` back to back; predict from the parts.

    The parts: the step time of ``nprocs`` processes training *without* communicating (compute
    alone, including any slowdown from sharing the machine — on a CPU the processes share memory
    bandwidth; on GPUs each has its own device) and the all-reduce time measured for exactly the
    bytes DDP sends. Their sum predicts the DDP step; the measured DDP step tests the prediction.
    """
    from dtlab.launch import run

    one = run(measure_step, cfg, nprocs=1)[0]
    alone = run(measure_step, {**cfg, "no_comm": True}, nprocs=nprocs)[0]
    many = run(measure_step, cfg, nprocs=nprocs)[0]
    measured = nprocs * one["step_s"] / many["step_s"]  # same samples per process per step
    compute = max(alone["step_s"], one["step_s"])  # sharing the machine can only slow compute; less is noise
    predicted = nprocs * one["step_s"] / (compute + many["allreduce_s"])  # the model, without overlap
    return {"config": cfg, "one_step_s": one["step_s"], "alone_step_s": alone["step_s"], "n_step_s": many["step_s"],
            "allreduce_s": many["allreduce_s"], "grad_bytes": one["grad_bytes"], "measured": measured,
            "predicted": predicted, "error": predicted / measured - 1}
