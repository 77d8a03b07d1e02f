"""Exercise 14.parallel_linear: Megatron's column- and row-parallel linear layers, forward and backward.

Write two ``nn.Module`` classes and pass them as a pair:
``check("14.parallel_linear", (MyColumnParallelLinear, MyRowParallelLinear))``.

* ``MyColumnParallelLinear(full: nn.Linear, rank, world)`` keeps this rank's slice of the **output** features:
  rows ``rank * out/world ... (rank + 1) * out/world - 1`` of ``full.weight`` (``out x in``) and the same slice of
  ``full.bias``. ``forward(x)`` takes the whole input ``x`` (the same on every rank) and returns this rank's slice
  of ``full(x)`` along the last dimension. Its backward must give ``x`` its **whole** gradient: each rank's
  gradient covers only its rows of the weight, so the ranks' input gradients must be added — Megatron's *f*, an
  autograd function that is the identity forward and all-reduces the gradient backward.
* ``MyRowParallelLinear(full: nn.Linear, rank, world)`` keeps this rank's slice of the **input** features: columns
  ``rank * in/world ...`` of ``full.weight``, and the whole bias. ``forward(x_slice)`` takes this rank's slice of
  the input (what a column-parallel layer outputs: no communication between the two) and returns the **whole**
  ``full(x)`` on every rank: the ranks' partial products summed (Megatron's *g*: all-reduce forward, identity
  backward), the bias added once.

Keep the slices as parameters named ``weight`` and ``bias`` (as ``nn.Linear`` does): the grader compares their
gradients. Use the default process group (``dist.all_reduce(t)`` sums ``t`` in place over every rank).

What must hold (what the grader checks, on 2 processes by default): a ``Linear(3, 12) -> GELU -> Linear(12, 3)``
is split into your column layer, GELU, your row layer (12 hidden features divide by 2, 3 and 4 ranks; the 3
outer ones need not divide); a batch of shape (2, 4, 3) whose input requires its gradient goes forward, then
``(output * target).sum()`` backward. On every rank, compared with one process running the whole MLP (bound
stated: float32 rounding of sums over the 12 hidden features, or the 8 positions, in another order):

* each layer holds the right slice (shapes and values) of the full layer's weight and bias;
* the output equals the whole MLP's output;
* the input's gradient equals the whole MLP's;
* each layer's weight and bias gradients equal the matching slices of the whole MLP's gradients.

Hints: ``tensor.chunk(world, dim)[rank]`` (``.clone()`` it, then wrap in ``nn.Parameter``); an autograd function
is a class with two staticmethods, ``forward(ctx, x)`` and ``backward(ctx, grad)``, called as ``F.apply(x)``;
``dist.all_reduce`` works in place, so all-reduce a clone of what autograd gives you.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dtlab.exercises.grading import Rank, Report, compare, learner_error, run_ranks, signature_of
from dtlab.measure import reduction_tolerance

NPROCS = 2
D, HIDDEN, SHAPE = 3, 12, (2, 4, 3)   # HIDDEN must divide by the number of ranks


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, D))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)


def _slices(mlp: nn.Sequential, rank: int, n: int, grads: bool = False) -> dict[str, dict[str, torch.Tensor]]:
    """What each of your layers must hold on ``rank`` (or the gradients of it): the full layers' slices."""
    t = {name: getattr(p, "grad" if grads else "data") for name, p in mlp.named_parameters()}
    return {"column layer": {"weight": t["0.weight"].chunk(n, 0)[rank], "bias": t["0.bias"].chunk(n, 0)[rank]},
            "row layer": {"weight": t["2.weight"].chunk(n, 1)[rank], "bias": t["2.bias"]}}


def _cpu(t: Any) -> Any:
    return t.detach().cpu() if torch.is_tensor(t) else None


