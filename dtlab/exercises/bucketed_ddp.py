"""Exercise 03.bucketed_ddp: data parallelism with gradient buckets, all-reduced while backward still runs.

Write ``class MyBucketedDDP(torch.nn.Module)`` with:

* ``__init__(self, module, bucket_cap_mb)``: wrap ``module`` (already on its device; the process group is
  initialised). Every rank must start from rank 0's weights, whatever it was built with.
* ``forward(self, *args)``: run the module.
* ``finish_gradient_synchronization(self)``: called after ``loss.backward()``, before ``optimizer.step()``;
  when it returns, every parameter's ``.grad`` holds the gradient *averaged* over the ranks.

What must hold (what the grader checks, on 2 processes by default, with an MLP of 14 small tensors whose
ranks are seeded differently, SGD with momentum, each rank on its half of every global batch):

* right after wrapping, every rank holds rank 0's initial weights;
* after the first backward and ``finish_gradient_synchronization``, every ``.grad`` equals the gradient of
  one process on the full batch (within float32 rounding: ``dtlab.measure.reduction_tolerance``);
* after a few steps, every rank's weights equal the one-process run's, and the replicas are identical;
* the gradients travel in buckets: one ``dist.all_reduce`` per bucket, a bucket holding at most
  ``bucket_cap_mb`` MiB (2**20 bytes) of gradients (a tensor larger than that on its own). The grader picks a
  cap that makes about 3 buckets and accepts that number give or take one;
* at least one all-reduce is *issued during* ``loss.backward()``: a bucket is sent as soon as its last
  gradient is ready, so communication overlaps the rest of the backward pass.

Hints: decide the buckets once, in ``__init__``, walking the parameters in reverse (backward produces the
last layer's gradients first). ``p.register_post_accumulate_grad_hook(fn)`` calls ``fn(p)`` once ``p.grad`` is
complete. ``dist.all_reduce(flat, async_op=True)`` returns a handle to ``wait()`` on later. A bucket is one
flat tensor (``torch.cat`` of its gradients); after the wait, copy its pieces back into each ``.grad``.
Reset whatever tells you a bucket is ready, for the next step.
"""

from __future__ import annotations

from typing import Any

import torch

from dtlab.exercises.grading import Rank, Report, compare, run_ranks, scale_of

NPROCS = 2
#: the model (an MLP with DEPTH hidden layers: 2 * (DEPTH + 1) tensors), the batches and the optimizer
IN, HIDDEN, OUT, DEPTH = 6, 8, 4, 6
LOCAL_BATCH, STEPS, LR, MOMENTUM = 4, 3, 0.1, 0.9
SEED = 1234


def _model(seed: int) -> torch.nn.Module:
    from dtlab.models import MLP

    with torch.random.fork_rng(devices=[]):            # leave the caller's random state alone
        torch.manual_seed(seed)
        return MLP(IN, HIDDEN, OUT, depth=DEPTH)


def _batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    n = LOCAL_BATCH * world
    return [(torch.randn(n, IN, generator=g), torch.randint(0, OUT, (n,), generator=g)) for _ in range(STEPS)]


def plan_buckets(sizes_bytes: list[int], cap_bytes: float) -> list[list[int]]:
    """Indices of the tensors in each bucket, filled in reverse order, a new one when the cap would be passed."""
    buckets: list[list[int]] = [[]]
    size = 0
    for i in reversed(range(len(sizes_bytes))):
        if buckets[-1] and size + sizes_bytes[i] > cap_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += sizes_bytes[i]
    return buckets


def cap_mb() -> float:
    """The cap the grader passes: a little over a third of the model's gradient bytes (3 buckets)."""
    total = sum(p.numel() * p.element_size() for p in _model(SEED).parameters())
    return 1.25 * total / 3 / 2**20


def _one_process(device: torch.device, world: int) -> dict[str, Any]:
    """The same training in one process, on the full batches, from rank 0's initial weights."""
    import torch.nn.functional as F

    model = _model(SEED).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step, (x, y) in enumerate(_batches(world)):
        opt.zero_grad()
        F.cross_entropy(model(x.to(device)), y.to(device)).backward()
        if step == 0:
            grads = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()}
        opt.step()
    return {"grads": grads, "weights": {n: p.detach().cpu().clone() for n, p in model.named_parameters()}}


