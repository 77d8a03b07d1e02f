"""Exercise 06.sharded_optimizer: ZeRO stage 1 — the optimizer state split across ranks, parameters re-synchronised.

Write ``class MyShardedOptimizer`` with:

* ``__init__(self, params, optimizer_class, **defaults)``: ``params`` as for any torch optimizer — an iterable of
  tensors (``model.parameters()``), or a list of parameter groups (dicts with ``"params"`` and settings of their
  own, such as ``{"params": biases, "weight_decay": 0.0}``) —, ``optimizer_class`` the real optimizer (AdamW, SGD,
  Adam, ...) and ``**defaults`` its settings (``lr=..., betas=..., weight_decay=...``). Every parameter is
  *owned* by exactly one rank, the same on every rank; each rank keeps optimizer state for what it owns only, in
  a ``torch.optim.Optimizer`` of ``optimizer_class`` built with those settings and each group's own.
* ``step()``: each rank steps what it owns; then every parameter is sent from its owner to the other ranks, so
  every rank leaves ``step()`` with the same, fully updated weights.
* ``zero_grad(set_to_none=True)``: as torch's: every parameter's gradient (not only the owned ones') becomes
  ``None``, or, with ``set_to_none=False``, stays a tensor filled with zeros.

The gradients arrive already averaged over the ranks: the grader all-reduces them itself before it calls
``step()`` (the job DDP does in a real run). Not allowed: running the course's ``ShardedOptimizer``
(``dtlab.parallel.zero``) or torch's ``ZeroRedundancyOptimizer`` — either is this exercise, finished.

What must hold (what the grader checks, on 2, 3 and 4 processes; in each case T is the number of parameter
elements, every input is seeded, and a report names the case that failed):

* the cases: N = 3, AdamW with lr, betas, eps and weight_decay all different from AdamW's defaults, seven
  parameters, one holding more than 1/3 of all elements; N = 2, SGD with momentum, nesterov and weight decay,
  ``zero_grad(set_to_none=False)``; N = 4, Adam (amsgrad) over two parameter groups with settings of their own,
  five parameters; N = 4, three parameters — fewer than ranks, so a rank may own none — given as one parameter
  group whose ``"params"`` is a generator (it can be read only once). T does not divide by N
  except in the third case (64 elements over 4 ranks);
* after 3 steps every rank's weights equal one process's (``optimizer_class`` over the same groups with the same
  settings, on the averaged gradients) within ``dtlab.measure.reduction_tolerance``, and the ranks' weights are
  identical bit for bit;
* the optimizer state is split. The grader looks at every ``torch.optim.Optimizer`` each rank builds (of any class,
  kept anywhere) and still holds after the steps, and counts the parameter elements that have state there (a
  tensor it keeps state for, e.g. its ``exp_avg``, counts its elements once).
  The rule: each rank holds state for at most T/N elements plus the largest parameter's, and over the ranks every
  parameter has state exactly once (state kept for tensors of your own, such as flattened shards, is counted
  by elements: at least T in all, with at most N-1 padding elements per group);
* the re-synchronisation moves a shard per rank, not the model: in each ``step()`` each rank sends at most S
  elements and receives at most N x S, where S is the most elements any rank holds state for (a broadcast counts
  as sent by its src and received by the others; an all-gather counts this rank's input as sent and the
  gathered output as received; a send or recv as itself), every
  broadcast has the same src on every rank, and nothing in ``step()`` is reduced (no all-reduce,
  reduce-scatter or reduce: the gradients are averaged already, and the weights need copying, not summing);
* after ``zero_grad()`` no parameter has a gradient left (``None``; zeros with ``set_to_none=False``).

The grader watches the process group itself, so every collective is seen under whatever name it was imported.

Hints: each rank must reach the same ownership without asking the others — what does every rank know alike?
Balance elements, not tensors: a model's tensors differ in size by orders of magnitude. A rank that owns nothing
still takes part in every collective. Which collective sends one rank's tensor to every other rank?
"""

from __future__ import annotations

import functools
import gc
import math
import weakref
from typing import Any

import torch

from dtlab.exercises.grading import Case, Rank, Report, compare, grade_cases, run_ranks

