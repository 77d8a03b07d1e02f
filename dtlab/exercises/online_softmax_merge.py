"""Exercise 16.online_softmax_merge: ring attention's merge of two partial softmax results.

Write ``merge(out_a, lse_a, out_b, lse_b) -> (out, lse)``. ``out_a`` (shape ``[..., q, d]``: any batch and head
dimensions, then q queries of d values) is attention of q queries over one block of keys, normalised within that
block (softmax over the block's keys, times their values); ``lse_a`` (shape ``[..., q]``) is the log-sum-exp of
those queries' scores over the block: ``-inf`` for a query that sees no key of the block (its row of ``out_a`` is
then 0). ``out_b``, ``lse_b``: the same over another block of keys. Return the attention over both blocks
together and its log-sum-exp, as if the two blocks had been one, in new tensors. This is the step ring attention
runs each time a key/value block arrives from its neighbour (``dtlab.parallel.context._ring_forward`` does it
inline, on its running result).

What must hold (what the grader checks; every input is seeded, so a report names the case that failed and it
fails the same way again):

* **Your merge on its own**, first, in a child process stopped after the time limit (an endless loop is reported,
  not waited for): six groups of (out, lse) pairs, each merged as ``merge(a, b)`` and again as ``merge(b, a)``
  with the same tensors: out of shapes ``[2, 3, 16, 8]``, ``[4, 8, 5]``, ``[3, 10, 4]``, ``[2, 2, 12, 6]``,
  ``[8, 8]`` (no batch dimensions, as many queries as values) and ``[3, 1, 1]``; log-sum-exps of order 10 with
  ``-inf`` in a only, in b only and in both on different queries of one tensor; equal log-sum-exps; log-sum-exps
  more than 100 apart either way; and log-sum-exps around +1e4 and -1e4, some within 2 of each other, some of
  opposite signs (``exp`` overflows float32 above 88.7 and is 0 below about -103). For every query: ``lse`` is
  the log-sum-exp over both blocks and ``out`` the merged attention, within 8 float32 epsilons times (1 + the
  larger |lse|) (times the row's largest |value| for ``out``): float32 rounding of numbers that large, not an
  approximation. Where neither block has a visible key, ``lse`` is ``-inf`` (a stand-in below -1e30, such as
  ``finfo.min / 2``, is accepted) and ``out`` is 0, never NaN. Shapes are those of the inputs.
* **Inputs left as they were**: ``merge`` returns new tensors and changes none of its four inputs in place (the
  caller may still need them: the grader merges the same tensors twice, a training step keeps each block's lse
  for backward).
* **In a ring attention**, on 3, 2 and 4 processes: each rank holds some queries, keys and values of a sequence;
  the grader passes the key/value blocks around the ring, starts each query from nothing seen (``out = 0``,
  ``lse = -inf``) and calls your ``merge(running out, running lse, block out, block lse)`` once per block as it
  arrives (its own block last). Each rank's output and ``lse`` must equal softmax attention over the whole
  sequence computed in one process (in float64), within 8·N float32 epsilons times (1 + the largest possible
  |score|) (times the largest |value| for the output), with no inf or NaN. The cases: N = 3, causal, zig-zag
  layout (rank r holds chunks r and 5 - r of six 2-query chunks: blocks in which some queries see keys and others
  none, and rank 0's first queries see nothing until their own block, the last); N = 2, no causal mask but packed
  documents (a query sees only its own document's keys), blocks of 9 and 7 queries, scores up to 182; N = 4,
  causal, blocks of 3, 5, 2 and 4 queries, scores up to 1e4 in magnitude, blocks' log-sum-exps from -1e4 to
  1e4, some within 2 of the running one, some thousands apart and of the other sign.

Hints: each block's output is already an average over its own keys; the merged output is a mix of the two, and
what decides each block's part is how much of the total softmax mass its keys hold. The masses themselves
(exponentials of the log-sum-exps) do not fit in float32 here, but their ratios do: work with differences of
logs, and choose what you subtract so that no exponent is ever positive. A block a query cannot see holds no
mass; then try two such blocks together.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from dtlab.exercises.grading import Case, Rank, Report, compare, grade_cases, learner_error, run_limited, run_ranks

NPROCS = 3
EPS = 2.0 ** -23
#: The float32 roundings (of the largest magnitude involved) a bound allows per merge.
ROUNDINGS = 8
#: Where nothing is visible, an lse at or below this is taken for -inf (a finite stand-in such as finfo.min / 2).
STAND_IN = -1e30
NAMES = ("out_a", "lse_a", "out_b", "lse_b")

#: The groups of (out, lse) pairs merge is called on directly, before any ring: (label, shape of out, kind, seed).
GROUPS = [
    ("lse of order 10, -inf in a only, in b only and in both on different queries", (2, 3, 16, 8), "mixed", 1),
    ("equal lse in a and b, from -30 to 30 and from 1e3 to 1e4 in magnitude", (4, 8, 5), "equal", 2),
    ("lse_a and lse_b more than 100 apart, either one the larger", (3, 10, 4), "far", 3),
    ("lse around +1e4 and -1e4: some pairs within 2 of each other, some of opposite signs", (2, 2, 12, 6), "huge", 4),
    ("no batch dimensions and as many queries as values (q = d = 8), -inf mixed in", (8, 8), "mixed", 5),
    ("one query, one value per row, -inf mixed in", (3, 1, 1), "mixed", 6),
]

#: The ring attentions, in the order they are graded.
CASES = [
    Case("N = 3, causal, zig-zag layout (rank r holds chunks r and 5 - r of six chunks of 2 queries), scores of "
         "order 1: blocks where some queries see keys and others none", 3,
         {"layout": "zigzag", "chunk": 2, "mask": "causal", "scores": "random", "scale": 1.0, "dim": 8, "seed": 21}),
    Case("N = 2, no causal mask, packed documents of 5, 7 and 4 tokens (a query sees its own document only), blocks "
         "of 9 and 7 queries, scores up to 182", 2,
         {"sizes": [9, 7], "mask": "documents", "documents": [5, 7, 4], "scores": "random", "scale": 7.0, "dim": 8,
          "seed": 22}),
    Case("N = 4, causal, blocks of 3, 5, 2 and 4 queries, scores up to 1e4 in magnitude (blocks' lse from -1e4 to 1e4, "
         "some within 2 of the running lse, some thousands apart)", 4,
         {"sizes": [3, 5, 2, 4], "mask": "causal", "scores": "designed", "dim": 16, "seed": 23}),
]
HEADS = 2


# ---------------------------------------------------------------------------------------------- the direct check

def _group(g: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group ``g``'s inputs (float32): out_a, lse_a, out_b, lse_b; rows of out are 0 where lse is -inf."""
    _, shape, kind, seed = GROUPS[g]
    gen = torch.Generator().manual_seed(1600 + seed)
    rows = shape[:-1]
    n = math.prod(rows)

    def uniform(low: float, high: float) -> torch.Tensor:
        return low + (high - low) * torch.rand(n, generator=gen, dtype=torch.float64)

    def signs() -> torch.Tensor:
        return torch.randint(0, 2, (n,), generator=gen).double() * 2 - 1

    if kind == "mixed":
        lse_a, lse_b = uniform(-20, 20), uniform(-20, 20)
        # 2 in 5 queries see both blocks, 1 in 5 only b, 1 in 5 only a, 1 in 5 neither
        pattern = torch.tensor([0, 0, 1, 2, 3]).repeat(n // 5 + 1)[:n][torch.randperm(n, generator=gen)]
        lse_a[(pattern == 1) | (pattern == 3)] = -math.inf
        lse_b[(pattern == 2) | (pattern == 3)] = -math.inf
    elif kind == "equal":
        lse_a = torch.where(torch.arange(n) % 2 == 0, uniform(-30, 30), signs() * uniform(1e3, 1e4))
        lse_b = lse_a.clone()
    elif kind == "far":
        lse_a = uniform(-50, 50)
        lse_b = lse_a + signs() * uniform(100, 400)
    else:                                           # "huge"
        kind_of = torch.arange(n) % 4               # near ties at +1e4, near ties at -1e4, +1e4 vs -1e4, -1e4 vs +1e4
        base = uniform(0.9e4, 1.1e4)
        lse_a = torch.where(kind_of % 2 == 0, base, -base)
        lse_b = torch.where(kind_of < 2, lse_a + uniform(-2, 2), -lse_a + uniform(-50, 50))
    lse_a, lse_b = lse_a.float().reshape(rows), lse_b.float().reshape(rows)
    out_a = torch.randn(shape, generator=gen) * 2
    out_b = torch.randn(shape, generator=gen) * 2
    out_a[torch.isinf(lse_a)] = 0.0
    out_b[torch.isinf(lse_b)] = 0.0
    return out_a, lse_a, out_b, lse_b


def _merged(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
            lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge, in float64 (what your float32 result is compared with)."""
    a, b = lse_a.double(), lse_b.double()
    lse = torch.logaddexp(a, b)
    finite = lse.masked_fill(torch.isinf(lse), 0.0)
    return torch.exp(a - finite)[..., None] * out_a.double() + torch.exp(b - finite)[..., None] * out_b.double(), lse


#: Tiny merges whose answers say what went wrong: name -> (out_a, lse_a, out_b, lse_b) for one query, one value.
PROBES = {
    "weight of a": (1.0, math.log(3.0), 0.0, 0.0),            # a holds 3/4 of the mass: out 0.75, lse log 4
    "weight of b": (0.0, math.log(3.0), 1.0, 0.0),            # out 0.25
    "both empty": (0.0, -math.inf, 0.0, -math.inf),           # out 0, lse -inf
    "a empty": (0.0, -math.inf, 1.0, 2.0),                    # out 1, lse 2
    "b empty": (1.0, 2.0, 0.0, -math.inf),                    # out 1, lse 2
    "shifted up": (1.0, 500 + math.log(3.0), 0.0, 500.0),     # out 0.75, lse 500 + log 4
    "shifted down": (1.0, -500 + math.log(3.0), 0.0, -500.0),  # out 0.75, lse -500 + log 4
    "b far above": (1.0, 0.0, 0.0, 200.0),                    # out 0, lse 200
    "a far above": (1.0, 200.0, 0.0, 0.0),                    # out 1, lse 200
}


def _plain(got: Any) -> dict[str, Any]:
    """What merge returned, as data the notebook's process can read back."""
    if isinstance(got, (tuple, list)) and len(got) == 2 and all(torch.is_tensor(t) for t in got):
        return {"out": got[0].detach().cpu().clone(), "lse": got[1].detach().cpu().clone()}
    kind = type(got).__name__ + (f" of {len(got)}" if isinstance(got, (tuple, list)) else "")
    return {"other": kind}


def _call_directly(impl: Any) -> dict[str, Any]:
    """In a child process (``run_limited``): your merge on every group, as merge(a, b) and then merge(b, a) with the
    same tensors, and on the probes. Returns plain data."""
    calls = []
    for g in range(len(GROUPS)):
        out_a, lse_a, out_b, lse_b = _group(g)
        for order, args in (("merge(a, b)", (out_a, lse_a, out_b, lse_b)),
                            ("merge(b, a)", (out_b, lse_b, out_a, lse_a))):
            kept = [t.clone() for t in args]
            try:
                got = impl(*args)
            except NotImplementedError:
                raise
            except Exception as exc:     # noqa: BLE001 -- the learner's error, in words
                calls.append({"group": g, "order": order, "error": learner_error(exc)})
                break
            changed = [name for name, t, k in zip(NAMES, args, kept)
                       if t.shape != k.shape or not torch.equal(t, k)]
            calls.append({"group": g, "order": order, "changed": changed, **_plain(got)})
    probes = {}
    for name, (a, la, b, lb) in PROBES.items():
        try:
            got = impl(torch.tensor([[a]]), torch.tensor([la]), torch.tensor([[b]]), torch.tensor([lb]))
            probes[name] = (float(got[0].reshape(-1)[0]), float(got[1].reshape(-1)[0]))
        except NotImplementedError:
            raise
        except Exception:                # noqa: BLE001 -- a probe your merge does not take: no cause from it
            probes[name] = None
    return {"calls": calls, "probes": probes}


def _describe(x: float) -> str:
    return f"{x:.6g}"


def _check_call(report: Report, call: dict[str, Any]) -> bool:
    """Compare one direct call with the float64 merge; fail the report for what differs. True if it held."""
    g, order = call["group"], call["order"]
    label, shape, _, _ = GROUPS[g]
    where = f"{order} on group {g + 1} of {len(GROUPS)} (out {list(shape)}: {label})"
    if "error" in call:
        report.fail(f"{where}: your merge raised {call['error']}", _error_cause(call["error"]))
        return False
    if "other" in call:
        report.fail(f"{where}: your merge returned a {call['other']}, not a pair of tensors (out, lse)")
        return False
    args = _group(g)
    if order == "merge(b, a)":
        args = (args[2], args[3], args[0], args[1])
    out_a, lse_a, out_b, lse_b = args
    if call["changed"]:
        report.fail(f"{where}: your merge changed its input{'s' if len(call['changed']) > 1 else ''} "
                    f"{', '.join(call['changed'])} in place",
                    "merge must leave its inputs as they were and return new tensors: its caller may still use them "
                    "(here the same tensors are merged again as merge(b, a); a training step keeps each block's lse "
                    "for backward). Write out = ... rather than out_a *= ...")
        return False
    expected_out, expected_lse = _merged(out_a, lse_a, out_b, lse_b)
    got_out, got_lse = call["out"], call["lse"]
    ok = True
    if tuple(got_lse.shape) != tuple(lse_a.shape):
        report.fail(f"{where}: your lse has shape {list(got_lse.shape)}, expected {list(lse_a.shape)} (one number per "
                    "query, like lse_a)")
        ok = False
    if tuple(got_out.shape) != tuple(out_a.shape):
        report.fail(f"{where}: your out has shape {list(got_out.shape)}, expected {list(out_a.shape)} (like out_a)",
                    "out has a row of d values per query and lse one number per query: a weight per query must "
                    "meet the rows (a trailing axis of size 1), not the values' axis")
        ok = False
    if not ok:
        return False
    # per query: float32 rounding of the largest magnitude involved, 8 times over
    finite = [x.double().masked_fill(torch.isinf(x), 0.0).abs() for x in (lse_a, lse_b)]
    magnitude = torch.maximum(*finite)
    bound_lse = ROUNDINGS * EPS * (1 + magnitude)
    values = torch.maximum(out_a.double().abs().amax(-1), out_b.double().abs().amax(-1))
    bound_out = bound_lse * values
    gl = got_lse.double()
    empty = torch.isinf(expected_lse)
    err_lse = torch.where(empty, torch.where((gl <= STAND_IN) | (gl == -math.inf), 0.0, math.inf),
                          (gl - expected_lse).abs())
    err_lse = torch.where(torch.isnan(err_lse) | torch.isinf(gl) & ~empty, math.inf, err_lse)
    go = got_out.double()
    err_out = (go - expected_out).abs().amax(-1)
    err_out = torch.where(torch.isnan(err_out) | ~torch.isfinite(go).all(-1), math.inf, err_out)
    total = lse_a.numel()
    for what, err, bound in (("lse", err_lse, bound_lse), ("out", err_out, bound_out)):
        bad = ~(err <= bound)
        if not bad.any():
            continue
        ok = False
        ratio = torch.where(bad, err / bound.clamp_min(1e-300), 0.0).nan_to_num(math.inf)
        i = int(ratio.reshape(-1).argmax())
        idx = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), err.shape))
        la, lb = lse_a.reshape(-1)[i].item(), lse_b.reshape(-1)[i].item()
        head = f"{where}: at query {idx if len(idx) > 1 else idx[0]}, lse_a = {_describe(la)}, lse_b = {_describe(lb)}"
        if what == "lse":
            got = gl.reshape(-1)[i].item()
            report.fail(f"{head}: your lse is {_describe(got)}, the log-sum-exp over both blocks is "
                        f"{_describe(expected_lse.reshape(-1)[i].item())} (bound {bound.reshape(-1)[i].item():.1e}); "
                        f"{int(bad.sum())} of {total} queries off")
        else:
            row = go.reshape(-1, go.shape[-1])[i]
            state = "holds NaN" if torch.isnan(row).any() else "holds inf" if torch.isinf(row).any() else \
                f"differs from the merged attention by {err.reshape(-1)[i].item():.2e} (bound " \
                f"{bound.reshape(-1)[i].item():.1e})"
            report.fail(f"{head}: your out {state}; {int(bad.sum())} of {total} queries off")
    return ok


