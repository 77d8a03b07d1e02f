"""``dtlab.parallel.peak_memory`` measures live tensor bytes exactly: checked against bytes computed by hand.

One process, no process group, a few milliseconds each: known tensors, a tensor made and freed on another
thread (what gloo's worker threads do, and what the profiler's memory events miss), and one training step of
a single ``nn.Linear`` with AdamW, whose every allocation can be written down.
"""

import threading

import pytest
import torch

from dtlab.parallel import peak_memory as pm

pytestmark = pytest.mark.skipif(not pm.cpu_tracking_available(), reason="this torch's c10 lacks the allocator flags")

MB = 1_000_000


@pytest.fixture(autouse=True)
def tracking():
    before = pm.track_cpu_allocations(True)
    yield
    pm.track_cpu_allocations(before)


def test_known_tensors_exactly():
    keep = []

    def first():
        a = torch.empty(MB, dtype=torch.uint8)
        b = torch.empty(2 * MB, dtype=torch.uint8)      # 3 MB live here: the peak
        del a
        keep.append(torch.empty(MB // 2, dtype=torch.uint8))
        keep.append(b)                                  # 2.5 MB stay

    def second():
        keep.pop()                                      # b freed: 0.5 MB stay
        torch.empty(MB // 4, dtype=torch.float32)       # 1 MB, made and dropped at once

    m = pm.measure_peak([first, second])
    assert m.peak - m.start == 3 * MB
    assert [a - m.start for a in m.after] == [MB * 5 // 2, MB // 2]
    assert [p - m.start for p in m.phase_peaks] == [3 * MB, MB * 5 // 2]
    assert m.events == 7                                # 4 allocations, 3 frees (keep's last tensor still lives)
    assert pm.peak_bytes(lambda: torch.zeros(3, 5, dtype=torch.float64)) - m.after[-1] == 3 * 5 * 8


def test_counts_other_threads_which_the_profiler_misses():
    def elsewhere():                                    # as a gloo worker thread allocates a collective's buffer
        t = threading.Thread(target=lambda: torch.empty(4 * MB, dtype=torch.uint8))
        t.start()
        t.join()

    def here():
        torch.empty(MB, dtype=torch.uint8)

    m = pm.measure_peak([here, elsewhere], cross_check=True)
    assert [p - m.start for p in m.phase_peaks] == [MB, 4 * MB]
    assert m.peak - m.start == 4 * MB
    # torch 2.13's profiler: only the calling thread's allocations carry the running total, so it saw 1 MB
    assert m.profiler_peak is not None and m.profiler_peak <= m.peak


def test_one_linear_layer_step_by_hand():
    """A step of ``Linear(I, O)`` on a batch of B, loss ``sum(y**2)``, AdamW (torch's single-tensor loop on CPU),
    gradients set to None after the step, fp32 (4 bytes). Each phase's bytes above the start of the step:

    * forward: ``y`` (B x O, kept by ``square`` for its backward) and ``y**2`` (consumed by ``sum``, then
      freed), the loss (a scalar): peak ``2 B O + 1`` elements, ``B O + 1`` left after it;
    * backward: the loss and the initial gradient (two scalars), ``grad_y`` (B x O) while ``addmm``'s backward
      makes the weight's and the bias's gradients; ``y`` was freed when ``square``'s backward had run: peak
      ``(O I + O) + B O + 2``, the gradients left;
    * AdamW: moments updated in place; ``denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`` holds
      the square root and the quotient at once: two weight-sized tensors beside the gradients (and a few scalars),
      then ``zero_grad(set_to_none=True)`` leaves exactly the start.
    """
    B, n_in, n_out = 64, 256, 128                       # B, I and O of the docstring
    before = pm.measure_peak(lambda: None).start
    torch.manual_seed(0)
    lin = torch.nn.Linear(n_in, n_out)
    x = torch.randn(B, n_in)
    opt = torch.optim.AdamW(lin.parameters(), lr=1e-3)
    held = {}

    def forward():
        held["loss"] = lin(x).square().sum()

    def backward():
        held.pop("loss").backward()

    def step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    for phase in (forward, backward, step):             # warm-up: AdamW's state exists from here on
        phase()
    m = pm.measure_peak([forward, backward, step])

    params = 4 * (n_out * n_in + n_out)
    state = 2 * params + 2 * 4                          # exp_avg, exp_avg_sq, and one fp32 'step' scalar each
    assert m.start - before == params + 4 * B * n_in + state
    fwd, bwd, stp = (p - m.start for p in m.phase_peaks)
    assert fwd == 4 * (2 * B * n_out + 1)
    assert [a - m.start for a in m.after] == [4 * (B * n_out + 1), params, 0]
    assert bwd == params + 4 * (B * n_out + 2)
    assert 0 <= stp - params - 2 * 4 * n_out * n_in <= 64       # the scalars of the update: a few bytes
    assert m.peak - m.start == max(fwd, bwd, stp) == stp    # the optimizer step: here no activations outweigh it


def test_parse_reads_marks_and_interleaved_threads():
    log = (b"[I1205 CPUAllocator.cpp:216] C10 alloc 1 bytes, total alloc 101 bytes.\n"
           b"[I1205 CPUAllocator.cpp:255] C10 deleted 1 bytes, total alloc 100 bytes.\n"
           b"\ndtlab-peak-mark 0\n"
           b"[rank0]:[I1205 CPUAllocator.cpp:216] C10 alloc 50 bytes, total alloc 150 bytes."
           b"[I1205 CPUAllocator.cpp:216] C10 alloc 70 bytes, total alloc 220 bytes.\n\n"   # two threads, one line
           b"[I1205 CPUAllocator.cpp:255] C10 deleted 70 bytes, total alloc 150 bytes.\n"
           b"\ndtlab-peak-mark 1\n"
           b"[W1205 something.cpp:1] a warning\n"
           b"\ndtlab-peak-mark 2\n")
    start, after, peaks, events = pm._parse(log, 2)
    assert (start, after, peaks, events) == (100, [150, 150], [220, 150], 3)


def test_storage_bytes_counts_each_storage_once():
    a = torch.zeros(10)
    seen = set()
    assert pm.storage_bytes([a, a[2:5], a.view(2, 5), None], seen) == 40
    assert pm.storage_bytes([a, torch.zeros(3, dtype=torch.float64)], seen) == 24
