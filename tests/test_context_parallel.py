"""Ring attention from scratch (dtlab.parallel.context) must equal attention over the whole sequence, and keep for
backward only its own block.

Every rank builds the same q, k, v and output weights for the whole sequence; the reference is
``scaled_dot_product_attention`` on all of it in the same process, and the loss a fixed weighted
sum of the output. Each rank keeps its part of the sequence (contiguous or zig-zag), runs the ring,
and compares its output part and the gradients of its q, k and v parts (fp32, within 1e-5). The bytes
autograd saves for backward are counted with saved-tensor hooks, for the ring and for the naive ring
that lets autograd keep what it received.
"""

import pytest
import torch
import torch.nn.functional as F

from dtlab.launch import run
from dtlab.parallel import context as cpmod

B, H, T, D = 2, 2, 24, 8


pytestmark = pytest.mark.cluster  # code a cluster runs: make test-runtime repeats these on its stack


def ring_worker() -> dict:
    import torch.distributed as dist

    from dtlab.measure import SavedBytes

    dist.init_process_group("gloo")
    cp = cpmod.ContextGroup(record_timeline=True)
    g = torch.Generator().manual_seed(0)
    q, k, v, w = (torch.randn(B, H, T, D, generator=g) for _ in range(4))
    out = {"rank": cp.rank, "local_qkv_bytes": 3 * q.numel() // cp.size * q.element_size()}
    for causal in (True, False):
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        reference = F.scaled_dot_product_attention(*full, is_causal=causal)
        (reference * w).sum().backward()
        for layout in cpmod.LAYOUTS:
            part = lambda t, lay=layout: cpmod.split_sequence(t, cp, dim=2, layout=lay)  # noqa: E731
            for name, attention in (("ring", cpmod.ring_attention), ("naive", cpmod.naive_ring_attention)):
                mine = [part(t.detach()).requires_grad_() for t in full]
                cp.counts.clear()
                cp.timeline.clear()
                with SavedBytes() as saved:
                    result = attention(*mine, cp, causal=causal, layout=layout)
                (result * part(w)).sum().backward()
                diffs = [(result - part(reference.detach())).abs().max().item()]
                diffs += [(m.grad - part(f.grad)).abs().max().item() for m, f in zip(mine, full)]
                whole_again = cpmod.gather_sequence(result.detach(), cp, dim=2, layout=layout)
                out[(name, causal, layout)] = {
                    "max_diff": max(diffs), "ring_steps": cp.counts["ring_steps"], "work": cp.counts["work"],
                    "saved": saved.bytes, "timeline": list(cp.timeline),
                    "gathered": (whole_again - reference.detach()).abs().max().item()}
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module", params=[2, 3, 4], ids=["N=2", "N=3", "N=4"])
def ranks(request):
    return request.param, run(ring_worker, nprocs=request.param, timeout=180)


@pytest.mark.parametrize("name", ["ring", "naive"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", cpmod.LAYOUTS)
def test_ring_attention_equals_whole_sequence_attention(ranks, name, causal, layout):
    n, results = ranks
    for r in results:
        assert r[(name, causal, layout)]["max_diff"] <= 1e-5, r[(name, causal, layout)]
        assert r[(name, causal, layout)]["gathered"] <= 1e-5
        assert r[(name, causal, layout)]["ring_steps"] == n - 1


def test_the_ring_keeps_its_own_block_for_backward_the_naive_one_the_whole_sequence(ranks):
    n, results = ranks
    for r in results:
        local = r["local_qkv_bytes"]
        ring = max(r[("ring", c, lay)]["saved"] for c in (True, False) for lay in cpmod.LAYOUTS)
        assert ring <= 1.5 * local, (ring, local)        # q, k, v, the output and the log-sum-exp: 4/3 + 1/(3D)
        naive = r[("naive", False, "contiguous")]["saved"]
        assert naive >= n * local / 2, (naive, local)    # every received K/V block and each step's probabilities


def test_the_next_block_is_posted_before_the_compute_and_waited_for_after(ranks):
    n, results = ranks
    for r in results:
        for phase in ("forward", "backward"):
            events = [e for e in r[("ring", False, "contiguous")]["timeline"] if e["pass"] == phase]
            whats = [e["what"] for e in events]
            assert whats == ["compute", "wait"] * (n - 1) + ["compute"], whats
            for compute, wait in zip(events[::2], events[1::2]):
                assert compute["end"] <= wait["start"]


def test_causal_work_is_unbalanced_contiguous_and_even_zigzag(ranks):
    n, results = ranks
    contiguous = [r[("ring", True, "contiguous")]["work"] for r in results]
    zigzag = [r[("ring", True, "zigzag")]["work"] for r in results]
    c = T // n
    assert contiguous == [B * H * (r * c * c + c * (c + 1) // 2) for r in range(n)]   # rank r: r blocks + the diagonal
    assert len(set(zigzag)) == 1 and sum(zigzag) == sum(contiguous) == B * H * T * (T + 1) // 2
    full = [r[("ring", False, "contiguous")]["work"] for r in results]
    assert full == [B * H * c * T] * n


def test_a_length_that_does_not_split_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="16 tokens cannot be cut into 6 equal parts.*Fix"):
        cpmod.positions(16, 3, 0, "zigzag")
    with pytest.raises(ValueError, match="layout='ring'"):
        cpmod.positions(16, 2, 0, "ring")
    assert cpmod.positions(16, 2, 1, "zigzag").tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


def torch_cp_on_cpu() -> str:
    """torch's own context_parallel on CPU processes (gloo): what it raises, or "ran"."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    q, k, v = (torch.randn(1, 2, 16, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        answer = "ran"
    except NotImplementedError as err:
        answer = str(err)
    dist.destroy_process_group()
    return answer


@pytest.mark.slow
def test_torchs_context_parallel_has_no_cpu_path_so_the_lessons_cell_is_gpu_only():
    """Notebook 16 runs torch's context_parallel only on CUDA GPUs, on every torch. That rests on this: the CPU's
    attention kernel has no context-parallel rule (torch 2.7.0 and 2.13.0 alike). The day it runs, this fails
    and the lesson's cell (and SKIPPED_ON in tests/runtime) should run it on CPU too."""
    try:
        from torch.distributed.tensor.experimental import context_parallel  # noqa: F401
    except ImportError:
        pytest.skip(f"torch {torch.__version__} has no context_parallel")
    for answer in run(torch_cp_on_cpu, nprocs=2, timeout=120):
        assert "_scaled_dot_product_flash_attention_for_cpu" in answer, answer
