"""Data for the course: deterministic synthetic sets, one small real set, and a distributed loader.

Every dataset here is made from a seed, with no download, so every process of a distributed
job (and every re-run) sees exactly the same samples.

* ``synthetic_classification`` — vectors labelled by a hidden linear "teacher" (learnable).
* ``synthetic_images``         — noisy class templates, for the CNN.
* ``synthetic_tokens``         — token sequences following a hidden rule, for the tiny GPT.
* ``digits``                   — scikit-learn's 8x8 handwritten digits (1,797 real images, shipped
  inside the package).
* ``DistributedLoader``        — DataLoader + DistributedSampler whose epoch advances by itself.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset


def synthetic_classification(n: int = 4096, features: int = 64, classes: int = 10, seed: int = 0,
                             noise: float = 0.1) -> TensorDataset:
    """``n`` Gaussian vectors labelled by ``argmax(x @ W + noise)`` for a fixed random ``W``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    teacher = torch.randn(features, classes, generator=g)
    y = (x @ teacher + noise * torch.randn(n, classes, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


def synthetic_images(n: int = 2048, channels: int = 3, size: int = 32, classes: int = 10, seed: int = 0,
                     noise: float = 0.5) -> TensorDataset:
    """Images ``(n, channels, size, size)``: one random template per class plus Gaussian noise."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.randn(classes, channels, size, size, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    x = templates[y] + noise * torch.randn(n, channels, size, size, generator=g)
    return TensorDataset(x, y)


def synthetic_tokens(n: int = 1024, block_size: int = 32, vocab_size: int = 64, seed: int = 0) -> TensorDataset:
    """Sequences where each token is ``(3 * previous + 1) % vocab`` except for random resets.

    Returns pairs ``(x, y)`` of shape ``(block_size,)`` with ``y`` = ``x`` shifted by one token,
    the usual language-modelling target. About 10% of positions are random, so the best
    achievable loss is well above zero but far below ``log(vocab_size)``.
    """
    g = torch.Generator().manual_seed(seed)
    seq = torch.empty(n, block_size + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, vocab_size, (n,), generator=g)
    resets = torch.rand(n, block_size + 1, generator=g) < 0.1
    random_tokens = torch.randint(0, vocab_size, (n, block_size + 1), generator=g)
    for t in range(1, block_size + 1):
        nxt = (3 * seq[:, t - 1] + 1) % vocab_size
        seq[:, t] = torch.where(resets[:, t], random_tokens[:, t], nxt)
    return TensorDataset(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())


def digits(test_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's handwritten digits as ``(train, test)``: images ``(1, 8, 8)`` in [0, 1], labels 0-9.

    The split is a fixed permutation from ``seed``, so it is the same in every process.
    """
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = int(round(test_fraction * len(y)))
    test, train = order[:n_test], order[n_test:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


class SlowDataset(Dataset):
    """Wraps a dataset and sleeps ``delay_s`` per item: a stand-in for decoding/augmentation cost."""

    def __init__(self, dataset: Dataset, delay_s: float = 0.001):
        self.dataset, self.delay_s = dataset, delay_s

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, i: int):
        time.sleep(self.delay_s)
        return self.dataset[i]


class DistributedLoader:
    """A DataLoader over this rank's share of ``dataset`` that reshuffles every epoch by itself.

    ``DistributedSampler`` shuffles with ``seed + epoch``; forget ``sampler.set_epoch(epoch)`` and
    every epoch repeats the first epoch's order. Here each pass over the loader advances the
    epoch, so it cannot be forgotten; ``set_epoch`` is still there to jump (e.g. when resuming).

    Args:
        dataset: the full dataset (identical on every rank).
        batch_size: samples per batch *per rank*.
        rank, world_size: this process's share; default to the running process group (or 0 / 1).
        shuffle, seed, drop_last: as for ``DistributedSampler``.
        **loader_kwargs: passed to ``DataLoader`` (``num_workers``, ``pin_memory``, ...).

    >>> loader = DistributedLoader(synthetic_classification(64), batch_size=8, rank=0, world_size=2)
    >>> len(loader), loader.epoch
    (4, 0)
    """

    def __init__(self, dataset: Dataset, batch_size: int, rank: int | None = None,
                 world_size: int | None = None, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 **loader_kwargs):
        from dtlab import distributed

        rank = distributed.rank() if rank is None else rank
        world_size = distributed.world_size() if world_size is None else world_size
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is outside world_size={world_size}")
        self.sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle,
                                          seed=seed, drop_last=drop_last)
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self.sampler, **loader_kwargs)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass use ``epoch``'s shuffle (for resuming mid-training)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)
