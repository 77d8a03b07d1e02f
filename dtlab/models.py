"""The course's models: small enough for a laptop CPU, shaped like the real thing.

* ``MLP``       — a stack of Linear+ReLU layers; the default workhorse (fast, easy to reason about).
* ``SmallResNet`` — a ResNet-style CNN (conv, batch norm, residual blocks) for image data.
* ``TinyGPT``   — a decoder-only transformer (token + position embeddings, causal self-attention,
  weight-tied output head) for the memory and scaling lessons.

Every model is deterministic given ``torch.manual_seed`` and has no dropout, so distributed
runs can be compared with single-process runs weight for weight.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dtlab import _compat  # noqa: F401  (work-arounds for the runtime's torch and DeepSpeed)


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameters, counting shared (tied) tensors once."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():  # .parameters() already skips duplicates of a tied tensor
        if trainable_only and not p.requires_grad:
            continue
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


class MLP(nn.Module):
    """``depth`` hidden layers of width ``hidden``, ReLU between them (and dropout, if asked:
    then the random state matters, which is what an exact resume must restore).

    >>> MLP(64, 128, 10, depth=2)(torch.zeros(4, 64)).shape
    torch.Size([4, 10])
    """

    def __init__(self, in_features: int = 64, hidden: int = 256, out_features: int = 10, depth: int = 2,
                 dropout: float = 0.0):
        super().__init__()
        if depth < 1:
            raise ValueError(f"depth={depth}: an MLP needs at least one hidden layer")
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()] + ([nn.Dropout(dropout)] if dropout else [])
            width = hidden
        layers.append(nn.Linear(width, out_features))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))


class ResidualBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus the input (projected when the shape changes), then ReLU."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class SmallResNet(nn.Module):
    """A three-stage ResNet for small images (8x8 digits, 32x32 synthetic images).

    >>> SmallResNet(in_channels=1, num_classes=10)(torch.zeros(2, 1, 8, 8)).shape
    torch.Size([2, 10])
    """

    def __init__(self, in_channels: int = 3, num_classes: int = 10, width: int = 16):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.stages = nn.Sequential(ResidualBlock(width, width), ResidualBlock(width, 2 * width, 2),
                                    ResidualBlock(2 * width, 4 * width, 2))
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.head(x.mean(dim=(2, 3)))


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t sees only positions <= t.

    Queries, keys and values have a projection each (``q``, ``k``, ``v``) and the heads are read
    off the tensor's shape, so a tensor-parallel rank holding only some heads' rows of ``q/k/v``
    (and the matching columns of ``proj``) runs this same code on its heads (notebook 14).

    The attention itself (scores, softmax, weighted sum) is the submodule ``core``: PyTorch's fused
    ``scaled_dot_product_attention`` by default, or, with ``fused=False``, written out as
    ``softmax(q k^T / sqrt(d)) v``, which keeps the ``heads x seq x seq`` probabilities for its backward
    (notebook 19 measures the difference and recomputes ``core`` alone: selective recomputation).
    """

    def __init__(self, n_embd: int, n_head: int, fused: bool = True, dropout: float = 0.0):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head}")
        self.n_head = n_head
        self.head_dim = n_embd // n_head
        self.q = nn.Linear(n_embd, n_embd)
        self.k = nn.Linear(n_embd, n_embd)
        self.v = nn.Linear(n_embd, n_embd)
        self.core = AttentionCore(fused)
        self.proj = nn.Linear(n_embd, n_embd)
        self.dropout = nn.Dropout(dropout) if dropout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (lin(x).view(b, t, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = self.proj(self.core(q, k, v).transpose(1, 2).reshape(b, t, -1))
        return self.dropout(y) if self.dropout is not None else y


class AttentionCore(nn.Module):
    """Causal attention of ``q, k, v`` shaped ``(batch, heads, time, head_dim)``, no parameters.

    ``fused=True``: ``F.scaled_dot_product_attention`` (a fused kernel on CPU and GPU: its backward
    recomputes the scores, so it keeps only q, k, v, its output and one log-sum-exp per row).
    ``fused=False``: the same arithmetic written out; autograd keeps the probabilities, ``heads x time x time``
    per sequence.
    """

    def __init__(self, fused: bool = True):
        super().__init__()
        self.fused = fused

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        t = q.shape[-2]
        future = torch.full((t, t), float("-inf"), dtype=q.dtype, device=q.device).triu(1)   # added: kept by no one
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1])) + future
        return torch.softmax(scores, dim=-1) @ v


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x)) (dropout after each, if any)."""

    def __init__(self, n_embd: int, n_head: int, fused_attention: bool = True, dropout: float = 0.0):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, fused=fused_attention, dropout=dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))
        if dropout:
            self.mlp.append(nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A GPT-2-shaped language model, small. The output head shares the token embedding's weight
    (``tie_weights=False``: a weight of its own).

    ``forward(idx)`` returns logits ``(batch, time, vocab)``; ``forward(idx, targets)`` returns
    ``(logits, loss)``.

    >>> TinyGPT(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16)(torch.zeros(2, 16).long()).shape
    torch.Size([2, 16, 32])
    """

    def __init__(self, vocab_size: int = 64, block_size: int = 32, n_layer: int = 2, n_head: int = 4,
                 n_embd: int = 64, tie_weights: bool = True, fused_attention: bool = True, dropout: float = 0.0):
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, fused_attention, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        if tie_weights:
            self.head.weight = self.tok_emb.weight  # weight tying: one tensor, two uses
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by depth
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        b, t = idx.shape
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size={self.block_size}")
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class LogitsOnly(nn.Module):
    """A causal LM (a Hugging Face ``...ForCausalLM``) that maps token ids to logits and nothing else: the form a model
    takes to be logged, served and loaded back (``mlflow.pytorch``'s wrapper calls ``model(x)`` and needs a tensor,
    where a Hugging Face model returns an output object). Its ``state_dict`` is the wrapped model's, under
    ``lm.``."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=torch.as_tensor(input_ids).long(), use_cache=False).logits


@torch.no_grad()
def next_token_loss(model: nn.Module, tokens: torch.Tensor, batch_size: int = 16) -> float:
    """Mean cross-entropy of predicting each next token of ``tokens`` (rows of ``seq_len + 1``), ``model`` mapping
    ids to logits (``LogitsOnly``); evaluated in eval mode, in batches, summed in float64."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(tokens), batch_size):
        rows = torch.as_tensor(tokens[start:start + batch_size]).long()
        logits = model(rows[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten(), reduction="sum")
        total, count = total + float(loss), count + rows[:, 1:].numel()
    model.train(was_training)
    return total / count


@torch.no_grad()
def held_out_loss(model: nn.Module, batches: Any, device: torch.device | str = "cpu") -> float:
    """Mean next-token cross-entropy of a Hugging Face causal LM over ``batches`` (``{"tokens": (b, seq_len + 1)}``,
    this rank's share, e.g. a ``dtlab.shards.ShardStream`` of held-out shards), over all ranks when a process group
    runs; in eval mode. Under FSDP2 the model's weights are sharded again afterwards (an evaluation is a forward
    with no backward to release them)."""
    import torch.distributed as dist

    was_training = model.training
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for batch in batches:
        tokens = batch["tokens"].to(device)
        logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
        sums[0] += F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="sum").double()
        sums[1] += tokens[:, 1:].numel()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(sums)
    if hasattr(model, "reshard"):                  # FSDP2: free the gathered weights the forward left
        model.reshard()
    model.train(was_training)
    return float(sums[0] / sums[1])


def warmup_cosine(step: int, warmup: int, total: int, floor: float = 0.1) -> float:
    """The learning rate's factor at ``step`` (0-based): rising linearly to 1 over ``warmup`` steps, then a cosine
    down to ``floor`` at ``total``; for ``torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s,
    ...))``."""
    if step < warmup:
        return (step + 1) / warmup
    done = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * done))
