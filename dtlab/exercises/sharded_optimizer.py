"""Exercise 06.sharded_optimizer: ZeRO stage 1 — the optimizer state split across ranks, parameters re-synchronised.

Write ``class MyShardedOptimizer`` with:

* ``__init__(self, params, optimizer_class, **defaults)``: ``params`` as for any torch optimizer (the grader passes
  ``model.parameters()``), ``optimizer_class`` the real optimizer (the grader passes ``torch.optim.AdamW``) and
  its hyperparameters (``lr=..., weight_decay=...``). Every parameter is *owned* by exactly one rank; each rank
  builds ``optimizer_class`` over the parameters it owns only, so it keeps optimizer state for those only.
* ``step()``: each rank steps the parameters it owns; then every parameter is sent from its owner to the others,
  so every rank leaves ``step()`` with the same, fully updated weights.
* ``zero_grad(set_to_none=True)``: clear the gradient of every parameter (not only the owned ones).

The gradients arrive already averaged over the ranks: the grader all-reduces them itself before it calls
``step()`` (the job DDP does in a real run), so ``step()`` needs no ``all_reduce``.

What must hold (what the grader checks, on 2 processes by default, with an MLP of 10 tensors and AdamW for a few
steps, each rank on its half of every global batch):

* every rank's weights equal one process's (AdamW on the averaged gradients), within
  ``dtlab.measure.reduction_tolerance``, and the replicas are identical;
* the optimizer state is split: the grader counts the elements of the tensors in the ``.state`` of every
  ``torch.optim.Optimizer`` it can reach from your object — the object itself if it is one, and any Optimizer
  among its attributes' values (directly, or inside a list, tuple or dict). Each rank may hold at most 1/N of the
  whole state plus one parameter's share, and over the ranks every parameter has state exactly once.
* after ``zero_grad()`` no parameter has a gradient left.

Hints: decide the owners from the parameters alone (their order and sizes), never from the rank, so that every
rank reaches the same answer. Balance elements, not tensors: round-robin by position would give one rank every
weight matrix of this MLP and the other every bias. ``dist.broadcast(p.data, src=owner)`` for every parameter, in
the same order on every rank.
"""

from __future__ import annotations

from typing import Any

import torch

from dtlab.exercises.grading import Rank, Report, compare, run_ranks

NPROCS = 2
#: the model (an MLP: 2 * (DEPTH + 1) tensors of similar size, so the state splits evenly), batches, optimizer
IN, HIDDEN, OUT, DEPTH = 8, 8, 4, 4
LOCAL_BATCH, STEPS, LR, WEIGHT_DECAY = 4, 3, 0.01, 0.01
SEED = 4321


def _model() -> torch.nn.Module:
    from dtlab.models import MLP

    with torch.random.fork_rng(devices=[]):            # leave the caller's random state alone
        torch.manual_seed(SEED)
        return MLP(IN, HIDDEN, OUT, depth=DEPTH)


def _batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    n = LOCAL_BATCH * world
    return [(torch.randn(n, IN, generator=g), torch.randint(0, OUT, (n,), generator=g)) for _ in range(STEPS)]


def optimizers_in(obj: Any) -> list[torch.optim.Optimizer]:
    """The optimizers the grader counts: ``obj`` if it is one, and any among its attributes' values (directly, or
    in a list, tuple or dict)."""
    found = [obj] if isinstance(obj, torch.optim.Optimizer) else []
    for value in getattr(obj, "__dict__", {}).values():
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
        found += [x for x in items if isinstance(x, torch.optim.Optimizer) and all(x is not f for f in found)]
    return found


def _state_elements(optimizers: list[torch.optim.Optimizer], names: dict[int, str]) -> dict[str, int]:
    """Elements of optimizer state held for each parameter (by name; '?' for tensors not among the model's)."""
    held: dict[str, int] = {}
    for opt in optimizers:
        for p, state in opt.state.items():
            n = sum(t.numel() for t in state.values() if torch.is_tensor(t))
            name = names.get(id(p), "?")
            held[name] = held.get(name, 0) + n
    return held


