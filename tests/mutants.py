"""Mutation testing of the exercise graders: small wrong edits of each reference, which its grader must fail.

A mutant is an exercise's reference with one edit, the kind of slip a learner makes: an integer off by one,
``+`` for ``-``, ``<`` for ``<=``, a call dropped (a collective, a ``.wait()``, a ``div_``), two statements in the
other order, two arguments swapped, a rank replaced by 0, ``and`` for ``or``, a ``not`` or a minus dropped,
``add_`` for ``copy_``. Every mutant that changes the result, the traffic or the memory must be failed by the
grader ("killed"); one that passes ("survives") is either equivalent to the reference, argued so in
``KNOWN_EQUIVALENT``, or a weakness of the grader.

The source edited is that of what ``reference()`` returns. When it returns functions or classes defined inside
``reference()``, the whole of ``reference()`` is edited (inside those definitions only) and the edited
``reference()`` is called; a function or class defined at a module's top level is edited on its own. Either
way the edited source runs in a copy of its module's globals named ``__mutant__``, a module no process can
import, so cloudpickle ships the mutant to the grader's workers by value, not the original by name.

Used by tests/test_exercise_mutants.py and scripts/mutants.py (``make mutants``).
"""

from __future__ import annotations
import __future__

import ast
import inspect
import random
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dtlab.exercises import check, exercise

#: Seconds a mutant's run may block before the grader stops it (a mutant often deadlocks).
LIMIT_S = 8.0
#: The module name the mutants are defined in: not importable, so they are pickled by value.
MODULE = "__mutant__"

#: The families of edits (the first word of a mutant's id).
OPERATORS = ("const", "binop", "divisor", "cmp", "boolop", "unary", "drop-call", "drop-del", "swap-stmts",
             "swap-args", "rank->0", "method")
#: Names that hold a rank (or a stage): used as a call's argument, each is replaced by 0.
RANKISH = {"rank", "src", "dst", "peer", "left", "right", "owner", "root", "stage", "s"}
#: ``+`` becomes ``-`` and so on (one mutant per replacement).
BINOPS: dict[type, tuple[type, ...]] = {ast.Add: (ast.Sub,), ast.Sub: (ast.Add,), ast.Mult: (ast.Div, ast.FloorDiv),
                                        ast.Div: (ast.Mult,), ast.FloorDiv: (ast.Mult,), ast.Mod: (ast.FloorDiv,)}
COMPARISONS: dict[type, type] = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
                                 ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
                                 ast.In: ast.NotIn, ast.NotIn: ast.In}
#: In-place tensor methods swapped for one another.
METHODS = {"add_": ("copy_", "sub_"), "copy_": ("add_",)}
SYMBOL = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
          ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=",
          ast.Is: "is", ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in", ast.And: "and", ast.Or: "or"}

