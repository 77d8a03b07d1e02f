"""Exercise 12.fsdp_unit: FSDP's three operations on one flat parameter — shard, gather, reduce-scatter the gradient.

FSDP keeps one N-th of every layer's parameters on each rank. Write the three functions it is made of, for a
layer whose weight and bias are flattened into one 1-D tensor of ``numel`` elements (FSDP's "flat parameter"),
and pass them as a tuple, in this order: ``check("12.fsdp_unit", (shard, gather, reduce_grad))`` (the names are
yours: notebook 12 calls them ``shard_flat``, ``gather_flat`` and ``reduce_grad``).

* ``shard(flat, rank, world) -> Tensor``: rank ``rank``'s piece of the 1-D tensor ``flat``. Every rank holds
  the same number of elements, ``ceil(numel / world)``: pad ``flat`` with zeros at the end to a multiple of
  ``world`` first, and rank r keeps elements ``r * chunk ... (r + 1) * chunk - 1``. No communication.
* ``gather(piece, numel) -> Tensor``: every rank's piece, all-gathered into the full 1-D tensor of ``numel``
  elements (the padding removed). A collective: every rank calls it.
* ``reduce_grad(full_grad) -> Tensor``: ``full_grad`` is this rank's gradient of the whole flat parameter
  (``numel`` elements, from its own micro-batch); return this rank's piece (``ceil(numel / world)`` elements)
  of the gradient **averaged** over the ranks, with a reduce-scatter. A collective too.

``gather`` and ``reduce_grad`` use the default process group (``dist.get_rank()``, ``dist.get_world_size()``);
tensors stay on the device they came on (CPU with gloo, the rank's GPU with nccl).

What must hold (what the grader checks, on 3 processes by default): the grader owns a tiny FSDP around a
``Linear(6, 7) -> Tanh -> Linear(7, 5)``: each linear layer is one unit whose flat parameter (weight then bias:
49 and 40 elements, neither divisible by 3) is cut by your ``shard``; a rank holds only its pieces; before a
layer runs forward, your ``gather`` gives it its full parameter, freed right after; backward gathers it again;
the layer's full gradient goes through your ``reduce_grad``, and SGD steps the piece. Then:

* ``shard`` (checked first, in the notebook's own process: it needs no communication): every rank's piece is
  exactly its ``ceil(numel/N)`` elements of the zero-padded flat parameter;
* ``gather`` returns ``numel`` elements: the parameter, without the padding;
* ``reduce_grad`` returns this rank's piece of the average of the ranks' gradients: at the first step, equal
  within float32 rounding (the bound is stated) to the gradient one process computes on the whole batch;
* after 3 steps every rank's pieces, and the parameters your ``gather`` assembles, equal one process's training
  on the whole batch (within ``dtlab.measure.reduction_tolerance``);
* ``reduce_grad`` does not all-reduce: every rank would receive the whole gradient to keep 1/N of it.

Hints: ``math.ceil``, ``torch.nn.functional.pad`` or ``torch.zeros`` + a copy; the collectives that fill one
tensor from equal pieces are ``dist.all_gather_into_tensor(out, piece)`` and ``dist.reduce_scatter_tensor(out,
padded)`` (torch 2.13 also names them ``all_gather_single`` and ``reduce_scatter_single``; ``dtlab.distributed``
gives both names on every torch). They work on gloo and nccl alike on torch 2.3 and later; the list form
``dist.reduce_scatter`` does not exist on gloo before torch 2.6. ``ReduceOp.AVG`` is not portable either (gloo
refuses it, or sums silently, before torch 2.13): reduce with the default sum and divide.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dtlab.exercises.grading import Rank, Report, compare, learner_error, run_ranks, scale_of
from dtlab.measure import reduction_tolerance

NPROCS = 3
#: The model: two linear units of 7 x (6 + 1) = 49 and 5 x (7 + 1) = 40 parameters (neither divides by 3).
SIZES = [(6, 7), (7, 5)]
STEPS, LR, PER_RANK = 3, 0.1, 4
NAMES = ("shard", "gather", "reduce_grad")


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(*SIZES[0]), nn.Tanh(), nn.Linear(*SIZES[1]))


def _units(model: nn.Sequential) -> list[tuple[str, nn.Linear]]:
    return [(f"layer {i} (Linear({m.in_features}, {m.out_features}): {m.out_features * (m.in_features + 1)} "
             "parameters)", m) for i, m in enumerate(model) if isinstance(m, nn.Linear)]


def _flat(layer: nn.Linear, grad: bool = False) -> torch.Tensor:
    w, b = (layer.weight.grad, layer.bias.grad) if grad else (layer.weight, layer.bias)
    return torch.cat([w.detach().reshape(-1), b.detach()])


def _batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(PER_RANK * world, SIZES[0][0], generator=g), torch.randn(PER_RANK * world, SIZES[1][1],
                                                                                 generator=g)


def _pieces(flat: torch.Tensor, world: int) -> torch.Tensor:
    """The grader's own cut: (world, chunk), zero-padded."""
    chunk = math.ceil(flat.numel() / world)
    return F.pad(flat, (0, chunk * world - flat.numel())).view(world, chunk)


