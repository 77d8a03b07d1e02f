"""Exercise 19.selective_recompute: recompute a block's attention core during backward, built by hand.

Write ``class SelectiveRecompute(torch.nn.Module)``: ``SelectiveRecompute(core)`` wraps an attention core — a
module with no parameters computing ``core(q, k, v)`` from tensors shaped (batch, heads, time, head_dim), here
with dropout on its probabilities — so that between forward and backward only ``q``, ``k`` and ``v`` are kept for
it (not the heads x time x time scores, probabilities and dropout mask), and the backward pass runs the core
again to get its gradients. That is Korthikanti et al.'s selective recomputation (2022), the part of a block
whose activations grow with the sequence squared. Build it from a ``torch.autograd.Function`` of your own, not
with ``torch.utils.checkpoint`` (nor ``checkpoint_wrapper``, nor the course's ``recompute``), which do it for you.

What must hold (what the grader checks, on 2 processes: rank 0 computes on the CPU, rank 1 on a GPU when the
machine has one; each rank its own batch and its own dropout masks, every input seeded). Four cases, in order:

1. a 2-layer GPT whose blocks' cores you wrap (4 heads of 8, sequence 24, dropout p = 0.1): one forward, then
   backward;
2. the same with two micro-batches before one backward (loss = loss1 + loss2, gradient accumulation: every
   core runs twice before its first backward; 2 heads of 8, sequence 40, p = 0.3);
3. q, k, v read more than once before backward (3 heads of 5, sequence 17, p = 0.2): two wrapped cores reading
   the same q, k, v; one wrapped core called twice on them; one tensor passed as both q and k;
4. dropout p = 0, nothing random (a 3-layer GPT, 1 head of 16, sequence 9).

In each, against the same model (or cores) without recomputation, on the same inputs with the same dropout masks:

* the loss (the outputs) and every parameter's gradient (q's, k's and v's) equal, within float32 rounding (the
  same operations run again); the inputs unchanged, still leaves that require grad;
* what autograd saves during each wrapped call (counted with saved-tensor hooks, storage by storage) is at most
  its q, k, v, its output and the random generator's state: no tensor of heads x time x time, and none alive
  between forward and backward anywhere else (on ``ctx`` or on the module);
* the core itself runs exactly once in forward and once during backward, per call (its runs are counted where
  they happen, whatever calls it);
* the core never runs inside ``torch.utils.checkpoint`` (seen from the code that runs, whatever name it was
  imported under);
* after the step, the random numbers training draws next (CPU and GPU) are those it draws without
  recomputation.

Hints: the backward of your Function gets only what its forward left on ``ctx``: autograd makes one ``ctx`` per
call, so two calls before one backward each find their own there (which other place would the second call
overwrite?). Dropout must draw the same mask the second time: what decides which numbers it draws, on the CPU
and on a GPU, and how do you put that back for the recomputation without moving the numbers training draws
afterwards? In backward, the recomputation is an ordinary forward with a graph; differentiate it with respect
to tensors that belong to this recomputation alone, and give autograd one gradient per input of forward (it adds
them up when an input is read twice).
"""

from __future__ import annotations

import gc
import inspect
import math
import os
import sys
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dtlab.exercises.grading import Case, Rank, Report, compare, grade_cases, run_ranks

NPROCS = 2
VOCAB = 32

