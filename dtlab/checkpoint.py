"""Checkpoints that never leave you with nothing.

* ``save``   writes to a temporary file in the same directory, flushes it to disk, then renames it
  over the target. A crash at any moment leaves either the old checkpoint or the new one, never
  half of one.
* ``load``   reads with ``weights_only=True`` (no arbitrary code runs from a checkpoint file) and
  turns a truncated or corrupt file into a ``CheckpointError`` that says what to do.
* ``training_state`` / ``restore`` bundle and unbundle model, optimizer, position and RNG states,
  so a resumed run continues where it stopped.
* ``save_on_rank0`` is the distributed form: rank 0 writes, everybody waits at a barrier.

>>> state = training_state(model, optimizer, epoch=3, step=120)      # doctest: +SKIP
>>> save("checkpoints/last.pt", state)                                # doctest: +SKIP
>>> epoch, step = restore(load("checkpoints/last.pt"), model, optimizer)  # doctest: +SKIP
"""

from __future__ import annotations

import os
import pickle
import random
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, read or applied; the message says why and what to do."""


def save(path: str | os.PathLike, state: dict[str, Any]) -> Path:
    """Write ``state`` to ``path`` atomically (temporary file + fsync + rename).

    The directory must exist: a typo in a path should fail loudly rather than scatter
    checkpoints in new folders. If anything fails, the previous file at ``path`` is untouched.
    """
    path = Path(path)
    directory = path.parent
    if not directory.is_dir():
        raise CheckpointError(f"cannot save checkpoint to {path}: directory {directory} does not exist. "
                              f"Fix: create it first, e.g. os.makedirs({str(directory)!r}, exist_ok=True).")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
    return path


def load(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint with ``weights_only=True``; unreadable files raise ``CheckpointError``."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}. Fix: check the path, or start from scratch.")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as exc:
        if "Unsupported global" in str(exc):  # a pickled class/function, not a corrupt file
            raise CheckpointError(f"{path} holds Python objects that weights_only=True refuses to unpickle "
                                  "(only tensors, numbers, strings and containers are allowed). Fix: save "
                                  "plain state_dicts (dtlab.checkpoint.training_state), or, if you trust the "
                                  "file, torch.load(path, weights_only=False).") from exc
        raise CheckpointError(f"{path} is not a readable checkpoint (truncated or corrupt: "
                              f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). "
                              "The file was left as it is. Fix: resume from an earlier checkpoint.") from exc


def rng_state() -> dict[str, Any]:
    """The random states of Python, NumPy and torch (CPU and CUDA), in a weights_only-safe form."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` captured."""
    random.setstate(_as_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, epoch: int = 0,
                   step: int = 0, **extra: Any) -> dict[str, Any]:
    """Everything needed to continue training: weights, optimizer, position, RNG, and ``extra``.

    Pass the *unwrapped* model (``ddp_model.module``) so the keys carry no ``module.`` prefix and
    the checkpoint loads into a plain model too.
    """
    state = {"model": model.state_dict(), "epoch": epoch, "step": step, "rng": rng_state()}
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    state.update(extra)
    return state


def restore(state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
            restore_rng: bool = True) -> tuple[int, int]:
    """Load ``state`` (from ``training_state``) into ``model`` and ``optimizer``; return ``(epoch, step)``.

    Raises ``CheckpointError`` naming the mismatching tensor when the checkpoint was made for a
    model of another shape; the model is left unchanged in that case.
    """
    if "model" not in state:
        raise CheckpointError(f"checkpoint has no 'model' entry (keys: {sorted(state)}); "
                              "it was not written by dtlab.checkpoint.training_state.")
    own = model.state_dict()
    problems = [f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}"
                for k, v in state["model"].items() if k in own and hasattr(v, "shape") and v.shape != own[k].shape]
    missing = sorted(set(own) - set(state["model"]))
    unexpected = sorted(set(state["model"]) - set(own))
    if problems or missing or unexpected:
        detail = "; ".join(problems[:3] + ([f"missing {missing[:3]}"] if missing else [])
                           + ([f"unexpected {unexpected[:3]}"] if unexpected else []))
        hint = " (keys start with 'module.': save ddp_model.module, not the DDP wrapper)" \
            if any(k.startswith("module.") for k in unexpected) else ""
        raise CheckpointError(f"checkpoint does not fit this model: {detail}{hint}. "
                              "Fix: build the model with the same configuration as the one that was saved.")
    model.load_state_dict(state["model"])
    if optimizer is not None and "optimizer" in state:
        optimizer.load_state_dict(state["optimizer"])
    if restore_rng and "rng" in state:
        set_rng_state(state["rng"])
    return int(state.get("epoch", 0)), int(state.get("step", 0))


def save_on_rank0(path: str | os.PathLike, state: dict[str, Any]) -> None:
    """Rank 0 writes ``state``; every rank then waits, so nobody reads a file that is not there yet."""
    from dtlab import distributed

    if distributed.is_main():
        save(path, state)
    distributed.barrier()