def _body(impl: Any, me: Rank) -> dict[str, Any]:
    import torch.nn.functional as F

    def weights() -> dict[str, torch.Tensor]:
        return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}

    def all_reduces() -> int:
        return me.tracer.calls.get("all_reduce", 0)

    model = _model(SEED + me.rank).to(me.device)        # different on each rank, on purpose
    with me.tracer.doing("wrapping the model: MyBucketedDDP(model, bucket_cap_mb)"):
        ddp = impl(model, cap_mb())
    start = weights()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    rows = slice(me.rank * LOCAL_BATCH, (me.rank + 1) * LOCAL_BATCH)
    during, per_step, grads = [], [], {}
    for step, (x, y) in enumerate(_batches(me.world)):
        opt.zero_grad()
        with me.tracer.doing(f"step {step}: forward"):
            loss = F.cross_entropy(ddp(x[rows].to(me.device)), y[rows].to(me.device))
        before = all_reduces()
        with me.tracer.doing(f"step {step}: loss.backward() (your gradient hooks run in it)"):
            loss.backward()
        during.append(all_reduces() - before)
        with me.tracer.doing(f"step {step}: finish_gradient_synchronization()"):
            ddp.finish_gradient_synchronization()
        per_step.append(all_reduces() - before)
        if step == 0:
            grads = {n: (p.grad.detach().cpu().clone() if p.grad is not None else None)
                     for n, p in model.named_parameters()}
        opt.step()
    out = {"start": start, "grads": grads, "weights": weights(), "during": during, "per_step": per_step}
    if me.rank == 0:
        out["one_process"] = _one_process(me.device, me.world)
    return out


def grade(impl: Any, report: Report, nprocs: int = NPROCS, limit_s: float = 30.0) -> Report:
    """Grade ``impl`` (your ``MyBucketedDDP`` class) on ``nprocs`` processes into ``report``."""
    from dtlab.measure import reduction_tolerance

    out = run_ranks(report, _body, impl, nprocs=nprocs, limit_s=limit_s)
    if out is None:
        return report
    start, one = _model(SEED).state_dict(), out[0]["one_process"]
    for rank, r in enumerate(out):
        before = len(report.problems)
        compare(report, f"rank {rank}, right after wrapping", r["start"], start, 0.0, "parameter")
        if len(report.problems) > before:
            report.fail(f"rank {rank} does not start from rank 0's weights (each rank built its model from its "
                        "own seed)", "broadcast rank 0's parameters and buffers when you wrap "
                        "(dist.broadcast(t, src=0) for each, in __init__)")
    if report.problems:
        return report
    report.ok("every rank starts from rank 0's weights")

    # the gradients after the first step's finish_gradient_synchronization: the full batch's, averaged
    scale = max(g.abs().max().item() for g in one["grads"].values())
    bound = reduction_tolerance(LOCAL_BATCH * nprocs, 1, scale)
    for rank, r in enumerate(out):
        before = len(report.problems)
        compare(report, f"rank {rank}, step 0, after finish_gradient_synchronization", r["grads"], one["grads"],
                bound, "gradient of parameter")
        cause = _grad_cause(r["grads"], one["grads"], bound, nprocs) if len(report.problems) > before else None
        if cause and cause not in report.causes:
            report.causes.append(cause)
    if not report.problems:
        report.ok(f"every .grad after finish_gradient_synchronization is the full batch's gradient (bound "
                  f"{bound:.1e})")

    # the weights after a few steps, and identical replicas
    if not report.problems:
        scale = max(w.abs().max().item() for w in one["weights"].values())
        bound = reduction_tolerance(LOCAL_BATCH * nprocs, STEPS, scale)
        for rank, r in enumerate(out):
            compare(report, f"rank {rank}, after {STEPS} steps", r["weights"], one["weights"], bound, "parameter")
        for rank, r in enumerate(out[1:], start=1):
            differ = [n for n, w in r["weights"].items() if not torch.equal(w, out[0]["weights"][n])]
            if differ:
                report.fail(f"after {STEPS} steps rank {rank} and rank 0 hold different weights "
                            f"({', '.join(differ[:3])}{' ...' if len(differ) > 3 else ''})",
                            "the ranks stepped with different gradients: every rank must end "
                            "finish_gradient_synchronization with the same averaged gradients")
        if not report.problems:
            report.ok(f"after {STEPS} SGD steps every rank's weights equal one process's on the full batch "
                      f"(bound {bound:.1e}), identical on every rank")

    # the all-reduces: one per bucket, the first ones issued during backward
    sizes = [p.numel() * p.element_size() for p in _model(SEED).parameters()]
    buckets = len(plan_buckets(sizes, cap_mb() * 2**20))
    calls = [c for r in out for c in r["per_step"]]
    tensors = len(sizes)
    hook = ("launch a bucket from the gradient hook when its last gradient arrives "
            "(register_post_accumulate_grad_hook), not after backward: that is what overlaps communication with the "
            "rest of the backward pass")
    if max(calls) >= tensors:
        report.fail(f"{max(calls)} dist.all_reduce calls in a step for {tensors} gradient tensors; a cap of "
                    f"{cap_mb() * 2**20:.0f} bytes makes {buckets} buckets",
                    "no buckets: one all-reduce per tensor pays the latency per tensor. Pack a bucket's gradients "
                    "into one flat tensor (torch.cat) and all-reduce that")
    elif min(calls) == 0 < max(calls):
        report.fail(f"some steps issued no dist.all_reduce at all (per step and rank: {calls})",
                    "the first step synchronised, later ones not: reset what tells you a bucket is ready (and what "
                    "was sent) at the end of finish_gradient_synchronization")
    elif not all(buckets - 1 <= c <= buckets + 1 for c in calls):
        report.fail(f"{_span(calls)} dist.all_reduce calls per step; a cap of {cap_mb() * 2**20:.0f} bytes over "
                    f"these {tensors} tensors ({sum(sizes)} bytes) makes {buckets} buckets",
                    "start a new bucket when the next gradient would take the bucket past bucket_cap_mb MiB "
                    "(bucket_cap_mb * 2**20 bytes)")
    else:
        report.ok(f"{_span(calls)} all-reduces per step for {buckets} buckets of at most "
                  f"{cap_mb() * 2**20:.0f} bytes ({tensors} tensors)")
    during = [c for r in out for c in r["during"]]
    if max(calls) > 0 and max(during) == 0:
        report.fail(f"no dist.all_reduce was issued during loss.backward() (per step and rank: {during}); all "
                    "of them waited for finish_gradient_synchronization", hook)
    elif min(calls) > 0 and min(during) == 0:
        report.fail(f"in some steps no dist.all_reduce was issued during loss.backward() (per step and rank: "
                    f"{during})", "the first step sent buckets during backward, later ones did not: reset what "
                    "counts a bucket's arrived gradients at the end of finish_gradient_synchronization")
    elif max(calls) > 0 and min(during) > 0:
        report.ok(f"all-reduces issued during loss.backward(): {_span(during)} per step")
    return report


