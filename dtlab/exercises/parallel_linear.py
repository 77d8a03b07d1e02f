"""Exercise 14.parallel_linear: Megatron's column- and row-parallel linear layers, forward and backward.

Write two ``nn.Module`` classes and pass them as a pair:
``check("14.parallel_linear", (MyColumnParallelLinear, MyRowParallelLinear))``.

* ``MyColumnParallelLinear(full: nn.Linear, rank, world)`` keeps this rank's slice of the **output** features:
  block ``rank`` of ``world`` equal blocks of ``full.weight``'s rows (``out x in``) and the same block of
  ``full.bias``. ``forward(x)`` takes the whole input ``x`` (the same on every rank) and returns this rank's slice
  of ``full(x)`` along the last dimension, computed without any communication. Its backward must give ``x`` its
  **whole** gradient: each rank's gradient covers only its rows of the weight, so the ranks' input gradients
  must be added — Megatron's *f*: the identity forward, an all-reduce of the gradient backward.
* ``MyRowParallelLinear(full: nn.Linear, rank, world)`` keeps this rank's slice of the **input** features: block
  ``rank`` of ``full.weight``'s columns, and the whole bias. ``forward(x_slice)`` takes this rank's slice of the
  input (what a column-parallel layer outputs: no communication between the two) and returns the **whole**
  ``full(x)`` on every rank: the ranks' partial products summed (Megatron's *g*: an all-reduce forward, the
  identity backward), the bias added once.

Keep the slices as parameters named ``weight`` and ``bias`` (as ``nn.Linear`` does): the grader compares their
gradients. Use the default process group. The course's own ``dtlab.parallel.tensor`` layers are what you are
rebuilding: code that runs them (or their autograd functions) is not graded as yours.

What must hold (what the grader checks, on 3, 2 and 4 processes; the hidden features divide by N, the outer
ones need not; every weight and input seeded, so a report names the case that failed and it fails the same way
again):

* N = 3: ``Linear(20, 48) -> GELU -> Linear(48, 12)`` split into your column layer, GELU, your row layer, on an
  input of shape (6, 20);
* N = 2: a residual block ``x + row(gelu(h1) + tanh(h2) / 2)`` where ``h1`` and ``h2`` are two calls of the same
  column layer ``Linear(16, 24)`` on the same ``x`` (shape (2, 5, 16)) before one backward: ``x`` is read three
  times, twice through your layer and once around it;
* N = 4: two column layers ``Linear(24, 32)`` reading the same ``x`` (shape (3, 4, 24)), their outputs combined
  into one row layer ``Linear(32, 10)``.

In each, ``(output * target).sum()`` goes backward. On every rank, compared with one process running the whole
layers in float64 (bound stated: float32 rounding of sums of that many terms, ``dtlab.measure``'s
``reduction_tolerance``):

* each layer holds the right slice (shapes and values) of its full layer's weight and bias;
* each call of the column layer returns this rank's slice of the full layer's output (shape and values);
* the row layer's output equals the whole output;
* the input's gradient equals the whole one, including what ``x``'s other uses contribute;
* each layer's weight and bias gradients equal the matching slices of the whole gradients (summed over both
  calls where the layer is called twice);
* communication, on each rank and for each layer (seen at the process group, whatever name it was called by):
  the column layer sends nothing in forward and exactly one all-reduce of the input's size per call in backward;
  the row layer exactly one all-reduce of the output's size in forward and nothing in backward. Gathering the
  slices and multiplying by whole matrices also gives the right numbers, but is not tensor parallelism.

Hints: which dimension of ``weight`` (``out x in``) holds the output features, and which the input ones? Each
rank keeps one contiguous block; make it the layer's own parameter rather than a view of ``full``'s. Autograd
does not know that the other ranks used ``x`` too: a small ``torch.autograd.Function`` lets you say what
backward does, and where you apply it decides which part of ``x``'s gradient it sees (only what flows into your
layer, or everything ``x`` receives?). For the row layer: each rank's product is one term of a sum; every rank
already holds the whole gradient of that sum, so what does each term's gradient need? Is a differentiable
all-reduce's backward that? And where must the bias go so that it is counted once?
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dtlab.exercises.grading import Case, Rank, Report, compare, grade_cases, learner_error, run_ranks, signature_of
from dtlab.measure import reduction_tolerance

NPROCS = 3
#: The cases, in the order they are graded. ``columns``: how many column layers (each from its own full layer);
#: ``calls``: which column layer each call applies to ``x`` (the first call's output goes through GELU, each
#: later one through tanh / 2, and their sum into the row layer); ``residual``: ``x`` is added to the output.
CASES = [
    Case("N = 3, Linear(20, 48) -> GELU -> Linear(48, 12), input of shape (6, 20)", 3,
         {"d_in": 20, "hidden": 48, "d_out": 12, "shape": (6, 20), "columns": 1, "calls": [0], "residual": False,
          "seed": 3}),
    Case("N = 2, x + row(gelu(h1) + tanh(h2) / 2) with h1 and h2 two calls of the same column layer Linear(16, 24) "
         "on the same x of shape (2, 5, 16), row layer Linear(24, 16)", 2,
         {"d_in": 16, "hidden": 24, "d_out": 16, "shape": (2, 5, 16), "columns": 1, "calls": [0, 0],
          "residual": True, "seed": 2}),
    Case("N = 4, two column layers Linear(24, 32) reading the same x of shape (3, 4, 24), row layer Linear(32, 10) "
         "on gelu(h1) + tanh(h2) / 2", 4,
         {"d_in": 24, "hidden": 32, "d_out": 10, "shape": (3, 4, 24), "columns": 2, "calls": [0, 1],
          "residual": False, "seed": 4}),
]

#: the grader's labels (``Tracer.doing``) and markers (``Tracer.mark``): which layer and pass sent what
BUILD, ROW_FORWARD, BACKWARD = "building your layers", "your row layer's forward", "the backward pass"
ROW_DONE, X_DONE = "the row layer's backward is done", "x's gradient is complete"


def _course() -> tuple:
    """The course's own tensor-parallel pieces: running any of them is not the learner's work."""
    from dtlab.parallel import tensor as tp

    return (tp.ColumnParallelLinear, tp.RowParallelLinear, tp.TPGroup, tp._CopyToParallel, tp._ReduceFromParallel,
            tp._GatherFromParallel, tp.copy_to_parallel, tp.reduce_from_parallel, tp.gather_from_parallel,
            tp.TensorParallelMLP)


# ---------------------------------------------------------------------------------------------- the graph

def _full_layers(p: dict) -> list[nn.Linear]:
    """The whole layers, the same on every rank: the column layers' full layers, then the row layer's."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(p["seed"])
        layers = [nn.Linear(p["d_in"], p["hidden"]) for _ in range(p["columns"])]
        return layers + [nn.Linear(p["hidden"], p["d_out"])]