#: Mutants that pass and cannot change the result, the traffic or the memory: exercise -> mutant id -> why.
#: A survivor that does change one of them is a weakness of the grader, never listed here.
_INDEPENDENT = "the two statements share no variable and neither communicates, so their order changes nothing"
KNOWN_EQUIVALENT: dict[str, dict[str, str]] = {
    "02.ring_all_reduce": {
        "swap-stmts L7:c8 right, left = ((rank + 1) % world, (rank - 1) %...":
            "the neighbours' ranks and the chunk views are computed from rank, world and tensor alone: "
            + _INDEPENDENT,
        "cmp:==->!= L12:c15 rank % 2 == 0":
            "odd ranks send first and even ranks receive first instead: rank 0 still receives first, which breaks "
            "the cycle of blocking sends, and the same chunks move and are added in the same order",
        "const+1 L12:c27 rank % 2 == 0":
            "rank % 2 == 1 is rank % 2 != 0 for ranks >= 0: odd ranks send first, rank 0 still receives first "
            "(no cycle of blocking sends); the same chunks move and are added in the same order",
        "const+1 L12:c22 rank % 2":
            "rank % 3 == 0: ranks 0 and 3 receive first, the others send first; a ring with a rank that receives "
            "first and one that sends first has no cycle of blocking sends (N >= 2 has ranks 0 and 1); the same "
            "chunks move and are added in the same order",
        "divisor+1 L12:c15 rank % 2":
            "rank % (2 + 1) is rank % 3, argued for `const+1 L12:c22 rank % 2`",
    },
    "03.bucketed_ddp": {
        "swap-stmts L8:c12 self.module = module": "self.module and self.world: " + _INDEPENDENT,
        "swap-stmts L9:c12 self.world = dist.get_world_size()":
            "self.world is not read by the broadcasts that follow; every rank makes the same broadcasts in the "
            "same order",
        "swap-stmts L10:c12 with torch.no_grad(): for t in list(module.para...":
            "the broadcasts of the weights and `cap = ...`: " + _INDEPENDENT + " (every rank broadcasts alike)",
        "swap-stmts L13:c12 cap = bucket_cap_mb * 2 ** 20": "`cap` and `params`: " + _INDEPENDENT,
        "swap-stmts L14:c12 params = [p for p in module.parameters() if p.r...":
            "`params` and `self.buckets = [[]]`: " + _INDEPENDENT,
        "swap-stmts L15:c12 self.buckets: list[list[torch.nn.Parameter]] = ...":
            "`self.buckets = [[]]` and `size = 0`: " + _INDEPENDENT,
        "const-1 L19:c33 -1":
            "self.buckets[0] and self.buckets[-1] are both empty before the first parameter and both non-empty "
            "after it (a new bucket gets its parameter at once), so the test is the same",
        "swap-stmts L20:c20 self.buckets.append([])": "`self.buckets.append([])` and `size = 0`: " + _INDEPENDENT,
        "swap-stmts L22:c16 self.buckets[-1].append(p)": "`...append(p)` and `size += nbytes`: " + _INDEPENDENT,
        "swap-stmts L24:c12 self.bucket_of = {id(p): i for i, bucket in enu...":
            "`self.bucket_of` and `self.arrived`: " + _INDEPENDENT,
        "swap-stmts L25:c12 self.arrived = [0] * len(self.buckets)":
            "`self.arrived` and `self.in_flight`: " + _INDEPENDENT,
        "swap-stmts L26:c12 self.in_flight: dict[int, tuple[torch.Tensor, A...":
            "the hooks registered after `self.in_flight = {}` instead of before run only during backward, after "
            "__init__ has set it either way",
        "swap-stmts L41:c12 for i, (flat, work) in self.in_flight.items(): ...":
            "resetting self.arrived before or after unpacking the buckets: the loop never reads it and no hook "
            "runs in between",
        "swap-stmts L42:c16 work.wait()": "`work.wait()` and `offset = 0`: " + _INDEPENDENT,
        "swap-stmts L47:c12 self.arrived = [0] * len(self.buckets)":
            "`self.arrived` and `self.in_flight` reset: " + _INDEPENDENT,
    },
    "06.sharded_optimizer": {
        "const-1 L8:c51 groups[0]":
            "groups[-1] for groups[0]: a list of parameters is all tensors or all dicts (torch's optimizers take "
            "no mixture), so the last is a dict exactly when the first is",
        "swap-stmts L11:c12 self.params = [p for g in groups for p in g['pa...":
            "`self.params` and `rank, world = ...`: " + _INDEPENDENT,
        "const+1 L13:c32 [0]":
            "every rank's load starts at 1 instead of 0: the same shift for all, so the least loaded rank, ties "
            "included, is the same at every choice",
        "const-1 L13:c32 [0]": "every rank's load starts at -1 instead of 0: as for `const+1 L13:c32 [0]`",
        "swap-stmts L16:c16 self.owner[id(p)] = r": "`self.owner[...] = r` and `load[r] += ...`: " + _INDEPENDENT,
        "swap-stmts L19:c12 mine = [g for g in mine if g['params']]":
            "the optimizer gets this rank's groups with the empty ones left in: a torch optimizer keeps no state "
            "and does nothing for a group without parameters, so the state, the steps and the memory are the same",
    },
    "12.fsdp_unit": {},
    "14.parallel_linear": {
        "swap-stmts L12:c12 grad = grad.clone()":
            "all-reduce in place, then copy: the gradient it gets is the one F.linear's backward just made for "
            "this Function's output (line 34), held by nothing else; same values, traffic and one copy either way",
        "swap-stmts L19:c12 x = x.clone()":
            "all-reduce in place, then copy: its input is the F.linear output made on line 43, held by nothing "
            "else; same values, traffic and one copy either way",
        "swap-stmts L30:c12 self.weight = nn.Parameter(full.weight.detach()...":
            "the column layer registers its bias before its weight: only the order of parameters() changes, not a "
            "value, a gradient or a message",
        "const-1 L31:c69 full.bias.detach().chunk(world, 0)": "the bias is 1-D: its dimension -1 is dimension 0",
        "swap-stmts L39:c12 self.weight = nn.Parameter(full.weight.detach()...":
            "the row layer registers its bias before its weight: only the order of parameters() changes",
    },
    "15.one_f_one_b": {},
    "16.online_softmax_merge": {
        "swap-args L5:c14 torch.logaddexp(lse_a, lse_b)":
            "logaddexp is symmetric, computed as max + log1p(exp(-|a - b|)): the same bits either way",
    },
    "19.selective_recompute": {
        "swap-stmts L6:c12 ctx.core = core": "`ctx.core` and `ctx.devices`: " + _INDEPENDENT,
        "swap-stmts L7:c12 ctx.devices = [q.device] if q.is_cuda else []":
            "`ctx.devices` and `ctx.cpu_state`: " + _INDEPENDENT + " (reading the generator's state draws nothing)",
        "swap-stmts L8:c12 ctx.cpu_state = torch.get_rng_state()":
            "reading the CPU and the CUDA generators' states in the other order: neither read draws a number",
        "swap-stmts L9:c12 ctx.cuda_state = torch.cuda.get_rng_state(q.dev...":
            "`ctx.cuda_state` and `ctx.save_for_backward`: " + _INDEPENDENT,
        "swap-stmts L18:c16 torch.set_rng_state(ctx.cpu_state)":
            "the CPU and the CUDA generators restored in the other order, both before the recomputation: "
            "independent generators",
    },
}

