"""Sharded checkpoints: every rank writes its own part, any number of ranks reads them back.

``torch.distributed.checkpoint`` (DCP) saves a state dict whose tensors may be sharded (FSDP2's
``DTensor`` parameters, their optimizer moments) as one file per rank plus a ``.metadata`` file
that says which slice of which tensor lies where. Loading plans the reads for the *loading* run's
shards, so a checkpoint saved by 2 ranks loads on 1 or 3 — resharding for free. This module adds
what a training run needs around it, with the guarantees of ``dtlab.checkpoint``:

* ``save``     writes into a hidden ``.step-N.partial`` folder and renames it to ``step-N`` once
  every rank has finished: a run killed mid-write leaves the previous checkpoint as the newest.
* ``read_meta``  plain data saved beside the tensors (step, data loader position), as JSON.
* ``latest``   the newest complete checkpoint in a folder (partial and damaged ones skipped).
* ``check``    before anything is read: is every rank's file there, and does the checkpoint hold
  this model (same names, same shapes)? A ``CheckpointError`` names what is wrong and the fix,
  and nothing already in memory has been changed.
* ``load``     ``check``, then ``dcp.load`` in place.
* ``consolidate``  one ordinary ``torch.save`` file (``dcp_to_torch_save``), loadable with
  ``torch.load(..., weights_only=True)`` for inference or for sharing.

DCP needs torch >= 2.2 (Databricks Runtime 15.4 LTS ML has 2.3); ``save``/``load`` work with or
without a process group (a single notebook process can read a checkpoint that 8 GPUs wrote).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dtlab.checkpoint import CheckpointError
from dtlab.distributed import initialized

_STEP = re.compile(r"^step-(\d+)$")


def _barrier() -> None:
    if initialized():
        dist.barrier()


def _dcp(fn: Any, state: dict[str, Any], path: Path) -> Any:
    """Run ``dcp.save``/``dcp.load``; without a process group that is one process, on purpose (no warning)."""
    import warnings

    with warnings.catch_warnings():
        if not initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is .*unavailable or uninitialized")
        return fn(state, checkpoint_id=str(path))


def step_folder(folder: str | os.PathLike, step: int) -> Path:
    """Where ``save(folder, state, step)`` puts step ``step``: ``folder/step-00000012``."""
    return Path(folder) / f"step-{step:08d}"


def save(folder: str | os.PathLike, state: dict[str, Any], step: int, meta: dict[str, Any] | None = None) -> Path:
    """Save ``state`` (e.g. ``{"model": ..., "optim": ...}``) as step ``step``; a collective.

    Every rank calls it with its own (sharded) state dict; each writes its own file. ``meta`` is
    small plain data rank 0 writes beside it as ``meta.json`` (the step, the data loader's
    position): read it back with ``read_meta``. The folder appears under its final name only after
    all ranks have written, so a crash leaves either the old newest checkpoint or the new one.
    Returns the checkpoint's folder.
    """
    import torch.distributed.checkpoint as dcp

    final = step_folder(folder, step)
    partial = final.with_name(f".{final.name}.partial")
    if (dist.get_rank() if initialized() else 0) == 0:
        Path(folder).mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # left by a run killed while saving this step
    _barrier()
    _dcp(dcp.save, state, partial)  # returns once every rank has written and .metadata exists
    if (dist.get_rank() if initialized() else 0) == 0:
        (partial / "meta.json").write_text(json.dumps({"step": step, **(meta or {})}, indent=1))
        for f in partial.iterdir():  # on disk before the rename makes it the newest checkpoint
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if final.exists():  # saving a step again: the new one replaces it
            old = final.with_name(f".{final.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            partial.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            partial.rename(final)
    _barrier()
    return final


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The plain data saved with the checkpoint (``meta`` of ``save``, plus its ``step``)."""
    file = Path(path) / "meta.json"
    return json.loads(file.read_text()) if file.is_file() else {}


def _metadata(path: Path) -> Any:
    import torch.distributed.checkpoint as dcp

    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{path} is not a complete DCP checkpoint (no .metadata file). Fix: pass a folder "
                              "written by dtlab.sharded_checkpoint.save (or dcp.save), e.g. latest(folder).")
    return dcp.FileSystemReader(str(path)).read_metadata()