def _one_process(device: torch.device, world: int) -> dict[str, Any]:
    """AdamW in one process on the gradients the ranks average: each rank's slice, summed in rank order, / N."""
    import torch.nn.functional as F

    model = _model().to(device)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    for x, y in _batches(world):
        per_rank = []
        for rank in range(world):
            rows = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
            grads = torch.autograd.grad(F.cross_entropy(model(x[rows].to(device)), y[rows].to(device)), params)
            per_rank.append(grads)
        for i, p in enumerate(params):
            total = per_rank[0][i].clone()
            for grads in per_rank[1:]:
                total += grads[i]
            p.grad = total / world
        opt.step()
    names = {id(p): n for n, p in model.named_parameters()}
    return {"weights": {n: p.detach().cpu().clone() for n, p in model.named_parameters()},
            "state": _state_elements([opt], names)}


def _body(impl: Any, me: Rank) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.nn.functional as F

    model = _model().to(me.device)                      # the same on every rank (DDP's broadcast, done)
    names = {id(p): n for n, p in model.named_parameters()}
    with me.tracer.doing("creating your optimizer: MyShardedOptimizer(model.parameters(), torch.optim.AdamW, ...)"):
        opt = impl(model.parameters(), torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY)
    rows = slice(me.rank * LOCAL_BATCH, (me.rank + 1) * LOCAL_BATCH)
    left_over = set()
    for step, (x, y) in enumerate(_batches(me.world)):
        with me.tracer.doing(f"step {step}: your zero_grad()"):
            opt.zero_grad()
        left_over |= {n for n, p in model.named_parameters() if p.grad is not None and bool(p.grad.any())}
        F.cross_entropy(model(x[rows].to(me.device)), y[rows].to(me.device)).backward()
        with me.tracer.doing(f"step {step}: the grader averaging the gradients (dist.all_reduce, then / N)"):
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(me.world)
        with me.tracer.doing(f"step {step}: your step()"):
            opt.step()
    optimizers = optimizers_in(opt)
    out = {"weights": {n: p.detach().cpu().clone() for n, p in model.named_parameters()},
           "optimizers": len(optimizers), "held": _state_elements(optimizers, names), "left_over": sorted(left_over),
           "own_all_reduces": me.tracer.calls.get("all_reduce", 0) - STEPS * len(names)}
    if me.rank == 0:
        out["one_process"] = _one_process(me.device, me.world)
    return out