def _error_cause(error: str) -> str | None:
    if "must match the size" in error or "broadcast" in error:
        return ("out has a row of d values per query ([..., q, d]) and lse one number per query ([..., q]): a weight "
                "per query needs a trailing axis of size 1 to scale its row")
    return None


def _causes(report: Report, probes: dict[str, Any]) -> None:
    """Likely causes, from your merge's answers to a few one-number merges (computed in the child process)."""
    def near(x: float | None, y: float, tol: float = 1e-4) -> bool:
        return x is not None and not math.isnan(x) and (x == y or abs(x - y) < tol)

    def found(cause: str, problem: str | None = None) -> None:
        if problem:
            report.fail(problem, cause)
        elif cause not in report.causes:
            report.causes.append(cause)

    wa, wb = probes.get("weight of a"), probes.get("weight of b")
    weights_right = bool(wa and wb and near(wa[0], 0.75) and near(wb[0], 0.25) and near(wa[1], math.log(4.0)))
    if wa and wb:
        (out_a, lse), (out_b, _) = wa, wb
        if near(out_a, 0.5) and near(out_b, 0.5):
            found("the outputs were averaged: each block's part is its share of the softmax mass of both blocks, "
                  "which is not one half unless the two lse are equal")
        elif near(out_a, 0.25) and near(out_b, 0.75):
            found("the weights are swapped: out_a's part is block a's own share of the mass")
        elif near(lse, math.log(3.0)):
            found("lse is the larger of the two, not the log-sum-exp over both blocks: the merged softmax denominator "
                  "is the sum of the two blocks' denominators")
        elif near(out_a, 1.0) and near(out_b, 1 / 3):
            found("the weights are relative to lse_a (the lse before this block): block a keeps weight 1 and the "
                  "parts add up to more than 1; measure both blocks' mass against the merged lse")
        elif not (near(out_a, 0.75) and near(out_b, 0.25)) and out_a is not None and out_b is not None \
                and not math.isnan(out_a + out_b) and not near(out_a + out_b, 1.0):
            found(f"with block a holding 3/4 of the mass your merge gives block a weight {out_a:.4g} and block b "
                  f"{out_b:.4g}: the two parts of a softmax add up to 1 (3/4 and 1/4 here)")
    both = probes.get("both empty")
    if both and (math.isnan(both[0]) or math.isnan(both[1])):
        found("-inf - (-inf) is NaN: when both lse are -inf the merged lse is -inf and both parts must be 0, not NaN "
              "(no exponent of an infinite difference: a finite stand-in where the merged lse is -inf)",
              f"merge(0, -inf, 0, -inf) gave out = {both[0]}, lse = {both[1]}: a query that has seen no key yet, "
              "and a block it may not see either")
    if not weights_right:
        return                                  # the probes below would only show the same mistake again
    for name, side in (("a empty", "a"), ("b empty", "b")):
        got = probes.get(name)
        if got and not (near(got[0], 1.0) and near(got[1], 2.0)):
            found(f"a block a query cannot see (lse = -inf) holds no mass: its part must be 0 and the other block's "
                  f"result must come out unchanged (merge with block {side} empty gave out = {got[0]:.4g}, lse = "
                  f"{got[1]:.4g}; expected 1 and 2)")
            break
    for name, shift in (("shifted up", 500.0), ("shifted down", -500.0)):
        got, tol = probes.get(name), 16 * EPS * (1 + abs(shift))      # float32 rounding at that size
        if got and not (near(got[0], 0.75, tol) and near(got[1], shift + math.log(4.0), tol)):
            found("exp(lse) overflows float32 above 88.7 (and is 0 below about -103): the denominators themselves do "
                  "not fit, their ratios do",
                  f"merge of two blocks with lse {shift + math.log(3.0):.1f} and {shift:.1f} gave out = {got[0]:.4g}, "
                  f"lse = {got[1]:.6g}; the same blocks with every score {abs(shift):g} "
                  f"{'lower' if shift > 0 else 'higher'} "
                  f"(lse {math.log(3.0):.2f} and 0) give out = 0.75, lse = {math.log(4.0):.4f}: shifting every score "
                  "must leave out unchanged and shift lse by as much")
            break
    for name, (out, lse) in (("b far above", (0.0, 200.0)), ("a far above", (1.0, 200.0))):
        got, (_, la, _, lb) = probes.get(name), PROBES[name]
        if got and not (near(got[0], out) and near(got[1], lse, 1e-3)):
            found("an exponent of one lse minus the other overflows when they are more than 88.7 apart: subtract the "
                  "larger one (or the merged lse), so that every exponent is at most 0",
                  f"merge(1, {la:g}, 0, {lb:g}) "
                  f"gave out = {got[0]:.4g}, lse = {got[1]:.6g}; expected out = {out:g}, lse = {lse:g}")
            break


