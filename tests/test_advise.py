"""`dtlab advise`: the advisor against the ZeRO paper, DeepSpeed's estimators, the Megatron formulas and a measured
FSDP; every layout priced or skipped with its reason, bad input refused with the fix, and the old `dtlab memory`.

Every figure the advisor prints comes from `dtlab.planner.formulas` and `dtlab.planner.cost`; its step times are
held to published runs in tests/test_published_runs.py.
"""

import json

import pytest

from dtlab.planner import advise, formulas, hardware
from dtlab.planner import formulas as memory
from dtlab.tooling import cli

GB = 1e9


def test_the_zero_papers_example_7_5b_on_64_gpus():
    """Rajbhandari et al. (2019), Figure 1: 120 / 31.4 / 16.6 / 1.9 GB per GPU for DDP / ZeRO-1 / 2 / 3: the paper's
    accounting (formulas.model_states). The advisor prices what a framework keeps: DeepSpeed's ZeRO-1 is the paper's;
    its ZeRO-2 and ZeRO-3 add an fp32 gradient partition (its own estimators, the next test); PyTorch keeps fp32
    parameters and gradients (16 bytes a parameter, sharded from FSDP's SHARD_GRAD_OP on)."""
    paper = {name: formulas.model_states(7.5e9, 64, stage).gpu / GB
             for name, stage in (("DDP", 0), ("ZeRO-1", 1), ("ZeRO-2", 2), ("ZeRO-3", 3))}
    assert {k: round(v, 1) for k, v in paper.items()} == {"DDP": 120.0, "ZeRO-1": 31.4, "ZeRO-2": 16.6, "ZeRO-3": 1.9}
    for framework, expected in (("deepspeed", {"DDP": 120.0, "ZeRO-1": 31.4, "ZeRO-2": 17.1, "ZeRO-3": 2.1}),
                                ("pytorch", {"DDP": 120.0, "ZeRO-1": 60.9, "ZeRO-2": 1.9, "ZeRO-3": 1.9})):
        a = advise.advise(7.5e9, gpus=64, gpu_mem_gb=32, layouts=False, framework=framework,
                          precision="fp16" if framework == "deepspeed" else "bf16")   # the paper: fp16
        states = {name: sum(a.row(name)["memory_bytes"][k] for k in ("params", "grads", "optimizer")) / GB
                  for name in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")}
        assert {k: round(v, 1) for k, v in states.items()} == expected, framework
    assert not a.timed and a.recommendation["strategy"] == "ZeRO-3"      # first that fits, by memory only
    assert a.row("ZeRO-2")["fit"] == "tight"        # its bf16 weights stay gathered from forward to backward
    assert "step time not computed" in a.recommendation["reason"]


@pytest.mark.parametrize("psi", [1.3e9, 7e9, 13e9, 70e9])
@pytest.mark.parametrize("per_node, nodes", [(4, 1), (4, 4), (8, 8)])
def test_zero2_and_zero3_states_are_deepspeeds_estimates_less_its_documented_buffers(psi, per_node, nodes):
    deepspeed = pytest.importorskip("deepspeed")  # noqa: F841
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    n = per_node * nodes
    a = advise.advise(psi, gpus=n, gpu_mem_gb=80, gpus_per_node=per_node, layouts=False, framework="deepspeed")
    states = {name: sum(a.row(name)["memory_bytes"][k] for k in ("params", "grads", "optimizer"))
              for name in ("ZeRO-2", "ZeRO-3")}
    _, ds2 = estimate_zero2_model_states_mem_needs(psi, per_node, nodes, cpu_offload=False)
    largest = psi / 50
    _, ds3, _ = estimate_zero3_model_states_mem_needs(psi, largest, per_node, nodes, cpu_offload=False,
                                                      cpu_offload_params=False)
    # the planner's DeepSpeed states are its estimators' (2 + 18/N at stage 2, 18/N at stage 3); DeepSpeed's stage 3
    # estimate adds the largest layer gathered in fp32, which the planner counts among the buffers
    assert ds2 == pytest.approx(states["ZeRO-2"], abs=2)
    assert ds3 - states["ZeRO-3"] == pytest.approx(4 * largest, abs=2)


def test_activations_follow_the_megatron_formulas_with_tensor_parallelism():
    """Korthikanti et al. (2022), Table 2, with tensor and sequence parallelism (t): s*b*h*L*(34/t + 5*a*s/(h*t))
    without recomputation and 34*s*b*h*L/t with selective recomputation (plus one layer's scores at the peak)."""
    L, h, a, s, b, t = 32, 4096, 32, 2048, 2, 4
    gpt = formulas.ModelShape("GPT", L, h, a, dropout=True)                 # the paper's layer: GPT, with dropout
    for recompute, expected in (("none", s * b * h * L * (34 / t + 5 * a * s / (h * t))),
                                ("selective", 34 * s * b * h * L / t + 5 * a * s * s * b / t)):
        common = dict(shape=gpt, cluster="g5.12xlarge x4", micro_batch=b, seq_len=s, recompute=recompute,
                      flash_attention=False, global_batch=32)
        adv = advise.advise(layout={"dp": 4, "tp": 4}, **common)
        assert adv.rows[0]["memory_bytes"]["activations"] == pytest.approx(expected, rel=1e-12)
        ddp = advise.advise(layouts=False, **common).row("DDP")
        assert ddp["memory_bytes"]["activations"] == pytest.approx(expected * t, rel=1e-12)   # t = 1


def test_the_shape_gives_the_parameters():
    a = advise.advise(n_layer=32, n_embd=4096, n_head=32, vocab=32000, layouts=False)
    assert a.model["params"] == 12 * 32 * 4096**2 + 32000 * 4096


def test_the_issues_probe_prices_what_can_take_the_batch_and_skips_the_rest_with_the_reason():
    # 70B on 96 A100 80GB (12 nodes), 1,000 sequences per step: DP over 96 cannot take it; 3-D layouts can.
    a = advise.advise(70e9, gpus=96, gpu_mem_gb=80, gpus_per_node=8, tflops=312, intra_node_gbs=300,
                      inter_node_gbs=50, global_batch=1000)
    ddp = a.row("DDP")
    assert ddp["skipped"] and "1000" in ddp["skipped"] and "Fix" in ddp["skipped"]
    assert a.recommendation is not None and a.row(a.recommendation["strategy"])["layout"]["tp"] > 1
    assert "skipped" in a.table()


def test_a_batch_nothing_can_take_gives_an_empty_result_that_names_the_fix():
    a = advise.advise(7e9, cluster="g5.12xlarge x4", global_batch=999, micro_batch=2)   # odd: no DP x 2 divides it
    assert a.recommendation is None and not a.priced
    assert "no layout can run" in a.table() and "Fix: a global batch" in a.table()


def test_every_tp_degree_that_divides_the_heads_inside_a_node_is_considered():
    a = advise.advise(530e9, cluster="p4d.24xlarge x64", global_batch=2048, recompute="full")
    tps = {r["layout"]["tp"] for r in a.priced}
    assert {1, 2, 4, 8} <= tps, "the 530B shape's heads take TP 8 (they used to be 139)"


def test_a_7b_model_on_the_four_g5_nodes_is_timed_and_the_recommendation_is_the_fastest_that_fits():
    a = advise.advise(7e9, cluster="g5.12xlarge x4")
    assert a.timed and a.cluster["gpus"] == 16
    fitting = [r for r in a.priced if r["fits"]]
    assert a.row("DDP")["fit"] == "does not fit" and a.row("ZeRO-3")["fit"] in ("fits", "tight")
    best = max(r["tokens_per_second"] for r in fitting)
    assert a.recommendation["tokens_per_second"] == best
    for r in a.priced:                                # every part adds up, and the clock is the sum of its parts
        mem, step = r["memory_bytes"], r["step_seconds"]
        parts = ("params", "grads", "optimizer", "activations", "loss", "buffers")
        assert mem["allocated"] == pytest.approx(sum(mem[k] for k in parts))
        assert mem["total"] == pytest.approx(mem["allocated"] + mem["runtime"])
        assert step["total"] == pytest.approx(step["compute"] + step["comm_exposed"] + step["bubble"] + step["offload"])
        assert r["tokens_per_second"] == pytest.approx(512 * 2048 / step["total"])


def test_sgd_keeps_one_moment_where_adam_keeps_two():
    """PyTorch: Adam's two fp32 moments (8 bytes) against SGD's momentum (4); with a separate fp32 master copy
    (DeepSpeed, Megatron-LM): 12 against 8."""
    for framework, adam_bytes, sgd_bytes in (("pytorch", 8e9, 4e9), ("deepspeed", 12e9, 8e9)):
        adam = advise.advise(1e9, layouts=False, framework=framework).row("DDP")["memory_bytes"]
        sgd = advise.advise(1e9, optimizer="sgd", layouts=False, framework=framework).row("DDP")["memory_bytes"]
        assert adam["optimizer"] == adam_bytes and sgd["optimizer"] == pytest.approx(sgd_bytes)
        assert adam["total"] - sgd["total"] == pytest.approx(adam_bytes - sgd_bytes)


def test_a_layout_inside_the_headroom_reads_tight_not_does_not_fit():
    """Issue 41 item 7: a 3B model, 8k tokens, micro-batch 3, no recomputation, FSDP on 8 x H100 80 GB trained, but
    read "does not fit" (75.0 GB against 68 usable). Inside the headroom it reads "tight"; only above the GPU's
    memory "does not fit"; the recommendation still takes only what fits with the headroom kept."""
    a = advise.advise(3e9, gpu="H100", gpus=8, gpu_mem_gb=80, seq_len=8192, micro_batch=3, recompute="none",
                      layout=advise.Layout(dp=8, zero=3))
    row = a.rows[0]
    usable, whole = a.cluster["usable_bytes"], a.cluster["gpu_memory_bytes"]
    assert usable < row["memory_bytes"]["total"] <= whole and row["fit"] == "tight" and row["fits"] is False
    assert "tight" in a.table() and a.recommendation is None
    bigger = advise.advise(3e9, gpu="H100", gpus=8, gpu_mem_gb=80, seq_len=8192, micro_batch=4, recompute="none",
                           layout=advise.Layout(dp=8, zero=3)).rows[0]
    assert bigger["memory_bytes"]["total"] > whole and bigger["fit"] == "does not fit"
    assert advise.advise(3e9, gpu="H100", gpus=8, layout=advise.Layout(dp=8, zero=3)).rows[0]["fit"] == "fits"


def test_nothing_is_recommended_when_nothing_fits():
    a = advise.advise(70e9, cluster="g5.12xlarge", recompute="none")
    assert not any(r["fits"] for r in a.rows) and a.recommendation is None
    assert "nothing fits" in a.table() and "Fix:" in a.table()


def test_a_cluster_without_speeds_is_ranked_by_memory_and_says_so():
    a = advise.advise(7e9, gpus=16, gpu_mem_gb=80, layouts=False)
    assert not a.timed and all(r["step_seconds"] is None for r in a.priced)
    assert a.recommendation["strategy"] == "ZeRO-2"     # DDP holds 112 GB, ZeRO-1 its fp32 weights and gradients whole
    assert "step time not computed" in a.recommendation["reason"]


def test_offload_to_a_host_of_unknown_size_is_neither_yes_nor_no():
    a = advise.advise(7.5e9, gpus=64, gpu_mem_gb=32, layouts=False)
    assert a.row("ZeRO-3 + optimizer offload")["fits"] is None
    assert a.recommendation["strategy"] != "ZeRO-3 + optimizer offload"


@pytest.mark.cluster
@pytest.mark.parametrize("memory", [None, 80, 94])
def test_a_named_gpu_keeps_its_name_peak_and_measured_efficiency_whatever_memory_is_given(memory):
    """Issue 41, item 1: advise(gpu="H100", gpus=8, gpu_mem_gb=80) priced an "80 GB GPU" at the all-runs median."""
    from dtlab.planner import cost

    advice = advise.advise(7e9, gpu="H100", gpus=8, gpu_mem_gb=memory)
    h100 = hardware.gpu("H100")
    # each kernel at the H100's measured rates (dtlab.planner.kernels), not at a median of every GPU
    assert advice.setup["efficiency"] is None and "H100" in advice.setup["efficiency_source"]
    assert cost.kernels_for(advice.cluster["gpu"], h100).family == "H100"
    assert advice.cluster["name"] == "8 x H100", advice.cluster
    c = advise.resolve_cluster(gpu="H100", gpus=8, gpu_mem_gb=memory)
    assert c.gpu.peak_flops("bf16") == h100.peak_flops("bf16") and c.gpu.fp32_tflops == h100.fp32_tflops
    assert c.gpu.memory_gb == (memory or h100.memory_gb)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"params": 0}, ValueError, "positive number of parameters. Fix"),
    ({"params": -7e9}, ValueError, "positive number"),
    ({"n_layer": 32, "n_embd": 4100, "n_head": 32}, ValueError, "not divisible by 32 heads. Fix"),
    ({"n_layer": 32, "n_embd": 4096}, ValueError, "whole shape"),
    ({"params": 7e9, "cluster": "g5.12xlarg x4"}, hardware.UnknownHardware, "did you mean 'g5.12xlarge x4'"),
    ({"params": 7e9, "cluster": "nope"}, hardware.UnknownHardware, "known: g5.12xlarge"),
    ({"params": 7e9, "cluster": "g5.12xlarge x4", "layout": {"dp": 2, "tp": 4}}, ValueError, "product is 16"),
    ({"params": 7e9, "cluster": "g4dn.12xlarge"}, ValueError, "no bf16. Fix: precision='fp16'"),
    ({"params": 7e9, "precision": "fp8"}, ValueError, "precision='fp8'"),
    ({"params": 7e9, "gpus": 12, "gpu_mem_gb": 80, "gpus_per_node": 8}, ValueError, "whole nodes"),
    ({"params": 7e9, "micro_batch": 8, "global_batch": 4}, ValueError, "larger than global_batch=4. Fix"),
    ({"params": 7e9, "gpus": 16}, ValueError, "needs both gpus and gpu_mem_gb. Fix"),
    ({"params": 7e9, "efficiency": 1.5}, ValueError, "0 < efficiency <= 1. Fix"),
])
def test_bad_input_is_refused_with_the_fix(kwargs, error, match):
    with pytest.raises(error, match=match):
        advise.advise(**kwargs)


