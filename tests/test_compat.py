"""The work-arounds dtlab applies for the learner's library versions."""

import os
import subprocess
import sys
import time

import pytest
import torch

from dtlab import launch

pytestmark = pytest.mark.cluster  # code a cluster runs: make test-runtime repeats these on its stack


def _sweep_then_destroy():
    import torch.distributed as dist

    from dtlab.bandwidth import time_all_reduce

    dist.init_process_group("gloo")
    seconds = [time_all_reduce(n, "cpu", iters=2) for n in (4096, 262144, 4194304)]
    patched = getattr(dist.destroy_process_group, "_dtlab", False)
    dist.destroy_process_group()
    return len(seconds), patched


@pytest.mark.slow
def test_destroying_a_gloo_group_right_after_collectives_does_not_deadlock():
    """torch 2.3.1 (Databricks 15.4) hung in ~ProcessGroupGloo in 9 of 15 such launches without dtlab._compat,
    torch 2.7.0 (17.3) in FSDP and checkpoint tests."""
    from dtlab._compat import GLOO_DESTROY_FIXED

    major, minor = (int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    needed = (major, minor) < GLOO_DESTROY_FIXED
    start = time.monotonic()
    for _ in range(8):  # the work-around is in place in the workers exactly where it is needed
        assert launch.run(_sweep_then_destroy, nprocs=2, timeout=60) == [(3, needed), (3, needed)]
    assert time.monotonic() - start < 400  # a hang would end in LaunchTimeout above, not here


def test_deepspeed_pads_its_zero3_reduce_scatter_with_zeros_not_leftover_memory():
    """ZeRO-3's coalesced reduce-scatter pads gradients with ``torch.empty``; dtlab makes that padding zeros, so
    what the allocator last held cannot reach the gradients (it sent bf16 ZeRO-3 to NaN on the runtime stack).
    Only that function's ``torch.empty`` changes: the module keeps torch itself."""
    from deepspeed.runtime.comm import coalesced_collectives

    from dtlab import _compat

    (padding,) = [f for _, f in _compat._wrapped_functions(coalesced_collectives.reduce_scatter_coalesced)
                  if getattr(f, "_dtlab", False)]
    junk = torch.full((4096,), float("nan"))
    del junk                                                   # leave NaNs where the next block may come from
    assert torch.equal(padding.__globals__["torch"].empty(4096), torch.zeros(4096))
    assert padding.__globals__["torch"].cat is torch.cat       # everything else is torch itself
    assert coalesced_collectives.torch is torch


_PROBE = """
import sys
order = sys.argv[1]
if order == "libraries first":
    import torch.distributed as dist
    from deepspeed.runtime.comm import coalesced_collectives
    import dtlab.ds_config                # a module that imports neither torch nor DeepSpeed itself
else:
    import dtlab.ds_config
    import torch.distributed as dist
    from deepspeed.runtime.comm import coalesced_collectives
from dtlab import _compat
print(getattr(dist.destroy_process_group, "_dtlab", False), _compat._padding_is_zeroed(coalesced_collectives))
"""


@pytest.mark.slow
@pytest.mark.parametrize("order", ["libraries first", "dtlab first"])
def test_the_work_arounds_are_in_force_after_importing_any_dtlab_module_in_either_order(order):
    """``import dtlab.ds_config`` left dtlab._compat unloaded, so a learner's DeepSpeed run missed the ZeRO-3 fix."""
    out = subprocess.run([sys.executable, "-c", _PROBE, order], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    from dtlab._compat import GLOO_DESTROY_FIXED

    major, minor = (int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    assert out.stdout.split()[-2:] == [str((major, minor) < GLOO_DESTROY_FIXED), "True"], out.stdout


def test_import_dtlab_loads_neither_torch_nor_deepspeed():
    out = subprocess.run([sys.executable, "-c", "import sys, dtlab, dtlab.ds_config; "
                          "print('torch' in sys.modules, 'deepspeed' in sys.modules)"],
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "False"], out.stdout + out.stderr


def test_a_deepspeed_buffer_counts_as_left_over_only_once_no_process_maps_it():
    # Tests run two at a time (make test): one test's check must not take another's running job for a leak.
    import mmap

    from dtlab import _compat

    path = _compat.SHM_FOLDER / f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_test{os.getpid()}_0"
    path.write_bytes(b"\0" * mmap.PAGESIZE)
    try:
        with open(path, "r+b") as f, mmap.mmap(f.fileno(), mmap.PAGESIZE):
            assert path not in _compat.leftover_deepspeed_shm()
        assert path in _compat.leftover_deepspeed_shm()
    finally:
        path.unlink()


def test_a_cycle_of_recycled_thread_idents_no_longer_hangs_a_notebooks_output():
    """ipykernel 6.29 (17.3's) walked thread idents to their oldest ancestor forever when recycled idents made a
    cycle (ipython/ipykernel#1269): notebook 21 hung in the 17.3 job simulation. The walk now stops at a repeat."""
    import contextvars
    import threading
    import types

    iostream = pytest.importorskip("ipykernel.iostream")
    prop = iostream.OutStream.__dict__.get("parent_header")
    if not getattr(getattr(prop, "fget", None), "_dtlab_cycle_safe", False):
        pytest.skip(f"ipykernel {__import__('ipykernel').__version__} does not walk thread idents (6.29 does)")
    me = threading.get_ident()
    stream = types.SimpleNamespace(_parent_header=contextvars.ContextVar("unset"), _parent_header_global="global",
                                   _thread_to_parent={me: 1, 1: 2, 2: 1},            # 1 and 2: recycled idents
                                   _thread_to_parent_header={2: "cell 2"})
    answer = []

    def walk():                                   # a thread whose parent's ident was recycled into a cycle
        stream._thread_to_parent[threading.get_ident()] = 1
        answer.append(prop.fget(stream))

    walker = threading.Thread(target=walk, daemon=True)
    walker.start()
    walker.join(timeout=5)
    assert not walker.is_alive(), "the walk through a cycle of thread idents did not end"
    assert answer == ["global"]                                    # no header for ident 1: the global fallback
    stream._thread_to_parent = {me: 1, 1: 2}
    assert prop.fget(stream) == "cell 2"                          # without a cycle: the oldest ancestor's, as before
