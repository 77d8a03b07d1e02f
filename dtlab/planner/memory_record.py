"""The planner's memory held to published peak-memory measurements: ``measured_memory.json`` beside this file.

    python -m dtlab.planner.memory_record      # the table, per source, and the OOM runs

``dtlab/planner/measured_memory.json`` lists training runs whose peak GPU memory was published (and runs that
ran out of memory), each with its source, model, batch, layout and what the number is (``figure``). For each run
``price`` builds what the planner takes, the way ``dtlab.planner.published`` does for throughput runs:

* a ``ModelShape`` (layers, width, heads, MLP, vocabulary) and the parameter count;
* a ``cost.Layout`` (TP, PP, DP, CP, ZeRO stage, interleaving, optimizer offload);
* a ``cost.Setup`` (global batch, micro-batch, sequence, recomputation, precision, fused attention);
* a cluster of the run's GPUs with the card's memory (``hardware.custom_cluster``);

then calls ``cost.cost``, which checks the layout, prices memory per GPU on the busiest GPU (``cost.memory``) and
says whether it fits (``cost.fit_state``).

Some runs the planner cannot express: Float8 training, ``torch.compile``, encoder-decoder models, a pipeline
micro-batch the source does not give. They are listed as "not expressible: <why>" rather than priced as
something they are not.

``main`` prints a markdown table (predicted / measured for each run), then per source: how many runs, how many priced
against a figure, the median predicted / measured and how many are within 25%; and how many runs that ran out of
memory the planner says "fits" (the mistake that costs a learner a failed job).

Reading the ratio: each prediction is the figure of the kind the source measured (``memory.figure``): peak
allocated, peak reserved, or nvidia-smi's whole process; a number whose tool the source does not name is read as
nvidia-smi's.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from dtlab.planner import cost, hardware, memory
from dtlab.planner.formulas import GiB, ModelShape

PATH = Path(__file__).with_name("measured_memory.json")
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
                      schedule=s["schedule"], framework=s["framework"])


def cluster(run: dict[str, Any]) -> hardware.Cluster:
    """The run's GPUs, with the card's memory (GiB in the record; the planner counts GB = 10**9 bytes). No peak
    TFLOP/s is given, so ``cost.cost`` prices memory only."""
    c = run["cluster"]
    return hardware.custom_cluster(c["gpus"], c["gpu_memory_gib"] * GiB / 1e9, c["gpus_per_node"],
                                   host_memory_gb_per_gpu=c.get("host_memory_gb_per_gpu", 0.0), gpu_name=c["gpu"])


def price(run: dict[str, Any]) -> dict[str, Any]:
    """The planner's view of ``run``: ``predicted_gib`` (busiest GPU), ``fit`` and ``ratio`` (predicted / measured,
    None without a figure), or ``not_expressible`` (why, as one line)."""
    out: dict[str, Any] = {"run": run, "predicted_gib": None, "fit": None, "ratio": None, "not_expressible": None,
                           "memory": None, "figure": None}
    why = not_expressible(run)
    if why:
        out["not_expressible"] = "; ".join(why)
        return out
    try:
        priced = cost.cost(run["model"]["params"], layout(run), cluster(run), setup(run), shape(run))
    except (cost.LayoutError, ValueError) as error:
        out["not_expressible"] = f"the planner refuses the layout: {error}"
        return out
    out["memory"] = priced["memory"]
    out["figure"] = figure_of(run)
    out["predicted_gib"] = memory.figure(priced["memory"], out["figure"], card=card_bytes(run)) / GiB
    out["fit"] = priced["fit"]
    if run["peak_gib"]:
        out["ratio"] = out["predicted_gib"] / run["peak_gib"]
    return out


#: A figure from nvidia-smi this close to the card's memory says the allocator filled the card: an upper bound on what
#: the run needed, not a measure of it (the caching allocator keeps what it once reserved).
FULL = 0.97


def card_bytes(run: dict[str, Any]) -> float:
    """The run's GPU memory in bytes."""
    return run["cluster"]["gpu_memory_gib"] * GiB


def bound(run: dict[str, Any]) -> bool:
    """Whether the run's figure is only an upper bound: nvidia-smi read the card full (``FULL``)."""
    return (figure_of(run) == "nvidia-smi" and run["peak_gib"] is not None
            and run["peak_gib"] >= FULL * run["cluster"]["gpu_memory_gib"])