#: Mutants of code that runs only on a GPU (``if q.is_cuda``): on a machine without one they pass, untested;
#: with one the grader must kill them. Exercise -> mutant id -> what the edit breaks there.
NEEDS_GPU: dict[str, dict[str, str]] = {
    "19.selective_recompute": {
        "swap-stmts L19:c16 if ctx.cuda_state is not None: torch.cuda.set_r...":
            "the CUDA generator restored after the recomputation: its dropout masks differ from forward's",
        "drop-call L20:c20 torch.cuda.set_rng_state(ctx.cuda_state, q.device)":
            "the CUDA generator never restored: the recomputation's dropout masks differ from forward's",
        "swap-args L20:c20 torch.cuda.set_rng_state(ctx.cuda_state, q.device)":
            "torch.cuda.set_rng_state(device, state) raises on a GPU",
    },
}


# ---------------------------------------------------------------------------------------------- what is edited

@dataclass
class Target:
    """One piece of source the mutants edit: ``reference`` itself, or a top-level function or class."""

    exercise: str
    name: str
    source: str
    globals: dict[str, Any]
    flags: int
    #: the namespace the edited source was run in -> the implementation to grade
    pick: Callable[[dict[str, Any]], Any]
    #: nested definitions only (``reference``'s own imports and ``return`` are not the implementation)
    nested_only: bool


def _flags(module_globals: dict[str, Any]) -> int:
    feature = module_globals.get("annotations")
    return feature.compiler_flag if isinstance(feature, __future__._Feature) else 0


def targets(name: str) -> list[Target]:
    """What to edit for exercise ``name``: ``reference()`` when it defines what it returns, and each returned
    object defined at the top level of a module."""
    module = exercise(name)
    made = module.reference()
    members = list(made) if isinstance(made, tuple | list) else [made]
    out = []
    if any("<locals>" in getattr(m, "__qualname__", "") for m in members):
        out.append(Target(name, "reference", textwrap.dedent(inspect.getsource(module.reference)), vars(module),
                          _flags(vars(module)), lambda ns: ns["reference"](), nested_only=True))
    for i, member in enumerate(members):
        if "<locals>" in getattr(member, "__qualname__", "<locals>"):
            continue
        home = inspect.getmodule(member)

        def pick(ns: dict[str, Any], i: int = i, member: Any = member) -> Any:
            if not isinstance(made, tuple | list):
                return ns[member.__name__]
            return type(made)(ns[member.__name__] if j == i else m for j, m in enumerate(members))

        out.append(Target(name, member.__name__, textwrap.dedent(inspect.getsource(member)), vars(home),
                          _flags(vars(home)), pick, nested_only=False))
    return out


