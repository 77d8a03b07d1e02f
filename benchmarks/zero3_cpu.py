"""How often does DeepSpeed ZeRO-3 on CPU processes (gloo) train the wrong weights? (``zero.zero3_cpu_fault``)

    .venv-dbr17.3/bin/python benchmarks/zero3_cpu.py [--runs 12] [--nprocs 3] [--thresholds 100000 0]
                                                     [--wait-every-gather]

Each run launches ``nprocs`` gloo processes (``torch.distributed.run``) that train notebook 21's Llama shape (its
Databricks job parameters: hidden 48, 2 layers, 3 heads, 1 key/value head, vocabulary 512, 48 tokens) under ZeRO-3
for 12 steps of SGD with momentum on random tokens, and compares the gathered weights with one process trained on
the same global batches. ``--thresholds`` are values of DeepSpeed's ``stage3_param_persistence_threshold``
(parameters with fewer elements stay whole on every rank; its default, 100,000, is every parameter of this model;
0 partitions them all). A run counts as wrong when any weight is more than 1e-3 from the reference (float32
reordering alone gives ~1e-8 here). Another DeepSpeed can be tried without installing it:
``PYTHONPATH=<a folder holding it> .venv-dbr17.3/bin/python benchmarks/zero3_cpu.py``.

Measured on the course's CI machine (2 cores), torch 2.7 (Databricks 17.3's stack) unless said:

| DeepSpeed | processes | threshold | runs wrong |
|---|---:|---:|---:|
| 0.14.4 (15.4's), torch 2.3 | 3 | 100,000 | 3 of 8 (3 NaN) |
| 0.14.4, torch 2.3 | 3 | 0 | 0 of 12 |
| 0.16.5 | 3 | 100,000 | 7 of 12 (5 NaN or > 1e12) |
| 0.16.5 | 3 | 0 | 1 of 12 |
| 0.16.5 | 2 | 100,000 | 0 of 8 (counted while this script was blind to NaN; a CI run later had a NaN) |
| 0.16.5 | 4 | 100,000 | 3 of 6 (3 NaN or > 1e17) |
| 0.19.8 | 3 | 100,000 | 0 of 10 |

The wrong runs start at a different step each time (2 to 11) on one rank's forward (an inf or NaN loss there
first): something reads memory that was never written. The cause (found later): DeepSpeed before 0.19 gathers
several parameters with one asynchronous all-gather each and waits only for the last launched
(``_allgather_params_coalesced``); on gloo each runs on its own thread, in no order, so the others can still be
empty when the parameters are used (deepspeedai/DeepSpeed#8539, which waits for every one). ``--wait-every-gather``
makes each all-gather DeepSpeed launches finish before it returns, in the workers only:

| DeepSpeed | processes | threshold | all-gathers | runs wrong |
|---|---:|---:|---|---:|
| 0.16.5 | 3 | 100,000 | as DeepSpeed launches them | 2 of 8 (2 NaN) |
| 0.16.5 | 3 | 100,000 | each waited for (``--wait-every-gather``) | 0 of 12 |

(the same session, one after the other; the workers' final gather takes all parameters at once, as the runs above
did, and is covered by the flag too). The final gather of the weights has the same fault, on any number of
processes: ``dtlab.parallel.zero.full_state_dict`` gathers one parameter at a time.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPE = {"vocab_size": 512, "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 3, "num_key_value_heads": 1, "max_position_embeddings": 48}
STEPS, BATCH, TOKENS = 12, 24, 49

WORKER = f"BATCH, STEPS, TOKENS = {BATCH}, {STEPS}, {TOKENS}\n" + """
import json, sys
import deepspeed, torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

shape, threshold, out = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
if sys.argv[4:] == ["wait-every-gather"]:     # DeepSpeed waits for each all-gather it launches, as 0.19 does
    import deepspeed.comm as ds_comm
    for name in ("all_gather_into_tensor", "all_gather"):
        def waited(*args, _launch=getattr(ds_comm, name), **kwargs):
            handle = _launch(*args, **kwargs)
            if handle is not None:
                handle.wait()
            return handle
        setattr(ds_comm, name, waited)
deepspeed.init_distributed(dist_backend="gloo")
rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(**shape))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
config = {"train_micro_batch_size_per_gpu": BATCH // world, "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": threshold},
          "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}
engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
data = torch.randint(0, shape["vocab_size"], (STEPS, BATCH, TOKENS), generator=torch.Generator().manual_seed(1))
per = BATCH // world
for step in range(STEPS):
    tokens = data[step, rank * per:(rank + 1) * per]
    loss = F.cross_entropy(engine(input_ids=tokens[:, :-1], use_cache=False).logits.flatten(0, 1).float(),
                           tokens[:, 1:].flatten())
    engine.backward(loss)
    engine.step()
with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
    weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
if rank == 0:
    torch.save(weights, out)
"""


def reference() -> dict:
    """One process, the whole global batch each step."""
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.randint(0, SHAPE["vocab_size"], (STEPS, BATCH, TOKENS), generator=torch.Generator().manual_seed(1))
    for tokens in data:
        loss = F.cross_entropy(model(input_ids=tokens[:, :-1], use_cache=False).logits.flatten(0, 1).float(),
                               tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main() -> None:
    import json

    import torch

    from dtlab.measure import max_diff

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=14)
    ap.add_argument("--nprocs", type=int, default=3)
    ap.add_argument("--thresholds", type=int, nargs="*", default=[100_000, 0])
    ap.add_argument("--wait-every-gather", action="store_true",
                    help="make every all-gather DeepSpeed launches finish before it returns (the fault's cause)")
    args = ap.parse_args()
    ref = reference()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        worker = Path(tmp) / "worker.py"
        worker.write_text(WORKER)
        for threshold in args.thresholds:
            diffs = []
            for i in range(args.runs):
                out = Path(tmp) / f"w{threshold}-{i}.pt"
                proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nprocs}",
                                f"--master_port={29700 + i}", str(worker), json.dumps(SHAPE), str(threshold),
                                str(out), *(["wait-every-gather"] if args.wait_every_gather else [])],
                                env=env, capture_output=True, text=True, timeout=300)
                if not out.exists():
                    raise SystemExit(f"run {i} failed:\n{proc.stderr[-6000:]}")
                got = torch.load(out)
                diffs.append(max_diff(got, ref))
            wrong = sum(not d <= 1e-3 for d in diffs)     # NaN counts as wrong
            print(f"threshold {threshold:>7}: {wrong} of {len(diffs)} runs wrong; max |diff| per run: "
                  + ", ".join(f"{d:.1e}" for d in diffs), flush=True)


if __name__ == "__main__":
    main()