def _three(impl: Any) -> tuple[Any, Any, Any] | None:
    if isinstance(impl, (tuple, list)) and len(impl) == 3:
        return tuple(impl)
    if all(hasattr(impl, n) for n in NAMES):
        return tuple(getattr(impl, n) for n in NAMES)
    return None


class _Unit:
    """One linear layer under the grader's FSDP: it keeps ``piece``; your gather fills it in for each use."""

    def __init__(self, name: str, layer: nn.Linear, fns: tuple, me: Rank, problems: dict[str, tuple]):
        self.name, self.layer, self.me, self.problems = name, layer, me, problems
        self.shard, self.gather, self.reduce_grad = fns
        flat = _flat(layer).to(me.device)
        self.numel, self.chunk, self.n_weight = flat.numel(), math.ceil(flat.numel() / me.world), layer.weight.numel()
        self.piece = self.shard(flat, me.rank, me.world).detach().clone()    # all this rank keeps between uses
        self.full: torch.Tensor | None = None
        self.first: torch.Tensor | None = None                               # your gather's first result
        del layer.weight, layer.bias
        layer.register_forward_pre_hook(self._before)
        layer.register_forward_hook(self._after)

    def _sized(self, t: torch.Tensor, n: int, what: str, cause: str | None) -> torch.Tensor:
        t = t.detach().reshape(-1)
        if t.numel() != n:
            holds = "the parameter has" if what == "gather" else "this rank's piece has"
            self.problems.setdefault(f"{what} {self.name}", (
                f"{self.name}: {what} returned {t.numel()} elements; {holds} {n} (each of "
                f"{self.me.world} ranks holds {self.chunk})", cause if t.numel() > n else None))
            t = F.pad(t, (0, max(0, n - t.numel())))[:n]   # carry on with the right size, to check the rest
        return t

    def _gather(self, when: str) -> torch.Tensor:
        with self.me.tracer.doing(f"{self.name}, {when}: your gather of its parameter"):
            full = self.gather(self.piece.detach(), self.numel)
        full = self._sized(full, self.numel, "gather", "the gathered tensor still holds the padding: keep its "
                           "first numel elements (full[:numel])")
        if self.first is None:
            self.first = full.cpu().clone()
        return full

    def _before(self, layer: nn.Linear, args: tuple) -> None:
        self.full = self._gather("forward").clone().requires_grad_()
        layer.weight = self.full[:self.n_weight].view(layer.out_features, layer.in_features)
        layer.bias = self.full[self.n_weight:]

    def _after(self, layer: nn.Linear, args: tuple, out: torch.Tensor) -> None:
        self.full.untyped_storage().resize_(0)            # freed: backward gathers it again
        out.register_hook(lambda grad: self._regather())

    def _regather(self) -> None:
        again = self._gather("backward")
        self.full.untyped_storage().resize_(self.numel * self.full.element_size())
        self.full.data.copy_(again)

    def step(self) -> torch.Tensor:
        """Reduce-scatter the full gradient with your reduce_grad, SGD-step the piece; return the averaged piece."""
        with self.me.tracer.doing(f"{self.name}: your reduce_grad of its gradient"):
            grad = self.reduce_grad(self.full.grad.detach().clone())
        grad = self._sized(grad, self.chunk, "reduce_grad", "reduce_grad returns only this rank's piece of the "
                           "averaged gradient (the reduce-scatter's output), ceil(numel/N) elements")
        self.piece -= LR * grad
        self.full.untyped_storage().resize_(0)
        self.full = None
        return grad.cpu()