def test_dtlab_advise_json_gives_bytes_per_strategy(capsys):
    assert cli.main(["advise", "--params", "7.5e9", "--gpus", "64", "--gpu-mem-gb", "32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ddp = next(s for s in out["strategies"] if s["strategy"] == "DDP")
    assert ddp["memory_bytes"]["params"] + ddp["memory_bytes"]["grads"] + ddp["memory_bytes"]["optimizer"] == 120e9
    assert out["step_time_computed"] is False and out["recommendation"]["strategy"] == "ZeRO-3"
    assert all(s["evidence"]["family"] and s["evidence"]["text"] for s in out["strategies"])      # issue 41 item 8
    assert out["recommendation"]["evidence"]["family"] == "ZeRO-3 / FSDP"


def test_dtlab_advise_table_and_bad_input(capsys):
    assert cli.main(["advise", "--params", "7e9", "--cluster", "g5.12xlarge x4"]) == 0
    out = capsys.readouterr().out
    assert "GB = 10^9 bytes" in out and "Recommendation: " in out and "MFU" in out
    assert cli.main(["advise", "--params", "7e9", "--mfu", "0.4"]) == 2
    assert "--mfu is now --efficiency" in capsys.readouterr().err
    assert cli.main(["advise", "--params", "7e9", "--cluster", "g5.12xlarge x4", "--layout", "dp=2,tp=4"]) == 2
    assert "product is 16" in capsys.readouterr().err
    g5 = ["advise", "--params", "1.3e9", "--cluster", "g5.12xlarge x4", "--layout"]
    assert cli.main([*g5, "dp=16,zero=3,shard=4"]) == 0
    assert "HSDP (shard 4, 4 replicas)" in capsys.readouterr().out
    assert cli.main([*g5, "dp=16,zero=1,shard=4"]) == 2
    assert "zero=1 is not stage 3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["advise", "--params", "-1"])
    assert "out of range" in capsys.readouterr().err


def test_the_memory_model_is_the_one_the_course_measures_against():
    # Notebooks 06 and 12 assert that measured per-rank elements equal dtlab.memory's formulas; the advisor
    # prints the same formulas (bytes = elements x bytes per element), not a second copy of them.
    a = advise.advise(1e6, gpus=2, gpu_mem_gb=24, precision="fp32", layouts=False, recompute="full", global_batch=2,
                      framework="deepspeed")    # the paper's fp32 keeps a master copy from stage 1, as DeepSpeed
    for name, stage in (("DDP", 0), ("ZeRO-1", 1), ("ZeRO-2", 2), ("ZeRO-3", 3)):
        paper = memory.model_states(1e6, 2, stage, "fp32")
        row = a.row(name)["memory_bytes"]
        assert (row["params"], row["grads"], row["optimizer"]) == (paper.params, paper.grads, paper.optimizer)


def _fsdp_held(cfg):
    import torch
    import torch.distributed as dist

    from dtlab.parallel.fsdp import ScratchFSDP

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(cfg["width"], cfg["width"], bias=False) for _ in range(3)])
    fsdp = ScratchFSDP(model)
    optimizer = torch.optim.AdamW(fsdp.parameters(), lr=1e-3)
    fsdp(torch.randn(4, cfg["width"])).sum().backward()
    fsdp.finish_gradient_synchronization()
    optimizer.step()
    held = fsdp.held_elements()
    held["optimizer"] = sum(t.numel() for s in optimizer.state.values() for t in s.values() if t.dim())
    dist.destroy_process_group()
    return held


