"""Hold the planner's memory prediction to published peak-memory measurements (issue 49).

    python scripts/memory_record.py

``dtlab/planner/measured_memory.json`` lists training runs whose peak GPU memory was published (and runs that
ran out of memory), each with its source, model, batch, layout and what the number is (``figure``). For each run
this script builds what the planner takes, the way ``dtlab.planner.published`` does for throughput runs:

* a ``ModelShape`` (layers, width, heads, MLP, vocabulary) and the parameter count;
* a ``cost.Layout`` (TP, PP, DP, CP, ZeRO stage, interleaving, optimizer offload);
* a ``cost.Setup`` (global batch, micro-batch, sequence, recomputation, precision, fused attention);
* a cluster of the run's GPUs with the card's memory (``hardware.custom_cluster``);

then calls ``cost.cost``, which checks the layout, prices memory per GPU on the busiest GPU (``cost.memory``) and
says whether it fits (``cost.fit_state``: "fits" within the planner's 15% headroom, "tight" inside it, "does not
fit" beyond the card).

Some runs the planner cannot express: Float8 training, ``torch.compile``, encoder-decoder models, a pipeline
micro-batch the source does not give. They are listed as "not expressible: <why>" rather than priced as
something they are not.

It prints a markdown table (predicted / measured for each run), then per source: how many runs, how many priced
against a figure, the median predicted / measured and how many are within 25%; and how many runs that ran out of
memory the planner says "fits" (the mistake that costs a learner a failed job).

Reading the ratio: the planner counts what training keeps (model states, activations, logits, ZeRO-3's
gathered layers) and leaves the rest to its headroom. A figure from ``max_memory_reserved`` or nvidia-smi also
holds the caching allocator's slack (and, for nvidia-smi, the CUDA context), so even a perfect count reads below
1 against those; ``max_memory_allocated`` is the closest to what the planner counts.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from dtlab.planner import cost, hardware
from dtlab.planner.formulas import GiB, ModelShape

PATH = Path(__file__).resolve().parent.parent / "dtlab" / "planner" / "measured_memory.json"
#: A prediction within this share of the measurement counts as close (predicted / measured in 0.75-1.25).
CLOSE = 0.25


def not_expressible(run: dict[str, Any]) -> list[str]:
    """Why the planner cannot price ``run`` as it ran (empty when it can).

    Float8 training (torchao's float8 linears keep float8 copies for backward and FSDP gathers float8 weights) has
    no precision in the planner, which knows bf16, fp16 and fp32; ``torch.compile`` fuses operators and so changes
    what autograd keeps, and AsyncTP adds symmetric-memory buffers: the planner has no knob for either. Its
    ``ModelShape`` is a decoder-only transformer. A field the source does not give is not guessed here."""
    m, s = run["model"], run["setup"]
    why = []
    if m["encoder_decoder"]:
        why.append(f"encoder-decoder model ({m.get('layers', 'encoder + decoder')}); ModelShape is decoder-only")
    if s["float8"]:
        why.append("Float8 linears (the planner has bf16/fp16/fp32 only)")
    if s["torch_compile"]:
        why.append("torch.compile (no knob)")
    if s["async_tp"]:
        why.append("AsyncTP (no knob)")
    for group, fields in (("setup", ("global_batch", "micro_batch", "seq_len")), ("layout", ("virtual",))):
        why += [f"{group}.{field} unknown" for field in fields if run[group][field] is None]
    if m["n_layer"] is None and not m["encoder_decoder"]:
        why.append("model.n_layer unknown")
    return why


def shape(run: dict[str, Any]) -> ModelShape:
    """The run's ``ModelShape`` (as ``published.Run.shape`` builds one)."""
    m = run["model"]
    return ModelShape(run["name"], m["n_layer"], m["n_embd"], m["n_head"], run["source"]["title"],
                      n_kv_head=m["n_kv_head"], ffn=m["ffn"], gated=m["gated"], vocab=m["vocab"], tied=m["tied"],
                      dropout=m["dropout"])


def layout(run: dict[str, Any]) -> cost.Layout:
    """The run's ``cost.Layout`` (as ``published.Run.layouts`` builds one, with optimizer offload)."""
    lay = run["layout"]
    return cost.Layout(dp=lay["dp"], tp=lay["tp"], pp=lay["pp"], cp=lay["cp"], zero=lay["zero"],
                       virtual=lay["virtual"], offload_optimizer=lay["offload_optimizer"])


def setup(run: dict[str, Any]) -> cost.Setup:
    """The run's ``cost.Setup`` (as ``published.Run.setup`` builds one; no efficiency: only memory is priced)."""
    s = run["setup"]
    return cost.Setup(s["global_batch"], s["micro_batch"], s["seq_len"], s["recompute"], s["precision"],
                      flash_attention=s["flash_attention"], sequence_parallel=s["sequence_parallel"],
                      schedule=s["schedule"])


def cluster(run: dict[str, Any]) -> hardware.Cluster:
    """The run's GPUs, with the card's memory (GiB in the record; the planner counts GB = 10**9 bytes). No peak
    TFLOP/s is given, so ``cost.cost`` prices memory only."""
    c = run["cluster"]
    return hardware.custom_cluster(c["gpus"], c["gpu_memory_gib"] * GiB / 1e9, c["gpus_per_node"],
                                   host_memory_gb_per_gpu=c.get("host_memory_gb_per_gpu", 0.0), gpu_name=c["gpu"])


def price(run: dict[str, Any]) -> dict[str, Any]:
    """The planner's view of ``run``: ``predicted_gib`` (busiest GPU), ``fit`` and ``ratio`` (predicted / measured,
    None without a figure), or ``not_expressible`` (why, as one line)."""
    out: dict[str, Any] = {"run": run, "predicted_gib": None, "fit": None, "ratio": None, "not_expressible": None}
    why = not_expressible(run)
    if why:
        out["not_expressible"] = "; ".join(why)
        return out
    try:
        priced = cost.cost(run["model"]["params"], layout(run), cluster(run), setup(run), shape(run))
    except (cost.LayoutError, ValueError) as error:
        out["not_expressible"] = f"the planner refuses the layout: {error}"
        return out
    out["predicted_gib"] = priced["memory"]["total"] / GiB
    out["fit"] = priced["fit"]
    if run["peak_gib"]:
        out["ratio"] = out["predicted_gib"] / run["peak_gib"]
    return out


def measured_text(run: dict[str, Any]) -> str:
    """The measurement as the table shows it."""
    if run["peak_gib"] is not None:
        return f"{run['peak_gib']:.2f} ({run['figure']})"
    failure = run.get("at_failure")
    if failure:
        return f"OOM ({failure['allocated_gib']:.2f} allocated at failure)"
    return "OOM (no figure)"


def table(rows: list[dict[str, Any]]) -> str:
    """One markdown row per run."""
    lines = ["| # | run | source | measured GiB (figure) | predicted GiB | predicted / measured | planner says | "
             "ran out of memory |", "|---:|---|---|---|---:|---:|---|---|"]
    for i, row in enumerate(rows, 1):
        run = row["run"]
        oom = "yes" if run["ran_out_of_memory"] else "no"
        if not run["use_for_validation"]:
            oom += " (not for validation)"
        if row["not_expressible"]:
            predicted, ratio, fit = "-", "-", f"not expressible: {row['not_expressible']}"
        else:
            predicted = f"{row['predicted_gib']:.2f}"
            ratio = f"{row['ratio']:.2f}" if row["ratio"] is not None else "-"
            fit = row["fit"] or "?"
        lines.append(f"| {i} | {run['name']} | {run['org']} | {measured_text(run)} | {predicted} | {ratio} | {fit} | "
                     f"{oom} |")
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> str:
    """Per source: runs, runs priced against a figure, their median predicted / measured and how many are within
    ``CLOSE``; then the runs that ran out of memory and the planner says fit."""
    lines = ["Per source (use_for_validation runs; predicted / measured over the priced runs with a figure):", ""]
    by_org: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row["run"]["use_for_validation"]:
            by_org.setdefault(row["run"]["org"], []).append(row)
    for org, group in by_org.items():
        ratios = [row["ratio"] for row in group if row["ratio"] is not None]
        skipped = sum(1 for row in group if row["not_expressible"])
        if ratios:
            close = sum(1 for r in ratios if abs(r - 1) <= CLOSE)
            text = (f"median predicted / measured {statistics.median(ratios):.2f}, within ±{CLOSE:.0%}: {close} of "
                    f"{len(ratios)}")
        else:
            text = "no priced run with a figure"
        runs = f"{len(group)} run" + ("s" if len(group) > 1 else "")
        lines.append(f"- {org}: {runs}, {len(ratios)} priced with a figure, {skipped} not expressible; "
                     f"{text}")
    ooms = [row for row in rows if row["run"]["ran_out_of_memory"] and row["run"]["use_for_validation"]]
    priced = [row for row in ooms if not row["not_expressible"]]
    wrong = [row for row in priced if row["fit"] == "fits"]
    left = sum(1 for row in rows if row["run"]["ran_out_of_memory"] and not row["run"]["use_for_validation"])
    lines += ["", f'OOM runs that read "fits": {len(wrong)} of {len(priced)} priced ({len(ooms) - len(priced)} not '
                  f"expressible, {left} not for validation left out)"
              + "".join(f"\n- {row['run']['name']}" for row in wrong)]
    return "\n".join(lines)


def main() -> None:
    runs = json.loads(PATH.read_text())["runs"]
    rows = [price(run) for run in runs]
    print(table(rows))
    print()
    print(summary(rows))


if __name__ == "__main__":
    main()
