"""The planner held to published training runs (dtlab/planner/published_runs.json), not to itself.

For every run: its layout fits by the planner's memory model; the planner's throughput for it, with the kernel
overhead fitted to the runs of *other sources* (leave-one-source-out: a source's runs share its code, cluster and way
of measuring) and of other framework families, is within 35% of what the source measured; and where
the source measured a layout as its best, no other layout is rated more than 15% faster unless the run says why.
A run is left out of a check only with its reason written in the file (``exempt``).
"""

import re
from pathlib import Path

import pytest

from dtlab.planner import cost, published

# Issue 41's probes hold on every stack: the runtime stacks rerun this file (make test-runtime).
pytestmark = pytest.mark.cluster

RUNS = published.runs()
NAMES = [r.name for r in RUNS]
CHOSEN = [r for r in RUNS if not r.benchmark]          # the runs chosen one by one; the benchmark tables are apart
ROOT = Path(__file__).resolve().parents[1]


def test_the_file_holds_enough_sourced_runs():
    assert len(RUNS) >= 8
    checked = [r for r in RUNS if not r.exempt("throughput")]
    assert len(checked) >= 8, "at least 8 runs checked for throughput"
    assert len({r.record["source"]["url"] for r in checked}) >= 5, "from at least 5 sources"
    for r in RUNS:
        source = r.record["source"]
        assert source["title"] and source["url"].startswith("https://") and source["where"] and source["quote"]
        assert r.record["measured"], r.name
        for check, why in r.record["exempt"].items():
            assert check in ("throughput", "fits") and len(why) > 80, f"{r.name}: say why it is left out of {check}"
    assert len(set(NAMES)) == len(NAMES)


@pytest.mark.parametrize("run", RUNS, ids=NAMES)
def test_no_published_layout_reads_does_not_fit(run):
    """Issue 41 item 7: a layout that trained must never read "does not fit"; it may read "tight" (inside the
    planner's headroom: since issue 49 the total counts the CUDA context, NCCL and the allocator's slack it used to
    leave to the headroom, so a run its framework tuned to fill the card reads tight). The runs left out of the
    "fits" check are held to this too, except where the reason the
    record gives is a memory the planner does not model at all."""
    fit = published.compare(run, alternatives=False)["fit"]
    if fit == "does not fit" and run.exempt("fits"):
        pytest.skip(f"the planner's memory model misses what this run did: {run.exempt('fits')[:100]}")
    assert fit in ("fits", "tight"), f"{run.name}: {fit}"


@pytest.mark.parametrize("run", CHOSEN, ids=[r.name for r in CHOSEN])
def test_the_predicted_throughput_is_within_35_percent_of_the_measured(run):
    held_out = published.held_out(run)
    if run.exempt("throughput"):
        if "upper bound" in run.exempt("throughput"):
            assert held_out["ratio"] >= 1, "the model is an upper bound for this implementation"
        return
    assert 1 / 1.35 <= held_out["ratio"] <= 1.35, held_out


@pytest.mark.parametrize("run", [r for r in RUNS if r.record["best_of_source"]], ids=lambda r: r.name)
def test_no_layout_is_rated_much_faster_than_one_a_source_measured_as_its_best(run):
    row = published.compare(run)
    if row["best_other_ratio"] is not None and row["best_other_ratio"] > 1.15:
        why = run.record["why_not_best"]
        assert why and row["best_other"].split(" ")[0] in why, (row, "the run must record why")


def test_the_one_rate_efficiencies_are_the_medians_of_the_runs():
    by_family, overall = published.median_efficiencies()
    for family, value in cost.EFFICIENCY.items():
        assert value == pytest.approx(by_family[family], abs=0.01), family
    assert cost.DEFAULT_EFFICIENCY == pytest.approx(overall, abs=0.01)


def test_the_kernel_overhead_the_planner_uses_is_the_median_over_sources():
    """Issue 49: one constant on top of the kernels' measured rates, the median over sources of each source's median
    fitted overhead (every source weighs the same), not one efficiency per GPU."""
    assert cost.KERNEL_OVERHEAD == pytest.approx(published.median_overhead(), abs=0.01)
    assert 1.0 <= cost.KERNEL_OVERHEAD <= 1.3     # the kernels' own rates leave little unexplained