#: The cases, in the order they are graded (all on 2 processes: no communication is involved, the ranks give
#: two devices and two sets of dropout masks). ``kind``: "gpt" (a TinyGPT whose cores are wrapped; ``micro``
#: micro-batches before one backward) or "shared" (wrapped cores called directly on leaf q, k, v).
CASES = [
    Case("a 2-layer GPT, 4 heads of 8, sequence 24, batch 2, dropout p = 0.1: one forward, then backward", 2,
         {"kind": "gpt", "layers": 2, "heads": 4, "head_dim": 8, "seq": 24, "batch": 2, "p": 0.1, "micro": 1}),
    Case("two micro-batches before one backward (loss = loss1 + loss2): a 2-layer GPT, 2 heads of 8, sequence 40, "
         "batch 2, dropout p = 0.3", 2,
         {"kind": "gpt", "layers": 2, "heads": 2, "head_dim": 8, "seq": 40, "batch": 2, "p": 0.3, "micro": 2}),
    Case("q, k, v read more than once before backward (two wrapped cores on the same q, k, v; one wrapped core "
         "called twice; one tensor as both q and k): 3 heads of 5, sequence 17, batch 2, dropout p = 0.2", 2,
         {"kind": "shared", "heads": 3, "head_dim": 5, "seq": 17, "batch": 2, "p": 0.2}),
    Case("dropout p = 0 (nothing random): a 3-layer GPT, 1 head of 16, sequence 9, batch 3", 2,
         {"kind": "gpt", "layers": 3, "heads": 1, "head_dim": 16, "seq": 9, "batch": 3, "p": 0.0, "micro": 1}),
]

#: The shared-input experiments of case 3: name -> the calls, each (which wrapped core, which of q, k, v it reads).
SHARED = {
    "two wrapped cores reading the same q, k, v": [(0, "qkv"), (1, "qkv")],
    "one wrapped core called twice on the same q, k, v": [(0, "qkv"), (0, "qkv")],
    "one tensor passed as both q and k": [(0, "qqv")],
}

#: Where a core run is: the grader sets the phase around ``loss.backward()`` and the window around each wrapped call.
_STATE: dict[str, Any] = {"phase": "forward", "window": None}
#: What a wrapped call may save besides q, k, v and its output: the random generators' states, as tensors.
_STATE_ALLOWANCE = torch.get_rng_state().numel() + 1024
#: Source files whose frames around a core run mean torch's checkpoint (or a wrapper of it) is running it.
_CHECKPOINT_FILES = (os.path.join("torch", "utils", "checkpoint.py"), "checkpoint_wrapper.py",
                     os.path.join("dtlab", "activations.py"))


def _inside_checkpoint() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_CHECKPOINT_FILES):
            return True
        frame = frame.f_back
    return False


class DropoutAttentionCore(nn.Module):
    """Causal attention written out, with dropout on the probabilities: softmax(q k^T / sqrt(d)) -> dropout -> @ v.
    ``runs`` records each of its forward runs: (the grader's phase, grad mode, inside torch's checkpoint)."""

    def __init__(self, p: float = 0.1):
        super().__init__()
        self.p = p
        self.runs: list[tuple[str, bool, bool]] = []

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.runs.append((_STATE["phase"], torch.is_grad_enabled(), _inside_checkpoint()))
        t = q.shape[-2]
        future = torch.full((t, t), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1])) + future
        return F.dropout(torch.softmax(scores, dim=-1), self.p, self.training) @ v


class _Probe(nn.Module):
    """The grader's frame around one wrapped core: counts its calls and opens the window in which what autograd
    saves is that core's; notes what the call may keep (its inputs' storages and its output)."""

    def __init__(self, inner: Any, index: int):
        super().__init__()
        self.inner, self.index = inner, index
        self.calls, self.allowed = 0, 0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        self.calls += 1
        storages = {(t.device.type, t.untyped_storage().data_ptr()): max(t.untyped_storage().nbytes(),
                                                                         t.numel() * t.element_size())
                    for t in (q, k, v)}
        previous, _STATE["window"] = _STATE["window"], self.index
        try:
            out = self.inner(q, k, v)
        finally:
            _STATE["window"] = previous
        self.allowed += sum(storages.values()) + (out.numel() * out.element_size() if torch.is_tensor(out) else 0)
        return out


class _Kept:
    """Saved-tensor hooks: each storage autograd saves, counted once, charged to the wrapped call it was saved in."""

    def __init__(self, seq: int):
        self.seq = seq
        self.bytes: dict[int, int] = {}
        self.shapes: dict[int, list[tuple[int, ...]]] = {}
        self.square: dict[int, int] = {}
        self._seen: set[tuple] = set()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            key, nbytes = (t.device.type, t.device.index, t.untyped_storage().data_ptr()), t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError, TypeError):   # a tensor without a plain storage: its own bytes
            key, nbytes = ("id", id(t)), t.numel() * t.element_size()
        window = _STATE["window"]
        if key not in self._seen:
            self._seen.add(key)
            if window is not None:
                self.bytes[window] = self.bytes.get(window, 0) + nbytes
                self.shapes.setdefault(window, []).append(tuple(t.shape))
                if _is_square(t, self.seq):
                    self.square[window] = self.square.get(window, 0) + 1
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t


