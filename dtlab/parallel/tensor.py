"""Tensor parallelism (Megatron-style) built from scratch: one layer's weights split over N ranks.

Data parallelism and FSDP give every rank the *whole* computation of a layer. Tensor parallelism
splits the computation itself: each rank holds a slice of a weight matrix and computes a slice of
the layer's output, so a layer too large (or too slow) for one GPU runs on N. Two splits of a
linear layer ``y = x W^T + b`` (``W`` is ``out x in``) make everything else:

    column-parallel:  rank r keeps rows r of W (a slice of the *outputs*); every rank needs the
                      whole input x, and produces its slice y_r of the output.
    row-parallel:     rank r keeps columns r of W (a slice of the *inputs*); it takes its input
                      slice x_r and produces a partial sum; an all-reduce adds the N partials.

Put a column-parallel layer before a row-parallel one (MLP: up-projection, activation,
down-projection; attention: q/k/v by heads, then the output projection) and the slice y_r is
exactly the input the row-parallel layer wants: no communication in between. Each pair costs one
all-reduce in the forward pass and one in the backward pass, made by two small autograd
functions Megatron-LM calls f and g:

    f (``_CopyToParallel``):   forward: identity            backward: all-reduce the gradient
    g (``_ReduceFromParallel``): forward: all-reduce         backward: identity

f sits where a replicated activation enters the column-parallel layer (each rank's gradient with
respect to x covers only its slice of W, so the N gradients must be added); g sits after the
row-parallel layer. A vocabulary-parallel embedding splits the embedding table by rows (token
ids) and ends with g too.

    tp = TPGroup()                                   # after dist.init_process_group(...)
    mlp = TensorParallelMLP(full_mlp, tp)            # built from the unsharded module, then sliced
    y = mlp(x)                                       # x and y replicated: equal on every rank
    tp.counts                                        # {('forward', 'all_reduce'): 1, ...}

Every layer here is built *from* the unsharded layer (same seed on every rank, then each keeps
its slice), so the tensor-parallel module starts equal to the unsharded one and tests can compare
them. ``parallelize_gpt`` applies all of it to the course's ``TinyGPT``.

What it leaves out: sequence parallelism (notebook 14 shows PyTorch's), a vocabulary-parallel
cross-entropy (the logits are gathered here), and overlapping the all-reduces with compute.
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtlab.distributed import GroupTally


@dataclass
class TPGroup(GroupTally):
    """The ranks one layer is split over, and a tally of what they sent.

    ``counts[(phase, op)]`` counts collectives ("forward"/"backward", "all_reduce"/"all_gather");
    ``elements[(phase, op)]`` the tensor elements they carried (per rank, before the ring's
    2(N-1)/N factor). ``group=None`` is the default (whole-world) process group.
    """

    elements: Counter = field(default_factory=Counter)

    def reset(self) -> None:
        """Forget the tally (e.g. before the step you want to count)."""
        self.counts.clear()
        self.elements.clear()

    def chunk(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of ``tensor`` along ``dim`` (N equal slices), as a new tensor."""
        if tensor.shape[dim] % self.size:
            raise ValueError(f"dimension {dim} of size {tensor.shape[dim]} cannot be split into {self.size} equal "
                             f"slices. Fix: a size divisible by the tensor-parallel degree {self.size} (or another "
                             "degree that divides it)")
        return tensor.detach().chunk(self.size, dim=dim)[self.rank].clone()

    def all_reduce(self, x: torch.Tensor, phase: str) -> torch.Tensor:
        self.counts[(phase, "all_reduce")] += 1
        self.elements[(phase, "all_reduce")] += x.numel()
        x = x.contiguous()
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor, phase: str) -> torch.Tensor:
        self.counts[(phase, "all_gather")] += 1
        self.elements[(phase, "all_gather")] += x.numel() * self.size
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


class _CopyToParallel(torch.autograd.Function):
    """f: identity forward; all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.all_reduce(grad.clone(), "backward"), None


class _ReduceFromParallel(torch.autograd.Function):
    """g: all-reduce forward (add the partial sums); identity backward."""

    @staticmethod
    def forward(ctx, x, tp):
        return tp.all_reduce(x.clone(), "forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromParallel(torch.autograd.Function):
    """All-gather slices along the last dimension forward; keep this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return tp.all_gather_last(x, "forward")

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.tp.size, dim=-1)[ctx.tp.rank].contiguous(), None


