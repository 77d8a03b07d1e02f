"""Exercise 19.selective_recompute: recompute a block's attention core during backward, built by hand.

Write ``class SelectiveRecompute(torch.nn.Module)``: ``SelectiveRecompute(core)`` wraps an attention core — a
module with no parameters computing ``core(q, k, v)`` from tensors shaped (batch, heads, time, head_dim), here
with dropout on its probabilities — so that between forward and backward the block keeps only ``q``, ``k`` and
``v`` for it (not the heads x time x time scores, probabilities and dropout mask), and the backward pass runs the
core again to get its gradients. That is Korthikanti et al.'s selective recomputation (2022), the part of a block
whose activations grow with the sequence squared. Build it from a ``torch.autograd.Function`` (forward under
``torch.no_grad()``, backward under ``torch.enable_grad()``), not with ``torch.utils.checkpoint``, which does it
for you.

What must hold (what the grader checks, on each of 2 processes, a small GPT whose blocks' cores you wrap):

* the gradients of every parameter equal those of the same model without recomputation, on the same batch
  with the same dropout masks (within float32 rounding: the same operations run again);
* the forward keeps, for each core, no more than ``q``, ``k`` and ``v`` (counted with saved-tensor hooks,
  ``dtlab.activations.SavedTensors``): at least the probabilities and the mask less than without recomputation;
* the core runs twice per training step and no more: once in forward, once in backward;
* no ``torch.utils.checkpoint``.

Hints: ``ctx.save_for_backward`` what backward needs; dropout must draw the same mask the second time (save the
random generator's state in forward — ``torch.get_rng_state()``, and ``torch.cuda.get_rng_state(device)`` on a
GPU — and restore it around the recomputation, inside ``torch.random.fork_rng`` so training's own random stream
goes on unchanged); in backward, recompute on detached inputs that require grad and use ``torch.autograd.grad``;
return one gradient per input of forward.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dtlab.exercises.grading import Rank, Report, compare, run_ranks

NPROCS = 2
BATCH, SEQ, EMBD, HEADS, LAYERS, VOCAB, P_DROP = 2, 24, 32, 4, 2, 32, 0.1


class DropoutAttentionCore(nn.Module):
    """Causal attention written out, with dropout on the probabilities: softmax(q k^T / sqrt(d)) -> dropout -> @ v.
    ``calls`` counts its forward runs (the grader reads it)."""

    def __init__(self, p: float = P_DROP):
        super().__init__()
        self.p, self.calls = p, 0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        t = q.shape[-2]
        future = torch.full((t, t), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1])) + future
        return F.dropout(torch.softmax(scores, dim=-1), self.p, self.training) @ v


def _model(wrap: Any, device: torch.device) -> tuple[nn.Module, list[DropoutAttentionCore]]:
    from dtlab import models

    torch.manual_seed(0)
    model = models.TinyGPT(vocab_size=VOCAB, block_size=SEQ, n_layer=LAYERS, n_head=HEADS, n_embd=EMBD,
                           fused_attention=False)
    cores = []
    for block in model.blocks:
        core = DropoutAttentionCore()
        cores.append(core)
        block.attn.core = wrap(core) if wrap is not None else core
    return model.to(device).train(), cores


def _body(impl: Any, me: Rank) -> dict[str, Any]:
    import torch.utils.checkpoint as checkpoint

    from dtlab.activations import SavedTensors

    uses = []
    original = checkpoint.checkpoint
    checkpoint.checkpoint = lambda *a, **k: (uses.append(1), original(*a, **k))[1]
    g = torch.Generator().manual_seed(100 + me.rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g).to(me.device)
    seed = 7 + me.rank                                    # each rank its own batch and its own dropout masks
    try:
        runs = {}
        for name, wrap in (("reference", None), ("yours", impl)):
            model, cores = _model(wrap, me.device)
            torch.manual_seed(seed)
            with SavedTensors(exclude=model.parameters()) as saved:
                loss = model(tokens[:, :-1], tokens[:, 1:])[1]
            in_forward = [c.calls for c in cores]
            loss.backward()
            runs[name] = {"grads": {n: (p.grad.detach().cpu() if p.grad is not None else None)
                                    for n, p in model.named_parameters()},
                          "saved": saved.bytes, "in_forward": in_forward, "calls": [c.calls for c in cores],
                          "square": sum(1 for s in saved.shapes if len(s) >= 2 and s[-1] == s[-2] == SEQ),
                          "next_random": torch.rand(1).item()}     # where training's random stream goes on
    finally:
        checkpoint.checkpoint = original
    return {**runs, "checkpoint_calls": len(uses)}


def grade(impl: Any, report: Report, nprocs: int = NPROCS, limit_s: float = 30.0) -> Report:
    """Grade ``impl`` (your ``SelectiveRecompute`` class) on ``nprocs`` processes into ``report``."""
    out = run_ranks(report, _body, impl, nprocs=nprocs, limit_s=limit_s)
    if out is None:
        return report
    for rank, r in enumerate(out):
        where = f"rank {rank}"
        if r["checkpoint_calls"]:
            report.fail(f"{where}: torch.utils.checkpoint was called {r['checkpoint_calls']} times",
                        "build the recomputation yourself from a torch.autograd.Function: checkpoint does it for you")
        ref_run, yours = r["reference"], r["yours"]
        missing = [n for n, g in yours["grads"].items() if g is None and ref_run["grads"][n] is not None]
        if missing:
            report.fail(f"{where}: parameters {', '.join(missing[:3])} got no gradient",
                        "backward must return one gradient per input of forward (q, k and v), computed with "
                        "torch.autograd.grad on the recomputed output")
        ref = {n: g for n, g in ref_run["grads"].items() if g is not None and n not in missing}
        scale = max(g.abs().max().item() for g in ref.values())
        bound = 64 * 2.0 ** -23 * scale          # the same operations run again: rounding-level at most
        worst = compare(report, where, yours["grads"], ref, bound, "gradient of",
                        against="the model without recomputation")
        if worst > bound and not missing and not r["checkpoint_calls"] and not yours["square"]:
            report.fail(f"{where}: the gradients differ although the same operations ran again",
                        "the recomputed core drew other dropout masks: save the random generator's state in forward "
                        "and restore it (inside torch.random.fork_rng) before running the core again")
        layers = len(yours["calls"])
        limit = ref_run["saved"] - layers * (BATCH * HEADS * SEQ * SEQ * (4 + 1))   # fp32 probabilities + bool mask
        if yours["saved"] > limit or yours["square"]:
            report.fail(f"{where}: the forward kept {yours['saved']:,} bytes for backward, {ref_run['saved']:,} "
                        f"without recomputation; keeping only q, k, v per core it keeps at most {limit:,} "
                        f"({yours['square']} saved tensors are time x time)",
                        "run the core under torch.no_grad() in forward and save only q, k and v "
                        "(ctx.save_for_backward)")
        twice = all(c == 2 for c in yours["calls"]) and all(c == 1 for c in yours["in_forward"])
        if not twice:
            report.fail(f"{where}: the cores ran {yours['in_forward']} times in forward and {yours['calls']} in all "
                        "(expected once in forward, twice in all)",
                        "nothing was recomputed: backward must run the core again" if max(yours["calls"]) < 2 else
                        "run the core once in forward (under no_grad) and once in backward, and take every input's "
                        "gradient from that one recomputation (one torch.autograd.grad call for q, k and v)")
        if yours["next_random"] != ref_run["next_random"] and not report.problems:
            report.fail(f"{where}: after your training step, the random stream is not where it is without "
                        "recomputation",
                        "restore the generator's state inside torch.random.fork_rng, so training's own random "
                        "numbers go on unchanged")
    if not report.problems:
        r = out[0]
        report.ok(f"every parameter's gradient equals the model without recomputation (same dropout masks), on "
                  f"{len(out)} ranks")
        report.ok(f"the forward kept {r['yours']['saved']:,} bytes for backward instead of "
                  f"{r['reference']['saved']:,}: no time x time tensor")
        report.ok("each core ran twice per step: once in forward, once in backward; no torch.utils.checkpoint")
    return report


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
