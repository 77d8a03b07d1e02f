"""Sharded checkpoints: every rank writes its own part, any number of ranks reads them back.

``torch.distributed.checkpoint`` (DCP) saves a state dict whose tensors may be sharded (FSDP2's
``DTensor`` parameters, their optimizer moments) as one file per rank plus a ``.metadata`` file
that says which slice of which tensor lies where. Loading plans the reads for the *loading* run's
shards, so a checkpoint saved by 2 ranks loads on 1 or 3 — resharding for free. This module adds
what a training run needs around it, with the guarantees of ``dtlab.checkpoint``:

* ``save``     writes into a hidden ``.step-N.partial`` folder and renames it to ``step-N`` once
  every rank has finished, then a ``manifest.json`` (every file and its size) is the last file
  written: a run killed mid-write leaves the previous checkpoint as the newest. On paths where a
  rename is not atomic — object stores behind a file system: a Databricks ``/Volumes`` or ``/dbfs``
  path, S3 through a FUSE mount — it writes straight into ``step-N``, and the manifest alone says the
  checkpoint is complete (``rename=False``; chosen by itself for those paths).
* ``save_async``  the same, in the background (``dcp.async_save``): training goes on while the files
  are written; ``wait()`` on what it returns finishes it (the manifest, the rename).
* ``read_meta``  plain data saved beside the tensors (step, data loader position), as JSON.
* ``latest``   the newest complete checkpoint in a folder (one with a manifest its files match).
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
from dtlab.distributed import barrier, initialized

_STEP = re.compile(r"^step-(\d+)$")


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


#: Path prefixes where a folder rename is not atomic (object stores mounted as files): save writes in place there.
NO_ATOMIC_RENAME = ("/Volumes/", "/dbfs/", "/mnt/")
MANIFEST = "manifest.json"


def renames_atomically(folder: str | os.PathLike) -> bool:
    """False for a Databricks ``/Volumes``, ``/dbfs`` or ``/mnt`` path (object storage behind a FUSE file system,
    where renaming a folder copies its files one by one), True elsewhere."""
    return not str(Path(folder).absolute()).startswith(NO_ATOMIC_RENAME)


def _rank() -> int:
    """This process's rank in the group; 0 without one (unlike ``distributed.rank``, ``RANK`` is not read:
    a process that never joined a group saves alone)."""
    return dist.get_rank() if initialized() else 0


def _begin(folder: str | os.PathLike, step: int, rename: bool | None) -> tuple[Path, Path, bool]:
    """Where this save writes (``writing``) and ends up (``final``); empties ``writing`` first. A collective."""
    rename = renames_atomically(folder) if rename is None else rename
    final = step_folder(folder, step)
    writing = final.with_name(f".{final.name}.partial") if rename else final
    if _rank() == 0:
        Path(folder).mkdir(parents=True, exist_ok=True)
        if writing.exists():
            if writing == final and (final / MANIFEST).exists():
                (final / MANIFEST).unlink()     # first: a half-overwritten folder must not look complete
            shutil.rmtree(writing, ignore_errors=True)  # left by a run killed while saving this step
    barrier()
    return writing, final, rename


def _finish(writing: Path, final: Path, step: int, meta: dict[str, Any] | None) -> Path:
    """After every rank has written: meta.json, fsync, the rename (if any) and the manifest, last. A collective."""
    if _rank() == 0:
        (writing / "meta.json").write_text(json.dumps({"step": step, **(meta or {})}, indent=1))
        for f in writing.iterdir():  # on disk before the checkpoint can count as complete
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if writing != final:
            if final.exists():  # saving a step again: the new one replaces it
                old = final.with_name(f".{final.name}.old")
                shutil.rmtree(old, ignore_errors=True)
                final.rename(old)
                writing.rename(final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                writing.rename(final)
        files = {f.name: f.stat().st_size for f in sorted(final.iterdir()) if f.name != MANIFEST}
        with open(final / MANIFEST, "w") as fh:
            json.dump({"step": step, "files": files}, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
    barrier()
    return final


def save(folder: str | os.PathLike, state: dict[str, Any], step: int, meta: dict[str, Any] | None = None,
         rename: bool | None = None) -> Path:
    """Save ``state`` (e.g. ``{"model": ..., "optim": ...}``) as step ``step``; a collective.

    Every rank calls it with its own (sharded) state dict; each writes its own file. ``meta`` is
    small plain data rank 0 writes beside it as ``meta.json`` (the step, the data loader's
    position): read it back with ``read_meta``. The checkpoint counts as complete only once every
    rank has written and ``manifest.json`` (written last) lists its files, so a crash leaves either
    the old newest checkpoint or the new one. ``rename``: write into a hidden folder and rename it
    (True), or straight into ``step-N`` (False); None chooses by ``renames_atomically(folder)``.
    Returns the checkpoint's folder.
    """
    import torch.distributed.checkpoint as dcp

    writing, final, _ = _begin(folder, step, rename)
    _dcp(dcp.save, state, writing)  # returns once every rank has written and .metadata exists
    return _finish(writing, final, step, meta)


class PendingSave:
    """A checkpoint being written in the background by ``save_async``.

    ``done()``: whether this rank's files are written. ``wait()``: block until they are, then finish the
    checkpoint (meta, rename, manifest) — a collective, so every rank calls it, before the next save and before
    the run ends; returns the checkpoint's folder.
    """

    def __init__(self, future: Any, writing: Path, final: Path, step: int, meta: dict[str, Any] | None):
        self._future, self._writing, self.folder, self._step, self._meta = future, writing, final, step, meta
        self._finished = False

    def done(self) -> bool:
        return self._finished or self._future.done()

    def wait(self) -> Path:
        if not self._finished:
            self._future.result()
            _finish(self._writing, self.folder, self._step, self._meta)
            self._finished = True
        return self.folder


def _snapshot(state: Any) -> Any:
    """CPU tensors copied (what is saved is the state now, whatever training does next); others as they are:
    ``dcp.async_save`` copies GPU tensors to CPU itself, but on torch 2.3 writes CPU tensors from the live ones."""
    if isinstance(state, dict):
        return {k: _snapshot(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_snapshot(v) for v in state]
    if torch.is_tensor(state) and state.device.type == "cpu":
        return state.detach().clone()
    return state


_writer: tuple[Any, Any] = (None, None)          # (the default group it was made beside, the writer's group)


def _writer_group() -> Any:
    """A gloo group of the same ranks for the background writer's own collectives (DCP's planning), created once
    per default group; a collective, like ``save_async``.

    The writer thread plans the checkpoint with collectives while the training thread goes on with its own. On one
    group the two threads' calls can reach the group in one order on one rank and the other order on another, and
    both ranks wait for a collective the other never starts: a run of notebook 13 with 4 ranks on 2 cores hung
    that way. A group of its own keeps the two streams of collectives apart (torchtitan's and xtuner's async
    checkpoints create one for the same reason); gloo, because what it moves is small and on the CPU."""
    global _writer
    world = dist.group.WORLD
    if _writer[0] is not world:
        _writer = (world, dist.new_group(backend="gloo"))
    return _writer[1]


def save_async(folder: str | os.PathLike, state: dict[str, Any], step: int, meta: dict[str, Any] | None = None,
               rename: bool | None = None) -> PendingSave:
    """Start saving ``state`` as step ``step`` and return at once with a ``PendingSave``; a collective.

    The state is copied first (the step loop pays for that copy, not for the writing), then DCP writes it
    from a background thread (``dcp.async_save``, torch >= 2.3; in a process without a process group, a
    thread of this module's running ``dcp.save``). Call ``wait()`` on the result on every rank
    before the next save and before the end of the run; only then is the checkpoint complete.
    """
    import torch.distributed.checkpoint as dcp

    writing, final, _ = _begin(folder, step, rename)
    copy = _snapshot(state)
    if initialized():
        future = dcp.async_save(copy, checkpoint_id=str(writing), process_group=_writer_group())
    else:  # one process, no group: torch 2.3's async_save needs one; a thread of our own does the same
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(1, thread_name_prefix="dtlab-checkpoint")
        future = pool.submit(_dcp, dcp.save, copy, writing)
        pool.shutdown(wait=False)
    return PendingSave(future, writing, final, step, meta)


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


def incomplete(path: str | os.PathLike) -> str | None:
    """Why the checkpoint at ``path`` is not complete (no manifest, a file missing or of another size than the
    manifest says), or None when it is."""
    path = Path(path)
    try:
        listed = json.loads((path / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return (f"no {MANIFEST}: the save did not finish (or the folder was written by dtlab before manifests; "
                "re-save it)")
    except (ValueError, KeyError):
        return f"{MANIFEST} is damaged: the save was killed while writing it"
    for name, size in listed.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, the manifest says {size}"
    return None


def latest(folder: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint (``step-N`` whose manifest its files match), or None."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    steps = sorted((int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP.match(p.name)) and p.is_dir())
    for _step, path in reversed(steps):
        if incomplete(path) is None:
            return path
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
    why = incomplete(path)
    if why:
        raise CheckpointError(f"{path} is not a complete checkpoint: {why}. Fix: load an older complete one: "
                              "dtlab.sharded_checkpoint.latest(folder).")
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
