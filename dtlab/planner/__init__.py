"""The planner: will it fit, how fast will it train, and which strategy to use — on paper, checked against runs.

Read it in this order:

    dtlab.planner.formulas   the arithmetic, each formula with its paper: model states (ZeRO), activations
                             (Korthikanti et al.), FLOPs with recomputation (Megatron-LM, PaLM), ring factors,
                             a model's shape from its size
    dtlab.planner.cost       one layout's memory per GPU and step time: traffic where the strategies send it
                             (per micro-batch for ZeRO-2/3 and FSDP), overlap only where compute can hide it,
                             links shared by the groups that use them at once, the pipeline bubble
    dtlab.planner.advise     every strategy priced for a model on a cluster and the fastest that fits
                             (``dtlab advise``)
    dtlab.planner.published  published training runs (OPT, BLOOM, Megatron, Llama 3, ...), each with its source,
                             and what the cost model predicts for them

    dtlab.planner.hardware   GPUs, instance types and clusters: memory, FLOP/s, links (one home for these facts)
    dtlab.planner.speedup    the speed-up model of notebook 08 (compute against the all-reduce) and its measurement
"""