def _grade_directly(impl: Any, report: Report, limit_s: float) -> bool:
    """Run your merge on the groups and probes in a child process; True if every call held."""
    before = len(report.problems)
    ok, got = run_limited(report, _call_directly, impl, limit_s=limit_s,
                          what="your merge(out_a, lse_a, out_b, lse_b)")
    if not ok:
        report.case = DIRECT
        return False
    failed = []
    for call in got["calls"]:
        scratch = Report(report.exercise, report.title)
        if not _check_call(scratch, call):
            failed.append((call, scratch))
    if failed:                              # the first failing call in full, the others by name
        for problem in failed[0][1].problems:
            report.fail(problem)
        report.causes.extend(c for c in failed[0][1].causes if c not in report.causes)
        others = [f"{c['order']} on group {c['group'] + 1}" for c, _ in failed[1:]]
        if others:
            report.fail(f"... and {len(others)} more of the {2 * len(GROUPS)} calls fail too: "
                        + ", ".join(others[:4]) + (", ..." if len(others) > 4 else ""))
    if len(report.problems) > before:
        report.case = DIRECT
        _causes(report, got["probes"])
        return False
    report.ok(f"your merge on its own: {len(GROUPS)} groups of (out, lse) pairs, as merge(a, b) and merge(b, a), "
              "each query within 8 float32 eps x (1 + |lse|) (x |value|); -inf in a, in b and in both (no NaN); "
              "equal lse; lse more than 100 apart; lse around +-1e4 of either sign; inputs left unchanged")
    return True