@pytest.mark.slow
def test_zero3_per_rank_states_match_a_measured_fsdp_at_two_ranks():
    # The scratch FSDP of notebook 12, run on 2 gloo processes in fp32 with AdamW: what each rank really holds,
    # counted, against the advisor's ZeRO-3 row for the same number of parameters (bytes / 4 = elements).
    from dtlab.launch import run

    width = 64
    psi = 3 * width * width
    held = run(_fsdp_held, {"width": width}, nprocs=2)
    row = advise.advise(psi, gpus=2, gpu_mem_gb=24, precision="fp32", layouts=False, global_batch=2).row(
        "ZeRO-3")["memory_bytes"]
    for rank in held:
        assert rank["params"] == row["params"] / 4 == psi / 2
        assert rank["grads"] == row["grads"] / 4
        # PyTorch's FSDP, the scratch one too: its fp32 shards are the master weights, so Adam's two moments alone
        assert rank["optimizer"] == row["optimizer"] / 4 == 2 * psi / 2


def test_the_form_is_a_real_ipywidgets_form_that_redraws(capsys):
    import matplotlib

    matplotlib.use("Agg")
    form = advise.form(7.0, "g5.12xlarge x4")
    controls = {c.description: c for c in form.children[:-1]}
    assert set(controls) == {"B params", "cluster", "micro-batch", "sequence", "precision", "recompute"}
    form.update()                                          # what moving a control does
    controls["B params"].value = 70.0
    form.update()
    printed = [o for o in form.out.outputs if o.get("name") == "stdout"] if hasattr(form, "out") else []
    text = "".join(o["text"] for o in printed) or capsys.readouterr().out
    assert "70B parameters" in text and "Recommendation" in text


