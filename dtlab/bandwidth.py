"""How fast do collectives move data? Timing, and the nccl-tests definitions of bandwidth.

Two numbers, as NVIDIA's nccl-tests report them:

* **algbw** (algorithm bandwidth) = S / t: the message size S divided by the time of the call.
* **busbw** (bus bandwidth) = algbw x a factor that depends on the collective and the world size
  N. It counts the bytes each rank must really move on the busiest link, so it can be compared
  with the hardware's link speed whatever N is. For all-reduce the factor is 2(N-1)/N: a ring
  all-reduce sends every byte around the ring twice (reduce-scatter, then all-gather), less the
  1/N each rank already holds.

Here S is the size of the tensor passed to ``all_reduce`` / ``broadcast``, the *output* of
``all_gather`` and the *input* of ``reduce_scatter``, as in nccl-tests.

How many bytes really crossed the wire? Between processes of one machine, gloo talks TCP over the
loopback interface, whose counters the kernel keeps (``loopback_bytes``): read them before and
after a collective and you have a measurement, not a formula. (NCCL between GPUs of one machine
uses shared memory and PCIe/NVLink, which no interface counter sees.)
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from dtlab import _compat  # noqa: F401  (work-arounds for the runtime's torch and DeepSpeed)
from dtlab.planner.formulas import ring_factor


def bus_bandwidth(op: str, world_size: int, algbw: float) -> float:
    """busbw from algbw for collective ``op`` on ``world_size`` ranks (same unit as ``algbw``): algbw times
    ``dtlab.planner.formulas.ring_factor`` (2(N-1)/N for all-reduce, (N-1)/N for all-gather, reduce-scatter and
    all-to-all, 1 for broadcast)."""
    return algbw * ring_factor(world_size, op)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_all_reduce(nbytes: int, device: torch.device | str = "cpu", iters: int = 5, warmup: int = 2) -> float:
    """Median seconds of one ``all_reduce`` of ``nbytes`` (float32) on the current process group.

    Call it on every rank (it is itself a collective). Each iteration starts after a barrier and
    counts the slowest rank's time, since a collective is only done when every rank is done.
    """
    device = torch.device(device)
    x = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    for _ in range(warmup):
        dist.all_reduce(x)
    times = []
    for _ in range(iters):
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        dist.all_reduce(x)
        _sync(device)
        elapsed = torch.tensor([time.perf_counter() - start], device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    return statistics.median(times)


def memcpy_bandwidth(nbytes: int = 256 * 2**20, device: torch.device | str = "cpu", iters: int = 5) -> float:
    """Bytes per second of copying ``nbytes`` within one device's memory (best of ``iters``).

    The ceiling for collectives between processes on one machine: they can never beat a plain copy.
    """
    device = torch.device(device)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(iters):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def loopback_bytes() -> int | None:
    """Bytes sent so far over this machine's loopback interface (``lo``; ``lo0`` on macOS).

    Every byte gloo moves between processes of this machine passes there, plus TCP/IP headers and
    acknowledgements (0.2% for megabyte messages, up to ~1.5% for DDP-sized buckets). The counter is the
    machine's: other loopback traffic in the same window adds to it. Returns None when it cannot be read.
    """
    try:
        import psutil

        counters = psutil.net_io_counters(pernic=True)
    except Exception:
        return None
    for name in ("lo", "lo0"):
        if name in counters:
            return counters[name].bytes_sent
    return None


def loopback_during(work, backend: str, tries: int = 3) -> int | None:
    """Bytes on the loopback interface while ``work()`` runs on every rank, between barriers; the least of ``tries``
    (other traffic on the machine only adds). None where gloo is not the backend (NCCL's traffic between GPUs
    passes no interface counter) or the counter cannot be read. A collective: call it on every rank."""
    best = None
    for _ in range(tries):
        dist.barrier()
        before = loopback_bytes()
        dist.barrier()
        work()
        dist.barrier()
        after = loopback_bytes()
        if before is None or backend != "gloo":
            return None
        best = after - before if best is None else min(best, after - before)
    return best



def _tcp_counters() -> dict[tuple[int, int], int] | None:
    """This process's TCP connections: ``(local port, peer port) -> bytes sent and acknowledged`` (the kernel's
    ``tcp_info.tcpi_bytes_acked``, Linux). None where the kernel keeps no such counter."""
    import os
    import socket
    import struct

    if not hasattr(socket, "TCP_INFO") or not os.path.isdir("/proc/self/fd"):
        return None
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(fd)))   # a second handle on the same connection, closed below
        except OSError:
            continue
        try:
            if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM:
                info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232)
                if len(info) >= 128:                     # tcpi_bytes_acked: a u64 at byte 120 (Linux >= 4.1)
                    out[(s.getsockname()[1], s.getpeername()[1])] = struct.unpack_from("Q", info, 120)[0]
        except OSError:
            pass                                          # a listening or closing socket: no peer
        finally:
            s.close()
    return out


def peer_bytes_during(work) -> dict[int, int] | None:
    """Bytes this rank sent to each other rank while ``work()`` ran: ``{peer rank: bytes}``. A collective.

    Measured per TCP connection (gloo connects every pair of ranks over TCP; the kernel counts the bytes each
    connection delivered), so unlike ``loopback_during`` it says *between whom* the bytes went: which of
    them crossed a node boundary, for example. Payload only, no headers. None where a rank cannot read
    its connections (not Linux) or the backend is not gloo (NCCL's traffic is not TCP).
    """
    before = _tcp_counters() if dist.get_backend() == "gloo" else None
    ports = None if before is None else sorted({local for local, _ in before})
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ports)             # who listens / connects on which port
    if any(p is None for p in everyone):
        return None
    owner = {port: rank for rank, rank_ports in enumerate(everyone) for port in rank_ports}
    dist.barrier()
    before = _tcp_counters()
    work()
    dist.barrier()
    after = _tcp_counters()
    sent: dict[int, int] = {}
    for (local, peer), total in after.items():
        rank = owner.get(peer)
        if rank is not None and rank != dist.get_rank():
            sent[rank] = sent.get(rank, 0) + total - before.get((local, peer), 0)
    return sent

#: c10d operator names (``torch.ops.c10d``) by the collective they perform.
_KIND = {"allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "_allgather_base_": "all_gather",
         "allgather_": "all_gather", "allgather_coalesced_": "all_gather",
         "allgather_into_tensor_coalesced_": "all_gather", "_reduce_scatter_base_": "reduce_scatter",
         "reduce_scatter_": "reduce_scatter", "reduce_scatter_tensor_coalesced_": "reduce_scatter",
         "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "broadcast_": "broadcast"}


def collective_calls(work, groups: dict | None = None) -> dict:
    """The collectives ``work()`` calls on this rank, by kind (``all_reduce``, ``all_gather``, ``reduce_scatter``,
    ``all_to_all``, ``broadcast``; others by their c10d name).

    Counted where torch dispatches them (its ``torch.ops.c10d`` operators), so it sees what any library issues
    through ``torch.distributed``: DDP's buckets, DeepSpeed's coalesced gathers, FSDP2's groups. With ``groups``
    (``{name: ProcessGroup}``, e.g. a mesh's dimensions) the keys are ``(kind, name)``: which group each ran on
    (``"world"`` for any other).
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: dict = {}
    names = {g.group_name: name for name, g in (groups or {}).items()}

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d":
                name = func.__name__.split(".")[0]
                key = _KIND.get(name, name)
                if groups is not None:
                    pg = next(a for a in args if isinstance(a, torch.ScriptObject))
                    key = (key, names.get(dist.ProcessGroup.unbox(pg).group_name, "world"))
                counts[key] = counts.get(key, 0) + 1
            return func(*args, **(kwargs or {}))

    with Counting():
        work()
    return counts


def collective_costs(device: torch.device | str, backend: str, ops: tuple[str, ...] = ("all_reduce", "all_gather",
                     "reduce_scatter"), reps: int = 5, group=None) -> dict[str, dict[str, dict[str, float]]]:
    """Weigh and time each collective of ``ops`` on ``group`` (the whole job by default; every rank calls it, each
    with its own group of a mesh dimension) at a small and a large size.

    Returns ``{"wire": {op: {"per_call", "per_element"}}, "time": {op: {"per_call", "per_element"}}}``: loopback
    bytes (empty off gloo) and seconds, per call and per element of the full tensor (the all-reduce's, the
    all-gather's output, the reduce-scatter's input, the all-to-all's), from a line through the two sizes — as
    notebook 08 fits latency and bandwidth. A prediction in elements becomes bytes and seconds on this machine.
    """
    from dtlab.distributed import all_gather_single, reduce_scatter_single

    device, world = torch.device(device), dist.get_world_size(group)
    calls = {"all_reduce": lambda n: dist.all_reduce(torch.ones(n, device=device), group=group),
             "all_gather": lambda n: all_gather_single(torch.empty(n, device=device),
                                                       torch.ones(n // world, device=device), group=group),
             "reduce_scatter": lambda n: reduce_scatter_single(torch.empty(n // world, device=device),
                                                               torch.ones(n, device=device), group=group),
             "all_to_all": lambda n: dist.all_to_all_single(torch.empty(n, device=device),
                                                            torch.ones(n, device=device), group=group)}
    small, large = 96 * world, 65536 * world
    empty = loopback_during(lambda: None, backend)
    out: dict[str, dict[str, dict[str, float]]] = {"wire": {}, "time": {}}

    def line(at: dict[int, float]) -> dict[str, float]:
        per = (at[large] - at[small]) / (large - small)
        return {"per_call": max(0.0, at[small] - per * small), "per_element": per}

    for op in ops:
        call = calls[op]
        seconds = {}
        for n in (small, large):
            call(n)
            times = []
            for _ in range(reps):
                dist.barrier()
                start = time.perf_counter()
                call(n)
                _sync(device)
                times.append(time.perf_counter() - start)
            seconds[n] = statistics.median(times)
        out["time"][op] = line(seconds)
        if empty is not None:
            out["wire"][op] = line({n: (loopback_during(lambda c=call, n=n: [c(n) for _ in range(reps)], backend)
                                        - empty) / reps for n in (small, large)})
    return out