DIRECT = f"merge called directly on {len(GROUPS)} groups of (out, lse) pairs, in one process"


# ---------------------------------------------------------------------------------------------- the ring attentions

def _owned(params: dict[str, Any], world: int) -> list[torch.Tensor]:
    """The global positions each rank holds."""
    if "chunk" in params:                           # zig-zag: chunks r and 2N - 1 - r of 2N equal chunks
        c = params["chunk"]
        return [torch.cat([torch.arange(r * c, (r + 1) * c),
                           torch.arange((2 * world - 1 - r) * c, (2 * world - r) * c)]) for r in range(world)]
    starts = [0]
    for s in params["sizes"]:
        starts.append(starts[-1] + s)
    return [torch.arange(starts[r], starts[r + 1]) for r in range(world)]


def _length(params: dict[str, Any], world: int) -> int:
    return 2 * world * params["chunk"] if "chunk" in params else sum(params["sizes"])


def _mask(params: dict[str, Any], length: int) -> torch.Tensor:
    """Which query (row) sees which key (column), over the whole sequence."""
    i = torch.arange(length)
    if params["mask"] == "causal":
        return i[:, None] >= i[None, :]
    doc = torch.repeat_interleave(torch.arange(len(params["documents"])), torch.tensor(params["documents"]))
    return doc[:, None] == doc[None, :]