def _body(impl: Any, me: Rank) -> dict[str, Any]:
    column_cls, row_cls = impl
    mlp = _mlp().to(me.device)
    column = column_cls(copy.deepcopy(mlp[0]), me.rank, me.world)
    row = row_cls(copy.deepcopy(mlp[2]), me.rank, me.world)
    held = {name: {k: _cpu(getattr(layer, k, None)) for k in ("weight", "bias")}
            for name, layer in (("column layer", column), ("row layer", row))}
    expected = _slices(mlp, me.rank, me.world)
    if any(not torch.is_tensor(held[n][k]) or held[n][k].shape != expected[n][k].shape for n in held for k in held[n]):
        return {"held": held}                            # every rank stops here: the grader names the shapes
    x, target = (t.to(me.device) for t in _data())
    x.requires_grad_(True)
    with me.tracer.doing("the forward pass (your column layer, GELU, your row layer)"):
        hidden = column(x)
        try:
            out = row(F.gelu(hidden))
        except RuntimeError as exc:
            return {"held": held, "row_error": learner_error(exc)}
    calls = me.tracer.calls.get("all_reduce", 0)
    with me.tracer.doing("the backward pass (your layers' backward functions)"):
        (out * target).sum().backward()
    grads = {name: {k: _cpu(getattr(getattr(layer, k, None), "grad", None)) for k in ("weight", "bias")}
             for name, layer in (("column layer", column), ("row layer", row))}
    return {"held": held, "out": out.detach().cpu(), "x_grad": _cpu(x.grad), "grads": grads,
            "all_reduces": (calls, me.tracer.calls.get("all_reduce", 0) - calls)}


def _one_process(n: int) -> dict[str, Any]:
    """The whole MLP in one process: output, input gradient, parameter gradients, and the bound (n x eps x the
    largest sum of magnitudes of the terms any compared value adds up)."""
    mlp = _mlp()
    x, target = _data()
    x.requires_grad_(True)
    pre = mlp[0](x)
    h = F.gelu(pre)
    out = mlp[2](h)
    pre.retain_grad()
    (out * target).sum().backward()
    X, H, G, GP = (t.detach().reshape(-1, t.shape[-1]).abs() for t in (x, h, target, pre.grad))
    w1, w2 = mlp[0].weight.detach().abs(), mlp[2].weight.detach().abs()
    scale = max((H @ w2.T).max() + mlp[2].bias.abs().max(), (GP @ w1).max(), (GP.T @ X).max(), (G.T @ H).max(),
                GP.sum(0).max(), G.sum(0).max()).item()
    return {"out": out.detach(), "x_grad": x.grad, "params": [_slices(mlp, r, n) for r in range(n)],
            "grads": [_slices(mlp, r, n, grads=True) for r in range(n)], "bias": mlp[2].bias.detach(),
            "bound": reduction_tolerance(max(HIDDEN + 1, X.shape[0]), 1, scale)}


def _pair(impl: Any) -> tuple[Any, Any] | None:
    if isinstance(impl, (tuple, list)) and len(impl) == 2 and all(isinstance(c, type) for c in impl):
        return tuple(impl)
    return None