@pytest.mark.parametrize("run", [r for r in CHOSEN if not r.exempt("throughput")],
                         ids=[r.name for r in CHOSEN if not r.exempt("throughput")])
def test_the_predicted_throughput_is_within_35_percent_held_out_by_framework_family(run):
    """Issue 49: a framework family's runs priced with the overhead fitted to the *other* families' runs alone
    (Megatron-LM's runs from PyTorch's and Megatron-DeepSpeed's, and so on): the kernels' rates carry across."""
    ratio = published.held_out(run, by="framework")["ratio"]
    assert 1 / 1.35 <= ratio <= 1.35, f"{run.name} ({run.framework}): {ratio:.2f}"


def test_the_llm_foundry_benchmark_tables_held_out_whole():
    """Issue 49: MosaicML's 209 bf16 rows (125M-70B, 512-65,536 tokens, A100 40/80 GB and H100, FSDP), none of them
    in the overhead's fit: at least 90% within 35% (193 of 209 when written; the rest are listed by section in the
    README: long sequences over-predicted, where the runs' Triton attention is slower than FlashAttention-2, and the
    A100 40 GB table's small models under-predicted), the H100 rows at up to 16k tokens every one, and every row,
    having run, reads fits or tight."""
    rows = published.benchmark_rows()
    assert len(rows) >= 200
    within = [x for x in rows if 1 / 1.35 <= x["by_source"] <= 1.35]
    assert len(within) >= 0.9 * len(rows)
    assert all(1 / 1.35 <= x["by_source"] <= 1.35 for x in rows if "H100" in x["section"] and x["seq_len"] <= 16384)
    assert all(x["fit"] in ("fits", "tight") for x in rows)
    assert [x["by_source"] for x in rows] == [x["by_framework"] for x in rows]   # one family: the same pool


def test_a_measurement_is_read_in_the_sources_own_units():
    # Megatron's 175B example: 32 s per iteration of 1,536 x 2,048 tokens on 1,024 GPUs, and 138 TFLOP/s by its eq. 3:
    # both readings give the same tokens per second, about 96 per GPU.
    run = published.run("Megatron-LM GPT-3 175B example, 1024 A100")
    by_time = run.measured_tokens_per_s_per_gpu
    record = dict(run.record, measured={"tflops_per_gpu": 138, "flops_formula": "megatron-eq3"})
    by_flops = published.Run(record).measured_tokens_per_s_per_gpu
    assert by_time == pytest.approx(1536 * 2048 / 32 / 1024)
    assert by_flops == pytest.approx(by_time, rel=0.02)


def test_zero3_at_scale_loses_to_3d_in_the_source_and_the_model_says_why_it_cannot_see_it():
    for gpus in (768, 1536):
        zero3 = published.run(f"ZeRO-3 GPT 175B, {gpus} A100")
        ptd = published.run(f"Megatron PTD-P GPT 175B, {gpus} A100")
        assert zero3.measured_tokens_per_s_per_gpu < ptd.measured_tokens_per_s_per_gpu / 1.5
        assert ptd.record["why_not_best"] and zero3.exempt("throughput")


def test_the_readme_shows_the_table_and_the_leave_one_source_out_figures():
    text = (ROOT / "README.md").read_text()
    assert published.format_table() in text, "README's predicted-vs-measured table is stale: paste format_table()"
    assert published.format_sources() in text, "README's leave-one-source-out table is stale: scripts/readme_tables.py"
    assert published.format_sources(by="framework") in text, "README's by-framework table is stale"
    assert published.format_benchmarks() in text, "README's benchmark table is stale"
    assert re.search(r"\| run \| layout priced \|", text)