def _qkv(params: dict[str, Any], world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole sequence's q, k, v, shape [1, HEADS, length, dim] (the same on every rank)."""
    length, dim = _length(params, world), params["dim"]
    gen = torch.Generator().manual_seed(params["seed"])
    if params["scores"] == "random":
        q, k = (torch.randn(1, HEADS, length, dim, generator=gen) * params["scale"] for _ in range(2))
    else:                                           # "designed": one-hot keys, so scores = q's entries, exactly
        owner = torch.cat([torch.full((len(p),), r) for r, p in enumerate(_owned(params, world))])
        scores = torch.empty(HEADS, length, length, dtype=torch.float64)
        for h in range(HEADS):
            for i in range(length):
                u = torch.rand(world + 2, generator=gen, dtype=torch.float64)
                sign = 1.0 if (i + h) % 2 == 0 else -1.0
                kind = (i + 2 * h) % 3
                if kind == 0:                       # every block at the same level: lse within a few of each other
                    level = torch.full((world,), sign * (5e3 + 5e3 * u[0].item()), dtype=torch.float64)
                elif kind == 1:                     # each block its own level and sign: lse thousands apart
                    level = (torch.rand(world, generator=gen, dtype=torch.float64) * 2 - 1) * 1e4
                else:                               # levels 100 to 400 apart
                    level = sign * 8e3 + torch.randperm(world, generator=gen).double() * (100 + 300 * u[1].item())
                jitter = (torch.rand(length, generator=gen, dtype=torch.float64) * 2 - 1) * 2
                scores[h, i] = level[owner] + jitter
        q = torch.zeros(1, HEADS, length, dim)
        q[0, :, :, :length] = (scores * dim ** 0.5).float()
        k = torch.eye(length, dim).expand(1, HEADS, length, dim).contiguous()
    v = torch.randn(1, HEADS, length, dim, generator=gen)
    return q, k, v


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Attention of q over one key block, normalised within it, and its log-sum-exp (-inf, output 0, where a
    query sees no key of the block)."""
    scores = (q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5).masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0)[..., None]) @ v, lse


def _shift(kv: torch.Tensor, me: Rank) -> torch.Tensor:
    """The grader's own step of the ring: send the block to rank + 1, receive the one rank - 1 holds."""
    received = torch.empty_like(kv)
    with me.tracer.quiet():
        works = [dist.isend(kv, (me.rank + 1) % me.world), dist.irecv(received, (me.rank - 1) % me.world)]
        for w in works:
            w.wait()
    return received


def _body(impl: Any, me: Rank, params: dict[str, Any]) -> dict[str, Any]:
    owned = _owned(params, me.world)
    mask = _mask(params, _length(params, me.world))
    q, k, v = _qkv(params, me.world)
    mine = owned[me.rank]
    most = max(len(p) for p in owned)
    qm = q[..., mine, :].to(me.device)
    kv = torch.zeros(2, *q.shape[:-2], most, q.shape[-1])
    kv[0, ..., :len(mine), :], kv[1, ..., :len(mine), :] = k[..., mine, :], v[..., mine, :]
    kv = kv.to(me.device)
    out = torch.zeros_like(qm)
    lse = torch.full(qm.shape[:-1], -math.inf, device=me.device)
    problem = None
    for step in range(1, me.world + 1):
        with me.tracer.doing(f"the ring's step {step} (the grader's send and recv)"):
            kv = _shift(kv, me)
        if problem:
            continue                                     # keep the ring going for the others
        source = (me.rank - step) % me.world
        theirs = owned[source]
        visible = mask[mine][:, theirs].to(me.device)
        block = _block(qm, kv[0, ..., :len(theirs), :], kv[1, ..., :len(theirs), :], visible)
        args = (out, lse, *block)
        kept = [t.clone() for t in args]
        where = f"merging the block rank {source} started with (step {step} of {me.world})"
        try:
            with me.tracer.doing(where):
                got = impl(*args)
        except NotImplementedError:
            raise
        except Exception as exc:           # noqa: BLE001 -- the learner's error, in words
            problem = f"{where}: your merge raised {learner_error(exc)}"
            continue
        changed = [name for name, t, c in zip(NAMES, args, kept) if t.shape != c.shape or not torch.equal(t, c)]
        if changed:
            problem = f"{where}: your merge changed its input {', '.join(changed)} in place"
            continue
        if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(torch.is_tensor(t) for t in got)):
            problem = f"{where}: your merge returned a {type(got).__name__}, not a pair of tensors (out, lse)"
            continue
        if tuple(got[0].shape) != tuple(out.shape) or tuple(got[1].shape) != tuple(lse.shape):
            problem = (f"{where}: your merge returned out of shape {list(got[0].shape)} and lse of shape "
                       f"{list(got[1].shape)}, expected {list(out.shape)} and {list(lse.shape)}")
            continue
        out, lse = got
    return {"output": out.detach().float().cpu(), "lse": lse.detach().float().cpu(), "problem": problem}


