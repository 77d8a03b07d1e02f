"""Number formats and gradient compression for the mixed-precision lesson.

* ``formats()`` — bits, range and precision of fp32, fp16 and bf16, read from ``torch.finfo``.
* ``CompressionHook`` — a DDP communication hook that casts each gradient bucket to a 16-bit
  type, all-reduces it, and casts back, counting the bytes it hands to the all-reduce. It does
  what torch's ``fp16_compress_hook`` / ``bf16_compress_hook`` do, in a dozen readable lines, and
  registers on every torch build (``DistributedDataParallel.register_comm_hook`` refuses torch's
  ``bf16_compress_hook`` unless torch was *built* with CUDA 11+ and NCCL 2.10+ — a pip ``+cpu``
  wheel, say — whatever backend the process group uses).

    hook = CompressionHook(torch.bfloat16)
    ddp_model.register_comm_hook(None, hook)
    ...
    hook.bytes_sent        # bytes handed to all-reduce so far (not what crosses the wire:
                           # a ring all-reduce sends 2(N-1)/N of them per rank, plus headers)
    hook.bucket_dtypes     # the dtypes DDP's buckets had before the cast: float32 for fp32
                           # parameters, under autocast too
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtlab import _compat  # noqa: F401  (work-arounds for the runtime's torch and DeepSpeed)


def formats() -> list[dict]:
    """fp32, fp16 and bf16: total bits, exponent/mantissa bits, largest value, smallest normal, epsilon."""
    rows = []
    for dtype, exponent, mantissa in ((torch.float32, 8, 23), (torch.float16, 5, 10), (torch.bfloat16, 8, 7)):
        info = torch.finfo(dtype)
        rows.append({"dtype": str(dtype).replace("torch.", ""), "bits": info.bits, "exponent_bits": exponent,
                     "mantissa_bits": mantissa, "max": info.max, "smallest_normal": info.tiny, "eps": info.eps})
    return rows


class CompressionHook:
    """DDP communication hook: all-reduce gradients in ``dtype`` (fp32 = no compression), counting bytes.

    Gradients are divided by the world size before the cast (averaging), so large sums do not
    overflow fp16's range of 65,504. ``float32`` sends the bucket uncompressed: what DDP's default
    all-reduce does, with the counting.

    Attributes:
        bytes_sent: bytes handed to ``all_reduce`` so far (numel x element size of the cast buckets).
        calls: buckets all-reduced so far.
        bucket_dtypes: the dtypes of the buckets DDP handed the hook (before the cast).
    """

    def __init__(self, dtype: torch.dtype = torch.float16):
        self.dtype = dtype
        # DDP reads a hook's __name__ and __qualname__, as if it were a function.
        self.__name__ = self.__qualname__ = f"compress_to_{str(dtype).replace('torch.', '')}_hook"
        self.bytes_sent = 0
        self.calls = 0
        self.bucket_dtypes: set[torch.dtype] = set()

    def __call__(self, state, bucket):  # no annotations: DDP inspects the hook's signature
        group = state if state is not None else dist.group.WORLD
        world = dist.get_world_size(group)
        buffer = bucket.buffer()
        self.bucket_dtypes.add(buffer.dtype)
        compressed = buffer.div(world).to(self.dtype)
        self.bytes_sent += compressed.numel() * compressed.element_size()
        self.calls += 1
        future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

        def decompress(fut):
            buffer.copy_(fut.value()[0])  # back to fp32 in place
            return buffer

        return future.then(decompress)
