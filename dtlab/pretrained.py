"""A Hugging Face model you bring: found, loaded into a sharded model, and written back as a Hugging Face folder.

The way to start FSDP2 from a checkpoint larger than one process's memory (PyTorch's FSDP2 tutorial, torchtitan):
build the model on the **meta** device (shapes, no memory), shard it, give each rank memory for its shards only
(``to_empty``), then load: rank 0 reads the folder and each tensor is scattered from it
(``set_model_state_dict(..., full_state_dict=True, broadcast_from_rank0=True)``). Only rank 0 ever holds the whole
model, and on the CPU.

* ``resolve(source)`` — a local folder written by ``save_pretrained``, or an MLflow model URI
  (``models:/<name>@<alias>``, ``runs:/<id>/model``) logged with MLflow's ``transformers`` flavour, as a folder;
  ``tokenizer_folder(source)`` where its tokenizer is.
* ``load_weights(model, folder)`` — the folder's weights into a sharded (or plain) model made on the meta device
  and moved with ``to_empty``; every rank calls it.
* ``export(model, folder, tokenizer)`` — the trained model, gathered one tensor at a time to rank 0's CPU
  (``get_model_state_dict(..., full_state_dict=True, cpu_offload=True)``), written by rank 0 as a Hugging Face folder
  with the tokenizer beside it: ``AutoModelForCausalLM.from_pretrained(folder)`` loads it without dtlab or FSDP.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch


def resolve(source: str | os.PathLike, into: str | os.PathLike | None = None) -> Path:
    """The folder holding the model's ``config.json``: ``source`` itself, or, for an MLflow URI (``models:/...``,
    ``runs:/...``), the model's files downloaded into ``into`` (a fresh temporary folder if not given).

    Raises:
        FileNotFoundError: no ``config.json`` there, naming the fix.
    """
    text = str(source)
    if text.startswith(("models:/", "runs:/")):
        import tempfile

        import mlflow

        local = Path(mlflow.artifacts.download_artifacts(text, dst_path=str(into or tempfile.mkdtemp())))
        found = sorted(local.rglob("config.json"), key=lambda p: len(p.parts))
        if not found:
            raise FileNotFoundError(f"{text} holds no Hugging Face model (no config.json). Fix: log it with "
                                    "mlflow.transformers.log_model, or pass the folder save_pretrained wrote")
        return found[0].parent
    folder = Path(text)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} is not a Hugging Face model folder (no config.json). Fix: the folder "
                                "model.save_pretrained(...) wrote, or models:/<name>@<alias> of a registered model")
    return folder


def tokenizer_folder(folder: str | os.PathLike) -> Path:
    """Where the tokenizer of the model in ``folder`` is: the folder itself, or (MLflow's ``transformers`` flavour)
    ``../components/tokenizer`` beside it."""
    folder = Path(folder)
    for candidate in (folder, folder.parent / "components" / "tokenizer", folder.parent.parent / "components" /
                      "tokenizer"):
        if (candidate / "tokenizer.json").is_file() or (candidate / "tokenizer_config.json").is_file():
            return candidate
    raise FileNotFoundError(f"no tokenizer beside the model in {folder}. Fix: save it there "
                            "(tokenizer.save_pretrained(folder))")


def load_weights(model: torch.nn.Module, folder: str | os.PathLike) -> torch.nn.Module:
    """Load the weights saved in ``folder`` into ``model`` on every rank; returns ``model``. A collective.

    ``model`` was built on the meta device from the folder's config, wrapped (``fully_shard``, recomputation)
    and given memory with ``to_empty``. Rank 0 loads the folder on its CPU; each tensor's shards go to the ranks
    that hold them. Buffers the folder does not save (a rotary embedding's frequency table) are taken from rank 0's
    copy too: ``to_empty`` leaves them uninitialised. Without a process group, the weights are simply loaded.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    full, buffers = {}, {}
    if rank == 0:
        source = _from_pretrained(folder)
        full = source.state_dict()
        buffers = {k: v for k, v in source.named_buffers() if k not in full}
        del source
    if not distributed:
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
    else:
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        shared = [buffers]
        dist.broadcast_object_list(shared, src=0)
        buffers = shared[0]
    _restore_buffers(model, buffers)
    return model


def _from_pretrained(folder: str | os.PathLike) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder))      # copied into the model's own dtype on loading


def _restore_buffers(model: torch.nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    """Copy ``buffers`` (names as in an unwrapped model) into ``model``'s, whatever wrappers renamed them."""
    mine = {_plain_name(k): v for k, v in model.named_buffers()}
    for name, value in buffers.items():
        if name in mine:
            with torch.no_grad():
                mine[name].copy_(value.to(mine[name].device, mine[name].dtype))


def _plain_name(name: str) -> str:
    for wrapper in ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod."):
        name = name.replace(wrapper, "")
    return name.removeprefix("module.")


def export(model: torch.nn.Module, folder: str | os.PathLike, tokenizer: Any = None,
           config: Any = None) -> Path | None:
    """Write the trained ``model`` as a Hugging Face folder (``save_pretrained``: ``config.json``, safetensors, the
    tokenizer); a collective, rank 0 writes. Returns the folder on rank 0, None elsewhere.

    The weights are gathered one tensor at a time into rank 0's CPU memory (never a GPU's), and the folder is
    written under another name and renamed when complete: a folder named ``folder`` is always whole. ``config``
    defaults to ``model.config``.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM

    distributed = dist.is_available() and dist.is_initialized()
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if distributed and dist.get_rank() != 0:
        return None
    config = config or getattr(model, "config", None) or model.module.config      # DDP keeps it on .module
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config)      # no memory: only save_pretrained's bookkeeping
    folder = Path(folder)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    plain.save_pretrained(str(partial), state_dict={k: v.contiguous() for k, v in state.items()})
    if tokenizer is not None:
        tokenizer.save_pretrained(str(partial))
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(partial, folder)
    return folder