def _is_square(t: Any, seq: int) -> bool:
    return t.dim() >= 2 and tuple(t.shape[-2:]) == (seq, seq) and t.numel() > seq * seq


def _alive_square(seq: int) -> list[tuple[int, ...]]:
    """Shapes of the time x time tensors (more than one) alive now, wherever they are held."""
    gc.collect()
    found = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for o in gc.get_objects():
            try:
                if isinstance(o, torch.Tensor) and _is_square(o, seq):
                    found.append(tuple(o.shape))
            except Exception:     # noqa: BLE001 -- an object that cannot be asked what it is: not a tensor
                continue
    return found


def _device(me: Rank) -> torch.device:
    """Rank 0 computes on the CPU, rank 1 on a GPU when there is one (the dropout masks of both generators)."""
    if me.rank % 2 == 0:
        return torch.device("cpu")
    if me.device.type == "cuda":
        return me.device
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _step(dev: torch.device, seq: int, seed: int, forward: Any, probes: list[_Probe], cores: list[Any],
          learner: bool) -> dict[str, Any]:
    """One training step's forward (``forward()`` returns the outputs and the loss) and backward, watched."""
    kept = _Kept(seq)
    torch.manual_seed(seed)
    _STATE["phase"], _STATE["window"] = "forward", None
    with torch.autograd.graph.saved_tensors_hooks(kept.pack, kept.unpack):
        outs, loss = forward()
    alive = _alive_square(seq) if learner else []
    _STATE["phase"] = "backward"
    try:
        loss.backward()
    finally:
        _STATE["phase"] = "after"
    return {"outs": [o.detach().cpu() if torch.is_tensor(o) else None for o in outs],
            "kept": kept.bytes, "shapes": kept.shapes, "square": kept.square, "alive": alive,
            "allowed": [p.allowed for p in probes], "calls": [p.calls for p in probes],
            "runs": [list(c.runs) for c in cores],
            "next": (torch.rand(1).item(), torch.rand(1, device=dev).item() if dev.type == "cuda" else None)}


def _gpt_run(wrap: Any, dev: torch.device, c: dict, tokens: list[torch.Tensor], seed: int) -> dict[str, Any]:
    from dtlab import models

    torch.manual_seed(0)
    model = models.TinyGPT(vocab_size=VOCAB, block_size=c["seq"], n_layer=c["layers"], n_head=c["heads"],
                           n_embd=c["heads"] * c["head_dim"], fused_attention=False)
    cores, probes = [], []
    for i, block in enumerate(model.blocks):
        core = DropoutAttentionCore(c["p"])
        cores.append(core)
        probes.append(_Probe(wrap(core) if wrap is not None else core, i))
        block.attn.core = probes[-1]
    model.to(dev).train()

    def forward() -> tuple[list, torch.Tensor]:
        losses = [model(t[:, :-1], t[:, 1:])[1] for t in tokens]
        return losses, sum(losses[1:], losses[0])
    out = _step(dev, c["seq"], seed, forward, probes, cores, wrap is not None)
    out["grads"] = {n: (p.grad.detach().cpu() if p.grad is not None else None) for n, p in model.named_parameters()
                    if ".attn.core." not in n}          # the model's own parameters (a wrapper has none)
    return out