def build(target: Target, source: str) -> Any:
    """Run ``source`` (the target's, edited) in a copy of its module's globals named ``__mutant__``; return the
    implementation it defines."""
    namespace = {**target.globals, "__name__": MODULE, "__spec__": None}
    code = compile(source, f"<mutant of {target.exercise} {target.name}>", "exec", flags=target.flags,
                   dont_inherit=True)
    exec(code, namespace)
    return target.pick(namespace)


# ---------------------------------------------------------------------------------------------- the edits

@dataclass(frozen=True, eq=False)
class Mutant:
    """One edit of one target. ``id`` is stable while the target's source is: the operator, the line (1 is the
    target's first line) and column, and the code edited."""

    exercise: str
    id: str
    operator: str
    description: str
    source: str = field(repr=False)
    target: Target = field(repr=False)

    def build(self) -> Any:
        return build(self.target, self.source)


def _one_line(node: ast.AST, width: int = 50) -> str:
    text = " ".join(ast.unparse(node).split())
    return text if len(text) <= width else text[:width - 3] + "..."


def _docstring(node: ast.AST) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def _editable(tree: ast.Module, nested_only: bool) -> set[int]:
    """The ids of the nodes an edit may touch: not docstrings, f-strings or annotations, and with
    ``nested_only`` only those inside the functions and classes ``reference()`` defines."""
    if nested_only:
        (ref,) = tree.body
        roots = [s for s in ref.body if isinstance(s, ast.FunctionDef | ast.ClassDef)]
    else:
        roots = tree.body
    allowed = {id(n) for root in roots for n in ast.walk(root)}
    for node in ast.walk(tree):
        skipped: list[ast.AST] = []
        if isinstance(node, ast.JoinedStr):
            skipped.append(node)
        if isinstance(node, ast.arg | ast.AnnAssign) and node.annotation is not None:
            skipped.append(node.annotation)
        if isinstance(node, ast.FunctionDef) and node.returns is not None:
            skipped.append(node.returns)
        if isinstance(node, ast.FunctionDef | ast.ClassDef | ast.Module) and node.body and _docstring(node.body[0]):
            skipped.append(node.body[0])
        for s in skipped:
            allowed -= {id(n) for n in ast.walk(s)}
    return allowed


#: An edit: (operator label, the node whose line and column the id gives, the code the id and description show,
#: a function that applies the edit to a fresh parse's nodes).
Edit = tuple[str, ast.AST, ast.AST, Callable[[list[ast.AST]], None]]