def copy_to_parallel(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """f: pass a replicated activation into column-parallel layers (its gradient gets all-reduced)."""
    return _CopyToParallel.apply(x, tp)


def reduce_from_parallel(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """g: add the ranks' partial sums (all-reduce); the gradient passes through unchanged."""
    return _ReduceFromParallel.apply(x, tp)


def gather_from_parallel(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Join the ranks' slices of the last dimension (all-gather); each rank keeps its slice of the gradient."""
    return _GatherFromParallel.apply(x, tp)


class ColumnParallelLinear(nn.Module):
    """Rank r keeps rows r of ``full.weight`` (and of its bias): a slice of the output features.

    Input: the whole (replicated) x; output: this rank's slice of ``full(x)`` along the last
    dimension, or the whole of it with ``gather_output=True``. ``copy_input=False`` when the caller
    already applied f to x (attention applies it once for q, k and v).
    """

    def __init__(self, full: nn.Linear, tp: TPGroup, gather_output: bool = False, copy_input: bool = True):
        super().__init__()
        if full.out_features % tp.size:
            raise ValueError(f"a column-parallel layer splits the {full.out_features} output features over "
                             f"{tp.size} ranks, which does not divide. Fix: a size divisible by {tp.size}, or "
                             "another tensor-parallel degree")
        self.tp, self.gather_output, self.copy_input = tp, gather_output, copy_input
        self.weight = nn.Parameter(tp.chunk(full.weight, 0))
        self.bias = nn.Parameter(tp.chunk(full.bias, 0)) if full.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = copy_to_parallel(x, self.tp)
        y = F.linear(x, self.weight, self.bias)
        return gather_from_parallel(y, self.tp) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Rank r keeps columns r of ``full.weight``: a slice of the input features; the bias stays whole.

    Input: this rank's slice of x along the last dimension (what a column-parallel layer gives);
    output: the whole ``full(x)`` on every rank, after one all-reduce of the partial sums (g).
    """

    def __init__(self, full: nn.Linear, tp: TPGroup):
        super().__init__()
        if full.in_features % tp.size:
            raise ValueError(f"a row-parallel layer splits the {full.in_features} input features over {tp.size} "
                             f"ranks, which does not divide. Fix: a size divisible by {tp.size}, or another "
                             "tensor-parallel degree")
        self.tp = tp
        self.weight = nn.Parameter(tp.chunk(full.weight, 1))
        self.bias = nn.Parameter(full.bias.detach().clone()) if full.bias is not None else None

    def forward(self, x_slice: torch.Tensor) -> torch.Tensor:
        y = reduce_from_parallel(F.linear(x_slice, self.weight), self.tp)   # sum of the N partial products
        return y + self.bias if self.bias is not None else y                # the bias once, after the sum


class TensorParallelMLP(nn.Module):
    """``Linear -> activation -> Linear`` split as column-parallel -> activation -> row-parallel.

    One all-reduce forward (after the row-parallel layer) and one backward (before the column one).
    """

    def __init__(self, mlp: nn.Sequential, tp: TPGroup):
        super().__init__()
        layers = list(mlp)
        if len(layers) != 3 or not isinstance(layers[0], nn.Linear) or not isinstance(layers[2], nn.Linear):
            raise ValueError(f"TensorParallelMLP expects nn.Sequential(Linear, activation, Linear); got {mlp}. "
                             "Fix: split other shapes with ColumnParallelLinear / RowParallelLinear by hand")
        self.up = ColumnParallelLinear(layers[0], tp)
        self.act = copy.deepcopy(layers[1])
        self.down = RowParallelLinear(layers[2], tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


class TensorParallelAttention(nn.Module):
    """Causal self-attention with the heads split over ranks: rank r computes heads r·H/N ... (r+1)·H/N − 1.

    ``q``, ``k`` and ``v`` are column-parallel (a head's rows are a contiguous slice), attention
    runs on the local heads with no communication, and ``proj`` is row-parallel. Built from
    ``dtlab.models.CausalSelfAttention``; the number of heads must divide by N.
    """

    def __init__(self, attn: nn.Module, tp: TPGroup):
        super().__init__()
        if attn.n_head % tp.size:
            fits = tp.size * max(1, attn.n_head // tp.size)
            raise ValueError(f"{attn.n_head} attention heads cannot be split over {tp.size} ranks. Fix: a head count "
                             f"divisible by the tensor-parallel degree (e.g. {fits})")
        self.tp, self.head_dim = tp, attn.head_dim
        self.q, self.k, self.v = (ColumnParallelLinear(lin, tp, copy_input=False) for lin in (attn.q, attn.k, attn.v))
        self.proj = RowParallelLinear(attn.proj, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        x = copy_to_parallel(x, self.tp)                      # one f for q, k and v together
        q, k, v = (lin(x).view(b, t, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # this rank's heads only
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class VocabParallelEmbedding(nn.Module):
    """Rank r keeps the embedding rows of token ids r·V/N ... (r+1)·V/N − 1.

    Each rank looks up the ids it holds, writes zeros for the others, and an all-reduce (g) adds
    the N partial results: exactly one rank contributed each token's row.
    """

    def __init__(self, full: nn.Embedding, tp: TPGroup):
        super().__init__()
        if full.num_embeddings % tp.size:
            raise ValueError(f"a vocabulary of {full.num_embeddings} cannot be split over {tp.size} ranks. Fix: pad "
                             f"the vocabulary to a multiple of {tp.size} (Megatron pads to a multiple of 128 x N)")
        self.tp = tp
        self.per_rank = full.num_embeddings // tp.size
        self.start = tp.rank * self.per_rank
        self.weight = nn.Parameter(tp.chunk(full.weight, 0))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        local = idx - self.start
        mine = (local >= 0) & (local < self.per_rank)
        rows = F.embedding(torch.where(mine, local, torch.zeros_like(local)), self.weight)
        return reduce_from_parallel(rows * mine.unsqueeze(-1), self.tp)


def parallelize_gpt(model: nn.Module, tp: TPGroup) -> nn.Module:
    """A tensor-parallel copy of a ``dtlab.models.TinyGPT`` (the original is left as it is).

    Token embedding: vocabulary-parallel; each block's attention and MLP: as above; the output
    head: column-parallel over the vocabulary with the logits gathered (its weight is the
    embedding's slice when the two are tied, as in the unsharded model). Layer norms and the
    position embedding stay whole on every rank, and their gradients agree without communication.
    The same ``forward`` runs: it finds the parallel modules where the plain ones were.
    """
    tied = model.head.weight is model.tok_emb.weight
    out = copy.deepcopy(model)
    out.tok_emb = VocabParallelEmbedding(model.tok_emb, tp)
    for block, original in zip(out.blocks, model.blocks):
        block.attn = TensorParallelAttention(original.attn, tp)
        block.mlp = TensorParallelMLP(original.mlp, tp)
    out.head = ColumnParallelLinear(model.head, tp, gather_output=True)
    if tied:
        out.head.weight = out.tok_emb.weight        # the same slice of the same tensor, as before splitting
    return out


def shard_like(full: nn.Module | dict[str, torch.Tensor], parallel: nn.Module, tp: TPGroup) -> dict[str, torch.Tensor]:
    """The unsharded model's tensors cut the way ``parallel`` holds them, keyed by ``parallel``'s parameter names.

    ``full`` is the unsharded module (its weights) or a dict of its tensors by parameter name
    (e.g. its gradients: ``{n: p.grad for n, p in full.named_parameters()}``). Each parameter of
    ``parallel`` (built from that module by ``parallelize_gpt`` or the classes above) gets the
    matching tensor: this rank's rows for column-parallel layers and vocabulary-parallel
    embeddings, its columns for row-parallel weights, the whole tensor otherwise.
    """
    if isinstance(full, nn.Module):
        full = {n: p for n, p in full.named_parameters(remove_duplicate=False)}
    out = {}
    for name, module in parallel.named_modules():
        for pname, _ in module.named_parameters(recurse=False, remove_duplicate=False):
            key = f"{name}.{pname}" if name else pname
            source = full[_full_name(key)]
            if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
                out[key] = tp.chunk(source, 0)
            elif isinstance(module, RowParallelLinear) and pname == "weight":
                out[key] = tp.chunk(source, 1)
            else:
                out[key] = source.detach().clone()
    return out


def compare_with_unsharded(full: nn.Module, parallel: nn.Module, x: torch.Tensor, tp: TPGroup,
                           loss_of, lr: float = 0.5) -> dict[str, float]:
    """Run both modules on ``x`` (forward, ``loss_of(output).backward()``, one SGD step); the largest differences.

    ``parallel`` must have been built from ``full`` (so they start equal). Returns the max absolute
    difference of the outputs, of the input gradients (floating-point inputs), of the weight
    gradients and of the weights after the step (``full``'s cut by ``shard_like``).
    """
    def biggest(a: dict, b: dict) -> float:
        return max((a[k] - b[k]).abs().max().item() for k in b)

    xf, xp = (x.clone().requires_grad_(x.is_floating_point()) for _ in range(2))
    out_full, out_par = full(xf), parallel(xp)
    loss_of(out_full).backward()
    loss_of(out_par).backward()
    grads_par = {n: p.grad for n, p in parallel.named_parameters(remove_duplicate=False)}
    grads_full = {n: p.grad for n, p in full.named_parameters(remove_duplicate=False)}
    result = {"output": (out_full - out_par).abs().max().item(),
              "weight_grad": biggest(shard_like(grads_full, parallel, tp), grads_par)}
    if x.is_floating_point():
        result["input_grad"] = (xf.grad - xp.grad).abs().max().item()
    for module in (full, parallel):
        torch.optim.SGD(module.parameters(), lr=lr).step()
    result["after_step"] = biggest(shard_like(full, parallel, tp),
                                   {n: p.detach() for n, p in parallel.named_parameters(remove_duplicate=False)})
    return result


def _full_name(name: str) -> str:
    """The unsharded module's name for a parameter of the parallel one (``mlp.up.weight`` -> ``mlp.0.weight``)."""
    return ".".join({"up": "0", "act": "1", "down": "2"}.get(part, part) for part in name.split("."))
