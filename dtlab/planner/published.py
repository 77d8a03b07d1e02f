"""Published training runs, and what the cost model predicts for each: the planner held to measurements.

``published_runs.json`` (beside this file) lists large training runs as their sources report them —
Megatron-LM's scaling tables and its ZeRO-3 comparison (Narayanan et al. 2021), sequence parallelism with
selective recomputation (Korthikanti et al. 2022), MT-NLG, BLOOM, Llama 3, torchtitan and MosaicML's
benchmarks — each with its source (title, address, table, a quote), its hardware, model shape, batch,
layout and measured throughput. What a source does not state is in the run's ``assumed``, with why.

``compare(run)`` prices the run's own layout with ``dtlab.planner.cost`` and sets the prediction beside
the measurement, in tokens per second per GPU (a measured iteration time gives it directly; a TFLOP/s
or MFU figure is turned into tokens with the source's own FLOPs formula, ``FLOPS_FORMULAS``). It also
prices every other layout the advisor would consider for the same model, cluster and batch, so that a
run a source measured as its best can be checked against the model's ranking.

    from dtlab.planner import published
    for row in published.table():
        print(row["name"], row["measured"], row["predicted"], row["ratio"])
"""

from __future__ import annotations

import functools
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtlab.planner import advise, cost, hardware
from dtlab.planner.formulas import ModelShape

PATH = Path(__file__).with_name("published_runs.json")


def _megatron_eq3(shape: ModelShape, seq_len: int, params: float) -> float:
    """Narayanan et al. 2021, eq. 3, per token: 96 l h^2 (1 + s/6h + V/16lh) (recomputation included)."""
    layers, h, v = shape.n_layer, shape.n_embd, shape.vocab or 0
    return 96 * layers * h * h * (1 + seq_len / (6 * h) + v / (16 * layers * h))


def _palm(shape: ModelShape, seq_len: int, params: float) -> float:
    """Chowdhery et al. 2022 (PaLM), appendix B, per token: 6N + 12 L h s (model FLOPs)."""
    return 6 * params + 12 * shape.n_layer * shape.n_embd * seq_len


def _bloom(shape: ModelShape, seq_len: int, params: float) -> float:
    """BigScience's throughput formula (tr11-176B-ml README): 4 x 2 x N per token (recomputation, no attention)."""
    return 8 * params


#: FLOPs per token each source counts, by name (the run's ``measured["flops_formula"]``).
FLOPS_FORMULAS = {"megatron-eq3": _megatron_eq3, "palm": _palm, "bloom-8n": _bloom}


