"""A named, checked DeviceMesh for composing parallelism (notebook 17); the layout model moved to the planner.

``device_mesh("cpu", dp=2, tp=2)`` builds a mesh whose dimensions have names, refusing degrees that do
not multiply to the world size before any collective runs; ``submesh(mesh, "tp")`` names the fix for a
dimension the mesh does not have.

What a ``DP x TP x PP x CP`` layout holds and sends on paper (``Layout``, ``cost``, ``inside_node``) is
now ``dtlab.planner.cost``; the old names keep working for one release with a DeprecationWarning.
"""

from __future__ import annotations

import warnings

from dtlab._moved import forward

__getattr__ = forward("dtlab.parallel.mesh", "dtlab.planner.cost",
                      gone={"memory_per_gpu": "it is dtlab.planner.cost.memory(num_params, shape, layout, setup)"})


def cost(num_params, layout, cluster, global_batch=512, micro_batch=1, seq_len=2048, recompute="selective",
              mfu=None, shape=None, precision="bf16"):
    """The old ``composition.cost(..., global_batch=, micro_batch=, mfu=)``: now ``dtlab.planner.cost.cost`` with
    a ``Setup`` (``mfu`` is now ``efficiency``: the fraction of peak while computing)."""
    from dtlab.planner import cost

    warnings.warn("dtlab.parallel.mesh.cost moved to dtlab.planner.cost.cost(num_params, layout, cluster, "
                  "cost.Setup(global_batch, micro_batch, seq_len, recompute, precision, efficiency), shape); "
                  "dtlab.parallel.mesh will be removed in the next release", DeprecationWarning, stacklevel=2)
    setup = cost.Setup(global_batch, micro_batch, seq_len, recompute, precision, mfu)
    return cost.cost(num_params, layout, cluster, setup, shape)


def device_mesh(device_type: str, **dims: int):
    """``init_device_mesh`` with named dimensions, checked first: ``device_mesh("cpu", dp=2, tp=2)``.

    Raises ``ValueError`` (before any collective) when the degrees' product is not the world size,
    or a degree is below 1. Index the result by name (``mesh["tp"]``); ``submesh`` names the fix for
    an unknown name.
    """
    import math

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    wanted = math.prod(dims.values()) if dims else 0
    if not dims or any(d < 1 for d in dims.values()) or wanted != world:
        shown = " x ".join(f"{k}={v}" for k, v in dims.items()) or "no dimensions"
        names = list(dims) or ["dp"]
        inner = dims.get(names[-1], 1) if len(names) > 1 and world % max(1, dims.get(names[-1], 1)) == 0 else 1
        example = {names[0]: world // inner, **({names[-1]: inner} if len(names) > 1 else {})}
        raise ValueError(f"a mesh of {shown} has {wanted} ranks but the job has {world}. Fix: degrees whose "
                         f"product is {world} (e.g. {', '.join(f'{k}={v}' for k, v in example.items())}), or start "
                         f"{wanted} processes")
    return init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))


def submesh(mesh, name: str):
    """``mesh[name]``, with an error that lists the mesh's dimension names when ``name`` is not one."""
    names = tuple(mesh.mesh_dim_names or ())
    if name not in names:
        raise ValueError(f"the mesh has no dimension {name!r}; its dimensions are {names}. Fix: one of those names "
                         "(set them with device_mesh(..., dp=2, tp=2))")
    return mesh[name]
