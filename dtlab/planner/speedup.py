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

With ``r = t_comm / t_compute`` this is ``S = N / (1 + r)``: one process would not be beaten only
when the all-reduce takes longer than ``N - 1`` steps of compute (``break_even_comm``).

A tempting simpler model grows communication with every peer, ``S = N / (1 + r (N-1))``
(``linear_comm_speedup``): what one parameter server receiving every worker's gradients would cost. A
ring all-reduce does not grow that way — each GPU sends ``2(N-1)/N`` of the gradients whatever N is
(Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations", J. Parallel
Distrib. Comput. 69(2), 2009; the Horovod paper, arXiv:1802.05799, section 3, contrasts the two) — and the
two formulas agree only at N = 2. With 55 ms of compute, a 40 ms all-reduce and N = 4, the growing model
gives 1.26x (1.18x with r = 0.8) and the ring 2.32x; 1.18x would need 3 x 40 ms of communication per step.

``measure_speedup`` measures the ingredients and the result on this machine, in the same
processes and interleaved step by step, so that the prediction and the measurement see the same
conditions (a noisy 2-core machine changes speed from minute to minute).
"""

from __future__ import annotations

from dataclasses import dataclass

from dtlab.planner.formulas import ring_factor


def allreduce_seconds(nbytes: float, n: int, bandwidth: float, latency: float = 0.0) -> float:
    """Ring all-reduce time for ``nbytes`` on ``n`` processes (bandwidth in bytes/s, latency in s)."""
    if n < 1 or bandwidth <= 0 or nbytes < 0 or latency < 0:
        raise ValueError("need n >= 1, bandwidth > 0, nbytes >= 0 and latency >= 0")
    if n == 1:
        return 0.0
    return ring_factor(n) * nbytes / bandwidth + 2 * (n - 1) * latency


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


def linear_comm_speedup(n: int, comm_over_compute: float) -> float:
    """``S = N / (1 + r (N - 1))`` with ``r = t_comm / t_compute`` measured at N = 2: the speed-up if the
    communication grew with every peer (one parameter server receiving all gradients), not a ring's."""
    return n / (1 + comm_over_compute * (n - 1))


def seed_formula(n: int, comm_over_compute: float) -> float:  # deprecated alias, removed in the next release
    """Deprecated: renamed ``linear_comm_speedup`` (what it computes); this name goes in the next release."""
    import warnings

    warnings.warn("dtlab.planner.speedup.seed_formula is renamed linear_comm_speedup; the old name goes in the next "
                  "release", DeprecationWarning, stacklevel=2)
    return linear_comm_speedup(n, comm_over_compute)


def break_even_ratio(n: int, target_speedup: float = 1.0) -> float:
    """The largest ``t_comm / t_compute`` at which N processes still reach ``target_speedup``,
    by ``linear_comm_speedup``: ``r = (N / S - 1) / (N - 1)`` (see ``break_even_comm`` for this model's).
    """
    if n < 2 or target_speedup <= 0:
        raise ValueError("need n >= 2 and a positive target")
    return (n / target_speedup - 1) / (n - 1)


def break_even_comm(n: int, target_speedup: float = 1.0) -> float:
    """The largest ``t_comm / t_compute`` at which N processes still reach ``target_speedup``, by this
    module's model ``S = N / (1 + r)``: ``r = N / S - 1`` (for S = 1: the all-reduce may take up to
    ``N - 1`` steps of compute before one process wins)."""
    if n < 2 or target_speedup <= 0:
        raise ValueError("need n >= 2 and a positive target")
    return n / target_speedup - 1