def _body(impl: Any, me: Rank) -> dict[str, Any]:
    problems: dict[str, tuple] = {}
    model = _model().to(me.device)
    units = [_Unit(name, layer, _three(impl), me, problems) for name, layer in _units(model)]
    first_grads, all_reduced = [], {"calls": 0, "elements": 0}
    for step in range(STEPS):
        x, y = (t[me.rank * PER_RANK:(me.rank + 1) * PER_RANK].to(me.device) for t in _batch(step, me.world))
        F.mse_loss(model(x), y).backward()
        before = (me.tracer.calls.get("all_reduce", 0), me.tracer.elements.get("all_reduce", 0))
        grads = [u.step() for u in reversed(units)][::-1]           # last layer first, as backward finishes
        all_reduced["calls"] += me.tracer.calls.get("all_reduce", 0) - before[0]
        all_reduced["elements"] += me.tracer.elements.get("all_reduce", 0) - before[1]
        first_grads = first_grads or grads
    gathered = [u._gather("after training") for u in units]
    return {"pieces": [u.piece.cpu() for u in units], "first_grads": first_grads,
            "gathered": [g.cpu() for g in gathered], "problems": list(problems.values()), "all_reduced": all_reduced,
            "first_gathered": [u.first for u in units]}


def _one_process(world: int) -> dict[str, Any]:
    """One process, the whole batch: the flat parameters after STEPS steps, the first step's gradients and the
    bound on those (n x eps x the sum of the per-sample terms' magnitudes)."""
    model = _model()
    units = [m for _, m in _units(model)]
    initial = [_flat(u).clone() for u in units]
    x, y = _batch(0, world)
    magnitude = [torch.zeros_like(_flat(u)) for u in units]
    for i in range(len(x)):                                   # per sample: the terms the gradient sums
        model.zero_grad()
        ((model(x[i:i + 1]) - y[i:i + 1]) ** 2).sum().div(y.numel()).backward()
        magnitude = [m + _flat(u, grad=True).abs() for m, u in zip(magnitude, units)]
    grads = None
    for step in range(STEPS):
        model.zero_grad()
        F.mse_loss(model(_batch(step, world)[0]), _batch(step, world)[1]).backward()
        grads = grads or [_flat(u, grad=True) for u in units]
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    flats = [_flat(u) for u in units]
    return {"flats": flats, "grads": grads, "initial": initial,
            "grad_bound": reduction_tolerance(len(x), 1, max(m.max().item() for m in magnitude)),
            "bound": reduction_tolerance(len(x), STEPS, max(f.abs().max().item() for f in flats))}