def test_held_out_leaves_the_runs_whole_source_or_family_out_of_the_fit():
    """Issue 41 deliverable 2, issue 49: the overhead a run is predicted with comes from no run of its own source
    (or, by framework, of its own framework family)."""
    run = published.run("Megatron PTD-P GPT 175B, 384 A100")
    fitted = published.fitted_runs()
    same_source = [n for n, (_, s, _, _) in fitted.items() if s == published.source_of(run)]
    same_family = [n for n, (_, _, f, _) in fitted.items() if f == run.framework]
    assert len(same_source) >= 5
    assert published.held_out(run)["pool"]["runs"] == len(fitted) - len(same_source)
    assert published.held_out(run, by="framework")["pool"]["runs"] == len(fitted) - len(same_family)
    assert published.held_out(run, by="run")["pool"]["runs"] == len(fitted) - 1
    with pytest.raises(ValueError, match="by='family'"):
        published.held_out(run, by="family")


def test_the_overhead_rests_on_several_sources_and_framework_families_on_both_gpus():
    checked = [r for r in RUNS if not r.exempt("throughput")]
    assert len({published.source_of(r) for r in checked}) >= 5
    assert len({r.framework for r in checked}) >= 3
    assert {"A100", "H100"} <= {r.family for r in checked}
    h100 = [r for r in checked if r.family == "H100"]
    assert len(h100) >= 6 and len({published.source_of(r) for r in h100}) >= 2


def test_every_priced_layout_and_the_recommendation_carry_the_nearest_published_run_of_their_family():
    """Issue 41 item 8: at 530B on 2,240 A100 80 GB, ZeRO-3's evidence is the ZeRO-3 run the source measured at
    that scale (48 TFLOP/s per GPU, far under what the planner prices it at, and said so), and a family the
    records hold nothing of reads "never measured"."""
    from dtlab.planner import advise

    a = advise.advise(529.6e9, cluster=published.run("ZeRO-3 GPT 530B, 2240 A100").cluster, global_batch=2240)
    zero3 = a.row("ZeRO-3")["evidence"]
    assert zero3["run"] == "ZeRO-3 GPT 530B, 2240 A100" and zero3["at_scale"]
    assert zero3["measured_tflops_per_gpu"] == 48 and zero3["exempt"]
    assert "48 TFLOP/s" in zero3["text"] and "leaves out" in zero3["text"]
    assert zero3["predicted_over_measured"] > 1.35              # the planner's ZeRO-3 is an upper bound there
    assert a.row("ZeRO-2 + optimizer offload")["evidence"]["text"].startswith("never measured")
    assert all(r["evidence"]["family"] for r in a.priced)
    rec = a.recommendation
    assert rec["evidence"] == a.row(rec["strategy"])["evidence"] and rec["evidence"]["run"]
    table = a.table()
    assert "evidence" in table.splitlines()[2] and "Evidence: the nearest published measured run" in table
    assert zero3["text"] in " ".join(table.split())       # the legend line says it (wrapped)


def test_evidence_is_the_nearest_run_of_the_same_family_and_says_when_it_is_far():
    small = published.evidence("ZeRO-3 / FSDP", 7e9, 16, "A10G")
    assert small["run"] == "torchtitan Llama 3.1 8B, 128 H100, FSDP" and small["at_scale"]
    far = published.evidence("ZeRO-3 / FSDP", 1e9, 4, "A10G")          # 8x fewer parameters, 32x fewer GPUs
    assert not far["at_scale"] and far["text"].startswith("never measured at this scale; the nearest is torchtitan")
    assert published.evidence("context parallel", 405e9, 16384, "H100")["run"].startswith("Llama 3 405B")
    assert published.family_of(8, 8, zero=1) == published.run_family(published.run("MT-NLG 530B, 2240 A100"))
    assert published.run_family(published.run("Megatron PTD-P GPT 175B, 384 A100")) == "TP x PP (x DP)"


def test_a_row_priced_at_a_split_the_source_did_not_give_says_so():
    """Issue 41 item 6: a source that gives only TP x PP is priced at the split the model rates fastest; the row
    says so, and a row with the source's own split does not."""
    rows = {row["name"]: row for row in published.table()}
    ptd = rows["Megatron PTD-P GPT 175B, 384 A100"]
    assert ptd["split"].startswith("not stated") and "96" in ptd["split"]
    assert rows["Megatron-LM GPT 1T, 3072 A100"]["split"] == "the source's"
    table = published.format_table(list(rows.values()))
    assert "TP4 x PP24 x DP4 (ZeRO-0) (the split the model rates fastest" in table