def implied_slack(row: dict[str, Any]) -> float | None:
    """The allocator slack at which ``row``'s prediction equals its figure, or None where the figure holds no slack
    (peak allocated) or is a bound."""
    run, mem = row["run"], row["memory"]
    if mem is None or run["peak_gib"] is None or bound(run) or figure_of(run) == "max_memory_allocated":
        return None
    measured = run["peak_gib"] * GiB - (mem["process"] if figure_of(run) == "nvidia-smi" else 0.0)
    return measured / mem["allocated"] - 1


def fitted_slack(leave_out: str | None = None, rows: list[dict[str, Any]] | None = None) -> float:
    """``memory.ALLOCATOR_SLACK`` as fitted: the median ``implied_slack`` over the checked runs, those of the source
    ``leave_out`` left out."""
    rows = rows if rows is not None else checked()
    values = [v for row in rows if source_of(row["run"]) != leave_out and (v := implied_slack(row)) is not None]
    return statistics.median(values)


def held_out(row: dict[str, Any], rows: list[dict[str, Any]] | None = None) -> float | None:
    """``row``'s predicted / measured with the allocator slack fitted to every *other* source's runs."""
    run = row["run"]
    if row["memory"] is None or run["peak_gib"] is None:
        return None
    slack = fitted_slack(source_of(run), rows)
    return memory.figure(row["memory"], row["figure"], slack, card_bytes(run)) / GiB / run["peak_gib"]


def figure_of(run: dict[str, Any]) -> str:
    """The ``memory.FIGURES`` kind the run's number is compared as: its own, and a number whose tool the source does
    not name as nvidia-smi's (the whole process: an upper bound on what the other tools show)."""
    return run["figure"] if run["figure"] in memory.FIGURES else "nvidia-smi"


def runs() -> list[dict[str, Any]]:
    """Every run of ``measured_memory.json``."""
    return json.loads(PATH.read_text())["runs"]


def source_of(run: dict[str, Any]) -> str:
    """The organisation that published the run: the unit a held-out check leaves out as a whole."""
    return run["org"]


def checked() -> list[dict[str, Any]]:
    """``price`` of every run used for validation that the planner can express."""
    return [row for row in map(price, runs()) if row["run"]["use_for_validation"] and not row["not_expressible"]]