def _check_shard(shard: Any, report: Report, n: int) -> bool:
    """Run ``shard`` here for every rank and unit (it needs no communication); False after a failure."""
    for name, layer in _units(_model()):
        flat = _flat(layer)
        expected = _pieces(flat, n)
        numel, c = flat.numel(), expected.shape[1]
        for r in range(n):
            call = f"shard(flat, rank={r}, world={n}) for {name}"
            try:
                got = shard(flat.clone(), r, n)
            except NotImplementedError as exc:
                report.attempted = False
                report.problems.append(f"Your code raised NotImplementedError ({exc}): fill in the stub and run the "
                                       "cell again.")
                return False
            except Exception as exc:
                report.fail(f"{call} raised {learner_error(exc)}")
                return False
            if not torch.is_tensor(got) or tuple(got.shape) != (c,):
                short = torch.is_tensor(got) and got.numel() < c
                report.fail(f"{call} gave {tuple(got.shape) if torch.is_tensor(got) else type(got).__name__}; every "
                            f"rank must hold a 1-D piece of ceil({numel}/{n}) = {c} elements",
                            f"the pieces are not padded: {numel} elements do not divide by {n}, so pad the flat "
                            f"parameter with zeros to {n} x {c} = {n * c} before cutting it (tensor_split and chunk "
                            "give unequal pieces; all-gather and reduce-scatter need equal ones)" if short else None)
                return False
            got = got.detach().float()
            if not torch.equal(got, expected[r]):
                other = [q for q in range(n) if torch.equal(got, expected[q])]
                real = max(0, min(c, numel - r * c))                      # elements of piece r that are not padding
                report.fail(f"{call}: the piece differs from elements {r * c}-{(r + 1) * c - 1} of the zero-padded "
                            f"flat parameter by {(got - expected[r]).abs().max().item():.2e}"
                            + (f"; it is rank {other[0]}'s piece" if other else ""),
                            f"a rank takes another rank's piece: rank r keeps piece r (rank {r}: elements {r * c} to "
                            f"{(r + 1) * c - 1})" if other else "the padding must be zeros (torch.zeros or F.pad), not "
                            "uninitialised memory" if torch.equal(got[:real], expected[r][:real]) else None)
                return False
    report.ok(f"shard: every rank's piece is its ceil(numel/{n}) elements of the zero-padded flat parameter "
              f"({', '.join(f'{_pieces(_flat(m), n).shape[1]} of {name}' for name, m in _units(_model()))})")
    return True


def grade(impl: Any, report: Report, nprocs: int = NPROCS, limit_s: float = 30.0) -> Report:
    """Grade ``impl`` = ``(shard, gather, reduce_grad)`` on ``nprocs`` processes into ``report``."""
    n, fns = nprocs, _three(impl)
    report.nprocs = n
    if fns is None:
        probe = Report(report.exercise, report.title)       # a lone stub is still "not attempted"
        if callable(impl):
            _check_shard(impl, probe, n)
        if not probe.attempted:
            report.attempted, report.problems = False, probe.problems
            return report
        report.fail(f"pass your three functions as one tuple: check('12.fsdp_unit', (shard, gather, reduce_grad)); "
                    f"got {type(impl).__name__}")
        return report
    if not _check_shard(fns[0], report, n):
        return report
    out = run_ranks(report, _body, impl, nprocs=n, limit_s=limit_s)
    if out is None:
        return report
    ref = _one_process(n)
    names = [name for name, _ in _units(_model())]
    _by_ranks(report, [r["problems"] for r in out])
    for k, name in enumerate(names):                        # your gather, at the first forward
        worst = max((r["first_gathered"][k] - ref["initial"][k]).abs().max().item() for r in out)
        if worst > 0:
            report.fail(f"{name}: at the first forward your gather gave a parameter that differs from the one the "
                        f"ranks sharded by {worst:.2e} (it must be exact: the pieces in rank order, padding cut)")
    if report.problems:
        return report
    pieces_of = [_pieces(g, n) for g in ref["grads"]]
    padded = sum(p.numel() for p in pieces_of) * STEPS
    _by_ranks(report, [[_all_reduced(r["all_reduced"], padded)] if r["all_reduced"]["calls"] else [] for r in out],
              ": ")
    for k, name in enumerate(names):                        # your reduce_grad, at the first step
        got = [r["first_grads"][k] for r in out]
        bad = [rank for rank in range(n) if (got[rank] - pieces_of[k][rank]).abs().max().item() > ref["grad_bound"]]
        if bad:
            worst = max((got[rank] - pieces_of[k][rank]).abs().max().item() for rank in bad)
            report.fail(f"{_ranks(bad)}, {name}: at step 1 reduce_grad returned a piece that differs from the same "
                        f"piece of one process's gradient on the whole batch by up to {worst:.2e} (bound "
                        f"{ref['grad_bound']:.1e})", _cause(got, pieces_of[k], bad, ref["grad_bound"]))
    if report.problems:
        return report
    for rank, r in enumerate(out):                          # after STEPS steps
        compare(report, f"rank {rank}, after {STEPS} steps", dict(zip(names, r["pieces"])),
                {name: p[rank] for name, p in zip(names, (_pieces(f, n) for f in ref["flats"]))}, ref["bound"],
                "piece of")
        compare(report, f"rank {rank}, your gather after {STEPS} steps", dict(zip(names, r["gathered"])),
                dict(zip(names, ref["flats"])), ref["bound"], "parameter of")
    if not report.problems:
        report.ok(f"gather: the exact parameter ({' and '.join(str(f.numel()) for f in ref['flats'])} elements) on "
                  "every rank, the padding removed")
        report.ok(f"reduce_grad: at step 1 each rank's piece of the averaged gradient is one process's gradient "
                  f"on the whole batch, within {ref['grad_bound']:.1e}; no all-reduce")
        report.ok(f"after {STEPS} SGD steps every rank's pieces and gathered parameters equal one process's "
                  f"within {ref['bound']:.1e}")
    return report


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _by_ranks(report: Report, per_rank: list[list[tuple[str, str | None]]], sep: str = ", ") -> None:
    """Report each (problem, cause) once, naming the ranks that had it."""
    seen: dict[tuple[str, str | None], list[int]] = {}
    for rank, problems in enumerate(per_rank):
        for problem in problems:
            seen.setdefault(tuple(problem), []).append(rank)
    for (problem, cause), ranks in seen.items():
        report.fail(f"{_ranks(ranks)}{sep}{problem}", cause)


