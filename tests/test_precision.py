"""Mixed precision: number formats, GradScaler's skipped steps, and compression hooks' bytes."""

import pytest
import torch
import torch.nn.functional as F

from dtlab import precision
from dtlab.launch import run
from dtlab.measure import max_diff


def test_formats_come_from_torch():
    rows = {r["dtype"]: r for r in precision.formats()}
    assert rows["float16"]["max"] == 65504 and rows["bfloat16"]["max"] > 3e38
    assert rows["bfloat16"]["eps"] > rows["float16"]["eps"] > rows["float32"]["eps"]
    assert all(r["bits"] == 1 + r["exponent_bits"] + r["mantissa_bits"] for r in rows.values())


def test_grad_scaler_skips_overflowing_steps_and_lowers_the_scale():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**30)
    x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
    before = [p.clone() for p in model.parameters()]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "the overflowing step was skipped"
    assert scaler.get_scale() == 2.0**29, "and the scale halved"


def _train(dtype_name, steps=3):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    from dtlab import models

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = models.MLP(16, 64, 4)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    hook = None
    if dtype_name == "builtin fp16":
        ddp.register_comm_hook(None, fp16_compress_hook)
    else:
        hook = precision.CompressionHook(getattr(torch, dtype_name))
        ddp.register_comm_hook(None, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(ddp(torch.randn(8, 16, generator=g)), torch.randint(0, 4, (8,), generator=g)).backward()
        opt.step()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    dist.destroy_process_group()
    return {"state": state, "bytes": hook.bytes_sent if hook else None}


def test_compression_hook_halves_the_bytes_and_matches_torch_fp16_hook():
    fp32 = run(_train, "float32", nprocs=2)[0]
    fp16 = run(_train, "float16", nprocs=2)[0]
    bf16 = run(_train, "bfloat16", nprocs=2)[0]
    builtin = run(_train, "builtin fp16", nprocs=2)[0]
    assert fp16["bytes"] * 2 == fp32["bytes"] == bf16["bytes"] * 2 > 0
    diff = max_diff(fp16["state"], builtin["state"])
    assert diff == pytest.approx(0, abs=1e-6), "our fp16 hook does what torch's does"
    drift = max_diff(bf16["state"], fp32["state"])
    assert 0 < drift < 1e-2, "bf16 rounding changes the weights a little"


def _buckets_under_autocast():
    import torch.distributed as dist

    from dtlab import models

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = models.MLP(16, 64, 4)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    hook = precision.CompressionHook(torch.float16)
    ddp.register_comm_hook(None, hook)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(ddp(torch.randn(8, 16)), torch.randint(0, 4, (8,)))
    loss.backward()
    seen = {"buckets": sorted(str(d) for d in hook.bucket_dtypes), "bytes": hook.bytes_sent,
            "grad": str(model.net[0].weight.grad.dtype)}
    dist.destroy_process_group()
    return seen


def test_ddp_hands_the_hook_fp32_buckets_under_autocast():
    from dtlab import models

    seen = run(_buckets_under_autocast, nprocs=2)[0]
    assert seen["buckets"] == ["torch.float32"] and seen["grad"] == "torch.float32", "autocast leaves gradients fp32"
    numel = models.count_parameters(models.MLP(16, 64, 4))
    assert seen["bytes"] == 2 * numel, "the fp16 hook handed all_reduce 2 bytes per gradient element"