def _data(p: dict) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + p["seed"])
    x = torch.randn(p["shape"], generator=g)
    return x, torch.randn(tuple(p["shape"][:-1]) + (p["d_out"],), generator=g)


def _combine(hs: list[torch.Tensor]) -> torch.Tensor:
    """What the row layer gets: gelu of the first call's output, plus tanh / 2 of each later one."""
    a = F.gelu(hs[0])
    for h in hs[1:]:
        a = a + torch.tanh(h) / 2
    return a


def _column_names(p: dict) -> list[str]:
    return ["column layer"] if p["columns"] == 1 else [f"column layer {k + 1}" for k in range(p["columns"])]


def _call_names(p: dict) -> list[str]:
    """How the report names each call of a column layer (and labels its forward)."""
    names, calls = _column_names(p), p["calls"]
    if len(calls) == 1:
        return ["your column layer"]
    if p["columns"] == 1:
        return [f"your column layer (call {k + 1} of {len(calls)})" for k in range(len(calls))]
    return [f"your {names[c]}" for c in calls]


def _forward_label(who: str) -> str:
    return f"{who}: forward"


def _cpu(t: Any) -> Any:
    return t.detach().cpu() if torch.is_tensor(t) else None


def _params_of(layer: Any) -> dict[str, Any]:
    return {k: _cpu(getattr(layer, k, None)) for k in ("weight", "bias")}