def _all_reduced(counted: dict[str, int], padded: int) -> tuple[str, str]:
    calls, elements = counted["calls"], counted["elements"]
    factor = 2 * elements / padded        # on a ring: all-reduce 2(N-1)/N x E per rank, reduce-scatter (N-1)/N x P
    return (f"reduce_grad called dist.all_reduce ({calls}x, {elements} elements in {STEPS} steps): an all-reduce "
            f"where a reduce-scatter is needed: every rank receives the whole gradient and keeps 1/N of it "
            f"({factor:.1f}x the traffic of a reduce-scatter's: on a ring an all-reduce sends 2(N-1)/N x {elements} "
            f"elements per rank, a reduce-scatter of the padded gradients (N-1)/N x {padded})",
            "reduce-scatter the padded gradient (dist.reduce_scatter_tensor(piece, padded)), then divide by N")


def _cause(got: list[torch.Tensor], pieces: torch.Tensor, bad: list[int], bound: float) -> str | None:
    n = len(pieces)
    c = scale_of(torch.cat([got[r] for r in bad]), torch.cat([pieces[r] for r in bad]))
    if abs(c - n) < 0.02 * n:
        return ("the gradient is summed, not averaged: it is N times the average (divide the reduce-scatter's "
                "output by dist.get_world_size())")
    if abs(c - 1 / n) < 0.02 / n:
        return "the gradient is divided by N twice (or averaged, then divided again)"
    taken = {r: q for r in bad for q in range(n) if q != r and (got[r] - pieces[q]).abs().max().item() <= bound}
    if taken:
        return ("a rank takes another rank's piece: " + ", ".join(f"rank {r} got piece {q}" for r, q in taken.items())
                + " of the averaged gradient (rank r keeps piece r: the reduce-scatter's output is already its piece)")
    return None


def reference() -> Any:
    """A correct implementation (the grader's own test uses it; try yours first)."""
    import torch.distributed as dist

    from dtlab.distributed import all_gather_single, reduce_scatter_single

    def shard(flat: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        return _pieces(flat, world)[rank].clone()

    def gather(piece: torch.Tensor, numel: int) -> torch.Tensor:
        full = torch.empty(piece.numel() * dist.get_world_size(), dtype=piece.dtype, device=piece.device)
        all_gather_single(full, piece.contiguous())
        return full[:numel]

    def reduce_grad(full_grad: torch.Tensor) -> torch.Tensor:
        world = dist.get_world_size()
        padded = _pieces(full_grad, world).reshape(-1)
        piece = torch.empty(padded.numel() // world, dtype=padded.dtype, device=padded.device)
        reduce_scatter_single(piece, padded)
        return piece / world

    return shard, gather, reduce_grad