def _span(counts: list[int]) -> str:
    return f"{min(counts)}" if min(counts) == max(counts) else f"{min(counts)} to {max(counts)}"


def _grad_cause(got: dict[str, torch.Tensor | None], expected: dict[str, torch.Tensor], bound: float,
                n: int) -> str | None:
    missing = [name for name, g in got.items() if g is None]
    if missing:
        return (f"{', '.join(missing)} had no .grad after finish_gradient_synchronization: copy each bucket's "
                "averaged values back into every parameter's .grad")
    c = scale_of(torch.cat([g.flatten() for g in got.values()]), torch.cat([e.flatten() for e in expected.values()]))
    if abs(c - n) < 0.02 * n:
        return f"the gradients are {n} times one process's: summed, not averaged (divide by the world size)"
    if abs(c - 1 / n) < 0.02 / n:
        return "the gradients are 1/N of one process's: divided by the world size twice"
    right = [name for name, g in got.items() if (g - expected[name]).abs().max().item() <= bound]
    if right:
        return (f"some gradients are right ({', '.join(right[:3])}{' ...' if len(right) > 3 else ''}), others "
                "not: a bucket was all-reduced before all its gradients had arrived, so it sent zeros or stale "
                "values for the late ones and copied those back. Launch a bucket when its LAST gradient is ready")
    return None


def reference() -> Any:
    """A correct implementation (the grader's own test uses it; try yours first): the course's
    ``BucketedDataParallel``, whose ``__init__(module, bucket_cap_mb)`` is the exercise's signature."""
    from dtlab.parallel.data_parallel import BucketedDataParallel

    return BucketedDataParallel