try:                                                  # torch >= 2.0 (the course's stacks all have it)
    from torch.utils._python_dispatch import TorchDispatchMode as _Mode
except ImportError:                                   # pragma: no cover
    _Mode = object

NPROCS = 3
LOCAL_BATCH, STEPS, SEED = 4, 3, 4321

#: The cases, in the order they are graded. ``shapes``: the model's parameters, named p0, p1, ... in order;
#: ``optimizer``: the class in ``torch.optim``, with ``settings``; ``groups``: parameter groups (their
#: parameters' positions and their own settings), or None for ``model.parameters()``; ``set_to_none``: how the
#: grader calls ``zero_grad`` (None: ``zero_grad()``).
CASES = [
    Case("N = 3, AdamW(lr=0.03, betas=(0.8, 0.9), eps=1e-4, weight_decay=0.1), 7 parameters of 64, 8, 6, 48, 5, 4 "
         "and 40 elements (175 in all: the first holds more than 1/3 of them), zero_grad()", 3,
         {"shapes": [(8, 8), (8,), (2, 3), (6, 8), (5,), (4,), (5, 8)], "optimizer": "AdamW",
          "settings": {"lr": 0.03, "betas": (0.8, 0.9), "eps": 1e-4, "weight_decay": 0.1},
          "groups": None, "set_to_none": None}),
    Case("N = 2, SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01), 5 parameters of 35, 3, 10, 16 and 1 "
         "elements (65 in all), zero_grad(set_to_none=False)", 2,
         {"shapes": [(5, 7), (3,), (10,), (4, 4), (1,)], "optimizer": "SGD",
          "settings": {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
          "groups": None, "set_to_none": False}),
    Case("N = 4, Adam(lr=0.02, betas=(0.85, 0.98), eps=1e-6, amsgrad=True) over two parameter groups: p0 and p2 "
         "(36 and 18 elements) with weight_decay=0.05, p1, p3 and p4 (6, 3 and 1 elements) with lr=0.05; "
         "64 elements in all, zero_grad(set_to_none=True)", 4,
         {"shapes": [(6, 6), (6,), (6, 3), (3,), (1,)], "optimizer": "Adam",
          "settings": {"lr": 0.02, "betas": (0.85, 0.98), "eps": 1e-6, "amsgrad": True},
          "groups": [([0, 2], {"weight_decay": 0.05}), ([1, 3, 4], {"lr": 0.05})], "set_to_none": True}),
    Case("N = 4, AdamW(lr=0.05, betas=(0.9, 0.95), weight_decay=0.05) over one parameter group whose params are a "
         "generator (p0, p1, p2: 40, 9 and 2 elements, fewer parameters than ranks) with lr=0.08, zero_grad()", 4,
         {"shapes": [(5, 8), (9,), (2,)], "optimizer": "AdamW",
          "settings": {"lr": 0.05, "betas": (0.9, 0.95), "weight_decay": 0.05},
          "groups": [([0, 1, 2], {"lr": 0.08})], "generator": True, "set_to_none": None}),
]

#: Calls that reduce: none belongs in step() (the gradients arrive averaged; the weights are copied).
REDUCTIONS = ("all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor",
              "reduce_scatter_tensor_coalesced")
#: The grader's own step between your backward and your step() (not counted as yours).
AVERAGING = "the grader averaging the gradients (dist.all_reduce, then / N)"


def _forbidden() -> tuple[str, ...]:
    """What a learner may not run (the grader says so when it does): the course's ``ShardedOptimizer`` and torch's
    ``ZeroRedundancyOptimizer``. Both are ``torch.optim.Optimizer`` subclasses, so each rank notes every optimizer
    constructed whose class is, or derives from, one of them (one kept inside the learner's object too). By name,
    so that a rank imports neither."""
    return ("dtlab.parallel.zero.ShardedOptimizer",
            "torch.distributed.optim.zero_redundancy_optimizer.ZeroRedundancyOptimizer")


class _Model(torch.nn.Module):
    """One term per parameter: tanh(x[:, :n] @ p.flatten()), summed; every parameter gets a gradient."""

    def __init__(self, shapes: list[tuple[int, ...]]):
        super().__init__()
        g = torch.Generator().manual_seed(SEED)
        for i, shape in enumerate(shapes):
            self.register_parameter(f"p{i}", torch.nn.Parameter(0.5 * torch.randn(shape, generator=g)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = 0
        for p in self.parameters():
            v = p.reshape(-1)
            out = out + torch.tanh(x[:, :v.numel()] @ v)
        return out


def _model(spec: dict) -> _Model:
    with torch.random.fork_rng(devices=[]):            # leave the caller's random state alone
        return _Model(spec["shapes"])


def _batches(spec: dict, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    width, n = max(math.prod(s) for s in spec["shapes"]), LOCAL_BATCH * world
    return [(torch.randn(n, width, generator=g), torch.randn(n, generator=g)) for _ in range(STEPS)]


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def _params_arg(model: torch.nn.Module, spec: dict, groups: bool = True) -> Any:
    """What the optimizer is given: ``model.parameters()``, or the case's parameter groups."""
    params = list(model.parameters())
    if not groups or spec["groups"] is None:
        return params
    if spec.get("generator"):                          # a group's params may be any iterable, read once
        return [{"params": (params[i] for i in where), **options} for where, options in spec["groups"]]
    return [{"params": [params[i] for i in where], **options} for where, options in spec["groups"]]


def _zero_grad_call(spec: dict) -> str:
    return "zero_grad()" if spec["set_to_none"] is None else f"zero_grad(set_to_none={spec['set_to_none']})"


class _Roots(_Mode):
    """Notes the src of every broadcast this rank takes part in (the tracer's log does not keep it)."""

    def __init__(self) -> None:
        super().__init__()
        self.roots: list[int | None] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        namespace, name = getattr(func, "namespace", ""), func._schema.name.split("::")[-1]
        if namespace == "c10d" and name == "broadcast_":
            self.roots.append(args[2] if len(args) > 2 and isinstance(args[2], int) else None)
        elif namespace in ("_c10d_functional", "c10d_functional") and name in ("broadcast", "broadcast_"):
            self.roots.append(args[1] if len(args) > 1 and isinstance(args[1], int) else None)
        return func(*args, **(kwargs or {}))


class _Optimizers:
    """Every ``torch.optim.Optimizer`` constructed inside (each one runs ``Optimizer.__init__``, whatever its class
    and wherever it is kept: an attribute, a list, a closure)."""

    def __init__(self, forbidden: tuple[str, ...] = ()):
        self.forbidden = forbidden
        self.made: list[weakref.ref] = []
        self.seen: list[str] = []           # "module.Class" of each forbidden class constructed

    def __enter__(self) -> _Optimizers:
        self._init = init = torch.optim.Optimizer.__init__
        made, seen, forbidden = self.made, self.seen, self.forbidden

        @functools.wraps(init)
        def __init__(opt: Any, *args: Any, **kwargs: Any) -> None:
            made.append(weakref.ref(opt))
            for cls in type(opt).__mro__:
                name = f"{cls.__module__}.{cls.__qualname__}"
                if name in forbidden and name not in seen:
                    seen.append(name)
            init(opt, *args, **kwargs)

        torch.optim.Optimizer.__init__ = __init__
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.optim.Optimizer.__init__ = self._init

    def alive(self) -> list[torch.optim.Optimizer]:
        gc.collect()                                     # one dropped in a reference cycle holds nothing
        return [opt for ref in self.made if (opt := ref()) is not None]


def _held(optimizers: list[torch.optim.Optimizer], names: dict[int, str]) -> dict[str, Any]:
    """The parameter elements that have optimizer state in these optimizers: each tensor an optimizer keeps
    per-element state for (a state tensor of its size) counted once."""
    keys: dict[int, tuple[str | None, int]] = {}
    holding = 0
    for opt in optimizers:
        state = getattr(opt, "state", None)
        if not isinstance(state, dict):
            continue
        counted = False
        for key, entry in list(state.items()):
            if not torch.is_tensor(key) or not isinstance(entry, dict):
                continue
            if any(torch.is_tensor(v) and v.dim() > 0 and v.numel() == key.numel() for v in entry.values()):
                keys[id(key)] = (names.get(id(key)), key.numel())
                counted = True
        holding += counted
    return {"params": sorted({n for n, _ in keys.values() if n is not None}, key=lambda n: int(n[1:])),
            "elements": sum(e for _, e in keys.values()),
            "other": sum(e for n, e in keys.values() if n is None), "optimizers": holding}


def _one_process(spec: dict, device: torch.device, world: int, make: Any) -> dict[str, torch.Tensor] | None:
    """``make(model)``'s optimizer in one process on the gradients the ranks average: each rank's slice, summed
    in rank order, / N. None when that optimizer cannot be built (a diagnosis that does not apply)."""
    model = _model(spec).to(device)
    params = list(model.parameters())
    try:
        opt = make(model)
    except (TypeError, ValueError):
        return None
    for x, y in _batches(spec, world):
        per_rank = []
        for rank in range(world):
            rows = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
            per_rank.append(torch.autograd.grad(_loss(model, x[rows].to(device), y[rows].to(device)), params))
        for i, p in enumerate(params):
            total = per_rank[0][i].clone()
            for grads in per_rank[1:]:
                total += grads[i]
            p.grad = total / world
        opt.step()
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def _references(spec: dict, device: torch.device, world: int) -> dict[str, Any]:
    """One process's weights with the case's optimizer, and with the usual mistakes (to name the cause)."""
    cls, settings = getattr(torch.optim, spec["optimizer"]), spec["settings"]
    makes = {
        "expected": lambda m: cls(_params_arg(m, spec), **settings),
        "no settings": lambda m: cls(_params_arg(m, spec, groups=False)),
        "lr only": lambda m: cls(_params_arg(m, spec, groups=False), lr=settings["lr"]),
    }
    if spec["groups"] is not None:
        makes["groups dropped"] = lambda m: cls(_params_arg(m, spec, groups=False), **settings)
    if cls is not torch.optim.AdamW:
        makes["AdamW"] = lambda m: torch.optim.AdamW(_params_arg(m, spec), lr=settings["lr"])
    return {what: _one_process(spec, device, world, make) for what, make in makes.items()}


def _body(impl: Any, me: Rank, spec: dict, forbidden: tuple) -> dict[str, Any]:
    model = _model(spec).to(me.device)                 # the same on every rank (DDP's broadcast, done)
    names = {id(p): n for n, p in model.named_parameters()}
    with _Optimizers(forbidden) as registry:
        opt, cleared, roots = _train(impl, me, spec, model)
    out = {"weights": {n: p.detach().cpu().clone() for n, p in model.named_parameters()},
           "held": _held(registry.alive(), names), "cleared": cleared, "roots": roots, "seen": registry.seen}
    del opt                                             # alive until its state was counted
    if me.rank == 0:
        out["one_process"] = _references(spec, me.device, me.world)
    return out


def _train(impl: Any, me: Rank, spec: dict, model: torch.nn.Module) -> tuple[Any, list, dict]:
    """The learner's optimizer for STEPS steps: (it, what zero_grad left behind, each step()'s broadcast srcs)."""
    import torch.distributed as dist

    cls = getattr(torch.optim, spec["optimizer"])
    given = ("model.parameters()" if spec["groups"] is None else
             f"{len(spec['groups'])} parameter group{'s' if len(spec['groups']) > 1 else ''}")
    with me.tracer.doing(f"creating your optimizer: MyShardedOptimizer({given}, torch.optim.{cls.__name__}, ...)"):
        opt = impl(_params_arg(model, spec) if spec["groups"] else model.parameters(), cls, **spec["settings"])
    rows = slice(me.rank * LOCAL_BATCH, (me.rank + 1) * LOCAL_BATCH)
    call, cleared, roots = _zero_grad_call(spec), [], {}
    for step, (x, y) in enumerate(_batches(spec, me.world)):
        had = {n for n, p in model.named_parameters() if p.grad is not None}
        with me.tracer.doing(f"step {step}: your {call}"):
            if spec["set_to_none"] is None:
                opt.zero_grad()
            else:
                opt.zero_grad(set_to_none=spec["set_to_none"])
        for n, p in model.named_parameters():
            if p.grad is None:
                if n in had and spec["set_to_none"] is False:
                    cleared.append((step, n, "None"))
            elif bool(p.grad.any()):
                cleared.append((step, n, "nonzero"))
            elif spec["set_to_none"] is not False:
                cleared.append((step, n, "zeros"))
        _loss(model, x[rows].to(me.device), y[rows].to(me.device)).backward()
        with me.tracer.doing(f"step {step}: {AVERAGING}"), me.tracer.quiet():
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(me.world)
        label = f"step {step}: your step()"
        spy = _Roots()
        with me.tracer.doing(label), spy:
            opt.step()
        roots[label] = spy.roots
    return opt, cleared, roots


def grade(impl: Any, report: Report, nprocs: int | None = None, limit_s: float = 30.0) -> Report:
    """Grade ``impl`` (your ``MyShardedOptimizer`` class) on each case (those on ``nprocs`` processes, if given)."""
    return grade_cases(report, CASES, lambda case, rep: _grade_case(impl, case, rep, limit_s), nprocs)


def _grade_case(impl: Any, case: Case, report: Report, limit_s: float) -> None:
    spec, n = case.params, case.nprocs
    out = run_ranks(report, _body, impl, spec, _forbidden(), nprocs=n, limit_s=limit_s)
    if out is None:
        _cause_of_error(report, spec)
        return
    seen = sorted({name for r in out for name in r["seen"]})
    for name in seen:
        module, _, cls = name.rpartition(".")
        whose = "the course's own" if module.startswith("dtlab") else "torch's"
        report.fail(f"your code runs {whose} {cls} ({module}): the exercise is to write it",
                    "build the optimizer of this rank's shard from optimizer_class yourself, and send the "
                    "parameters with torch.distributed's collectives")
    if seen:
        return
    reduced = _check_reductions(report, out)
    holders = _check_state(report, out, spec, n)
    _check_zero_grad(report, out, spec)
    _check_weights(report, out, spec, n, holders)
    if not reduced and any(r["held"]["elements"] for r in out):   # else reported already
        _check_traffic(report, out, n)


def _cause_of_error(report: Report, spec: dict) -> None:
    """The likely cause of a rank's error or a deadlock, from the problem's words."""
    text = " ".join(report.problems)
    if "deadlock" in text and "dist.broadcast" in text:          # not a send/recv ordering problem: say so
        report.causes[:] = ["a broadcast no rank receives: the ranks disagree about its src. Decide each "
                            "parameter's owner from what every rank knows alike (the parameters' order and sizes), "
                            "never from the rank itself"]
    elif "empty parameter list" in text:
        report.fail("a rank that owns no parameter built an optimizer over none",
                    "with fewer parameters (or elements) than ranks some rank owns nothing: it builds no "
                    "optimizer (or one over empty groups) and still takes part in every collective of step()")
    elif "unexpected keyword argument" in text or "got an invalid" in text:
        report.fail(f"this case passes torch.optim.{spec['optimizer']} with {', '.join(spec['settings'])}",
                    "build optimizer_class, the class you are given, with **defaults: not a class of your choice")
    elif spec["groups"] and "dict" in text:
        report.fail("this case passes parameter groups: a list of dicts, each with 'params' and settings of its own",
                    "params may be parameter groups: spread the parameters of every group over the ranks, and give "
                    "each rank's optimizer the groups (with their settings) holding the parameters it owns")


def _check_reductions(report: Report, out: list[dict]) -> bool:
    """Fail every rank that reduced something in step(); True if one did."""
    before = len(report.problems)
    for rank, r in enumerate(out):
        used: dict[str, int] = {}
        lines = set()
        for e in r["traffic"]["log"]:
            if e["op"] in REDUCTIONS and e["label"].endswith("your step()"):
                used[e["api"]] = used.get(e["api"], 0) + 1
                lines.add(e["line"])
        if used:
            report.fail(f"rank {rank} called {', '.join(f'dist.{op} ({c}x)' for op, c in used.items())} in step()"
                        + (f" (at {', '.join(sorted(x for x in lines if x))})" if any(lines) else ""),
                        "nothing in step() needs a reduction: the gradients arrive averaged, and each parameter "
                        "is copied from the rank that stepped it (a broadcast from its owner, or an all-gather of "
                        "the shards); an all-reduce moves about twice as much")
    return len(report.problems) > before


def _label(name: str, spec: dict) -> str:
    return f"{name} ({math.prod(spec['shapes'][int(name[1:])])} elements)"


def _check_state(report: Report, out: list[dict], spec: dict, n: int) -> dict[str, list[int]]:
    """Each rank's optimizer state within its share; every parameter's exactly once. Returns who holds what."""
    sizes = {f"p{i}": math.prod(s) for i, s in enumerate(spec["shapes"])}
    total, largest = sum(sizes.values()), max(sizes.values())
    groups = 1 if spec["groups"] is None else len(spec["groups"])
    allowed = total / n + largest
    holders = {p: [rank for rank, r in enumerate(out) if p in r["held"]["params"]] for p in sizes}
    held = [r["held"]["elements"] for r in out]
    before = len(report.problems)
    if not any(r["held"]["optimizers"] for r in out):
        report.fail(f"no rank holds optimizer state in a torch.optim.Optimizer ({spec['optimizer']} steps every "
                    "parameter, so some rank must)",
                    "build optimizer_class over the parameters this rank owns and let it step them: the grader "
                    "counts the state of the torch.optim.Optimizer objects in each process")
        return holders
    if n > 1 and all(len(h) == n for h in holders.values()):
        report.fail(f"every rank holds optimizer state for all {len(sizes)} parameters ({total} elements: one "
                    "process's whole state)", "every rank keeps the whole optimizer: that is plain data "
                    "parallelism. Build optimizer_class over the parameters this rank owns only")
        return holders
    for rank, h in enumerate(held):
        if h > allowed:
            report.fail(f"rank {rank} holds optimizer state for {h} elements; its share is at most T/N + the "
                        f"largest parameter = {total}/{n} + {largest} = {allowed:.0f}",
                        "balance elements, not tensors: dealing the parameters out by position can give one rank "
                        "all the large ones")
    for p, h in holders.items():
        if len(h) > 1:
            report.fail(f"parameter {_label(p, spec)} has optimizer state on ranks {' and '.join(map(str, h))}",
                        "the ranks disagree on who owns which parameter: decide ownership from what every rank "
                        "knows alike (the parameters' order and sizes), the same way on every rank")
    if not any(r["held"]["other"] for r in out):           # state kept for the model's own parameters only
        missing = [p for p, h in holders.items() if not h]
        if missing:
            report.fail(f"{len(missing)} parameter{'s' if len(missing) > 1 else ''} "
                        f"({', '.join(_label(p, spec) for p in missing[:3])}) ha{'ve' if len(missing) > 1 else 's'} "
                        "optimizer state on no rank", "every parameter must be owned, and stepped, by one rank")
    elif len(report.problems) == before:
        if sum(held) < total:
            report.fail(f"over the ranks, optimizer state is kept for {sum(held)} elements; the model has {total}",
                        "some elements belong to no rank's shard: a shard of ceil(T/N) elements (the last one "
                        "shorter, or padded) covers them all; T // N leaves the rest out")
        elif sum(held) > total + (n - 1) * groups:
            report.fail(f"over the ranks, optimizer state is kept for {sum(held)} elements; the model has {total} "
                        f"(padding allows at most {(n - 1) * groups} more)",
                        "the shards overlap: each element belongs to exactly one rank's shard")
    if len(report.problems) == before:
        report.ok("each rank's optimizer state covers at most T/N elements + the largest parameter, and every "
                  "element's is on exactly one rank")
    return holders


def _check_zero_grad(report: Report, out: list[dict], spec: dict) -> None:
    call = _zero_grad_call(spec)
    before = len(report.problems)
    for rank, r in enumerate(out):
        for kind, words, cause in (
                ("nonzero", "still had a gradient",
                 "zero_grad must clear the gradient of every parameter, not only the ones this rank owns"),
                ("zeros", "held zeros, not None",
                 "zero_grad(set_to_none=True) (the default) sets every gradient to None, freeing it"),
                ("None", "held None, not zeros",
                 "zero_grad(set_to_none=False) keeps each gradient tensor and fills it with zeros")):
            hit = [(s, p) for s, p, k in r["cleared"] if k == kind]
            if hit:
                step, _ = hit[0]
                ps = sorted({p for s, p in hit if s == step}, key=lambda p: int(p[1:]))
                report.fail(f"rank {rank}: after your {call} in step {step}, {', '.join(ps[:3])} {words}", cause)
    if len(report.problems) == before:
        report.ok("zero_grad() cleared every parameter's gradient on every rank: None, or zeros with "
                  "set_to_none=False")


def _check_weights(report: Report, out: list[dict], spec: dict, n: int, holders: dict[str, list[int]]) -> None:
    from dtlab.measure import reduction_tolerance

    refs = out[0]["one_process"]
    one = refs["expected"]
    names = list(one)
    start = {k: v.detach().cpu() for k, v in _model(spec).state_dict().items()}
    bound = reduction_tolerance(LOCAL_BATCH * n, STEPS, max(w.abs().max().item() for w in one.values()))
    before = len(report.problems)
    for rank, r in enumerate(out):
        compare(report, f"rank {rank}, after {STEPS} steps", r["weights"], one, bound, "parameter")
    if len(report.problems) > before:
        _cause_of_weights(report, out, spec, n, holders, refs, bound, start)
    for rank, r in enumerate(out[1:], start=1):
        differ = [p for p in names if not torch.equal(r["weights"][p], out[0]["weights"][p])]
        if differ and len(report.problems) == before:
            report.fail(f"rank {rank} and rank 0 hold different weights ({', '.join(differ[:3])})",
                        "every rank must leave step() with the owner's copy of every parameter")
    if len(report.problems) == before:
        report.ok(f"after {STEPS} steps every rank's weights equal one process's (the case's optimizer, groups and "
                  "settings) within reduction_tolerance, identical bits on every rank")


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor] | None, bound: float) -> bool:
    return b is not None and all(a[k].shape == b[k].shape and (a[k] - b[k]).abs().max().item() <= bound for k in b)


def _cause_of_weights(report: Report, out: list[dict], spec: dict, n: int, holders: dict[str, list[int]],
                      refs: dict[str, Any], bound: float, start: dict[str, torch.Tensor]) -> None:
    mine = out[0]["weights"]
    causes = {
        "no settings": f"your weights are those of {spec['optimizer']} with its default settings: the settings given "
                       "to your __init__ (**defaults) never reached the optimizer you built. Pass them on: "
                       "optimizer_class(..., **defaults)",
        "lr only": f"your weights are those of {spec['optimizer']} with lr and nothing else: the other settings "
                   f"({', '.join(k for k in spec['settings'] if k != 'lr')}) were dropped. Pass every one on "
                   "(**defaults)",
        "groups dropped": "your weights are those of one group with the case's defaults: the groups' own settings "
                          "were lost. Give your optimizer groups, each with its own settings and the parameters of "
                          "it this rank owns",
        "AdamW": f"your weights are AdamW's, not {spec['optimizer']}'s: build optimizer_class, the class you are "
                 "given",
    }
    for what, cause in causes.items():
        if what in refs and _close(mine, refs[what], bound):
            report.causes.append(cause)
            return
    names = list(start)
    unchanged = {p: [rank for rank, r in enumerate(out) if torch.equal(r["weights"][p], start[p])] for p in names}
    if any(0 < len(u) < n for u in unchanged.values()):
        p, u = next((p, u) for p, u in unchanged.items() if 0 < len(u) < n)
        report.causes.append(f"{p} never changed on rank {u[0]} although another rank stepped it: after stepping "
                             "its shard each rank must send the parameters it owns to the others (dist.broadcast(p, "
                             "src=owner))")
    elif any(len(u) == n and holders.get(p) for p, u in unchanged.items()):
        p = next(p for p, u in unchanged.items() if len(u) == n and holders.get(p))
        report.causes.append(f"{p} ended unchanged on every rank although rank {holders[p][0]} stepped it: it was "
                             "sent from a rank that did not step it. Send each parameter from its owner (src=owner), "
                             "not from rank 0")


def _check_traffic(report: Report, out: list[dict], n: int) -> None:
    shard = max(r["held"]["elements"] for r in out)
    before = len(report.problems)
    for label in out[0]["roots"]:
        seqs = [r["roots"][label] for r in out]
        for k in range(min(len(s) for s in seqs)):
            srcs = [s[k] for s in seqs]
            if len(set(srcs)) > 1:
                report.fail(f"{label.split(':')[0]}, broadcast {k}: the ranks gave src = "
                            f"{', '.join(map(str, srcs))} (ranks 0 to {n - 1})",
                            "the ranks disagree about its src: decide each parameter's owner from what every rank "
                            "knows alike (the parameters' order and sizes), never from the rank itself")
                break
    if len(report.problems) > before:
        return
    for rank, r in enumerate(out):
        for label, roots in r["roots"].items():
            roots = list(roots)
            sent = received = 0
            for e in r["traffic"]["log"]:
                if e["label"] != label or e["op"] == "mark":
                    continue
                if e["op"] == "broadcast":
                    src = roots.pop(0) if roots else None
                    sent += e["sent"] if src == rank else 0
                    received += e["received"] if src != rank else 0
                else:
                    sent += e["sent"]
                    received += e["received"]
            step = label.split(":")[0]
            if sent > shard:
                report.fail(f"rank {rank} sent {sent} elements in {step}'s step(); the largest shard of optimizer "
                            f"state is {shard} elements, and a rank sends only what it stepped "
                            f"({sent / shard:.2f}x)", _traffic_cause(r, label, rank))
                break
            if received > n * shard:
                report.fail(f"rank {rank} received {received} elements in {step}'s step(); at most N x the largest "
                            f"shard = {n} x {shard} = {n * shard}", _traffic_cause(r, label, rank))
                break
    if len(report.problems) == before:
        report.ok("in each step() every rank sent at most the largest shard of state and received at most N times "
                  "it; every broadcast had the same src on every rank; nothing reduced")


def _traffic_cause(r: dict, label: str, rank: int) -> str:
    ops = {e["op"] for e in r["traffic"]["log"] if e["label"] == label}
    if "send" in ops:
        return ("a send to each peer makes the owner send its shard N-1 times: one broadcast (or all-gather) "
                "sends it once, and the collective spreads it")
    if ops & {"all_gather", "all_gather_into_tensor", "all_gather_coalesced", "all_gather_into_tensor_coalesced"}:
        return ("each rank contributes its own shard to the all-gather (the parameters it stepped, padded to the "
                "largest shard), not the whole model")
    return ("each parameter is sent once, by its owner: broadcasting every parameter from one rank, or each one "
            "more than once, moves more than the shards")


def reference() -> Any:
    """A correct implementation (the grader's own test uses it; try yours first)."""
    import torch.distributed as dist

    class MyShardedOptimizer:
        def __init__(self, params, optimizer_class, **defaults):
            groups = list(params)
            if not groups or not isinstance(groups[0], dict):
                groups = [{"params": groups}]
            groups = [{**g, "params": list(g["params"])} for g in groups]
            self.params = [p for g in groups for p in g["params"]]
            rank, world = dist.get_rank(), dist.get_world_size()
            load, self.owner = [0] * world, {}
            for p in sorted(self.params, key=lambda p: p.numel(), reverse=True):
                r = min(range(world), key=lambda r: load[r])
                self.owner[id(p)] = r
                load[r] += p.numel()
            mine = [{**g, "params": [p for p in g["params"] if self.owner[id(p)] == rank]} for g in groups]
            mine = [g for g in mine if g["params"]]
            self.optimizer = optimizer_class(mine, **defaults) if mine else None

        @torch.no_grad()
        def step(self):
            if self.optimizer is not None:
                self.optimizer.step()
            for p in self.params:
                dist.broadcast(p, src=self.owner[id(p)])

        def zero_grad(self, set_to_none=True):
            for p in self.params:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    return MyShardedOptimizer