def _body(impl: Any, me: Rank, p: dict) -> dict[str, Any]:
    import torch.distributed as dist

    column_cls, row_cls = impl
    fulls = [layer.to(me.device) for layer in _full_layers(p)]
    with me.tracer.doing(BUILD):
        columns = [column_cls(copy.deepcopy(full), me.rank, me.world) for full in fulls[:-1]]
        row = row_cls(copy.deepcopy(fulls[-1]), me.rank, me.world)
    names = _column_names(p)
    held = {**{names[k]: _params_of(c) for k, c in enumerate(columns)}, "row layer": _params_of(row)}
    expected = _slices(fulls, me.rank, me.world, names)

    def agree(bad: bool) -> bool:                       # every rank stops at the same point, or none does
        flag = torch.tensor([1.0 if bad else 0.0], device=me.device)
        with me.tracer.quiet():
            dist.all_reduce(flag)
        return flag.item() > 0

    if agree(any(not torch.is_tensor(held[n][k]) or held[n][k].shape != expected[n][k].shape
                 for n in held for k in held[n])):
        return {"held": held}                            # the grader names the shapes
    x, target = (t.to(me.device) for t in _data(p))
    x.requires_grad_(True)
    hs = []
    for c, who in zip(p["calls"], _call_names(p)):
        with me.tracer.doing(_forward_label(who)):
            hs.append(columns[c](x))
    hidden = [_cpu(h) for h in hs]
    want = tuple(p["shape"][:-1]) + (p["hidden"] // me.world,)
    if agree(any(not torch.is_tensor(h) or tuple(h.shape) != want for h in hs)):
        return {"held": held, "hidden": hidden}
    a = _combine(hs)
    with me.tracer.doing(ROW_FORWARD):
        try:
            y = row(a)
        except RuntimeError as exc:
            return {"held": held, "hidden": hidden, "row_error": learner_error(exc)}
    if agree(not torch.is_tensor(y) or tuple(y.shape) != tuple(target.shape) or not y.requires_grad):
        return {"held": held, "hidden": hidden, "out": _cpu(y), "bad_out": True,
                "no_grad": torch.is_tensor(y) and not y.requires_grad}
    out = y + x if p["residual"] else y
    if a.requires_grad:                                  # markers between the layers' backward steps
        a.register_hook(lambda g: me.tracer.mark(ROW_DONE))
    x.register_hook(lambda g: me.tracer.mark(X_DONE))    # after any hook your layers put on x
    with me.tracer.doing(BACKWARD):
        (out * target).sum().backward()
    grads = {name: {k: _cpu(getattr(getattr(layer, k, None), "grad", None)) for k in ("weight", "bias")}
             for name, layer in zip(names + ["row layer"], columns + [row])}
    return {"held": held, "hidden": hidden, "out": _cpu(y), "x_grad": _cpu(x.grad), "grads": grads}


def _slices(fulls: list[nn.Linear], rank: int, n: int, names: list[str],
            grads: bool = False) -> dict[str, dict[str, torch.Tensor]]:
    """What each of your layers must hold on ``rank`` (or the gradients of it): the full layers' slices."""
    def get(layer: nn.Linear, k: str) -> torch.Tensor:
        t = getattr(layer, k)
        return (t.grad if grads else t).detach().cpu()

    out = {name: {"weight": get(full, "weight").chunk(n, 0)[rank], "bias": get(full, "bias").chunk(n, 0)[rank]}
           for name, full in zip(names, fulls[:-1])}
    out["row layer"] = {"weight": get(fulls[-1], "weight").chunk(n, 1)[rank], "bias": get(fulls[-1], "bias")}
    return out


def _one_process(p: dict, n: int) -> dict[str, Any]:
    """The whole layers in one process, in float64: every value compared, the parts of x's gradient (through the
    column layers, and around them), and the bound (n_terms x eps x the largest sum of magnitudes of the terms
    any compared value adds up)."""
    fulls = [layer.double() for layer in _full_layers(p)]
    names = _column_names(p)
    x, target = (t.double() for t in _data(p))
    x_in, x_around = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    hs = [fulls[c](x_in) for c in p["calls"]]
    for h in hs:
        h.retain_grad()
    a = _combine(hs)
    a.retain_grad()
    y = fulls[-1](a)
    ((y + x_around if p["residual"] else y) * target).sum().backward()
    around = x_around.grad if x_around.grad is not None else torch.zeros_like(x)
    X, A, G = (t.detach().abs().reshape(-1, t.shape[-1]) for t in (x, a, target))
    scales = [(A @ fulls[-1].weight.detach().abs().T).max() + fulls[-1].bias.detach().abs().max() + X.max(),
              (G.T @ A).max(), G.sum(0).max(), G.max()]
    x_grad_scale, col_w, col_b = 0.0, [0.0] * len(names), [0.0] * len(names)
    for c, h in zip(p["calls"], hs):
        w, b = fulls[c].weight.detach().abs(), fulls[c].bias.detach().abs()
        GP = h.grad.abs().reshape(-1, h.shape[-1])
        scales.append((X @ w.T).max() + b.max())
        x_grad_scale += float((GP @ w).max())
        col_w[c] += float((GP.T @ X).max())
        col_b[c] += float(GP.sum(0).max())
    scale = max([float(s) for s in scales] + [x_grad_scale + float(G.max()), *col_w, *col_b])
    rows, calls = math.prod(p["shape"][:-1]), len(p["calls"])
    terms = max(p["hidden"] * calls + 2, p["d_in"] + 1, rows * calls)
    return {"hidden": [h.detach().float() for h in hs], "out": y.detach().float(),
            "x_grad": (x_in.grad + around).float(), "through": x_in.grad.float(), "around": around.float(),
            "params": [_slices(fulls, r, n, names) for r in range(n)],
            "grads": [_slices(fulls, r, n, names, grads=True) for r in range(n)], "bias": fulls[-1].bias.detach(),
            "bound": 2 * reduction_tolerance(terms, 1, scale)}


# ---------------------------------------------------------------------------------------------- grading

def _pair(impl: Any) -> tuple[Any, Any] | None:
    if isinstance(impl, (tuple, list)) and len(impl) == 2 and all(isinstance(c, type) for c in impl):
        return tuple(impl)
    return None


def _construct_stub(impl: Any) -> None:
    impl(nn.Linear(4, 4), 0, 2)


def grade(impl: Any, report: Report, nprocs: int | None = None, limit_s: float = 30.0) -> Report:
    """Grade ``impl`` = ``(MyColumnParallelLinear, MyRowParallelLinear)`` on each case (those on ``nprocs``
    processes, if given)."""
    if _pair(impl) is None:
        if callable(impl):                                 # a lone stub still says "not attempted"
            from dtlab.exercises.grading import run_limited

            probe = Report(report.exercise, report.title)
            run_limited(probe, _construct_stub, impl, limit_s=min(limit_s, 10.0), what="constructing it")
            if not probe.attempted:
                report.attempted = False
                report.problems.extend(probe.problems)
                return report
        report.fail("pass your two classes as a pair: check('14.parallel_linear', (MyColumnParallelLinear, "
                    f"MyRowParallelLinear)); got {type(impl).__name__}")
        return report
    bounds: list[float] = []
    grade_cases(report, CASES, lambda case, rep: _grade_case(tuple(impl), case, rep, limit_s, bounds), nprocs)
    if report.passed:
        report.checks[:0] = [
            "each rank holds its 1/N of every layer (the column layers' rows, the row layer's columns and whole bias)",
            "each call of a column layer returns this rank's slice of the full layer's output; the row layer's "
            "output, the input's gradient (x also read twice by your layer, and around it) and every weight and "
            f"bias gradient equal the whole layers' on every rank, within float32 rounding (bounds "
            f"{min(bounds):.1e} to {max(bounds):.1e})",
            "on every rank, each call of a column layer sends nothing in forward and one all-reduce of the input's "
            "size in backward; the row layer one all-reduce of the output's size in forward, nothing in backward "
            "(seen at the process group)"]
    return report


def _grade_case(impl: tuple, case: Case, report: Report, limit_s: float, bounds: list[float]) -> None:
    n, p = case.nprocs, case.params
    out = run_ranks(report, _body, impl, p, nprocs=n, limit_s=limit_s, watched=_course())
    if out is None:
        return
    seen = list(dict.fromkeys(name for r in out for name in r["traffic"]["seen"]))
    if seen:
        layers = [s for s in seen if "ParallelLinear" in s] + [s for s in seen if "ParallelLinear" not in s]
        report.fail(f"your code runs the course's own {', '.join(s.rsplit('.', 1)[-1] for s in layers)} "
                    f"({layers[0].rsplit('.', 1)[0]}): the exercise is to write it",
                    "write your own layers and autograd functions (torch, torch.distributed and torch.nn are yours "
                    "to use; dtlab.parallel.tensor is the answer)")
        return
    ref = _one_process(p, n)
    bound = ref["bound"]
    for rank, r in enumerate(out):                       # 1. the slices each layer holds
        _check_held(report, rank, r["held"], ref["params"], n)
    if report.problems:
        return
    if not _check_hidden(report, impl, out, ref, p, n, bound):
        return
    for rank, r in enumerate(out):
        if "row_error" in r:
            report.fail(f"rank {rank}: your row layer's forward raised {r['row_error']}",
                        None if "shape" not in r["row_error"] and "size" not in r["row_error"] else
                        f"{signature_of(impl[1])}.forward gets this rank's slice of the input features already "
                        f"({p['hidden'] // n} of {p['hidden']}: what the column layer outputs); it must not split "
                        "it again")
    if report.problems:
        return
    _check_output(report, out, ref, n, bound)
    if any(r.get("bad_out") for r in out):
        return
    _check_traffic(report, out, p)                      # what moved: the likeliest explanation of what follows
    _check_x_grad(report, out, ref, p, n, bound)
    for rank, r in enumerate(out):                       # the parameters' gradients
        for layer, expected in ref["grads"][rank].items():
            compare(report, f"rank {rank}, {layer}", r["grads"][layer], expected, bound, "gradient of")
    bounds.append(bound)


def _check_held(report: Report, rank: int, held: dict, params: list[dict], n: int) -> None:
    """Shapes first (a split along the wrong dimension), then values (another rank's slice)."""
    for layer, expected in params[rank].items():
        what = ("the row layer keeps a slice of the INPUT features: columns of weight; the bias whole"
                if layer == "row layer" else
                "the column layer keeps a slice of the OUTPUT features: rows of weight (out x in) and the same "
                "slice of the bias")
        for name, exp in expected.items():
            got = held[layer][name]
            if not torch.is_tensor(got):
                report.fail(f"rank {rank}, {layer}: no parameter named {name!r} (keep the slices as nn.Parameter "
                            "attributes weight and bias)")
            elif got.shape != exp.shape:
                whole = layer == "row layer" and name == "bias"
                report.fail(f"rank {rank}, {layer}: {name} has shape {tuple(got.shape)}, expected {tuple(exp.shape)} "
                            + ("(the whole bias)" if whole else f"(1/{n} of the full layer's {name})"), what)
            elif not torch.equal(got.float(), exp):
                other = [q for q in range(n) if torch.equal(got.float(), params[q][layer][name])]
                report.fail(f"rank {rank}, {layer}: {name} is not this rank's slice of the full layer's {name}"
                            + (f" (it is rank {other[0]}'s)" if other else ""),
                            "rank r keeps block r of the N equal blocks" if other else None)


def _check_hidden(report: Report, impl: tuple, out: list[dict], ref: dict, p: dict, n: int, bound: float) -> bool:
    """Each call of a column layer returns this rank's slice of the full layer's output: shape, then values."""
    names, width = _call_names(p), p["hidden"] // n
    for rank, r in enumerate(out):
        for k, got in enumerate(r.get("hidden") or []):
            whole = ref["hidden"][k]
            exp = whole.chunk(n, -1)[rank]
            where = f"rank {rank}, {names[k]}"
            if not torch.is_tensor(got):
                report.fail(f"{where} returned no tensor")
            elif tuple(got.shape) != tuple(exp.shape):
                report.fail(f"{where} returned shape {tuple(got.shape)}, expected {tuple(exp.shape)}: this rank's "
                            f"{width} of the {p['hidden']} output features",
                            "the column layer returns its own slice (no gathering): the row layer takes it as it is"
                            if got.shape[-1:] == whole.shape[-1:] else None)
            else:
                d = (got.float() - exp).abs().max().item()
                if not d <= bound:
                    other = [q for q in range(n) if (got.float() - whole.chunk(n, -1)[q]).abs().max() <= bound]
                    report.fail(f"{where}'s output differs from this rank's slice of the full layer's output by "
                                f"{d:.2e} (bound {bound:.1e})" + (f"; it is rank {other[0]}'s slice" if other else ""))
    return not report.problems


def _check_output(report: Report, out: list[dict], ref: dict, n: int, bound: float) -> None:
    """The row layer's output, on every rank: the whole output (before the residual, where there is one)."""
    outs, expected = [r.get("out") for r in out], ref["out"]
    for rank, (r, got) in enumerate(zip(out, outs)):
        if not torch.is_tensor(got):
            report.fail(f"rank {rank}: your row layer returned no tensor")
        elif got.shape != expected.shape:
            report.fail(f"rank {rank}: your row layer's output has shape {tuple(got.shape)}, expected "
                        f"{tuple(expected.shape)} (the whole output, on every rank)")
        elif r.get("no_grad"):
            report.fail(f"rank {rank}: your row layer's output does not require grad: the graph to your layers' "
                        "weights is cut (a detach, .data or torch.no_grad?)")
        else:
            compare(report, f"rank {rank}", {"output": got}, {"output": expected}, bound, "the")
    if report.problems and all(torch.is_tensor(o) and o.shape == expected.shape for o in outs):
        total, bias = sum(outs), ref["bias"].float()
        if (total - expected).abs().max() <= n * bound or (total - (n - 1) * bias - expected).abs().max() <= n * bound:
            report.causes.append("each rank's output is only its partial sum: the row layer must all-reduce the "
                                 "partial products in forward (g: all-reduce forward, identity backward)")
        elif (outs[0] - (n - 1) * bias - expected).abs().max() <= n * bound:
            report.causes.append(f"the output is off by (N-1) x bias = {n - 1} x bias: bias added on every rank "
                                 "before the all-reduce is summed N times; add it once, after the sum")


def _fit(got: torch.Tensor, through: torch.Tensor, around: torch.Tensor) -> tuple[float, float, float]:
    """got ~ a x through + b x around (least squares): (a, b, the largest residual)."""
    t, o, g = (v.double().flatten() for v in (through, around, got))
    if float(o.abs().max()) == 0.0:
        a = float((g @ t) / (t @ t)) if float(t @ t) > 0 else 0.0
        return a, 0.0, float((g - a * t).abs().max())
    m = torch.stack([t, o], 1)
    coef = torch.linalg.lstsq(m, g.unsqueeze(1)).solution.flatten()
    a, b = float(coef[0]), float(coef[1])
    return a, b, float((g - a * t - b * o).abs().max())


def _check_x_grad(report: Report, out: list[dict], ref: dict, p: dict, n: int, bound: float) -> None:
    x_grads = [r.get("x_grad") for r in out]
    before = len(report.problems)
    for rank, g in enumerate(x_grads):
        compare(report, f"rank {rank}", {"gradient of the input": g}, {"gradient of the input": ref["x_grad"]},
                bound, "the")
    if len(report.problems) == before or any(g is None or g.shape != ref["x_grad"].shape for g in x_grads):
        return
    through, around = ref["through"], ref["around"]
    if (sum(x_grads) - through - n * around).abs().max() <= n * bound:
        report.causes.append("each rank's input gradient is only its part (the ranks' parts add up to the right "
                             "one): the column layer's input gradient must be all-reduced in backward (identity "
                             "forward, all-reduce backward: Megatron's f, a torch.autograd.Function)")
        return
    a, b, left = _fit(x_grads[0], through, around)
    if left > 10 * bound:
        return
    parts = f"{a:.3g} x the part that flows through your column layer" + (
        f" + {b:.3g} x the part from x's other use (the residual)" if p["residual"] else "")
    report.fail(f"rank 0: x's gradient is {parts}; expected 1 x" + (" + 1 x" if p["residual"] else ""))
    if p["residual"] and abs(b - 1) > 0.05:
        report.causes.append(
            "your all-reduce summed x's whole gradient, accumulated over all its uses: the residual's part is "
            "already whole on every rank, so it came out summed N times" + (
                ", and with your layer called twice it was all-reduced twice" if abs(a - 1) > 0.05 else "")
            + ". A hook on x, or on the gradient autograd accumulates for x, sees everything x receives; all-reduce "
            "only the gradient that flows into your layer, from inside it (an autograd Function applied to x in "
            "forward gets exactly that part)")
    elif len(p["calls"]) > 1 and abs(a - n) < 0.05 * n:
        report.causes.append(
            f"x is read by {len(p['calls'])} column-layer calls and its gradient came out N times too large: the "
            "all-reduce ran on x's whole, accumulated gradient once per call (a hook on x per forward?), so it was "
            "summed over the ranks twice; each call must all-reduce only its own part, from inside your layer (an "
            "autograd Function applied to x in forward)")
    elif abs(a - n) < 0.05 * n:
        report.causes.append("x's gradient is N times too large: it was summed over the ranks once too often (the "
                             "row layer's backward must not all-reduce: every rank already holds the whole gradient)")


# ---------------------------------------------------------------------------------------------- communication

def _moved(entries: list[dict]) -> str:
    parts = []
    for e in entries:
        size = f"{e['sent']} elements" + (f", received {e['received']}" if e["received"] != e["sent"] else "")
        parts.append(f"dist.{e['op']}({size}" + (f", at {e['line']}" if e["line"] else "") + ")")
    return ", ".join(parts) if parts else "nothing"


def _regions(log: list[dict]) -> dict[str, list[dict]]:
    """This rank's communication, per layer and pass: each forward by its label; the backward pass cut by the
    grader's markers into the row layer's backward, the column layer calls' backward, and what came after x's
    gradient was complete. Communication while your layers were built is not counted."""
    regions: dict[str, list[dict]] = {ROW_FORWARD: [], "row backward": [], "column backward": [], "after": []}
    part = "row backward"
    for e in log:
        if e["op"] == "mark":
            part = {ROW_DONE: "column backward", X_DONE: "after"}.get(e["label"], part)
        elif e["label"] == BACKWARD:
            regions[part].append(e)
        elif e["label"] not in (BUILD, ""):
            regions.setdefault(e["label"], []).append(e)
    return regions


def _check_traffic(report: Report, out: list[dict], p: dict) -> None:
    """Per rank and per layer: each column layer call sends nothing forward and one all-reduce of x's size
    backward; the row layer one all-reduce of the output's size forward and nothing backward. The same problem
    on several ranks is reported once, naming them."""
    x_numel, out_numel = math.prod(p["shape"]), math.prod(p["shape"][:-1]) * p["d_out"]
    calls, forwards = len(p["calls"]), [_forward_label(who) for who in _call_names(p)]
    column = ("your column layer's backward" if calls == 1 else
              f"the backward of your column layer's {calls} calls" if p["columns"] == 1 else
              f"the backward of your {calls} column layers")
    found: dict[tuple[str, str | None], list[int]] = {}

    def problem(rank: int, text: str, cause: str | None = None) -> None:
        found.setdefault((text, cause), []).append(rank)

    for rank, r in enumerate(out):
        regions = _regions(r["traffic"]["log"])
        for label in forwards:
            if regions.get(label):
                problem(rank, f"{label}: {_moved(regions[label])}; a column layer sends nothing in forward",
                        "each rank computes its slice of the output from the whole input it already has: "
                        "gathering the slices (or the weight) and multiplying by the whole matrix is one process's "
                        "work, moved around")
        entries = regions[ROW_FORWARD]
        if not (len(entries) == 1 and entries[0]["op"] == "all_reduce" and entries[0]["sent"] == out_numel):
            problem(rank, f"{ROW_FORWARD}: {_moved(entries)}; expected exactly one dist.all_reduce of the output's "
                    f"{out_numel} elements",
                    "the row layer's N partial products are summed by one all-reduce of the output (g); gathering "
                    "the input slices and multiplying by the whole weight moves what tensor parallelism keeps apart"
                    if any(e["op"] != "all_reduce" for e in entries) else None)
        entries = regions["row backward"]
        if entries:
            whole = any(e["op"] == "all_reduce" and e["sent"] == out_numel for e in entries)
            problem(rank, f"your row layer's backward: {_moved(entries)}; expected nothing (g is the identity in "
                    "backward)",
                    "your row layer's all-reduce also runs in backward, on the output's gradient (a differentiable "
                    "all-reduce such as torch.distributed.nn.functional.all_reduce sums its output's gradient over "
                    "the ranks); every rank already holds the whole gradient of the replicated output, so that "
                    "makes it N times too large: g's backward returns the gradient as it is" if whole else
                    "nothing in the row layer's backward needs the other ranks: the output's gradient is already "
                    "whole on every rank, so is the bias's gradient (summed from it), and each weight slice's "
                    "gradient is its own")
        entries = regions["column backward"]
        if not (len(entries) == calls and all(e["op"] == "all_reduce" and e["sent"] == x_numel for e in entries)):
            problem(rank, f"{column}: {_moved(entries)}; expected exactly {calls} dist.all_reduce of the input "
                    f"gradient's {x_numel} elements" + (" (one per call)" if calls > 1 else ""),
                    "in backward a column layer sums only x's gradient over the ranks (f), once per call; each "
                    "rank's weight and bias slices get their own gradients, which must not be summed, and nothing "
                    "needs gathering" if entries else None)
        if regions["after"]:
            problem(rank, f"the backward pass, after x's gradient was complete: {_moved(regions['after'])}; "
                    "expected nothing")
    for (text, cause), ranks in found.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        report.fail(f"{who}, {text}", cause)


def reference() -> Any:
    """A correct pair (the grader's own test uses it; try yours first)."""
    import torch.distributed as dist

    class CopyToParallelRegion(torch.autograd.Function):      # Megatron's f
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            grad = grad.clone()
            dist.all_reduce(grad)                  # each rank's part covers only its rows of the weight: add them
            return grad

    class ReduceFromParallelRegion(torch.autograd.Function):  # Megatron's g
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            x = x.clone()
            dist.all_reduce(x)                     # the sum of the N partial products
            return x

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return grad                            # the sum's gradient is every partial product's gradient

    class MyColumnParallelLinear(nn.Module):
        def __init__(self, full: nn.Linear, rank: int, world: int):
            super().__init__()
            self.weight = nn.Parameter(full.weight.detach().chunk(world, 0)[rank].clone())
            self.bias = nn.Parameter(full.bias.detach().chunk(world, 0)[rank].clone())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.linear(CopyToParallelRegion.apply(x), self.weight, self.bias)

    class MyRowParallelLinear(nn.Module):
        def __init__(self, full: nn.Linear, rank: int, world: int):
            super().__init__()
            self.weight = nn.Parameter(full.weight.detach().chunk(world, 1)[rank].clone())
            self.bias = nn.Parameter(full.bias.detach().clone())

        def forward(self, x_slice: torch.Tensor) -> torch.Tensor:
            return ReduceFromParallelRegion.apply(F.linear(x_slice, self.weight)) + self.bias

    return MyColumnParallelLinear, MyRowParallelLinear
