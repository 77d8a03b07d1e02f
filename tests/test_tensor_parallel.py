"""Tensor parallelism from scratch (dtlab.parallel.tensor) must compute what the unsharded module computes.

Every rank builds the unsharded module from the same seed and keeps its slice; the reference is
that unsharded module run in the same process on the same input. Outputs, input gradients, weight
gradients (cut the way the rank holds them) and the weights after an SGD step are compared
(``compare_with_unsharded``); the bitwise checks and the collective counts are made here directly.
Splitting a matrix product by output rows changes no sum, so the column-parallel output is
compared bitwise; a row-parallel split adds N partial sums (a different order), hence 1e-6.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dtlab import models
from dtlab.launch import WorkerError, run

pytestmark = pytest.mark.cluster  # code a cluster runs: make test-runtime repeats these on its stack


TOL = 1e-6


def tp_worker(n_embd: int, n_head: int) -> dict:
    import torch.distributed as dist

    from dtlab.parallel import tensor as tpmod

    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    tp = tpmod.TPGroup()
    torch.manual_seed(0)
    x = torch.randn(3, 5, n_embd)
    out = {"rank": tp.rank}

    # column-parallel: this rank's output columns, bitwise
    full = nn.Linear(n_embd, 4 * n_embd)
    col = tpmod.ColumnParallelLinear(full, tp)
    out["column_bitwise"] = torch.equal(col(x), tp.chunk(full(x), -1))
    out["column_elements"] = (col.weight.numel(), full.weight.numel())

    # MLP: outputs, gradients, step; and exactly one all-reduce each way
    block = models.Block(n_embd, n_head)
    tp.reset()
    mlp = tpmod.TensorParallelMLP(block.mlp, tp)
    out["mlp"] = tpmod.compare_with_unsharded(block.mlp, mlp, x, tp, lambda y: (y ** 2).mean())
    out["mlp_counts"] = dict(tp.counts)
    out["mlp_elements"] = dict(tp.elements)

    tp.reset()
    attn = tpmod.TensorParallelAttention(block.attn, tp)
    out["attention"] = tpmod.compare_with_unsharded(block.attn, attn, x, tp, lambda y: (y ** 2).mean())
    out["attention_counts"] = dict(tp.counts)

    emb = nn.Embedding(8 * tp.size, n_embd)
    ids = torch.randint(0, 8 * tp.size, (3, 5))
    out["embedding_bitwise"] = torch.equal(tpmod.VocabParallelEmbedding(emb, tp)(ids), emb(ids))

    for tied in (True, False):
        torch.manual_seed(1)
        gpt = models.TinyGPT(vocab_size=8 * tp.size, block_size=5, n_layer=2, n_head=n_head, n_embd=n_embd,
                             tie_weights=tied)
        par = tpmod.parallelize_gpt(gpt, tp)
        targets = torch.randint(0, 8 * tp.size, (3, 5))
        out[f"gpt_tied_{tied}"] = tpmod.compare_with_unsharded(
            gpt, par, ids, tp, lambda logits, t=targets: F.cross_entropy(logits.flatten(0, 1), t.flatten()))
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run(tp_worker, 16, 4, nprocs=2, timeout=120)


@pytest.mark.parametrize("part", ["mlp", "attention", "gpt_tied_True", "gpt_tied_False"])
def test_tensor_parallel_equals_the_unsharded_module_at_two_ranks(two_ranks, part):
    for r in two_ranks:
        assert max(r[part].values()) <= TOL, (part, r["rank"], r[part])


def test_column_parallel_output_is_its_slice_bitwise_and_holds_one_nth(two_ranks):
    for r in two_ranks:
        assert r["column_bitwise"] and r["embedding_bitwise"]
        held, total = r["column_elements"]
        assert held * 2 == total


def test_one_all_reduce_per_mlp_forward_and_one_backward(two_ranks):
    b, t, c = 3, 5, 16
    for r in two_ranks:
        assert r["mlp_counts"] == {("forward", "all_reduce"): 1, ("backward", "all_reduce"): 1}
        assert r["mlp_elements"] == {("forward", "all_reduce"): b * t * c, ("backward", "all_reduce"): b * t * c}
        assert r["attention_counts"] == {("forward", "all_reduce"): 1, ("backward", "all_reduce"): 1}


def test_tensor_parallel_equals_the_unsharded_module_at_four_ranks():
    for r in run(tp_worker, 16, 4, nprocs=4, timeout=180):
        for part in ("mlp", "attention", "gpt_tied_True", "gpt_tied_False"):
            assert max(r[part].values()) <= TOL, (part, r["rank"], r[part])
        assert r["column_bitwise"] and r["embedding_bitwise"]


def split_bad(what: str):
    import torch.distributed as dist

    from dtlab.parallel import tensor as tpmod

    dist.init_process_group("gloo")
    tp = tpmod.TPGroup()
    if what == "hidden":
        tpmod.ColumnParallelLinear(nn.Linear(4, 5), tp)
    elif what == "heads":
        tpmod.TensorParallelAttention(models.CausalSelfAttention(6, 3), tp)
    else:
        tpmod.VocabParallelEmbedding(nn.Embedding(7, 4), tp)


@pytest.mark.slow
@pytest.mark.parametrize("what, words", [("hidden", "5 output features"), ("heads", "3 attention heads"),
                                         ("vocab", "vocabulary of 7")])
def test_a_size_the_degree_does_not_divide_is_refused_with_the_fix(what, words):
    with pytest.raises(WorkerError) as err:
        run(split_bad, what, nprocs=2, timeout=60)
    assert words in str(err.value) and "Fix" in str(err.value)