def grade(impl: Any, report: Report, nprocs: int | None = None, limit_s: float = 30.0) -> Report:
    """Grade ``impl`` (your ``merge``): on its own first, then in a ring attention for each case (those on
    ``nprocs`` processes, if given)."""
    chosen = [c for c in CASES if nprocs is None or c.nprocs == nprocs]
    if not chosen:
        return grade_cases(report, CASES, lambda case, rep: None, nprocs)
    report.worlds.extend(c.nprocs for c in chosen)
    if not _grade_directly(impl, report, limit_s):
        return report
    grade_cases(report, CASES, lambda case, rep: _grade_case(impl, case, rep, limit_s), nprocs)
    if report.passed:
        worlds = [str(c.nprocs) for c in chosen]
        worlds = ", ".join(worlds[:-1]) + (" and " if len(worlds) > 1 else "") + worlds[-1]
        report.ok(f"in ring attentions on {worlds} processes: every rank's output "
                  "and lse equal attention over the whole sequence in one process, within 8N float32 eps x "
                  "(1 + |score|) (x |value|)")
        report.ok(f"blocks in which some queries see no key (lse = -inf on those rows only), and queries that see "
                  f"nothing before their last block, merged without NaN; scores up to "
                  f"{max(_largest_score(c) for c in chosen):.0f} in magnitude merged without inf or NaN (exp "
                  "overflows float32 above 88.7 and is 0 below -103)")
    return report