def by_source(rows: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Per source: runs priced against a figure, the median and the furthest-from-1 predicted / measured, and the
    runs that ran out of memory with what the planner says of them. The memory model has no constant fitted to these
    runs (every constant is a published byte count, ``dtlab.planner.memory``), so held out by source is the same as
    in sample: no run's own figure moves its prediction."""
    rows = rows if rows is not None else checked()
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        entry = out.setdefault(source_of(row["run"]), {"source": source_of(row["run"]), "ratios": [], "oom": []})
        if row["ratio"] is not None:
            entry["ratios"].append(row["ratio"])
        if row["run"]["ran_out_of_memory"]:
            entry["oom"].append(row["fit"])
    for entry in out.values():
        r = entry["ratios"]
        entry["median_ratio"] = statistics.median(r) if r else None
        entry["worst_ratio"] = max(r, key=lambda v: abs(v - 1)) if r else None
    return list(out.values())


def nearest(params: float, gpus: int, family: str, rows: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
    """The measured run nearest to ``params`` on ``gpus`` GPUs (log distance; a run of the same strategy ``family``,
    ``published.family_of``'s words, preferred): what a memory figure the planner gives rests on. Returns the run's
    name, its measured figure (GiB and kind), the planner's predicted / measured on it and a line for people.
    ``rows``: ``checked()``, priced once by a caller that asks for many (``advise`` asks once per candidate layout)."""
    from dtlab.planner.published import family_of  # published prices runs with advise, which imports this module

    rows = [row for row in (rows if rows is not None else checked()) if row["ratio"] is not None]
    if not rows:
        return None

    def distance(row: dict[str, Any]) -> float:
        r, lay = row["run"], row["run"]["layout"]
        same = family_of(lay["tp"], lay["pp"], lay["cp"], lay["zero"], lay.get("offload_optimizer", False)) == family
        return (abs(math.log(r["model"]["params"] / params)) + abs(math.log(r["cluster"]["gpus"] / gpus))
                + (0.0 if same else 1.0))
    row = min(rows, key=distance)
    r = row["run"]
    return {"run": r["name"], "measured_gib": r["peak_gib"], "figure": r["figure"], "ratio": row["ratio"],
            "text": f"memory: {r['name']} measured {r['peak_gib']:.1f} GiB ({r['figure']}); this planner predicts "
                    f"{row['ratio']:.2f}x that"}


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
    rows = [price(run) for run in runs()]
    print(table(rows))
    print()
    print(summary(rows))


if __name__ == "__main__":
    main()


def format_sources(rows: list[dict[str, Any]] | None = None) -> str:
    """Per source, the memory held out by source (the allocator's slack fitted to the other sources' runs), as a
    Markdown table (what the README shows)."""
    rows = rows if rows is not None else checked()
    lines = ["| source (memory; left out of the fit) | runs priced | median predicted / measured | furthest from 1 | "
             "ran out of memory: the planner says |", "|---|---:|---:|---:|---|"]
    by: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by.setdefault(source_of(row["run"]), []).append(row)
    for source, group in by.items():
        ratios = [held_out(row, rows) for row in group if row["ratio"] is not None and not bound(row["run"])]
        bounds = sum(1 for row in group if row["ratio"] is not None and bound(row["run"]))
        ooms = [row["fit"] for row in group if row["run"]["ran_out_of_memory"]]
        median = f"{statistics.median(ratios):.2f}" if ratios else "-"
        worst = f"{max(ratios, key=lambda v: abs(v - 1)):.2f}" if ratios else "-"
        runs = f"{len(ratios)}" + (f" (+{bounds} read at the card's full memory: a bound)" if bounds else "")
        lines.append(f"| {source} | {runs} | {median} | {worst} | {', '.join(ooms) if ooms else '-'} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- this machine's runs

CPU_PATH = Path(__file__).with_name("measured_cpu.json")


def cpu_runs() -> list[dict[str, Any]]:
    """The peak-memory measurements taken on this course's CPU machine (``measured_cpu.json``, written by
    ``scripts/measure_memory_cpu.py``): the course's TinyGPT and a Hugging Face Llama under DDP, FSDP2 and DeepSpeed's
    ZeRO on 2 gloo processes."""
    return json.loads(CPU_PATH.read_text())["runs"]


def price_cpu(run: dict[str, Any]) -> dict[str, Any]:
    """The planner's peak allocated bytes for one CPU run (fp32, one of 2 ranks) beside the measured peak (the most of
    any rank): ``predicted``, ``measured`` (bytes), ``ratio`` and the planner's ``memory`` dict."""
    m, strategy = run["model"], run["strategy"]
    shape = ModelShape(run["name"], m["n_layer"], m["n_embd"], m["n_head"], "this machine", n_kv_head=m["n_kv_head"],
                       ffn=m["ffn"], gated=m["gated"], vocab=m["vocab"], tied=m["tied"], dropout=m["dropout"])
    label, world = strategy["label"], run["world"]
    deepspeed = strategy.get("deepspeed") or {}
    zero_cfg = deepspeed.get("zero_optimization", {}) if isinstance(deepspeed, dict) else {}
    if label.startswith("DDP"):
        lay, framework = cost.Layout(dp=world, zero=0), "pytorch"
    elif label.startswith("FSDP2"):
        lay, framework = cost.Layout(dp=world, zero=3), "pytorch"
    else:
        lay, framework = cost.Layout(dp=world, zero=int(zero_cfg["stage"])), "deepspeed"
    setup = cost.Setup(global_batch=run["batch_per_rank"] * world, micro_batch=run["batch_per_rank"],
                       seq_len=run["seq_len"], recompute="none", precision="fp32", flash_attention=True,
                       framework=framework, deepspeed_bucket=float(zero_cfg.get("reduce_bucket_size", 5e8)))
    mem = cost.memory(float(m["params"]), shape, lay, setup)
    measured = float(run["peak_bytes_max_over_ranks"])
    return {"name": run["name"], "strategy": label, "predicted": mem["allocated"], "measured": measured,
            "ratio": mem["allocated"] / measured, "memory": mem}