def measure_step(cfg: dict) -> dict:
    """Worker for ``dtlab.launch.run``: time training steps of an MLP, and their ingredients, under ``cfg``.

    ``cfg`` keys: ``hidden``, ``depth``, ``batch`` (per process), ``accumulation``, ``compression``
    (True: fp16 hook), ``steps``, ``device`` ("cpu"/"cuda"), ``backend``, ``bucket_cap_mb``.

    On one process it times plain steps. On N processes it alternates, step by step and after a
    barrier each time, three things in the same processes: a DDP step; a step of an identical DDP
    model whose communication hook sends nothing (the compute plus DDP's own bookkeeping — bucket
    copies, hooks — and what the processes cost each other on a shared machine); and one all-reduce
    of exactly the bytes DDP sends per step. With ``accumulation`` k > 1 a fourth is interleaved: the
    same k micro-batches with an all-reduce after each (DDP without ``no_sync``), so the saving of
    ``no_sync`` is measured in the same processes, step beside step. Returns the means (seconds),
    the gradient bytes, every timed value (``samples``) and, with k > 1, ``sync_each_ratios``: per
    step, the time with an all-reduce per micro-batch over the time with ``no_sync``.

    Means, not medians: a step's time is the sum of its parts, and a sum holds for means. On a
    shared CPU a small all-reduce takes either well under a millisecond or one scheduler tick more
    (a waiting thread woken late); its median jumps between the two from launch to launch, while
    the DDP step it is meant to explain pays the mixture.
    """
    import contextlib
    import statistics
    import time

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    from dtlab import data, models
    from dtlab.distributed import local_device

    dist.init_process_group(cfg.get("backend", "gloo"))
    world = dist.get_world_size()
    dev = local_device(cfg.get("device", "cpu"))
    cuda = dev.type == "cuda"

    def build():
        torch.manual_seed(0)
        model = models.MLP(64, cfg["hidden"], 10, depth=cfg["depth"]).to(dev)
        return model, torch.optim.SGD(model.parameters(), lr=0.01)

    model, opt = build()
    grad_bytes = 4 * sum(p.numel() for p in model.parameters())
    ddp = None
    if world > 1:
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cfg.get("bucket_cap_mb", 25))
        if cfg.get("compression"):
            ddp.register_comm_hook(None, fp16_compress_hook)
    alone, alone_opt = build()                                   # the same work, never communicating
    if world > 1:
        alone = torch.nn.parallel.DistributedDataParallel(alone, bucket_cap_mb=cfg.get("bucket_cap_mb", 25))
        alone.register_comm_hook(None, _send_nothing)
    x, y = data.synthetic_classification(cfg["batch"], 64, 10, seed=dist.get_rank()).tensors
    x, y = x.to(dev), y.to(dev)
    k = cfg.get("accumulation", 1)
    sent = torch.ones(max(1, int(grad_bytes * (0.5 if cfg.get("compression") else 1.0)) // 4), device=dev)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    def train_step(net, optimizer, syncs: bool) -> None:
        for m in range(k):
            last = m == k - 1
            with (net.no_sync() if syncs and not last else contextlib.nullcontext()):
                (F.cross_entropy(net(x), y) / k).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def timed(fn) -> float:
        dist.barrier()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        elapsed = torch.tensor([time.perf_counter() - start], device=dev)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)            # a step ends when the slowest rank ends
        return elapsed.item()

    compare_sync = world > 1 and k > 1
    parts: dict[str, list[float]] = {"step_s": [], "alone_s": [], "allreduce_s": []}
    ratios: list[float] = []
    for i in range(cfg["steps"] + 2):                             # 2 warm-up rounds
        step = timed(lambda: train_step(ddp or model, opt, ddp is not None))
        if world > 1:
            comp = timed(lambda: train_step(alone, alone_opt, True))
            comm = timed(lambda: dist.all_reduce(sent))
        if compare_sync:
            each = timed(lambda: train_step(ddp, opt, False))    # an all-reduce after every micro-batch
        if i >= 2:
            parts["step_s"].append(step)
            if world > 1:
                parts["alone_s"].append(comp)
                parts["allreduce_s"].append(comm)
            if compare_sync:
                ratios.append(each / step)
    dist.destroy_process_group()
    out = {name: statistics.fmean(v) if v else 0.0 for name, v in parts.items()}
    out["samples"] = parts
    if compare_sync:
        out["sync_each_ratios"] = ratios
    return {**out, "grad_bytes": grad_bytes, "world": world}


def _send_nothing(state, bucket):  # no annotations: DDP inspects a hook's signature
    """A DDP communication hook that communicates nothing (the gradient bucket is returned as it is)."""
    import torch

    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def measure_speedup(cfg: dict, nprocs: int = 2, repeats: int = 1) -> dict:
    """Measure one process and ``nprocs`` processes on ``cfg``; predict from the measured ingredients.

    The prediction is ``predict`` with this machine's numbers: the compute per micro-batch of
    ``nprocs`` processes training side by side without communicating, and the link bandwidth that
    makes ``allreduce_seconds`` equal the measured all-reduce of the bytes DDP sends. The measured
    speed-up (``nprocs x`` one process's mean step time over the DDP step's: samples per second,
    as each process does the same work per step) tests it. ``repeats`` launches are interleaved;
    the medians of their results are returned, and ``spread`` (max - min over median) of the
    measured speed-up says how noisy the machine was. ``error`` (predicted / measured - 1) is the
    median of each launch's own error: a launch's prediction and measurement come from the same
    processes, step beside step, so pairing them leaves out what differs between launches, and with
    three launches or more one that a burst of other work disturbed does not decide it.
    ``allreduce_samples_s`` pools every launch's timed all-reduces (their spread is why
    ``measure_step`` averages); with accumulation, ``sync_each_ratios`` pools every launch's per-step
    ratios (see ``measure_step``).
    """
    import statistics

    from dtlab.launch import run

    rounds = []
    for _ in range(repeats):
        one = run(measure_step, cfg, nprocs=1)[0]
        many = run(measure_step, cfg, nprocs=nprocs)[0]
        k = cfg.get("accumulation", 1)
        sent = many["grad_bytes"] * (0.5 if cfg.get("compression") else 1.0)
        bandwidth = 2 * (nprocs - 1) / nprocs * sent / many["allreduce_s"]     # what makes the ring formula fit
        p = predict(many["alone_s"] / k, sent, nprocs, bandwidth, accumulation=k)
        rounds.append({"one_step_s": one["step_s"], "n_step_s": many["step_s"], "alone_step_s": many["alone_s"],
                       "allreduce_s": many["allreduce_s"], "grad_bytes": many["grad_bytes"],
                       "measured": nprocs * one["step_s"] / many["step_s"],
                       "predicted": nprocs * one["step_s"] / p.step_s,
                       "error": many["step_s"] / p.step_s - 1,
                       "sync_each_ratios": many.get("sync_each_ratios", []),
                       "allreduce_samples_s": many["samples"]["allreduce_s"]})
    pooled = ("sync_each_ratios", "allreduce_samples_s")
    med = {key: statistics.median(r[key] for r in rounds) for key in rounds[0] if key not in pooled}
    med.update({key: [x for r in rounds for x in r[key]] for key in pooled})
    measured = [r["measured"] for r in rounds]
    med["spread"] = (max(measured) - min(measured)) / med["measured"]
    return {"config": cfg, **med, "rounds": rounds}