def edits(tree: ast.Module, nested_only: bool) -> list[Edit]:
    """Every edit of ``tree``, in a fixed order. Each is applied by index to the node list of a fresh parse
    (``list(ast.walk(...))``), which is the same list for the same source."""
    nodes = list(ast.walk(tree))
    index = {id(n): i for i, n in enumerate(nodes)}
    allowed = _editable(tree, nested_only)
    parents = {id(child): node for node in nodes for child in ast.iter_child_nodes(node)}
    out: list[Edit] = []

    def context(node: ast.AST) -> ast.AST:
        parent = parents.get(id(node))
        return parent if isinstance(parent, ast.expr) else node

    for node in nodes:
        if id(node) not in allowed:
            continue
        i = index[id(node)]
        if isinstance(node, ast.Constant) and type(node.value) is int:
            for delta in (1, -1):
                def apply(ns, i=i, delta=delta):
                    ns[i].value += delta
                out.append((f"const{delta:+d}", node, context(node), apply))
        if isinstance(node, ast.BinOp | ast.AugAssign) and type(node.op) in BINOPS:
            for new in BINOPS[type(node.op)]:
                def apply(ns, i=i, new=new):
                    ns[i].op = new()
                old = SYMBOL[type(node.op)] + ("=" if isinstance(node, ast.AugAssign) else "")
                label = f"binop:{old}->{SYMBOL[new]}" + ("=" if isinstance(node, ast.AugAssign) else "")
                out.append((label, node, node, apply))
        if isinstance(node, ast.BinOp) and type(node.op) in (ast.Div, ast.FloorDiv, ast.Mod):
            def apply(ns, i=i):
                ns[i].right = ast.BinOp(ns[i].right, ast.Add(), ast.Constant(1))
            out.append(("divisor+1", node, node, apply))
        if isinstance(node, ast.Compare):
            for j, op in enumerate(node.ops):
                new = COMPARISONS[type(op)]
                def apply(ns, i=i, j=j, new=new):
                    ns[i].ops[j] = new()
                out.append((f"cmp:{SYMBOL[type(op)]}->{SYMBOL[new]}", node, node, apply))
        if isinstance(node, ast.BoolOp):
            new = ast.Or if isinstance(node.op, ast.And) else ast.And
            def apply(ns, i=i, new=new):
                ns[i].op = new()
            out.append((f"boolop:{SYMBOL[type(node.op)]}->{SYMBOL[new]}", node, node, apply))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not | ast.USub):
            parent = index[id(parents[id(node)])]
            def apply(ns, i=i, parent=parent):
                _replace(ns[parent], ns[i], ns[i].operand)
            out.append(("unary:drop-" + ("not" if isinstance(node.op, ast.Not) else "minus"), node, node, apply))
        if isinstance(node, ast.Call):
            args = node.args
            if (len(args) == 2 and not node.keywords and all(isinstance(a, ast.Name | ast.Attribute) for a in args)
                    and ast.dump(args[0]) != ast.dump(args[1])):
                def apply(ns, i=i):
                    ns[i].args.reverse()
                out.append(("swap-args", node, node, apply))
            values = [(a, j, None) for j, a in enumerate(args)]
            values += [(k.value, None, j) for j, k in enumerate(node.keywords)]
            for value, pos, kw in values:
                if isinstance(value, ast.Name) and value.id in RANKISH:
                    def apply(ns, i=i, pos=pos, kw=kw):
                        if pos is not None:
                            ns[i].args[pos] = ast.Constant(0)
                        else:
                            ns[i].keywords[kw].value = ast.Constant(0)
                    out.append(("rank->0", value, node, apply))
            if isinstance(node.func, ast.Attribute) and node.func.attr in METHODS:
                for new in METHODS[node.func.attr]:
                    def apply(ns, i=i, new=new):
                        ns[i].func.attr = new
                    out.append((f"method:{node.func.attr}->{new}", node.func, node, apply))
        for part in ("body", "orelse", "finalbody"):
            block = getattr(node, part, None)
            if not isinstance(block, list) or not block or not isinstance(block[0], ast.stmt):
                continue
            for pos, stmt in enumerate(block):
                dropped = ("drop-call" if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
                           else "drop-del" if isinstance(stmt, ast.Delete) else None)
                if dropped and id(stmt) in allowed:
                    def apply(ns, i=i, part=part, pos=pos):
                        getattr(ns[i], part)[pos] = ast.Pass()
                    out.append((dropped, stmt, stmt, apply))
            for pos in range(len(block) - 1):
                a, b = block[pos], block[pos + 1]
                if _movable(a) and _movable(b) and id(a) in allowed and ast.dump(a) != ast.dump(b):
                    def apply(ns, i=i, part=part, pos=pos):
                        block = getattr(ns[i], part)
                        block[pos], block[pos + 1] = block[pos + 1], block[pos]
                    out.append(("swap-stmts", a, a, apply))
    return out


def _movable(stmt: ast.stmt) -> bool:
    """A statement whose order is the computation's (not a definition, an import or a docstring)."""
    return not (_docstring(stmt) or isinstance(stmt, ast.FunctionDef | ast.ClassDef | ast.Import | ast.ImportFrom))


def _replace(parent: ast.AST, old: ast.AST, new: ast.AST) -> None:
    for name, value in ast.iter_fields(parent):
        if value is old:
            setattr(parent, name, new)
        elif isinstance(value, list):
            for k, item in enumerate(value):
                if item is old:
                    value[k] = new


