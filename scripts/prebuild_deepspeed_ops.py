"""Compile DeepSpeed's C++ ops once, ahead of the lessons, into torch's extension cache.

On a machine without a GPU DeepSpeed JIT-compiles its CPU ops the first time they are used:
the shared-memory communication op at ``deepspeed.init_distributed`` (~50 s), ``fused_adam``
for ``"optimizer": {"type": "Adam"}`` (~90 s) and ``cpu_adam`` for optimizer offload (~90 s).
Done here, the notebooks never stall on a surprise compile. The cache lives in
``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``), outside the repo, so it
survives fresh clones; a second run only loads the compiled ops (a few seconds).
"""

import os
import sys
import time
import warnings

OPS = ("ShareMemCommBuilder", "FusedAdamBuilder", "CPUAdamBuilder")


def main() -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if _has_cuda() else "cpu")
    warnings.filterwarnings("ignore")
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    for name in OPS:
        builder = acc.create_op_builder(name)
        if builder is None or type(builder).__name__ == "NotImplementedBuilder":
            print(f"[deepspeed] {name}: not used on the {acc._name} accelerator, skipped", flush=True)
            continue
        t = time.perf_counter()
        print(f"[deepspeed] {name}: loading (compiles the first time only, ~1 min) ...", flush=True)
        builder.load(verbose=False)
        print(f"[deepspeed] {name}: ready in {time.perf_counter() - t:.1f} s", flush=True)
    return 0


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