def _shared_run(wrap: Any, dev: torch.device, c: dict, calls: list[tuple[int, str]], seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    shape = (c["batch"], c["heads"], c["seq"], c["head_dim"])
    leaves = {name: torch.randn(shape, generator=g).to(dev).requires_grad_(True) for name in "qkv"}
    weights = [torch.randn(shape, generator=g).to(dev) for _ in calls]
    before = {name: t.detach().clone() for name, t in leaves.items()}
    cores = [DropoutAttentionCore(c["p"]) for _ in range(2)]
    probes = [_Probe(wrap(core) if wrap is not None else core, i).to(dev).train() for i, core in enumerate(cores)]

    def forward() -> tuple[list, torch.Tensor]:
        outs = [probes[i](*(leaves[name] for name in names)) for i, names in calls]
        return outs, sum((o * w).sum() for o, w in zip(outs, weights))
    out = _step(dev, c["seq"], seed, forward, probes, cores, wrap is not None)
    out["grads"] = {name: (t.grad.detach().cpu() if t.grad is not None else None) for name, t in leaves.items()}
    out["changed"] = [name for name, t in leaves.items() if not torch.equal(t.detach(), before[name])]
    out["not_leaves"] = [name for name, t in leaves.items() if not (t.is_leaf and t.requires_grad)]
    return out


def _body(impl: Any, me: Rank, c: dict) -> dict[str, Any]:
    from dtlab.exercises.grading import course_code

    me.tracer.watch(course_code(*_watched()))     # here, unwrapped: a decorator's code is shared with others
    dev = _device(me)
    seed = 7 + me.rank                                    # each rank its own batch and its own dropout masks
    runs: dict[str, Any] = {"device": dev.type}
    if c["kind"] == "gpt":
        tokens = [torch.randint(0, VOCAB, (c["batch"], c["seq"] + 1),
                                generator=torch.Generator().manual_seed(100 + 10 * m + me.rank)).to(dev)
                  for m in range(c["micro"])]
        runs["steps"] = {"": (_gpt_run(None, dev, c, tokens, seed), _gpt_run(impl, dev, c, tokens, seed))}
        if c["micro"] > 1:                            # the first micro-batch alone: is it the accumulation?
            runs["alone"] = (_gpt_run(None, dev, c, tokens[:1], seed), _gpt_run(impl, dev, c, tokens[:1], seed))
    else:
        runs["steps"] = {what: (_shared_run(None, dev, c, calls, seed), _shared_run(impl, dev, c, calls, seed))
                         for what, calls in SHARED.items()}
    return runs


def _watched() -> tuple:
    """torch's recomputation (``torch.utils.checkpoint``'s entry points, ``checkpoint_wrapper``) and the course's
    ``recompute``, each function unwrapped from its decorators (a decorator's code is shared with others)."""
    import torch.utils.checkpoint as cp

    from dtlab import activations

    objects: list[Any] = [getattr(cp, name) for name in (
        "checkpoint", "checkpoint_sequential", "CheckpointFunction", "_checkpoint_without_reentrant_generator",
        "_checkpoint_without_reentrant", "_checkpoint_hook", "_recomputation_hook", "_NoopSaveInputs",
        "_CachingTorchDispatchMode", "_CachedTorchDispatchMode", "create_selective_checkpoint_contexts")
        if hasattr(cp, name)]
    try:
        from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw
        objects += [getattr(cw, name) for name in ("checkpoint_wrapper", "CheckpointWrapper", "apply_activation_"
                                                   "checkpointing") if hasattr(cw, name)]
    except ImportError:                                 # pragma: no cover -- a torch without torch.distributed
        pass
    objects += [activations.recompute]
    found = []
    for obj in objects:
        members = [m for m in vars(obj).values()] if inspect.isclass(obj) else [obj]
        for m in members:
            m = getattr(m, "__func__", m)
            m = getattr(m, "fget", m)
            if not callable(m) or inspect.isclass(m):
                continue
            m = inspect.unwrap(m)
            code = getattr(m, "__code__", None)
            if code is not None and code.co_filename.endswith(_CHECKPOINT_FILES) and hasattr(m, "__qualname__"):
                found.append(m)
    return tuple(found)


def grade(impl: Any, report: Report, nprocs: int | None = None, limit_s: float = 30.0) -> Report:
    """Grade ``impl`` (your ``SelectiveRecompute`` class) on each case (those on ``nprocs`` processes, if given)."""
    held: dict[str, Any] = {}
    grade_cases(report, CASES, lambda case, rep: _grade_case(impl, case, rep, limit_s, held), nprocs)
    if report.passed:
        report.ok("in every case the loss (outputs) and every gradient equal the same model (cores) without "
                  f"recomputation, with the same dropout masks, on {' and '.join(sorted(held['devices']))}")
        if "kept" in held:
            report.ok(f"in case 1 the wrapped calls kept {held['kept'][0]:,} bytes for backward instead of "
                      f"{held['kept'][1]:,} (at most q, k, v, the output and the random state per call): no time x "
                      "time tensor saved, none alive between forward and backward")
        report.ok("each core ran once in forward and once during backward per call, never inside "
                  "torch.utils.checkpoint; training's random stream goes on as without recomputation")
    return report


def _grade_case(impl: Any, case: Case, report: Report, limit_s: float, held: dict[str, Any]) -> None:
    c = case.params
    out = run_ranks(report, _body, impl, c, nprocs=case.nprocs, limit_s=limit_s)
    if out is None:
        return
    # which ranks' gradients are right, for telling a CPU-only or GPU-only random state apart
    right = {rank: all(_grads_right(ref, yours) for ref, yours in r["steps"].values()) for rank, r in enumerate(out)}
    for rank, r in enumerate(out):
        where = f"rank {rank} ({r['device']})"
        seen = _shown(r["traffic"]["seen"])
        if seen:
            report.fail(f"{where}: your code runs {', '.join(seen)}: the exercise is to write the recomputation",
                        "build it from a torch.autograd.Function of your own: torch.utils.checkpoint (and "
                        "checkpoint_wrapper, and the course's recompute) does it for you")
        for what, (ref, yours) in r["steps"].items():
            here = f"{where}, {what}" if what else where
            _check_step(report, here, c, ref, yours, r, rank, right, what, bool(seen))
    held.setdefault("devices", set()).update(o["device"] for o in out)
    if c["kind"] == "gpt" and "kept" not in held:
        ref, yours = out[0]["steps"][""]
        held["kept"] = (sum(yours["kept"].values()), sum(ref["kept"].values()))


def _shown(seen: list[str]) -> list[str]:
    """The watched code that ran, as the objects a learner calls (a method by its class; the public ones when any
    ran): each name is its module's, then the object's qualified name."""
    _watched()                                          # their modules imported here too
    objects = set()
    for name in seen:
        parts = name.split(".")
        cut = next((i for i in range(len(parts) - 1, 0, -1) if ".".join(parts[:i]) in sys.modules), len(parts) - 1)
        objects.add(".".join(parts[:cut + 1]))
    public = sorted(o for o in objects if not o.split(".")[-1].startswith("_"))
    return [f"the course's own recompute ({o})" if o.startswith("dtlab.") else o for o in public or sorted(objects)]


def _grads_right(ref: dict, yours: dict) -> bool:
    expected = {n: g for n, g in ref["grads"].items() if g is not None}
    return all(yours["grads"].get(n) is not None and yours["grads"][n].shape == g.shape
               and (yours["grads"][n] - g).abs().max().item() <= _bound(expected) for n, g in expected.items())


def _bound(grads: dict[str, torch.Tensor]) -> float:
    scale = max((g.abs().max().item() for g in grads.values() if g.numel()), default=0.0)
    return 64 * 2.0 ** -23 * scale          # the same operations run again: rounding-level at most


def _check_step(report: Report, where: str, c: dict, ref: dict, yours: dict, r: dict, rank: int,
                right: dict[int, bool], what: str, seen: bool) -> None:
    before = len(report.problems)
    # 1. the core's own runs: inside checkpoint, in forward, during backward
    if any(run[2] for runs in yours["runs"] for run in runs) and not seen:
        report.fail(f"{where}: the core ran inside torch.utils.checkpoint",
                    "build it from a torch.autograd.Function of your own: torch.utils.checkpoint (and "
                    "checkpoint_wrapper, and the course's recompute) does it for you")
    in_forward = [sum(1 for run in runs if run[0] == "forward") for runs in yours["runs"]]
    in_backward = [sum(1 for run in runs if run[0] == "backward") for runs in yours["runs"]]
    calls = yours["calls"]
    used = [i for i, n in enumerate(calls) if n]
    if any(in_forward[i] != calls[i] or in_backward[i] != calls[i] for i in used):
        shown = "; ".join(f"core {i}: {in_forward[i]} run{'s' if in_forward[i] != 1 else ''} in forward, "
                          f"{in_backward[i]} during backward" + (f" ({calls[i]} calls)" if calls[i] > 1 else "")
                          for i in used)
        report.fail(f"{where}: {shown} (expected once in forward and once during backward, per call)",
                    "nothing was recomputed: backward must run the core again"
                    if not any(in_backward[i] for i in used) else
                    "the core ran more than once in forward: run it once, without a graph, and return its output"
                    if any(in_forward[i] > calls[i] for i in used) else
                    "run the core once per backward and take every input's gradient from that one recomputation"
                    if any(in_backward[i] > calls[i] for i in used) else
                    "every call's backward must run the core again (one recomputation per call)")
    # 2. what the forward kept: per wrapped call, and anywhere (ctx, the module) between forward and backward
    for i in used:
        kept, allowed = yours["kept"].get(i, 0), yours["allowed"][i] + calls[i] * _STATE_ALLOWANCE
        square = yours["square"].get(i, 0)
        if kept > allowed or square:
            shapes = ", ".join(str(s) for s in yours["shapes"].get(i, [])[:6])
            report.fail(f"{where}: during the calls of core {i}, autograd saved {kept:,} bytes ({square} tensors of "
                        f"time x time; shapes {shapes}), {ref['kept'].get(i, 0):,} without recomputation; q, k, v, "
                        f"the output and the random state are {allowed:,}",
                        "run the core in forward without building a graph (torch.no_grad()) and save only its "
                        "inputs for backward (ctx.save_for_backward)")
            break
    if yours["alive"]:
        report.fail(f"{where}: between forward and backward, {len(yours['alive'])} time x time tensors were alive "
                    f"(shapes {', '.join(str(s) for s in yours['alive'][:4])}), held outside autograd's saved "
                    "tensors", "keep nothing time x time on ctx or on the module: backward recomputes it")
    # 3. the forward's result, the inputs
    outs_ref, outs = ref["outs"], yours["outs"]
    forward_differs = False
    for j, (o_ref, o) in enumerate(zip(outs_ref, outs)):
        label = ("loss" if c["kind"] == "gpt" else "output") + (f" {j}" if len(outs) > 1 else "")
        if o is None:
            got = "it is not a tensor"
        elif o.shape != o_ref.shape:
            got = f"shape {tuple(o.shape)}, expected {tuple(o_ref.shape)}"
        else:
            diff = (o - o_ref).abs().max().item()
            if diff <= 1e-5 * (1 + o_ref.abs().max().item()):
                continue
            got = f"off by {diff:.2e}"
        report.fail(f"{where}: the forward's {label} differs from the same cores' without recomputation ({got})",
                    "forward must return what the core returns, drawing the masks training would draw: run the "
                    "core on the inputs as they are, without reseeding or moving the random generator first")
        forward_differs = True
        break
    for name in yours.get("changed", []):
        report.fail(f"{where}: {name} was modified by your code (it holds other values after the step)",
                    "another layer reads the same q, k, v: never modify the inputs in place")
    for name in yours.get("not_leaves", []):
        report.fail(f"{where}: after the step, {name} no longer requires grad as a leaf",
                    "recompute on copies of the inputs (detach() returns a new tensor), never detach the inputs "
                    "themselves in place")
    # 4. the gradients
    missing = [n for n, g in yours["grads"].items() if g is None and ref["grads"][n] is not None]
    if missing:
        report.fail(f"{where}: {'parameters' if c['kind'] == 'gpt' else 'inputs'} {', '.join(missing[:3])} got no "
                    "gradient", "backward must return one gradient per input of forward, in the order of forward's "
                    "inputs, from the recomputed output")
    expected = {n: g for n, g in ref["grads"].items() if g is not None and n not in missing}
    bound = _bound(expected)
    worst = compare(report, where, yours["grads"], expected, bound, "gradient of",
                    against="the same cores without recomputation")
    if worst > bound and not forward_differs and not missing:
        report.fail(f"{where}: the gradients differ although the same operations ran again",
                    _grads_cause(c, where, yours, r, rank, right, what))
    # 5. training's random stream, when all else held
    if len(report.problems) == before and yours["next"] != ref["next"]:
        report.fail(f"{where}: after your training step, the random stream is not where it is without recomputation",
                    "put the generator's state back after the recomputation (torch.random.fork_rng does both): "
                    "training's own random numbers must go on unchanged")



def _grads_cause(c: dict, where: str, yours: dict, r: dict, rank: int, right: dict[int, bool], what: str) -> str:
    square = any(yours["square"].values())
    if square:
        return "the core's backward did not run on the recomputation"
    if "alone" in r and _grads_right(*r["alone"]):
        return ("with one micro-batch the gradients are right, with two forwards before one backward they are not: "
                "the second forward overwrote what the first one left for its backward (inputs or random state) — "
                "keep it on ctx (one per call), not on the module (self.) or in a global")
    if what.startswith("one wrapped core called twice"):
        return ("the second call overwrote what the first one left for its backward: keep each call's inputs and "
                "random state on ctx (one per call), not on the module (self.)")
    if what.startswith("one tensor passed as both"):
        return ("one tensor passed as q and k: differentiating the recomputation with respect to that tensor twice "
                "gives its whole gradient for both, and autograd adds them again; recompute on a separate detached "
                "copy of each input (t.detach().requires_grad_()) and differentiate with respect to those")
    if what.startswith("two wrapped cores"):
        return ("two cores read the same q, k, v and autograd adds what their backwards return: return each "
                "call's own gradients, without writing into .grad and without touching the inputs")
    if c["p"] == 0:
        return ("with no dropout the recomputation is the same function: backward must return the recomputed "
                "output's gradients with respect to q, k and v (weighted by the incoming gradient), in that order")
    others = [o for o in right if o != rank]
    if r["device"] == "cuda" and others and all(right[o] for o in others):
        return ("right on the CPU, wrong on the GPU: dropout on a GPU draws from the GPU's generator; save and "
                "restore its state too, not only the CPU's")
    if r["device"] == "cpu" and any(right[o] for o in others):
        return ("right on the GPU, wrong on the CPU: dropout on the CPU draws from the CPU generator; save and "
                "restore its state too, not only the GPU's")
    return ("the recomputed core drew other dropout masks: the random generator must be where it was in forward "
            "when the core runs again (save its state in forward, restore it around the recomputation)")


def reference() -> Any:
    """A correct implementation (the grader's own test uses it; try yours first)."""
    class _Recompute(torch.autograd.Function):
        @staticmethod
        def forward(ctx, core, q, k, v):
            ctx.core = core
            ctx.devices = [q.device] if q.is_cuda else []
            ctx.cpu_state = torch.get_rng_state()
            ctx.cuda_state = torch.cuda.get_rng_state(q.device) if q.is_cuda else None
            ctx.save_for_backward(q, k, v)
            with torch.no_grad():
                return core(q, k, v)

        @staticmethod
        def backward(ctx, grad_out):
            q, k, v = (t.detach().requires_grad_(True) for t in ctx.saved_tensors)
            with torch.random.fork_rng(devices=ctx.devices):
                torch.set_rng_state(ctx.cpu_state)
                if ctx.cuda_state is not None:
                    torch.cuda.set_rng_state(ctx.cuda_state, q.device)
                with torch.enable_grad():
                    out = ctx.core(q, k, v)
            return (None, *torch.autograd.grad(out, (q, k, v), grad_out))

    class SelectiveRecompute(nn.Module):
        def __init__(self, core: nn.Module):
            super().__init__()
            self.core = core

        def forward(self, q, k, v):
            return _Recompute.apply(self.core, q, k, v)

    return SelectiveRecompute