def _grade_case(impl: Any, case: Case, report: Report, limit_s: float) -> None:
    n, params = case.nprocs, case.params
    out = run_ranks(report, _body, impl, params, nprocs=n, limit_s=limit_s)
    if out is None:
        return
    before = len(report.problems)
    for rank, r in enumerate(out):
        if r["problem"]:
            report.fail(f"rank {rank}, {r['problem']}")
        used = {e["api"] for e in r["traffic"]["log"] if e["op"] != "mark"}
        if used:
            report.fail(f"rank {rank}: your merge called {', '.join(f'dist.{api}' for api in sorted(used))}: a merge "
                        "is arithmetic on the two results it is given, on each rank alone")
    if len(report.problems) > before:
        return
    owned = _owned(params, n)
    length = _length(params, n)
    mask = _mask(params, length)
    q, k, v = (t.double() for t in _qkv(params, n))
    scores = (q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5).masked_fill(~mask, -math.inf)
    expected_out, expected_lse = torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1)
    size = (q.abs() @ k.abs().transpose(-2, -1) * q.shape[-1] ** -0.5).max().item()   # bounds |score| and its rounding
    bound_lse = ROUNDINGS * n * EPS * (1 + size)
    bound_out = bound_lse * v.abs().max().item()
    for rank, r in enumerate(out):
        rows = owned[rank]
        where = f"rank {rank} (queries {', '.join(map(str, rows.tolist()))})"
        for name, got, expected, bound in (("output", r["output"], expected_out[..., rows, :], bound_out),
                                           ("lse", r["lse"], expected_lse[..., rows], bound_lse)):
            if got.shape == expected.shape and torch.isinf(got).any():     # compare() names NaN, not inf
                i = int(torch.isinf(got).reshape(-1).nonzero()[0])
                report.fail(f"{where}: attention {name} holds {got.reshape(-1)[i].item()} where attention over the "
                            f"whole sequence is {expected.reshape(-1)[i].item():.6g}")
                continue
            compare(report, where, {name: got}, {name: expected}, bound, "attention")


def _largest_score(case: Case) -> float:
    q, k, _ = _qkv(case.params, case.nprocs)
    mask = _mask(case.params, _length(case.params, case.nprocs))
    scores = q.double() @ k.double().transpose(-2, -1) * q.shape[-1] ** -0.5
    return scores[mask.expand_as(scores)].abs().max().item()


def reference() -> Any:
    """A correct implementation (the grader's own test uses it; try yours first)."""
    def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
              lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lse = torch.logaddexp(lse_a, lse_b)
        finite = lse.masked_fill(torch.isinf(lse), 0.0)       # both blocks empty: weights 0, not NaN
        out = torch.exp(lse_a - finite)[..., None] * out_a + torch.exp(lse_b - finite)[..., None] * out_b
        return out, lse
    return merge