def mutants(name: str) -> list[Mutant]:
    """Every mutant of exercise ``name``'s reference, in a fixed order, each with a distinct source."""
    out: list[Mutant] = []
    seen: set[str] = set()
    for target in targets(name):
        tree = ast.parse(target.source)
        seen.add(ast.unparse(tree))
        position = {id(n): k for k, n in enumerate(ast.walk(tree))}
        prefix = "" if target.name == "reference" else f"{target.name}:"
        ordered = sorted(edits(tree, target.nested_only), key=lambda e: (e[1].lineno, e[1].col_offset))
        for label, at, shown, apply in ordered:
            fresh = ast.parse(target.source)
            before = _one_line(shown)
            nodes = list(ast.walk(fresh))
            apply(nodes)
            ast.fix_missing_locations(fresh)
            source = ast.unparse(fresh)
            if source in seen:
                continue
            seen.add(source)
            edited = nodes[position[id(shown)]]
            after = _one_line(edited.operand if isinstance(edited, ast.UnaryOp) and label.startswith("unary")
                              else edited)
            mutant_id = f"{label} {prefix}L{at.lineno}:c{at.col_offset} {before}"
            while any(m.id == mutant_id for m in out):
                mutant_id += "'"
            family = next(op for op in OPERATORS if label.startswith(op))
            out.append(Mutant(name, mutant_id, family, _describe(label, before, after), source, target))
    return out


def _describe(label: str, before: str, after: str) -> str:
    if label in ("drop-call", "drop-del"):
        return f"`{before}` left out"
    if label == "swap-stmts":
        return f"`{before}` moved after the statement that follows it"
    return f"`{before}` became `{after}`"


def original(name: str) -> Any:
    """The reference built the way the mutants are (unedited source, module ``__mutant__``): it must pass."""
    (target, *_) = targets(name)
    return build(target, target.source)


# ---------------------------------------------------------------------------------------------- grading them

@dataclass
class Outcome:
    """What the grader made of one mutant: ``killed`` (failed it), ``survived`` (passed it) or ``invalid`` (it
    does not even build), with the seconds it took and the first problem reported (or the error)."""

    mutant: Mutant
    status: str
    seconds: float
    detail: str = ""


def grade(mutant: Mutant, limit_s: float = LIMIT_S) -> Outcome:
    """Build ``mutant`` and grade it; an error raised by ``check`` itself counts as killed, its text kept."""
    try:
        impl = mutant.build()
    except Exception as exc:            # noqa: BLE001 -- an edit that does not even define the implementation
        return Outcome(mutant, "invalid", 0.0, f"{type(exc).__name__}: {exc}")
    start = time.monotonic()
    try:
        report = check(mutant.exercise, impl, quiet=True, limit_s=limit_s)
    except Exception as exc:            # noqa: BLE001 -- recorded, and not a pass
        return Outcome(mutant, "killed", time.monotonic() - start, f"check raised {type(exc).__name__}: {exc}")
    seconds = time.monotonic() - start
    if report.passed:
        return Outcome(mutant, "survived", seconds)
    return Outcome(mutant, "killed", seconds, report.problems[0] if report.problems else report.text())


def equivalent(mutant: Mutant) -> str | None:
    """The argument that ``mutant`` cannot change the result, traffic or memory, if one is recorded."""
    return KNOWN_EQUIVALENT.get(mutant.exercise, {}).get(mutant.id)


def needs_gpu(mutant: Mutant) -> str | None:
    """What ``mutant`` breaks, when it edits code that runs only on a GPU and this machine has none."""
    import torch

    return None if torch.cuda.is_available() else NEEDS_GPU.get(mutant.exercise, {}).get(mutant.id)


def sample(found: list[Mutant], k: int, seed: int = 0) -> list[Mutant]:
    """A fixed choice of ``k`` mutants: one of each of several operators (in an order drawn for the exercise),
    then at random, all seeded; never one argued equivalent or one only a GPU can kill on a machine without one
    (it passes: a whole grading run that shows nothing)."""
    pool = [m for m in found if equivalent(m) is None and needs_gpu(m) is None]
    draw = random.Random(f"{seed} {pool[0].exercise}" if pool else seed)
    chosen: list[Mutant] = []
    for op in draw.sample(OPERATORS, len(OPERATORS)):
        of_op = [m for m in pool if m.operator == op]
        if of_op and len(chosen) < k:
            chosen.append(draw.choice(of_op))
    rest = [m for m in pool if m not in chosen]
    chosen += draw.sample(rest, min(len(rest), k - len(chosen)))
    return [m for m in pool if m in chosen]           # in the mutants' own order