def test_dtlab_memory_is_now_a_view_of_advise(capsys):
    assert cli.main(["memory", "--params", "7e9", "--cluster", "g5.12xlarge x4", "--cpu-mem-gb-per-gpu", "40"]) == 0
    captured = capsys.readouterr()
    assert "dtlab advise --data-parallel-only" in captured.err
    table = captured.out.split("Evidence")[0]
    assert "ZeRO-3" in table and "TP" not in table


def test_hsdp_on_the_four_g5_nodes_beats_fsdp_but_not_zero1():
    # 1.3B on 4 x g5.12xlarge: FSDP over 16 GPUs gathers every layer across the 40 Gbps network each micro-batch;
    # HSDP gathers inside the node (PCIe) and sends only a quarter of the gradients across. ZeRO-1 all-reduces once
    # per step behind the last backward and stays the answer (before HSDP was priced, and after).
    # With gradients reduced in fp32 (the default, as torchtitan's HSDP does), HSDP's all-reduce across nodes every
    # micro-batch costs what ZeRO-3's gathers do; deferring it to once per step halves the step. In bf16 (FSDP2's own
    # default without a reduce_dtype) the cross-node all-reduce halves and HSDP beats ZeRO-3 every micro-batch too.
    a = advise.advise(1.3e9, cluster="g5.12xlarge x4")
    z3, hsdp = a.row("ZeRO-3"), a.row("HSDP (shard 4, 4 replicas)")
    assert hsdp["fits"] and hsdp["memory_bytes"]["optimizer"] == pytest.approx(4 * z3["memory_bytes"]["optimizer"])
    deferred = a.row("HSDP (shard 4, 4 replicas), all-reduce deferred")
    assert deferred["step_seconds"]["total"] < 0.5 * hsdp["step_seconds"]["total"]   # the network once per step
    assert deferred["step_seconds"]["total"] < 0.5 * z3["step_seconds"]["total"]
    halved = advise.advise(1.3e9, cluster="g5.12xlarge x4", grad_reduce="bf16")
    assert (halved.row("HSDP (shard 4, 4 replicas)")["step_seconds"]["total"]
            < 0.85 * halved.row("ZeRO-3")["step_seconds"]["total"])
    # ZeRO-1 no longer fits a 24 GB A10G once PyTorch's fp32 weights and gradients and DDP's buckets are counted
    # (issue 49); the fastest that fits is the same whichever format the gradients travel in, and not HSDP
    assert a.row("ZeRO-1")["fit"] != "fits"
    assert a.recommendation["strategy"] == halved.recommendation["strategy"]
    assert "HSDP" not in a.recommendation["strategy"]
    assert "HSDP (shard 4, 4 replicas)" in a.table()