def grade(impl: Any, report: Report, nprocs: int = NPROCS, limit_s: float = 30.0) -> Report:
    """Grade ``impl`` (your ``MyShardedOptimizer`` class) on ``nprocs`` processes into ``report``."""
    from dtlab.measure import reduction_tolerance

    out = run_ranks(report, _body, impl, nprocs=nprocs, limit_s=limit_s)
    if out is None:
        if any("dist.broadcast" in p for p in report.problems):   # not a send/recv ordering problem: say so
            report.causes[:] = ["a broadcast no rank receives: the ranks disagree about its src. Decide each "
                                "parameter's owner from the parameters alone (position, size), the same way on "
                                "every rank, never from the rank itself"]
        return report
    one = out[0]["one_process"]
    names = list(one["weights"])
    start = _model().state_dict()

    # the optimizer state: about 1/N on each rank, every parameter's exactly once over the ranks
    full = sum(one["state"].values())
    allowed = full / nprocs + max(one["state"].values())
    if all(r["optimizers"] == 0 for r in out):
        report.fail("no rank has a torch.optim.Optimizer in your object, so the grader cannot see the optimizer "
                    "state", "keep the optimizer of this rank's shard in an attribute (self.optimizer = "
                    "optimizer_class(my_parameters, **defaults))")
    holders = {n: [rank for rank, r in enumerate(out) if r["held"].get(n)] for n in names}
    if nprocs > 1 and all(len(h) == nprocs for h in holders.values()):
        report.fail(f"every rank holds optimizer state for all {len(names)} parameters ({full} elements: one "
                    "process's whole state)", "every rank keeps the whole optimizer: that is plain data parallelism. "
                    "Build optimizer_class over the parameters this rank owns only")
    else:
        for rank, r in enumerate(out):
            held = sum(r["held"].values())
            if held > allowed:
                report.fail(f"rank {rank} holds {held} elements of optimizer state; its share is at most "
                            f"{full}/{nprocs} + one parameter's = {allowed:.0f}",
                            "spread the parameters so each rank owns about 1/N of the elements")
        for n, h in holders.items():
            if len(h) != 1 and any(r["optimizers"] for r in out):
                where = "ranks " + " and ".join(map(str, h)) if h else "no rank"
                report.fail(f"parameter {n} has optimizer state on {where}",
                            "the ranks disagree on who owns which parameter: decide ownership from the parameters "
                            "alone (their order and sizes), the same way on every rank")
    if not report.problems:
        report.ok(f"optimizer state per rank: {', '.join(str(sum(r['held'].values())) for r in out)} elements of "
                  f"{full} (at most {allowed:.0f} each), every parameter's on exactly one rank")
    for rank, r in enumerate(out):
        if r["left_over"]:
            report.fail(f"rank {rank}: after your zero_grad() {', '.join(r['left_over'][:3])} still had a gradient",
                        "zero_grad must clear the gradient of every parameter, not only the ones this rank owns")

    # the weights: one process's, identical on every rank
    bound = reduction_tolerance(LOCAL_BATCH * nprocs, STEPS, max(w.abs().max().item() for w in one["weights"].values()))
    before = len(report.problems)
    for rank, r in enumerate(out):
        compare(report, f"rank {rank}, after {STEPS} steps", r["weights"], one["weights"], bound, "parameter")
    unchanged = {n: [rank for rank, r in enumerate(out) if torch.equal(r["weights"][n], start[n])] for n in names}
    if any(0 < len(u) < nprocs for u in unchanged.values()):
        n, u = next((n, u) for n, u in unchanged.items() if 0 < len(u) < nprocs)
        report.causes.append(f"{n} never changed on rank {u[0]} although another rank stepped it: after stepping its "
                             "shard each rank must broadcast the parameters it owns (dist.broadcast(p, src=owner))")
    elif any(len(u) == nprocs and holders[n] for n, u in unchanged.items()):
        n = next(n for n, u in unchanged.items() if len(u) == nprocs and holders[n])
        report.causes.append(f"{n} ended unchanged on every rank although rank {holders[n][0]} stepped it: its "
                             "broadcast came from a rank that did not step it. Broadcast each parameter from its "
                             "owner (src=owner), not from rank 0")
    if len(report.problems) > before and any(r["own_all_reduces"] > 0 for r in out):
        report.causes.append("the gradients arrive averaged already: step() needs no dist.all_reduce")
    for rank, r in enumerate(out[1:], start=1):
        differ = [n for n in names if not torch.equal(r["weights"][n], out[0]["weights"][n])]
        if differ and len(report.problems) == before:
            report.fail(f"rank {rank} and rank 0 hold different weights ({', '.join(differ[:3])})",
                        "every rank must leave step() with the owner's copy of every parameter")
    if len(report.problems) == before:
        report.ok(f"after {STEPS} AdamW steps every rank's weights equal one process's (bound {bound:.1e}), "
                  "identical on every rank")
    return report


def reference() -> Any:
    """A correct implementation (the grader's own test uses it; try yours first): the course's ``ShardedOptimizer``
    (``dtlab.parallel.zero``), constructed as the exercise's signature says."""
    from dtlab.parallel.zero import ShardedOptimizer

    return ShardedOptimizer