def missing_files(path: str | os.PathLike) -> list[str]:
    """Files the checkpoint's metadata refers to that are not in its folder (a lost rank's shard)."""
    path = Path(path)
    meta = _metadata(path)
    wanted = {info.relative_path for info in meta.storage_data.values()}
    return sorted(f for f in wanted if not (path / f).is_file())


def latest(folder: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint (``step-N`` with its metadata and every rank's file), or None."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    steps = sorted((int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP.match(p.name)) and p.is_dir())
    for _step, path in reversed(steps):
        try:
            if not missing_files(path):
                return path
        except Exception:  # unreadable metadata: an older one may still be good
            continue
    return None


def _flat_tensors(state: Any, prefix: str = "") -> dict[str, torch.Size]:
    """Tensor entries of a nested state dict, by DCP's dotted names, with their (global) shapes."""
    out: dict[str, torch.Size] = {}
    if isinstance(state, dict):
        for k, v in state.items():
            out.update(_flat_tensors(v, f"{prefix}{k}."))
    elif torch.is_tensor(state):
        out[prefix[:-1]] = state.shape  # a DTensor's .shape is the whole tensor's
    return out


def check(path: str | os.PathLike, state: dict[str, Any], which: tuple[str, ...] = ("model",)) -> None:
    """Raise ``CheckpointError`` unless ``path`` is complete and holds ``state``'s tensors under ``which``.

    Only the entries named in ``which`` (default: the model's) are compared by name and shape: an
    optimizer's entries follow from the model's. Reads only the metadata: nothing is changed.
    """
    path = Path(path)
    lost = missing_files(path)
    if lost:
        raise CheckpointError(f"{path} is missing {', '.join(lost)} (each rank writes its own file; a copy that "
                              "left one out cannot be loaded). Fix: copy the whole checkpoint folder, or load "
                              "an older complete one: dtlab.sharded_checkpoint.latest(folder).")
    saved = {k: torch.Size(v.size) for k, v in _metadata(path).state_dict_metadata.items() if hasattr(v, "size")}
    wanted = {k: s for k, s in _flat_tensors({w: state[w] for w in which if w in state}).items()}
    absent = sorted(k for k in wanted if k not in saved)
    other = sorted(k for k in wanted if k in saved and saved[k] != wanted[k])
    extra = sorted(k for k in saved if k.split(".")[0] in which and k not in wanted)
    if absent or other or extra:
        lines = [f"{k}: saved {tuple(saved[k])}, this model {tuple(wanted[k])}" for k in other[:3]]
        lines += [f"{k}: not in the checkpoint" for k in absent[:3]] + [f"{k}: not in this model" for k in extra[:3]]
        raise CheckpointError(f"{path} holds another model ({len(other)} shapes differ, {len(absent)} missing, "
                              f"{len(extra)} unexpected; e.g. {'; '.join(lines)}). Fix: build the model with the "
                              "configuration of the run that saved it (nothing was loaded).")


def load(path: str | os.PathLike, state: dict[str, Any], which: tuple[str, ...] = ("model",)) -> dict[str, Any]:
    """Fill ``state`` in place from the checkpoint at ``path``, for this run's sharding; a collective.

    Build ``state`` as you would to save (``get_state_dict(model, optimizer)`` for FSDP2), load,
    then hand it back (``set_state_dict``). Only the tensors named in ``state`` are read; plain
    data travels in ``meta`` (``read_meta``). ``check`` runs first, so a wrong
    or incomplete checkpoint changes nothing. Returns ``state``.
    """
    import torch.distributed.checkpoint as dcp

    check(path, state, which)
    _dcp(dcp.load, state, path)
    return state


def consolidate(path: str | os.PathLike, out_file: str | os.PathLike) -> Path:
    """Write the whole checkpoint at ``path`` as one ``torch.save`` file (atomically); one process only."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path, out_file = Path(path), Path(out_file)
    if missing_files(path):
        check(path, {})
    tmp = out_file.with_name(f".{out_file.name}.tmp")
    dcp_to_torch_save(str(path), str(tmp))
    os.replace(tmp, out_file)
    return out_file