def test_hsdp_does_not_fit_where_a_nodes_shard_cannot_hold_the_model():
    # 16 bytes per parameter over a node's 4 A10Gs: 5B needs 20 GB of states per GPU (more than the 20.5 usable
    # with activations), while ZeRO-3 over all 16 GPUs fits. A shard group of 2 nodes (8 GPUs), priced when asked,
    # fits and is still faster than ZeRO-3: only half as many nodes in each gather's ring.
    five = advise.advise(5e9, cluster="g5.12xlarge x4")
    assert five.row("ZeRO-3")["fits"]
    assert not any(r["fits"] for r in five.priced if r["layout"]["hsdp"] and r["layout"]["tp"] == 1)
    two_nodes = advise.advise(5e9, cluster="g5.12xlarge x4", layout=advise.Layout(dp=16, zero=3, shard=8)).rows[0]
    assert two_nodes["strategy"] == "HSDP (shard 8, 2 replicas)" and two_nodes["fit"] in ("fits", "tight")
    # faster than ZeRO-3 with 16-bit gradients on the wire; with fp32 ones its all-reduce across nodes eats the gain
    half = advise.advise(5e9, cluster="g5.12xlarge x4", grad_reduce="bf16")
    two_half = advise.advise(5e9, cluster="g5.12xlarge x4", grad_reduce="bf16",
                             layout=advise.Layout(dp=16, zero=3, shard=8)).rows[0]
    assert two_half["tokens_per_second"] > half.row("ZeRO-3")["tokens_per_second"]
    assert two_nodes["tokens_per_second"] == pytest.approx(five.row("ZeRO-3")["tokens_per_second"], rel=0.05)