def grade(impl: Any, report: Report, nprocs: int = NPROCS, limit_s: float = 30.0) -> Report:
    """Grade ``impl`` = ``(MyColumnParallelLinear, MyRowParallelLinear)`` on ``nprocs`` processes into ``report``."""
    n = report.nprocs = nprocs
    if _pair(impl) is None:
        try:                                               # a lone stub still says "not attempted"
            if callable(impl):
                impl(nn.Linear(D, HIDDEN), 0, n)
        except NotImplementedError:
            report.attempted = False
            report.problems.append("Your code raised NotImplementedError: fill in the stub and run the cell again.")
            return report
        except Exception:
            pass
        report.fail("pass your two classes as a pair: check('14.parallel_linear', (MyColumnParallelLinear, "
                    f"MyRowParallelLinear)); got {type(impl).__name__}")
        return report
    if HIDDEN % n:
        report.fail(f"the grader's hidden layer has {HIDDEN} features, which do not divide over {n} ranks: grade on "
                    "2, 3 or 4 processes")
        return report
    out = run_ranks(report, _body, impl, nprocs=n, limit_s=limit_s)
    if out is None:
        return report
    ref = _one_process(n)
    bound = ref["bound"]
    for rank, r in enumerate(out):                       # 1. the slices each layer holds
        _check_held(report, rank, r["held"], ref["params"], n)
    if report.problems:
        return report
    for rank, r in enumerate(out):
        if "row_error" in r:
            report.fail(f"rank {rank}: your row layer's forward raised {r['row_error']}",
                        None if "shape" not in r["row_error"] else
                        f"{signature_of(impl[1])}.forward gets this rank's slice of the input features already "
                        f"({HIDDEN // n} of {HIDDEN}: what the column layer outputs); it must not split it again")
    if report.problems:
        return report
    outs = [r["out"] for r in out]                       # 2. the output
    for rank, got in enumerate(outs):
        compare(report, f"rank {rank}", {"output": got}, {"output": ref["out"]}, bound, "the")
    if report.problems:
        total = sum(outs)
        if all(o.shape == ref["out"].shape for o in outs):
            if (total - ref["out"]).abs().max() <= n * bound or (total - (n - 1) * ref["bias"] - ref["out"]).abs(
                    ).max() <= n * bound:
                report.causes.append("each rank's output is only its partial sum: the row layer must all-reduce "
                                     "the partial products in forward (g: all-reduce forward, identity backward)")
            elif (outs[0] - (n - 1) * ref["bias"] - ref["out"]).abs().max() <= n * bound:
                report.causes.append(f"the output is off by (N-1) x bias = {n - 1} x bias: bias added on every rank "
                                     "before the all-reduce is summed N times; add it once, after the sum")
    x_grads = [r["x_grad"] for r in out]                 # 3. the input's gradient
    for rank, g in enumerate(x_grads):
        compare(report, f"rank {rank}", {"gradient of the input": g}, {"gradient of the input": ref["x_grad"]},
                bound, "the")
    if any(g is not None and (g - ref["x_grad"]).abs().max() > bound for g in x_grads) and all(
            g is not None for g in x_grads) and (sum(x_grads) - ref["x_grad"]).abs().max() <= n * bound:
        report.causes.append("each rank's input gradient is only its part (the ranks' parts add up to the right "
                             "one): the column layer's input gradient must be all-reduced in backward (identity "
                             "forward, all-reduce backward: Megatron's f, a torch.autograd.Function)")
    for rank, r in enumerate(out):                       # 4. the parameters' gradients
        for layer, expected in ref["grads"][rank].items():
            compare(report, f"rank {rank}, {layer}", r["grads"][layer], expected, bound, "gradient of")
    if not report.problems:
        forward, backward = out[0]["all_reduces"]
        report.ok(f"each rank holds its 1/{n} of both layers (the column layer's rows, the row layer's columns and "
                  "whole bias)")
        report.ok(f"output and input gradient equal the whole MLP's on every rank, within {bound:.1e}")
        report.ok(f"every weight and bias gradient equals its slice of the whole MLP's, within {bound:.1e}")
        report.ok(f"{forward} all-reduce(s) in forward, {backward} in backward (Megatron: one each)")
    return report


def _check_held(report: Report, rank: int, held: dict, params: list[dict], n: int) -> None:
    """Shapes first (a split along the wrong dimension), then values (another rank's slice)."""
    wrong_dim = {"column layer": ("the column layer keeps a slice of the OUTPUT features: rows of weight "
                                  "(out x in) and the same slice of the bias"),
                 "row layer": "the row layer keeps a slice of the INPUT features: columns of weight; the bias whole"}
    for layer, expected in params[rank].items():
        for name, exp in expected.items():
            got = held[layer][name]
            if not torch.is_tensor(got):
                report.fail(f"rank {rank}, {layer}: no parameter named {name!r} (keep the slices as nn.Parameter "
                            "attributes weight and bias)")
            elif got.shape != exp.shape:
                report.fail(f"rank {rank}, {layer}: {name} has shape {tuple(got.shape)}, expected {tuple(exp.shape)} "
                            f"(1/{n} of the full layer's {name})", wrong_dim[layer])
            elif not torch.equal(got.float(), exp):
                other = [q for q in range(n) if torch.equal(got.float(), params[q][layer][name])]
                report.fail(f"rank {rank}, {layer}: {name} is not this rank's slice of the full layer's {name}"
                            + (f" (it is rank {other[0]}'s)" if other else ""),
                            "rank r keeps slice r: tensor.chunk(world, dim)[rank]" if other else None)


def reference() -> Any:
    """A correct pair (the grader's own test uses it; try yours first): the course's layers, given a ``TPGroup``."""
    from dtlab.parallel.tensor import ColumnParallelLinear, RowParallelLinear, TPGroup

    class Column(ColumnParallelLinear):
        def __init__(self, full: nn.Linear, rank: int, world: int):
            tp = TPGroup()
            assert (tp.rank, tp.size) == (rank, world)
            super().__init__(full, tp)

    class Row(RowParallelLinear):
        def __init__(self, full: nn.Linear, rank: int, world: int):
            tp = TPGroup()
            assert (tp.rank, tp.size) == (rank, world)
            super().__init__(full, tp)

    return Column, Row
