"""Moved: the advisor is ``dtlab.planner.advise`` (``help(dtlab.planner)`` shows the whole planner).

Old names keep working for one release with a DeprecationWarning; ``advise(..., mfu=x)`` is now
``advise(..., efficiency=x)``: the fraction of peak the GPU reaches while computing (MFU is what the
advisor reports, not what it assumes).
"""

from __future__ import annotations

import warnings

from dtlab._moved import forward

__getattr__ = forward("dtlab.advise", "dtlab.planner.advise",
                      elsewhere={"PCIE_GBS": "dtlab.planner.cost", "CPU_ADAM_PARAMS_PER_S": "dtlab.planner.cost",
                                 "PRECISIONS": "dtlab.planner.cost"},
                      gone={"DATA_PARALLEL": "the data-parallel strategies are dtlab.planner.advise.STRATEGIES "
                                             "(cost.Layout objects)"})


def advise(*args, mfu=None, **kwargs):
    """The old ``dtlab.advise.advise``: ``dtlab.planner.advise.advise``, with ``mfu=`` read as ``efficiency=``."""
    from dtlab.planner import advise

    warnings.warn("dtlab.advise.advise moved to dtlab.planner.advise.advise" + ("; mfu= is now efficiency=" if mfu
                  else ""), DeprecationWarning, stacklevel=2)
    if mfu is not None:
        kwargs.setdefault("efficiency", mfu)
    return advise.advise(*args, **kwargs)
