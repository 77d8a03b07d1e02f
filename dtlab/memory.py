"""Moved: the memory formulas are ``dtlab.planner.formulas``; what fits is ``dtlab.planner.advise``.

``dtlab.memory`` was a planner of its own (DDP and ZeRO memory, what fits, ``dtlab memory``) beside the
advisor. The course now has one planner (``help(dtlab.planner)``): ``model_states``,
``activation_bytes``, ``deepspeed_estimate``, ``model_shape`` and the units are in
``dtlab.planner.formulas``; ``plan_table``, ``first_fit``, ``recommend`` and ``format_table`` are
``dtlab.planner.advise.advise(params, ..., layouts=False)`` (its rows, its recommendation, its table).
Old names keep working for one release, with a DeprecationWarning naming the new place.
"""

from dtlab._moved import forward

_ADVISE = ("is dtlab.planner.advise.advise(params, ..., layouts=False): its .rows (memory per GPU of DDP, ZeRO "
           "1-3 and offload, and 'fits'), .recommendation and .table()")
__getattr__ = forward("dtlab.memory", "dtlab.planner.formulas",
                      gone={name: f"{name} {_ADVISE}" for name in ("plan_table", "first_fit", "recommend",
                                                                   "format_table", "STRATEGIES")}
                      | {"MICRO_BATCH": "the micro-batch is advise(..., micro_batch=1)'s argument",
                         "SEQ_LEN": "the sequence length is advise(..., seq_len=2048)'s argument"})
