"""Exercise 12.fsdp_unit: FSDP's three operations on one flat parameter — shard, gather, reduce-scatter the gradient.

FSDP keeps one N-th of every layer's parameters on each rank. Write the three functions it is made of, for a
layer whose weight and bias are flattened into one 1-D tensor of ``numel`` elements (FSDP's "flat parameter"),
and pass them as a tuple, in this order: ``check("12.fsdp_unit", (shard, gather, reduce_grad))`` (the names are
yours: notebook 12 calls them ``shard_flat``, ``gather_flat`` and ``reduce_grad``).

* ``shard(flat, rank, world) -> Tensor``: rank ``rank``'s piece of the 1-D tensor ``flat``. Every rank holds
  the same number of elements, ``ceil(numel / world)``, so the flat parameter is padded with zeros at its end;
  rank r keeps the r-th piece, in its own memory (not a view that keeps the whole tensor alive). No
  communication.
* ``gather(piece, numel) -> Tensor``: every rank's piece, all-gathered into the full 1-D tensor of ``numel``
  elements (the padding removed), with **one all-gather** (``dist.all_gather_into_tensor``, or the list form
  ``dist.all_gather``). A collective: every rank calls it.
* ``reduce_grad(full_grad) -> Tensor``: ``full_grad`` is this rank's gradient of the whole flat parameter
  (``numel`` elements, from its own micro-batch); return this rank's piece (``ceil(numel / world)`` elements)
  of the gradient **averaged** over the ranks, with **one reduce-scatter** (``dist.reduce_scatter_tensor``, or
  the list form ``dist.reduce_scatter``). A collective too.

``gather`` and ``reduce_grad`` use the default process group (``dist.get_rank()``, ``dist.get_world_size()``);
tensors stay on the device they came on (CPU with gloo, the rank's GPU with nccl). The course's own FSDP
(``dtlab.parallel.fsdp.ScratchFSDP``) is not to be called: the exercise is to write it.

What must hold (what the grader checks). The grader owns a tiny FSDP around a chain of ``Linear`` layers with
``Tanh`` between them; each layer is one unit whose flat parameter (weight then bias) is cut by your ``shard``;
a rank holds only its pieces; before a layer runs forward, your ``gather`` gives it its full parameter, freed
right after; backward gathers it again; the layer's full gradient goes through your ``reduce_grad``, and SGD
steps the piece. It runs three cases, in this order, each with every input seeded (a report names the case that
failed, and it fails the same way again):

* N = 3 processes, flat parameters of 49, 40, 12, 3 and 2 elements;
* N = 2, flat parameters of 15, 8, 3 and 2 elements;
* N = 4, flat parameters of 35, 18, 8, 3 and 2 elements

(sizes that divide by N, sizes that do not, and sizes smaller than N, where some ranks' pieces are all padding).
Then:

* ``shard`` (run first, for every case, unit and rank, in a child process stopped after the time limit: it needs
  no process group): every rank's piece is a 1-D tensor of exactly ``ceil(numel/N)`` elements, of the flat
  parameter's dtype, equal to its piece of the zero-padded flat parameter (the padding zeros), and owning only
  its own elements;
* ``gather`` returns ``numel`` elements on every rank (the padding removed), exactly the parameter the ranks
  sharded; on every rank its communication is all-gathers only, sending this rank's piece and receiving the N
  pieces (no more: an all-reduce of a zero-padded full tensor gives the same parameter at twice an all-gather's
  traffic, and is rejected);
* ``reduce_grad`` returns ``ceil(numel/N)`` elements on every rank, its piece of the average of the ranks'
  gradients: at the first step equal, within float32 rounding (the bound is stated), to the same piece of the
  gradient one process computes on the whole batch; on every rank its communication is reduce-scatters only,
  receiving only this rank's piece (an all-reduce then a slice, an all-gather then a sum, or everything sent to
  one rank all give the same numbers while moving the whole gradient, and are rejected with what they moved);
* after 3 SGD steps every rank's pieces, and the parameters your ``gather`` assembles, equal one process's
  training on the whole batch (within ``dtlab.measure.reduction_tolerance``).

Hints: picture the flat parameter padded until it cuts into N equal pieces; how many elements does each piece
then hold, and how many zeros does that take (what if ``numel`` already divides by N, or is smaller than N)? Of
the ways to cut a tensor, which always gives N pieces, and which gives pieces of the size you asked for?
``gather`` is the inverse of ``shard``; ``reduce_grad`` sums each piece over the ranks and leaves piece r on
rank r, so the gradient needs the same padding as the parameter. Portability: the tensor forms of the two
collectives work on gloo and nccl alike on torch 2.3 and later (``dtlab.distributed`` also gives them under
torch 2.13's names, ``all_gather_single`` and ``reduce_scatter_single``); the list form ``dist.reduce_scatter``
does not exist on gloo before torch 2.6, and ``ReduceOp.AVG`` is not portable (gloo refuses it, or sums
silently, before torch 2.13): reduce with the default sum, then average yourself.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dtlab.exercises.grading import (
    Case,
    Rank,
    Report,
    Tracer,
    compare,
    course_code,
    grade_cases,
    learner_error,
    run_limited,
    run_ranks,
    scale_of,
)
from dtlab.measure import reduction_tolerance

NPROCS = 3
STEPS, LR, PER_RANK = 3, 0.1, 4
NAMES = ("shard", "gather", "reduce_grad")
#: What each function may communicate with (the c10d operators' usual names).
GATHER_OPS = ("all_gather", "all_gather_into_tensor", "all_gather_coalesced", "all_gather_into_tensor_coalesced")
REDUCE_OPS = ("reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced")


def _numels(dims: tuple[int, ...]) -> list[int]:
    return [o * (i + 1) for i, o in zip(dims, dims[1:])]


def _case(n: int, dims: tuple[int, ...]) -> Case:
    sizes = [str(s) for s in _numels(dims)]
    return Case(f"N = {n}, flat parameters of {', '.join(sizes[:-1])} and {sizes[-1]} elements", n, {"dims": dims})


#: The cases, in the order they are graded: N processes, and the widths of the chain of Linear layers (each layer
#: one unit); the flat parameters divide by N, do not, or are smaller than N (a Linear(1, 1): 2 elements).
CASES = [
    _case(3, (6, 7, 5, 2, 1, 1)),       # 49, 40, 12, 3, 2
    _case(2, (4, 3, 2, 1, 1)),          # 15, 8, 3, 2
    _case(4, (6, 5, 3, 2, 1, 1)),       # 35, 18, 8, 3, 2
]


def _model(dims: tuple[int, ...]) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for k, (i, o) in enumerate(zip(dims, dims[1:])):
        layers += [nn.Linear(i, o)] + ([nn.Tanh()] if k < len(dims) - 2 else [])
    return nn.Sequential(*layers)


def _units(model: nn.Sequential) -> list[tuple[str, nn.Linear]]:
    linears = [m for m in model if isinstance(m, nn.Linear)]
    return [(f"unit {k} (Linear({m.in_features}, {m.out_features}): {m.out_features * (m.in_features + 1)} "
             "elements)", m) for k, m in enumerate(linears)]


def _flat(layer: nn.Linear, grad: bool = False) -> torch.Tensor:
    w, b = (layer.weight.grad, layer.bias.grad) if grad else (layer.weight, layer.bias)
    return torch.cat([w.detach().reshape(-1), b.detach()])


def _batch(step: int, world: int, dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(PER_RANK * world, dims[0], generator=g), torch.randn(PER_RANK * world, dims[-1], generator=g)


def _pieces(flat: torch.Tensor, world: int) -> torch.Tensor:
    """The grader's own cut: (world, chunk), zero-padded."""
    chunk = -(-flat.numel() // world)
    return F.pad(flat, (0, chunk * world - flat.numel())).view(world, chunk)


def _three(impl: Any) -> tuple[Any, Any, Any] | None:
    if isinstance(impl, (tuple, list)) and len(impl) == 3:
        return tuple(impl)
    if all(hasattr(impl, n) for n in NAMES):
        return tuple(getattr(impl, n) for n in NAMES)
    return None


def _course() -> tuple:
    """The course's own FSDP: a learner's code running it is not the exercise."""
    from dtlab.parallel.fsdp import ScratchFSDP

    return (ScratchFSDP,)


def _calls(entries: list[dict]) -> str:
    used: dict[str, int] = {}
    for e in entries:
        used[e["api"] or e["op"]] = used.get(e["api"] or e["op"], 0) + 1
    return ", ".join(f"dist.{api} ({c}x)" for api, c in used.items())


# ---------------------------------------------------------------------------------------------- shard, alone

def _shards(shard: Any, cases: list[tuple[int, tuple[int, ...]]]) -> dict[str, Any]:
    """Run in a child process (``run_limited``): ``shard`` for every case, unit and rank. Returns, per case and
    unit, one entry per rank (the piece with its storage size, or what it was instead, or the error it raised:
    the first error ends the run) and the course code that ran."""
    tracer = Tracer(None)
    tracer.watch(course_code(*_course()))
    out: list[list[list[dict[str, Any]]]] = []
    try:
        for n, dims in cases:
            per_case: list[list[dict[str, Any]]] = []
            out.append(per_case)
            for _, layer in _units(_model(dims)):
                flat = _flat(layer)
                per_unit: list[dict[str, Any]] = []
                per_case.append(per_unit)
                for r in range(n):
                    try:
                        got = shard(flat.clone(), r, n)
                    except NotImplementedError:
                        raise
                    except Exception as exc:        # noqa: BLE001 -- the learner's error, in words
                        per_unit.append({"error": learner_error(exc), "type": type(exc).__name__})
                        return {"pieces": out, "seen": list(tracer.seen)}
                    if torch.is_tensor(got):
                        per_unit.append({"piece": got.detach().cpu().clone(),
                                         "storage": got.untyped_storage().nbytes() // max(1, got.element_size())})
                    else:
                        per_unit.append({"not_tensor": type(got).__name__})
    finally:
        tracer.uninstall()
    return {"pieces": out, "seen": list(tracer.seen)}


def _check_shard(case: Case, got: list[list[dict[str, Any]]], report: Report) -> None:
    """Judge ``shard``'s pieces for one case (computed by ``_shards``); the first problem ends the check."""
    n = case.nprocs
    for (name, layer), per_unit in zip(_units(_model(case.params["dims"])), got):
        flat = _flat(layer)
        expected = _pieces(flat, n)
        numel, c = flat.numel(), expected.shape[1]
        sizes = [g["piece"].numel() for g in per_unit if "piece" in g]
        for r, g in enumerate(per_unit):
            call = f"shard(flat, rank={r}, world={n}) for {name}"
            if "error" in g:
                pieces = len(flat.chunk(n))
                report.fail(f"{call} raised {g['error']}",
                            f"there is no piece {r} to take: cutting {numel} elements with chunk() gives {pieces} "
                            f"pieces, not {n} (it makes each piece ceil(numel/N) long and stops when the elements "
                            "run out); every rank needs a piece, so pad before cutting"
                            if g["type"] == "IndexError" and pieces < n else None)
                return
            if "not_tensor" in g:
                report.fail(f"{call} returned a {g['not_tensor']}; every rank must hold a 1-D tensor of "
                            f"ceil({numel}/{n}) = {c} elements")
                return
            piece = g["piece"]
            if tuple(piece.shape) != (c,):
                report.fail(f"{call} gave a piece of shape {tuple(piece.shape)}; every rank must hold a 1-D piece "
                            f"of ceil({numel}/{n}) = {c} elements", _size_cause(piece, sizes, numel, n, c))
                return
            if piece.dtype != flat.dtype:
                report.fail(f"{call} gave a {piece.dtype} piece of a {flat.dtype} flat parameter: keep its dtype")
                return
            if not torch.equal(piece, expected[r]):
                other = [q for q in range(n) if torch.equal(piece, expected[q])]
                real = max(0, min(c, numel - r * c))                      # elements of piece r that are not padding
                zeros = f"; elements {r * c + real}-{(r + 1) * c - 1} are padding" if real < c else ""
                report.fail(f"{call}: the piece differs from elements {r * c}-{(r + 1) * c - 1} of the zero-padded "
                            f"flat parameter{zeros} (largest difference "
                            f"{(piece - expected[r]).abs().nan_to_num(math.inf).max().item():.2e})"
                            + (f"; it is rank {other[0]}'s piece" if other else ""),
                            f"a rank takes another rank's piece: rank r keeps the r-th piece (rank {r}: elements "
                            f"{r * c} to {(r + 1) * c - 1})" if other else "the padding must be zeros (whatever "
                            "fills it is what the gradients and the optimizer see), not copies of the parameter or "
                            "uninitialised memory" if torch.equal(piece[:real], expected[r][:real]) else None)
                return
            if g["storage"] > c:
                report.fail(f"{call} returned a view into a tensor of {g['storage']} elements: a rank that keeps it "
                            f"keeps all {g['storage']}, not its {c}",
                            "the piece must own its memory (clone it): FSDP's point is that a rank holds only its "
                            "1/N of the parameter, so the full (padded) tensor can be freed")
                return
    report.ok("shard: every rank's piece is its ceil(numel/N) elements of the zero-padded flat parameter, in its own "
              "memory, for flat parameters that divide by N, that do not, and smaller than N")


def _size_cause(piece: torch.Tensor, sizes: list[int], numel: int, n: int, c: int) -> str | None:
    if piece.numel() == c:
        return "the piece must be 1-D (flat), like the flat parameter"
    if len(set(sizes)) > 1 and sum(sizes) == numel:
        return (f"the pieces are not padded: {numel} elements do not divide by {n}, so cutting them gives unequal "
                "pieces (all-gather and reduce-scatter need equal ones): pad the flat parameter with zeros first")
    if piece.numel() == numel // n:
        return (f"the piece size rounds down: {n} pieces of {numel // n} hold only {n * (numel // n)} of the {numel} "
                "elements; round up, and pad the rest with zeros")
    if piece.numel() > c and numel % n == 0:
        return f"{numel} elements already divide by {n}: they need no padding, each piece is {numel // n}"
    if piece.numel() > c:
        return (f"the pieces are larger than needed: pad only up to the next multiple of {n} ({n * c} elements, "
                f"{n * c - numel} of them zeros)")
    return None


# ---------------------------------------------------------------------------------------------- in the workers

class _Unit:
    """One linear layer under the grader's FSDP: it keeps ``piece``; your gather fills it in for each use."""

    def __init__(self, k: int, name: str, layer: nn.Linear, fns: tuple, me: Rank,
                 problems: dict[str, tuple[int, tuple]]):
        self.k, self.name, self.layer, self.me, self.problems = k, name, layer, me, problems
        self.shard, self.gather, self.reduce_grad = fns
        flat = _flat(layer).to(me.device)
        self.numel, self.chunk, self.n_weight = flat.numel(), -(-flat.numel() // me.world), layer.weight.numel()
        piece = self._traced("shard", f"{name}: your shard of its flat parameter", self.shard, flat, me.rank,
                             me.world)
        self.piece = self._sized(piece, self.chunk, "shard", None).clone()  # all this rank keeps between uses
        self.full: torch.Tensor | None = None
        self.first: torch.Tensor | None = None                               # your gather's first result
        del layer.weight, layer.bias
        layer.register_forward_pre_hook(self._before)
        layer.register_forward_hook(self._after)

    def _traced(self, what: str, label: str, fn: Any, *args: Any) -> Any:
        """Call your ``fn``; judge what it communicated on this rank against the collective it must be."""
        log = self.me.tracer.log
        start = len(log)
        with self.me.tracer.doing(label):
            out = fn(*args)
        moved = [e for e in log[start:] if e["op"] not in ("mark", "barrier")]     # a barrier moves no data
        problem = _judge(what, moved, self.name, self.numel, self.chunk, self.me.world)
        if problem is not None:
            self._problem(f"{what} traffic", problem)
        return out

    def _problem(self, kind: str, problem: tuple[str, str | None]) -> None:
        """Keep one problem of each kind on this rank: the first unit's that has it (the same mistake shows in
        every unit; the report names one)."""
        if kind not in self.problems or self.problems[kind][0] > self.k:
            self.problems[kind] = (self.k, problem)

    def _sized(self, t: Any, n: int, what: str, cause: str | None) -> torch.Tensor:
        if not torch.is_tensor(t):
            self._problem(f"{what} type", (f"{self.name}: {what} returned a {type(t).__name__}, not a tensor",
                                           None))
            return torch.zeros(n, device=self.me.device)
        t = t.detach().reshape(-1)
        if t.numel() != n:
            holds = "the parameter has" if what == "gather" else "this rank's piece has"
            self._problem(f"{what} size", (
                f"{self.name}: {what} returned {t.numel()} elements; {holds} {n} (each of "
                f"{self.me.world} ranks holds {self.chunk})", cause if t.numel() > n else None))
            t = F.pad(t, (0, max(0, n - t.numel())))[:n]   # carry on with the right size, to check the rest
        return t

    def _gather(self, when: str) -> torch.Tensor:
        full = self._traced("gather", f"{self.name}, {when}: your gather of its parameter", self.gather,
                            self.piece.detach(), self.numel)
        full = self._sized(full, self.numel, "gather", "the gathered tensor still holds the padding: the parameter "
                           "is its first numel elements")
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
        grad = self._traced("reduce_grad", f"{self.name}: your reduce_grad of its gradient", self.reduce_grad,
                            self.full.grad.detach().clone())
        grad = self._sized(grad, self.chunk, "reduce_grad", "reduce_grad returns only this rank's piece of the "
                           "averaged gradient (the reduce-scatter's output), ceil(numel/N) elements")
        self.piece -= LR * grad
        self.full.untyped_storage().resize_(0)
        self.full = None
        return grad.cpu()


def _judge(what: str, moved: list[dict], name: str, numel: int, c: int, n: int) -> tuple[str, str | None] | None:
    """(problem, cause) when one call's communication on this rank is not the collective it must be."""
    sent, received = sum(e["sent"] for e in moved), sum(e["received"] for e in moved)
    ops = {e["op"] for e in moved}
    padded = n * c
    if what == "shard":
        if moved:
            return (f"{name}: shard called {_calls(moved)}", "shard needs no communication: each rank cuts its "
                    "own piece from the flat parameter it was given")
        return None
    if what == "gather":
        if not moved:
            return (f"{name}: gather called no collective, yet the other ranks' pieces are only on those ranks",
                    None)
        if not ops <= set(GATHER_OPS):
            return (f"{name}: gather called {_calls(moved)}: this rank sent {sent} and received {received} "
                    f"elements; an all-gather sends its piece ({c}) and receives the {n} pieces ({padded})",
                    _gather_cause(ops, n))
        if not any(e["op"] in GATHER_OPS for e in moved) or sent > c or received > padded:
            return (f"{name}: gather's all-gathers sent {sent} and received {received} elements on this rank; "
                    f"all-gathering the pieces sends {c} and receives {padded}",
                    "all-gather each rank's piece once (not the whole parameter, and not more than once)")
        return None
    if not moved:
        return (f"{name}: reduce_grad called no collective, yet the average needs every rank's gradient", None)
    if not ops <= set(REDUCE_OPS):
        return (f"{name}: reduce_grad called {_calls(moved)}: this rank sent {sent} and received {received} "
                f"elements to keep its piece of {c}; a reduce-scatter gives each rank only its piece",
                _reduce_cause(ops, n))
    if sent > padded or received > c:
        return (f"{name}: reduce_grad's reduce-scatters sent {sent} and received {received} elements on this rank; "
                f"reduce-scattering the padded gradient sends {padded} and receives this rank's piece, {c}",
                "reduce-scatter the padded gradient once")
    return None


def _gather_cause(ops: set[str], n: int) -> str:
    if "all_reduce" in ops:
        return ("an all-reduce of a zero-padded full tensor (each rank's piece in its place) gives the same "
                "parameter at twice an all-gather's traffic (on a ring 2(N-1)/N x P elements per rank against "
                "(N-1)/N x P): all-gather the pieces")
    if "broadcast" in ops:
        return f"{n} broadcasts, one per rank's piece, are what one all-gather does in one collective: all-gather"
    return "gather is one all-gather of the pieces (dist.all_gather_into_tensor, or the list form dist.all_gather)"


def _reduce_cause(ops: set[str], n: int) -> str:
    fix = "reduce-scatter the padded gradient, then divide by N"
    if "all_reduce" in ops:
        return ("an all-reduce where a reduce-scatter is needed: every rank receives the whole summed gradient and "
                "keeps 1/N of it; on a ring an all-reduce of P elements sends 2(N-1)/N x P per rank, a "
                "reduce-scatter (N-1)/N x P: 2x the traffic of a reduce-scatter's. " + fix[0].upper() + fix[1:])
    if ops & {"all_gather", "all_gather_into_tensor", "all_to_all", "all_to_all_single"}:
        return (f"every rank receives every rank's whole gradient and adds them up itself: on a ring (N-1) x numel "
                f"elements per rank against a reduce-scatter's (N-1)/N x P, {n}x the traffic; in a reduce-scatter "
                f"each piece is summed on its way, and a rank receives only its own. {fix[0].upper() + fix[1:]}")
    if ops & {"gather", "reduce", "scatter", "broadcast"}:
        return ("one rank collects (or reduces) every rank's gradient and hands out the pieces: it moves N-1 "
                "whole gradients while the others wait; in a reduce-scatter every rank receives only its own "
                f"piece. {fix[0].upper() + fix[1:]}")
    return "reduce_grad is one reduce-scatter (dist.reduce_scatter_tensor, or the list form dist.reduce_scatter)"


def _body(impl: Any, me: Rank, dims: tuple[int, ...]) -> dict[str, Any]:
    problems: dict[str, tuple[int, tuple]] = {}
    model = _model(dims).to(me.device)
    units = [_Unit(k, name, layer, _three(impl), me, problems) for k, (name, layer) in enumerate(_units(model))]
    first_grads: list[torch.Tensor] = []
    for step in range(STEPS):
        x, y = (t[me.rank * PER_RANK:(me.rank + 1) * PER_RANK].to(me.device) for t in _batch(step, me.world, dims))
        F.mse_loss(model(x), y).backward()
        grads = [u.step() for u in reversed(units)][::-1]           # last layer first, as backward finishes
        first_grads = first_grads or grads
    gathered = [u._gather("after training") for u in units]
    return {"pieces": [u.piece.cpu() for u in units], "first_grads": first_grads,
            "gathered": [g.cpu() for g in gathered],
            "problems": [p for _, p in sorted(problems.values(), key=lambda unit_problem: unit_problem[0])],
            "first_gathered": [u.first for u in units]}


# ---------------------------------------------------------------------------------------------- in the notebook

def _one_process(world: int, dims: tuple[int, ...]) -> dict[str, Any]:
    """One process, the whole batch: the flat parameters after STEPS steps, the first step's gradients and the
    bound on those (n x eps x the sum of the per-sample terms' magnitudes)."""
    model = _model(dims)
    units = [m for _, m in _units(model)]
    initial = [_flat(u).clone() for u in units]
    x, y = _batch(0, world, dims)
    magnitude = [torch.zeros_like(_flat(u)) for u in units]
    for i in range(len(x)):                                   # per sample: the terms the gradient sums
        model.zero_grad()
        ((model(x[i:i + 1]) - y[i:i + 1]) ** 2).sum().div(y.numel()).backward()
        magnitude = [m + _flat(u, grad=True).abs() for m, u in zip(magnitude, units)]
    grads = None
    for step in range(STEPS):
        model.zero_grad()
        x, y = _batch(step, world, dims)
        F.mse_loss(model(x), y).backward()
        grads = grads or [_flat(u, grad=True) for u in units]
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    flats = [_flat(u) for u in units]
    return {"flats": flats, "grads": grads, "initial": initial,
            "grad_bound": reduction_tolerance(len(x), 1, max(m.max().item() for m in magnitude)),
            "bound": reduction_tolerance(len(x), STEPS, max(f.abs().max().item() for f in flats))}


def grade(impl: Any, report: Report, nprocs: int | None = None, limit_s: float = 30.0) -> Report:
    """Grade ``impl`` = ``(shard, gather, reduce_grad)`` on each case (those on ``nprocs`` processes, if given)."""
    fns = _three(impl)
    chosen = [c for c in CASES if nprocs is None or c.nprocs == nprocs]
    if not chosen:
        return grade_cases(report, CASES, lambda case, rep: None, nprocs)     # says which N there are
    report.nprocs = chosen[0].nprocs
    report.worlds += [c.nprocs for c in chosen]
    if fns is None:
        probe = Report(report.exercise, report.title)       # a lone stub is still "not attempted"
        if callable(impl):
            run_limited(probe, _shards, impl, [(chosen[0].nprocs, chosen[0].params["dims"])], limit_s=limit_s,
                        what="your shard")
        if not probe.attempted:
            report.attempted, report.problems = False, probe.problems
            return report
        report.fail(f"pass your three functions as one tuple: check('12.fsdp_unit', (shard, gather, reduce_grad)); "
                    f"got {type(impl).__name__}")
        return report
    ok, shards = run_limited(report, _shards, fns[0], [(c.nprocs, c.params["dims"]) for c in chosen],
                             limit_s=limit_s, what="your shard, for every case, unit and rank,")
    if not ok:
        return report
    if shards["seen"]:
        report.fail(f"your shard runs the course's own {', '.join(shards['seen'])}: the exercise is to write it")
        return report
    by_name = dict(zip((c.name for c in chosen), shards["pieces"]))
    grade_cases(report, chosen, lambda case, rep: _check_shard(case, by_name.get(case.name, []), rep))
    if not report.passed:
        return report
    return grade_cases(report, chosen, lambda case, rep: _grade_case(impl, case, rep, limit_s))


def _grade_case(impl: Any, case: Case, report: Report, limit_s: float) -> None:
    n, dims = case.nprocs, case.params["dims"]
    out = run_ranks(report, _body, impl, dims, nprocs=n, limit_s=limit_s, watched=_course())
    if out is None:
        return
    seen = sorted({s for r in out for s in r["traffic"]["seen"]})
    if seen:
        report.fail(f"your code runs the course's own {', '.join(seen)} (dtlab.parallel.fsdp): the exercise is to "
                    "write it")
        return
    ref = _one_process(n, dims)
    names = [name for name, _ in _units(_model(dims))]
    _by_ranks(report, [r["problems"] for r in out])
    for k, name in enumerate(names):                        # your gather, at the first forward
        worst = max((r["first_gathered"][k] - ref["initial"][k]).abs().nan_to_num(math.inf).max().item()
                    for r in out)
        if worst > 0:
            report.fail(f"{name}: at the first forward your gather gave a parameter that differs from the one the "
                        f"ranks sharded by {worst:.2e} (it must be exact: the pieces in rank order, padding cut)")
    if report.problems:
        return
    pieces_of = [_pieces(g, n) for g in ref["grads"]]
    for k, name in enumerate(names):                        # your reduce_grad, at the first step
        got = [r["first_grads"][k] for r in out]
        diffs = [(got[rank] - pieces_of[k][rank]).abs().nan_to_num(math.inf).max().item() for rank in range(n)]
        bad = [rank for rank in range(n) if diffs[rank] > ref["grad_bound"]]
        if bad:
            report.fail(f"{_ranks(bad)}, {name}: at step 1 reduce_grad returned a piece that differs from the same "
                        f"piece of one process's gradient on the whole batch by up to {max(diffs):.2e} (bound "
                        f"{ref['grad_bound']:.1e})", _cause(got, pieces_of[k], bad, ref["grad_bound"],
                                                            ref["grads"][k].numel()))
    if report.problems:
        return
    for rank, r in enumerate(out):                          # after STEPS steps
        compare(report, f"rank {rank}, after {STEPS} steps", dict(zip(names, r["pieces"])),
                {name: p[rank] for name, p in zip(names, (_pieces(f, n) for f in ref["flats"]))}, ref["bound"],
                "piece of")
        compare(report, f"rank {rank}, your gather after {STEPS} steps", dict(zip(names, r["gathered"])),
                dict(zip(names, ref["flats"])), ref["bound"], "parameter of")
    if not report.problems:
        report.ok("gather: on every rank the exact parameter, the padding removed, with one all-gather of the "
                  "pieces (each rank sends its piece and receives the N pieces)")
        report.ok("reduce_grad: at step 1 each rank's piece of the averaged gradient is one process's gradient on "
                  "the whole batch within float32 rounding, with a reduce-scatter (each rank receives only its "
                  "piece); no all-reduce")
        report.ok(f"after {STEPS} SGD steps every rank's pieces and gathered parameters equal one process's within "
                  "reduction_tolerance")


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


def _cause(got: list[torch.Tensor], pieces: torch.Tensor, bad: list[int], bound: float, numel: int) -> str | None:
    n, c = pieces.shape

    def only_padding_wrong(r: int) -> bool:
        real = max(0, min(c, numel - r * c))                                # elements of piece r that are not padding
        return real < c and (real == 0 or (got[r][:real] - pieces[r][:real]).abs().max().item() <= bound)

    if all(only_padding_wrong(r) for r in bad):
        return ("only the padding differs: the gradient's padding must be zeros too (pad it with zeros, as the "
                "parameter): an optimizer and a gradient norm see every element of the piece")
    scale = scale_of(torch.cat([got[r] for r in bad]), torch.cat([pieces[r] for r in bad]))
    if abs(scale - n) < 0.02 * n:
        return ("the gradient is summed, not averaged: it is N times the average (a reduce-scatter sums; the "
                "average divides by the number of ranks)")
    if abs(scale - 1 / n) < 0.02 / n:
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

    def padded(flat: torch.Tensor, world: int) -> tuple[torch.Tensor, int]:
        chunk = math.ceil(flat.numel() / world)
        return F.pad(flat, (0, chunk * world - flat.numel())), chunk

    def shard(flat: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        full, chunk = padded(flat, world)
        return full[rank * chunk:(rank + 1) * chunk].clone()

    def gather(piece: torch.Tensor, numel: int) -> torch.Tensor:
        full = torch.empty(piece.numel() * dist.get_world_size(), dtype=piece.dtype, device=piece.device)
        all_gather_single(full, piece.contiguous())
        return full[:numel]

    def reduce_grad(full_grad: torch.Tensor) -> torch.Tensor:
        world = dist.get_world_size()
        full, chunk = padded(full_grad, world)
        piece = torch.empty(chunk, dtype=full.dtype, device=full.device)
        reduce_scatter_single(piece, full)
        return piece / world

    return shard, gather, reduce_grad