@dataclass(frozen=True)
class Run:
    """One published run: its record from ``published_runs.json`` and the planner's objects for it."""

    record: dict[str, Any]

    @property
    def name(self) -> str:
        return self.record["name"]

    @property
    def shape(self) -> ModelShape:
        m = self.record["model"]
        return ModelShape(self.name, m["n_layer"], m["n_embd"], m["n_head"], self.record["source"]["title"],
                          n_kv_head=m["n_kv_head"], ffn=m["ffn"], gated=m["gated"], vocab=m["vocab"], tied=m["tied"],
                          dropout=m["dropout"])

    @property
    def params(self) -> float:
        return float(self.record["model"]["params"])

    @property
    def cluster(self) -> hardware.Cluster:
        c = self.record["cluster"]
        return hardware.custom_cluster(c["gpus"], c["gpu_memory_gb"], c["gpus_per_node"], c["peak_tflops"], True,
                                       c["intra_node_gbs"], c["inter_node_gbs"], gpu_name=c["gpu"])

    @property
    def family(self) -> str:
        """The GPU family (``cost.EFFICIENCY``'s keys: "A100", "H100"), or the GPU's name."""
        name = self.record["cluster"]["gpu"]
        return next((f for f in cost.EFFICIENCY if name.upper().startswith(f)), name)

    def exempt(self, check: str) -> str | None:
        """Why this run is left out of ``check`` ("throughput" or "fits"), or None when it is not."""
        return self.record.get("exempt", {}).get(check)

    @property
    def benchmark(self) -> str | None:
        """The benchmark table a run belongs to (held out whole: listed by section, not fitted), or None for the
        runs chosen one by one."""
        return self.record.get("table")

    @property
    def framework(self) -> str:
        """Whose code trained the run (``cost.Setup.framework``): the family a held-out check leaves out whole."""
        return self.record["setup"].get("framework", "pytorch")

    def setup(self, efficiency: float | None = None, overhead: float | None = None) -> cost.Setup:
        s = self.record["setup"]
        return cost.Setup(s["global_batch"], s["micro_batch"], s["seq_len"], s["recompute"], s["precision"],
                          efficiency, s["flash_attention"], s.get("grad_reduce", "fp32"),
                          s.get("sequence_parallel", True), s.get("schedule", "1f1b"),
                          s.get("bucket_bytes", cost.BUCKET_BYTES), s.get("pipeline_split", "even"),
                          self.framework, s.get("eager_norms", False), overhead, s.get("fused_loss", False),
                          s.get("attention_kernel", "flash2"))

    def layouts(self) -> list[cost.Layout]:
        """The run's layout; where the source gives only TP x PP (``model_parallel``), every split of it with TP
        inside a node that divides the heads."""
        lay = self.record["layout"]
        if lay["tp"] is not None:
            return [cost.Layout(dp=lay["dp"], tp=lay["tp"], pp=lay["pp"], cp=lay["cp"], zero=lay["zero"],
                                virtual=lay["virtual"], gathers_per_layer=lay["gathers_per_layer"])]
        mp, gpn = lay["model_parallel"], self.record["cluster"]["gpus_per_node"]
        return [cost.Layout(dp=lay["dp"], tp=tp, pp=mp // tp, zero=lay["zero"]) for tp in range(1, gpn + 1)
                if mp % tp == 0 and gpn % tp == 0 and self.shape.n_head % tp == 0]

    @property
    def measured_tokens_per_s_per_gpu(self) -> float:
        """Tokens per second per GPU, from what the source measured: an iteration time, tokens per second, or
        TFLOP/s (or MFU x peak) divided by the FLOPs per token of the source's formula."""
        m, s, c = self.record["measured"], self.record["setup"], self.record["cluster"]
        if m.get("iteration_seconds"):
            return s["global_batch"] * s["seq_len"] / (m["iteration_seconds"] * c["gpus"])
        if m.get("tokens_per_s_per_gpu"):
            return float(m["tokens_per_s_per_gpu"])
        tflops = m.get("tflops_per_gpu") or m["mfu"] * c["peak_tflops"]
        return tflops * 1e12 / FLOPS_FORMULAS[m["flops_formula"]](self.shape, s["seq_len"], self.params)

    def price(self, layout: cost.Layout, efficiency: float | None = None, overhead: float | None = None) -> dict:
        return cost.cost(self.params, layout, self.cluster, self.setup(efficiency, overhead), self.shape)


@functools.lru_cache(maxsize=1)
def _records() -> tuple[dict, ...]:
    return tuple(json.loads(PATH.read_text())["runs"])


def runs() -> list[Run]:
    """Every run of ``published_runs.json``."""
    return [Run(r) for r in _records()]


def run(name: str) -> Run:
    """The run called ``name`` (KeyError listing the names otherwise)."""
    for r in runs():
        if r.name == name:
            return r
    raise KeyError(f"no published run {name!r}; known: {', '.join(r.name for r in runs())}")


def compare(r: Run, efficiency: float | None = None, alternatives: bool = True,
            overhead: float | None = None) -> dict[str, Any]:
    """The prediction for ``r``'s layout beside its measurement, and the model's best alternative layout.

    Returns ``name``, ``layout`` (the one priced), ``fits``, ``fit`` (``cost.fit_state``), ``memory_gb`` (per GPU),
    ``measured`` and
    ``predicted`` (tokens/s per GPU), ``ratio`` (predicted / measured), ``exempt`` (the checks the run is
    left out of, with why), ``split`` (whether the TP x PP split priced is the source's own, or the fastest of the
    splits of a model-parallel size the source gives alone), and with ``alternatives``:
    ``best_other`` (the fastest other layout that fits, by the model, at the run's batch and micro-batch)
    and ``best_other_ratio`` (its predicted speed over the run's layout's).
    """
    priced = [r.price(lay, efficiency, overhead) for lay in r.layouts()]
    mine = max(priced, key=lambda p: p["tokens_per_second"])
    gpus = r.record["cluster"]["gpus"]
    out = {"name": r.name, "layout": mine["layout"], "fits": mine["fits"], "fit": mine["fit"],
           "memory_gb": mine["memory"]["total"] / 1e9,
           "measured": r.measured_tokens_per_s_per_gpu, "predicted": mine["tokens_per_second"] / gpus}
    out["ratio"] = out["predicted"] / out["measured"]
    out["exempt"] = dict(r.record.get("exempt", {}))
    mp = r.record["layout"]["model_parallel"] if r.record["layout"]["tp"] is None else None
    out["split"] = ("the source's" if mp is None else
                    f"not stated: the source gives only TP x PP = {mp}; priced at the split the model rates fastest")
    if alternatives:
        s = r.setup(efficiency, overhead)
        others = advise.advise(r.params, shape=r.shape, cluster=r.cluster, micro_batch=s.micro_batch,
                               seq_len=s.seq_len, global_batch=s.global_batch, precision=s.precision,
                               grad_reduce=s.grad_reduce, sequence_parallel=s.sequence_parallel,
                               schedule=s.schedule, bucket_bytes=s.bucket_bytes, pipeline_split=s.pipeline_split,
                               recompute=s.recompute, efficiency=efficiency, flash_attention=s.flash_attention,
                               framework=s.framework, eager_norms=s.eager_norms, overhead=overhead)
        fitting = [row for row in others.priced if row["fits"] is True and row["strategy"] != mine["layout"]]
        best = max(fitting, key=lambda row: row["tokens_per_second"], default=None)
        out["best_other"] = best["strategy"] if best else None
        out["best_other_ratio"] = best["tokens_per_second"] / mine["tokens_per_second"] if best else None
    return out


def fitted_efficiency(r: Run) -> float:
    """The one ``efficiency`` (fraction of peak for every kernel) at which the model predicts ``r``'s measured
    throughput exactly (bisection): what the planner used before its kernels were priced each at its own rate."""
    low, high = 0.05, 1.0
    for _ in range(40):
        mid = (low + high) / 2
        if compare(r, mid, alternatives=False)["ratio"] < 1:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def median_efficiencies() -> tuple[dict[str, float], float]:
    """The medians of ``fitted_efficiency`` by GPU family, and over every checked run: where ``cost.EFFICIENCY`` and
    ``cost.DEFAULT_EFFICIENCY`` (the one-rate model a given ``efficiency`` selects) come from."""
    by: dict[str, list[float]] = {}
    for r in runs():
        if not r.exempt("throughput") and not r.benchmark:
            by.setdefault(r.family, []).append(fitted_efficiency(r))
    return ({k: statistics.median(v) for k, v in by.items()}, statistics.median([e for v in by.values() for e in v]))


def fitted_overhead(r: Run) -> float:
    """The ``Setup.overhead`` (a factor on the kernels' measured time, ``cost.kernel_seconds``) at which the model
    predicts ``r``'s measured throughput exactly (bisection in log space)."""
    low, high = math.log(0.2), math.log(5.0)
    for _ in range(40):
        mid = (low + high) / 2
        if compare(r, alternatives=False, overhead=math.exp(mid))["ratio"] > 1:
            low = mid
        else:
            high = mid
    return math.exp((low + high) / 2)


def source_of(r: Run) -> str:
    """The source a run comes from (its paper or page): the unit ``held_out`` leaves out as a whole."""
    return r.record["source"]["title"]


@functools.cache
def fitted_runs() -> dict[str, tuple[str, str, str, float]]:
    """``fitted_overhead`` of every run whose throughput is checked: name -> (GPU family, source, framework,
    overhead)."""
    return {r.name: (r.family, source_of(r), r.framework, fitted_overhead(r)) for r in runs()
            if not r.exempt("throughput") and not r.benchmark}


def pooled_overhead(fitted: list[tuple[str, float]]) -> float:
    """The median over sources of each source's median overhead, from ``(source, overhead)`` pairs: every source
    weighs the same, however many runs it published."""
    by: dict[str, list[float]] = {}
    for source, value in fitted:
        by.setdefault(source, []).append(value)
    return statistics.median(statistics.median(v) for v in by.values())


def median_overhead() -> float:
    """``pooled_overhead`` over every checked run: where ``cost.KERNEL_OVERHEAD`` comes from."""
    return pooled_overhead([(source, value) for _, source, _, value in fitted_runs().values()])


#: What ``held_out`` can leave out: the run's whole source, its framework family, or the run alone.
HELD_OUT_BY = ("source", "framework", "run")


def held_out(r: Run, by: str = "source") -> dict[str, Any]:
    """``compare(r)`` with the kernel overhead fitted to runs ``r`` took no part in: with ``by="source"`` (the
    default) the runs of every *other* source (a paper's or a page's runs share its code, cluster and way of
    measuring, so they are left out together); with ``by="framework"`` the runs of every other framework family
    (Megatron-LM, Megatron-DeepSpeed, PyTorch: a family's kernels are priced from the others' runs alone); with
    ``by="run"`` every other run. The overhead is ``pooled_overhead`` of those. The returned dict adds ``overhead``
    (the one used) and ``pool`` (how many runs and sources it comes from)."""
    if by not in HELD_OUT_BY:
        raise ValueError(f"by={by!r}: one of {', '.join(map(repr, HELD_OUT_BY))}")
    others = [(source, value) for name, (_, source, framework, value) in fitted_runs().items()
              if name != r.name and (by == "run" or (by == "source" and source != source_of(r))
                                     or (by == "framework" and framework != r.framework))]
    value = pooled_overhead(others)
    out = compare(r, alternatives=False, overhead=value)
    out.update(overhead=value, pool={"runs": len(others), "sources": len({s for s, _ in others})})
    return out


def leave_one_out(by: str = "source") -> list[dict[str, Any]]:
    """For each source (``by="source"``) or framework family (``by="framework"``) of checked runs: its runs'
    ``held_out`` ratios with every run of it left out of the fit, their median and the worst (furthest from 1), how
    many are within 35%, and the overhead they were priced with."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in runs():
        if not r.exempt("throughput") and not r.benchmark:
            groups.setdefault(source_of(r) if by == "source" else r.framework, []).append(held_out(r, by))
    return [{by: key, "runs": len(rows), "median_ratio": statistics.median(x["ratio"] for x in rows),
             "worst_ratio": max((x["ratio"] for x in rows), key=lambda v: abs(math.log(v))),
             "within": sum(1 for x in rows if abs(math.log(x["ratio"])) <= math.log(1.35)),
             "overhead": statistics.median(x["overhead"] for x in rows)} for key, rows in groups.items()]


def leave_one_source_out() -> list[dict[str, Any]]:
    """``leave_one_out("source")``."""
    return leave_one_out("source")


def format_sources(rows: list[dict[str, Any]] | None = None, by: str = "source") -> str:
    """``leave_one_out(by)`` as a Markdown table (what the README shows, by source and by framework family)."""
    rows = rows if rows is not None else leave_one_out(by)
    what = "source" if by == "source" else "framework family"
    lines = [f"| {what} (left out of the fit) | runs | median predicted / measured | furthest from 1 | within 35% | "
             "overhead used |", "|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row[by]} | {row['runs']} | {row['median_ratio']:.2f} | {row['worst_ratio']:.2f} | "
                     f"{row['within']} of {row['runs']} | {row['overhead']:.2f} |")
    return "\n".join(lines)


#: How far a published run may be from the priced case and still be evidence "at this scale": parameters and GPUs
#: each within this factor, either way.
SCALE_FACTOR = {"params": 4.0, "gpus": 8.0}


def family_of(tp: int, pp: int, cp: int = 1, zero: int = 0, offload: bool = False) -> str:
    """The strategy family a layout belongs to, as the evidence column matches runs to layouts: "DDP",
    "ZeRO-1/2", "ZeRO-3 / FSDP" (HSDP included), "ZeRO-Offload", "TP x DP", "TP x ZeRO-3 / FSDP", "PP (x DP)",
    "TP x PP (x DP)" (any ZeRO stage over DP) or "context parallel"."""
    if cp > 1:
        return "context parallel"
    if tp > 1 and pp > 1:
        return "TP x PP (x DP)"
    if pp > 1:
        return "PP (x DP)"
    if tp > 1:
        return "TP x ZeRO-3 / FSDP" if zero == 3 else "TP x DP"
    if offload:
        return "ZeRO-Offload"
    return "ZeRO-3 / FSDP" if zero == 3 else "ZeRO-1/2" if zero in (1, 2) else "DDP"


def run_family(r: Run) -> str:
    """``family_of`` a published run's layout (a model-parallel size without its split counts as TP x PP)."""
    lay = r.record["layout"]
    if lay["tp"] is None:
        return "TP x PP (x DP)" if lay["model_parallel"] > r.record["cluster"]["gpus_per_node"] else "TP x DP"
    return family_of(lay["tp"], lay["pp"], lay["cp"], lay["zero"])


@functools.cache
def _ratio(name: str) -> float:
    return compare(run(name), alternatives=False)["ratio"]


def evidence(family: str, params: float, gpus: int, gpu: str = "") -> dict[str, Any]:
    """The published measured run nearest to ``params`` on ``gpus`` GPUs among those of strategy ``family``: what
    a layout the planner prices rests on beside its arithmetic.

    Nearest by parameters and GPU count (log distance), a run on the same GPU family preferred. Returns
    ``family``, ``run`` (None when the records hold no run of the family), its ``params``, ``gpus`` and ``gpu``,
    ``measured_tokens_per_s_per_gpu``, ``measured_tflops_per_gpu`` (when the source gives it), ``predicted_over_
    measured`` (this planner on that run's own layout), ``exempt`` (why the planner's throughput check leaves the
    run out, or None), ``at_scale`` (parameters within ``SCALE_FACTOR["params"]``
    and GPUs within ``SCALE_FACTOR["gpus"]``, either way) and ``text``, one line for people.
    """
    same = [r for r in runs() if run_family(r) == family and not r.benchmark]
    out: dict[str, Any] = {"family": family, "run": None, "at_scale": False}
    if not same:
        out["text"] = f"never measured: no published {family} run in the planner's records"
        return out
    wanted = next((f for f in cost.EFFICIENCY if gpu.upper().startswith(f)), gpu)

    def distance(r: Run) -> float:
        return (abs(math.log(r.params / params)) + abs(math.log(r.record["cluster"]["gpus"] / gpus))
                + (0.0 if r.family == wanted else 0.5))
    near = min(same, key=distance)
    c, m = near.record["cluster"], near.record["measured"]
    out.update(run=near.name, params=near.params, gpus=c["gpus"], gpu=c["gpu"],
               measured_tokens_per_s_per_gpu=near.measured_tokens_per_s_per_gpu,
               measured_tflops_per_gpu=m.get("tflops_per_gpu"), predicted_over_measured=_ratio(near.name),
               at_scale=(max(near.params / params, params / near.params) <= SCALE_FACTOR["params"]
                         and max(c["gpus"] / gpus, gpus / c["gpus"]) <= SCALE_FACTOR["gpus"]))
    tflops = f", {out['measured_tflops_per_gpu']:g} TFLOP/s" if out["measured_tflops_per_gpu"] else ""
    out["exempt"] = near.exempt("throughput")
    measured = (f"{near.name}: {out['measured_tokens_per_s_per_gpu']:,.0f} tokens/s per GPU measured{tflops}; "
                f"this planner predicts {out['predicted_over_measured']:.2f}x that"
                + (" (a run the planner's throughput check leaves out: published_runs.json says why)"
                   if out["exempt"] else ""))
    out["text"] = measured if out["at_scale"] else f"never measured at this scale; the nearest is {measured}"
    return out


def table(efficiency: float | None = None) -> list[dict[str, Any]]:
    """``compare`` for every run chosen one by one (not the benchmark tables'), in the file's order."""
    return [compare(r, efficiency) for r in runs() if not r.benchmark]


def benchmark_rows() -> list[dict[str, Any]]:
    """Every benchmark-table run held out by source and by framework family: ``name``, ``section`` (the table's
    section: GPU and precision), ``seq_len``, ``fit``, ``by_source`` and ``by_framework`` (predicted / measured)."""
    out = []
    for r in runs():
        if r.benchmark and not r.exempt("throughput"):
            out.append({"name": r.name, "section": r.record["source"]["where"].split("'")[1],
                        "seq_len": r.record["setup"]["seq_len"], "fit": compare(r, alternatives=False)["fit"],
                        "by_source": held_out(r)["ratio"], "by_framework": held_out(r, "framework")["ratio"]})
    return out


def format_benchmarks(rows: list[dict[str, Any]] | None = None) -> str:
    """``benchmark_rows`` by section, as a Markdown table (what the README shows)."""
    rows = rows if rows is not None else benchmark_rows()
    lines = ["| benchmark section (held out whole) | runs | median predicted / measured | within 35% | within 35% "
             "up to 16k tokens | read fits or tight |", "|---|---:|---:|---:|---:|---:|"]
    sections: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        sections.setdefault(row["section"], []).append(row)

    def within(group: list[dict[str, Any]]) -> str:
        return f"{sum(1 for x in group if abs(math.log(x['by_source'])) <= math.log(1.35))} of {len(group)}"
    for section, group in sections.items():
        short = [x for x in group if x["seq_len"] <= 16384]
        lines.append(f"| {section} | {len(group)} | {statistics.median(x['by_source'] for x in group):.2f} | "
                     f"{within(group)} | {within(short)} | "
                     f"{sum(1 for x in group if x['fit'] in ('fits', 'tight'))} of {len(group)} |")
    return "\n".join(lines)


def format_table(rows: list[dict[str, Any]] | None = None) -> str:
    """The comparison as a Markdown table (what the README shows)."""
    rows = rows if rows is not None else table()
    lines = ["| run | layout priced | fits | measured tokens/s/GPU | predicted | predicted / measured | fastest other "
             "layout (model) |", "|---|---|---|---:|---:|---:|---|"]
    for row in rows:
        other = (f"{row['best_other']}: {row['best_other_ratio']:.2f}x" if row.get("best_other") else "none fits")
        fits = {"fits": "yes", "tight": "tight", "does not fit": "no"}.get(row["fit"], "?")
        fits += " (not checked)" if "fits" in row["exempt"] else ""
        ratio = f"{row['ratio']:.2f}" + (" (not checked)" if "throughput" in row["exempt"] else "")
        layout = row["layout"] + ("" if row.get("split", "the source's") == "the source's" else
                                  f" (the split the model rates fastest: the source gives only "
                                  f"{row['split'].split('= ')[1].split(';')[0]} GPUs of model parallelism)")
        lines.append(f"| {row['name']} | {layout} | {fits} | {row['measured']:,.0f} | "
                     f"{row['predicted']:,.0f} | {ratio} | {other} |")
    return "\n".join(lines)
