"""Ulysses sequence parallelism (``dtlab.parallel.ulysses``) against attention over the whole sequence in one
process, and its bytes on the wire (the loopback interface's counter) against its formula and the ring's."""

import pytest
import torch
import torch.nn.functional as F

from dtlab.launch import run
from dtlab.parallel import ulysses

pytestmark = pytest.mark.cluster  # gloo's all_to_all_single and autograd on the runtime's torch too


def whole_and_split(cfg):
    """Every rank: the whole-sequence reference and its own Ulysses result, outputs and input gradients."""
    import torch.distributed as dist

    from dtlab.parallel.context import ContextGroup, split_sequence
    from dtlab.parallel.ulysses import UlyssesGroup, ulysses_attention

    dist.init_process_group("gloo")
    sp = UlyssesGroup()
    g = torch.Generator().manual_seed(0)
    b, s, d = cfg["batch"], cfg["seq"], cfg["head_dim"]
    q = torch.randn(b, cfg["heads"], s, d, generator=g, requires_grad=True)
    k, v = (torch.randn(b, cfg["kv_heads"], s, d, generator=g, requires_grad=True) for _ in range(2))
    w = torch.randn(b, cfg["heads"], s, d, generator=g)                  # a fixed weighting: a scalar loss
    group = cfg["heads"] // cfg["kv_heads"]
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                         is_causal=cfg["causal"])
    (ref * w).sum().backward()
    cp = ContextGroup()
    mine = [split_sequence(t.detach(), cp, dim=2).requires_grad_() for t in (q, k, v)]
    out = ulysses_attention(*mine, sp, causal=cfg["causal"])
    (out * split_sequence(w, cp, dim=2)).sum().backward()
    diffs = {"output": (out - split_sequence(ref.detach(), cp, dim=2)).abs().max().item()}
    for name, whole, part in zip("qkv", (q, k, v), mine):
        diffs[f"d{name}"] = (part.grad - split_sequence(whole.grad, cp, dim=2)).abs().max().item()
    counts = dict(sp.counts)
    dist.destroy_process_group()
    return {"diffs": diffs, "counts": counts}


@pytest.mark.parametrize("n, heads, kv_heads", [(2, 4, 4), (2, 4, 2), (4, 8, 4)], ids=["N=2", "N=2-gqa", "N=4-gqa"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_ulysses_equals_whole_sequence_attention(n, heads, kv_heads, causal):
    cfg = dict(batch=2, seq=8 * n, head_dim=4, heads=heads, kv_heads=kv_heads, causal=causal)
    for rank in run(whole_and_split, cfg, nprocs=n):
        assert max(rank["diffs"].values()) <= 1e-6, rank["diffs"]
        assert rank["counts"]["all_to_all"] == 4 + 4                      # q, k, v, out; and back in backward
        local = cfg["batch"] * cfg["seq"] // n * cfg["head_dim"]
        per_forward = (2 * heads + 2 * kv_heads) * local * (n - 1) // n
        assert rank["counts"]["elements_sent"] == 2 * per_forward


def refused(cfg):
    import torch.distributed as dist

    from dtlab.parallel.ulysses import UlyssesGroup, ulysses_attention

    dist.init_process_group("gloo")
    q = torch.zeros(1, cfg["heads"], 4, 2)
    k = torch.zeros(1, cfg["kv_heads"], 4, 2)
    try:
        ulysses_attention(q, k, k, UlyssesGroup())
        message = None
    except ValueError as err:
        message = str(err)
    dist.destroy_process_group()
    return message


def test_heads_that_do_not_divide_by_the_ranks_are_refused_with_the_fix():
    messages = run(refused, {"heads": 3, "kv_heads": 3}, nprocs=2)
    assert all(m and "must both divide by 2" in m and "Fix:" in m for m in messages)
    messages = run(refused, {"heads": 4, "kv_heads": 1}, nprocs=2)          # GQA: 1 key/value head, 2 ranks
    assert all(m and "must both divide by 2" in m for m in messages)


def wire(cfg):
    """Loopback bytes of one attention forward, Ulysses and the ring, on every rank."""
    import torch.distributed as dist

    from dtlab.bandwidth import loopback_during
    from dtlab.parallel.context import ContextGroup, ring_attention
    from dtlab.parallel.ulysses import UlyssesGroup, ulysses_attention

    dist.init_process_group("gloo")
    n = dist.get_world_size()
    g = torch.Generator().manual_seed(dist.get_rank())
    q = torch.randn(cfg["batch"], cfg["heads"], cfg["seq"] // n, cfg["head_dim"], generator=g)
    k, v = (torch.randn(cfg["batch"], cfg["kv_heads"], cfg["seq"] // n, cfg["head_dim"], generator=g)
            for _ in range(2))
    group = cfg["heads"] // cfg["kv_heads"]
    sp, cp = UlyssesGroup(), ContextGroup()
    with torch.no_grad():
        measured = {"ulysses": loopback_during(lambda: ulysses_attention(q, k, v, sp), "gloo"),
                    "ring": loopback_during(lambda: ring_attention(q, k.repeat_interleave(group, 1),
                                                                   v.repeat_interleave(group, 1), cp), "gloo")}
    dist.destroy_process_group()
    return measured


@pytest.mark.slow
@pytest.mark.alone  # bytes on the loopback interface: the machine's, not this test's
def test_bytes_on_the_wire_are_each_formula():
    cfg = dict(batch=2, seq=1024, heads=4, kv_heads=4, head_dim=16)
    n = 2
    measured = run(wire, cfg, nprocs=n)[0]
    if measured["ulysses"] is None:
        pytest.skip("the loopback interface's counter cannot be read here")
    for kind in ("ulysses", "ring"):
        formula = n * ulysses.sent_per_rank(kind, cfg["batch"], cfg["seq"], cfg["heads"], cfg["head_dim"], n)
        assert formula <= measured[kind] <= 1.05 * formula, (kind, measured[kind], formula)


def test_the_formulas_say_when_each_sends_less():
    args = dict(batch=1, seq_len=8192, heads=32, head_dim=128)
    assert ulysses.sent_per_rank("ulysses", n=2, **args) == ulysses.sent_per_rank("ring", n=2, **args)
    assert ulysses.sent_per_rank("ulysses", n=8, **args) < ulysses.sent_per_rank("ring", n=8, **args) / 3
    # grouped-query attention (8 key/value heads): the ring sends only the small K and V
    gqa = dict(args, kv_heads=8)
    assert ulysses.sent_per_rank("ring", n=2, **gqa) < ulysses.sent_per_rank("ulysses", n=2, **gqa)
    with pytest.raises(ValueError, match="'ulysses' or 'ring'"):
        ulysses.sent_per_rank("tree", n=2, **args)