def test_one_node_lists_no_hsdp_and_priced_by_hand_it_is_zero3():
    a = advise.advise(1.3e9, cluster="g5.12xlarge")
    assert not any(r["layout"]["hsdp"] for r in a.rows)
    by_hand = advise.advise(1.3e9, cluster="g5.12xlarge", layout=advise.Layout(dp=4, zero=3, shard=4)).rows[0]
    z3 = a.row("ZeRO-3")
    assert by_hand["memory_bytes"] == z3["memory_bytes"] and by_hand["step_seconds"] == z3["step_seconds"]


def test_hsdp_is_the_answer_where_the_network_is_slow_next_to_nvlink():
    # 7B on 8 x p4d.24xlarge (NVLink inside, 400 Gbps between): before HSDP was priced the advice was
    # TP2 x DP32 (ZeRO-1) at 230,276 tokens/s; HSDP over each node with one all-reduce per step is faster and much
    # faster than FSDP over 64 GPUs — with 16-bit gradients on the wire (FSDP2's default without a reduce_dtype).
    a = advise.advise(7e9, cluster="p4d.24xlarge x8", grad_reduce="bf16")
    best = a.row(a.recommendation["strategy"])
    assert best["layout"]["hsdp"] and best["layout"]["shard"] == 8
    assert best["tokens_per_second"] > 1.5 * a.row("ZeRO-3")["tokens_per_second"]
    assert best["tokens_per_second"] > a.row("TP2 x DP32 (ZeRO-1)")["tokens_per_second"]
    # In fp32 (torchtitan's reduce_dtype, the planner's default) its all-reduce doubles: still twice ZeRO-3's speed,
    # within 5% of the fastest layout, which now keeps DP small (TP2 x PP16 x DP2)
    full = advise.advise(7e9, cluster="p4d.24xlarge x8")
    hsdp = full.row("HSDP (shard 8, 8 replicas), all-reduce deferred")
    assert hsdp["tokens_per_second"] > 1.5 * full.row("ZeRO-3")["tokens_per_second"]
    assert hsdp["tokens_per_second"] > 0.95 * full.row(full.recommendation["strategy"])["tokens_per_second"]


def test_dtlab_advise_reads_a_hugging_face_config(tmp_path):
    """--hf-config: the shape from the model's config.json (LLaMA 7B's values), the same advice as the shape given."""
    import json

    from dtlab.tooling.cli import main

    config = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
              "intermediate_size": 11008, "vocab_size": 32000, "hidden_act": "silu", "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["advise", "--hf-config", str(tmp_path / "config.json"), "--json"]) == 0
    assert main(["advise", "--hf-config", str(tmp_path / "missing.json")]) == 2
