"""Data for the course: deterministic synthetic sets, one small real set, and a distributed loader.

Every dataset here is made from a seed, with no download, so every process of a distributed
job (and every re-run) sees exactly the same samples.

* ``synthetic_classification`` — vectors labelled by a hidden linear "teacher" (learnable).
* ``synthetic_images``         — noisy class templates, for the CNN.
* ``synthetic_tokens``         — token sequences following a hidden rule, for the tiny GPT.
* ``digits``                   — scikit-learn's 8x8 handwritten digits (1,797 real images, shipped
  inside the package).
* ``DistributedLoader``        — DataLoader + DistributedSampler whose epoch advances by itself
  and whose position can be saved and resumed mid-epoch.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset

from dtlab import _compat  # noqa: F401  (work-arounds for the runtime's torch and DeepSpeed)


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


class _SkipFirst(Sampler):
    """The indices of ``sampler`` without the first ``skip`` (resuming mid-epoch)."""

    def __init__(self, sampler: Sampler, skip: int):
        self.sampler, self.skip = sampler, skip

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.sampler), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.skip)


class _SeededBatches(Sampler):
    """Batches of ``(key, index)`` pairs: ``key`` names the epoch and batch a sample belongs to."""

    def __init__(self, sampler: Sampler, batch_size: int, drop_last: bool, epoch: int, first_batch: int):
        self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last
        self.epoch, self.first_batch = epoch, first_batch

    def __iter__(self) -> Iterator[list[tuple[tuple[int, int], int]]]:
        batch, number = [], self.first_batch
        for index in self.sampler:
            batch.append(((self.epoch, number), index))
            if len(batch) == self.batch_size:
                yield batch
                batch, number = [], number + 1
        if batch and not self.drop_last:
            yield batch

    def __len__(self) -> int:
        n = len(self.sampler)  # type: ignore[arg-type]
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)


class _SeededDataset(Dataset):
    """Reads ``(key, index)``: in a loader worker, seeds the RNGs from (seed, epoch, index) first.

    A worker's random stream otherwise depends on which batches that worker happened to load
    before, so random augmentation in ``num_workers > 0`` workers would differ after a resume.
    Seeding per sample makes it a function of the sample alone. In the main process
    (``num_workers=0``) nothing is seeded: the training RNG, which checkpoints restore, is used.
    """

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, item: tuple[tuple[int, int], int]):
        (epoch, _batch), index = item
        from torch.utils.data import get_worker_info

        if get_worker_info() is not None:
            import random

            import numpy as np

            sample_seed = (self.seed * 1_000_003 + epoch) * 1_000_003 + index
            torch.manual_seed(sample_seed)
            random.seed(sample_seed)
            np.random.seed(sample_seed % 2**32)
        return self.dataset[index]


class DistributedLoader:
    """A DataLoader over this rank's share of ``dataset`` that reshuffles every epoch by itself
    and can say exactly where it is, so a resumed run sees the batches it had not seen yet.

    ``DistributedSampler`` shuffles with ``seed + epoch``; forget ``sampler.set_epoch(epoch)`` and
    every epoch repeats the first epoch's order. Here each pass over the loader advances the
    epoch, so it cannot be forgotten; ``set_epoch`` is still there to jump.

    ``state_dict()`` is the position (epoch and batches already handed out in it);
    ``load_state_dict()`` makes the next pass start right after them, mid-epoch if need be. A pass
    that is left early (a ``break``, or ``zip(range(k), loader)``) ends its epoch: the next pass
    starts the next epoch, and ``state_dict()`` says so as soon as the pass is left.

    With ``num_workers > 0``, each sample's random augmentation in a worker is seeded from
    (seed, epoch, sample index), so a resumed run sees the same augmented samples as one that
    never stopped (a worker's own random stream would depend on which batches it loaded before).

    Args:
        dataset: the full dataset (identical on every rank).
        batch_size: samples per batch *per rank*.
        rank, world_size: this process's share; default to the running process group (or 0 / 1).
        shuffle, seed, drop_last: as for ``DistributedSampler``.
        **loader_kwargs: passed to ``DataLoader`` (``num_workers``, ``pin_memory``, ...).

    >>> loader = DistributedLoader(synthetic_classification(64), batch_size=8, rank=0, world_size=2)
    >>> len(loader), loader.epoch
    (4, 0)
    >>> batches = iter(loader); _ = next(batches); loader.state_dict()["batches_done"]
    1
    """

    def __init__(self, dataset: Dataset, batch_size: int, rank: int | None = None,
                 world_size: int | None = None, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 **loader_kwargs):
        from dtlab import distributed

        rank = distributed.rank() if rank is None else rank
        world_size = distributed.world_size() if world_size is None else world_size
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is outside world_size={world_size}")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1 (samples per batch per rank)")
        self.dataset, self.batch_size, self.world_size, self.seed = dataset, batch_size, world_size, seed
        self.sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle,
                                          seed=seed, drop_last=drop_last)
        # its own generator: a DataLoader otherwise draws a seed from the global RNG at every epoch
        # start, so a run resumed mid-epoch would see other dropout masks than one that never stopped
        loader_kwargs.setdefault("generator", torch.Generator().manual_seed(seed))
        self.loader_kwargs = loader_kwargs
        self.workers = int(loader_kwargs.get("num_workers", 0) or 0)
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self.sampler, **loader_kwargs)
        self.epoch = 0
        self._skip = 0                 # batches to skip at the start of the next pass
        self._position = (0, 0)        # (epoch, batches handed out in it)

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass use ``epoch``'s shuffle, from its first batch."""
        self.epoch, self._skip, self._position = epoch, 0, (epoch, 0)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator:
        epoch, skip = self.epoch, self._skip
        self.sampler.set_epoch(epoch)
        self.epoch, self._skip = epoch + 1, 0
        self._position = (epoch, skip)  # a new pass: this is where the loader is now
        loader = self._pass_loader(epoch, skip)
        done = skip
        try:
            for batch in loader:
                done += 1
                self._position = (epoch, done)  # counted when handed out: a step on it may follow
                yield batch
        except GeneratorExit:  # the pass was left early: the next one starts the next epoch
            self._position = (epoch + 1, 0)
            raise
        self._position = (epoch + 1, 0)

    def _pass_loader(self, epoch: int, skip: int) -> DataLoader:
        """The DataLoader of one pass, starting after ``skip`` batches of ``epoch``."""
        sampler = self.sampler if skip == 0 else _SkipFirst(self.sampler, skip * self.batch_size)
        if self.workers == 0:
            if skip == 0:
                return self.loader
            return DataLoader(self.dataset, batch_size=self.batch_size, sampler=sampler, **self.loader_kwargs)
        kwargs = {k: v for k, v in self.loader_kwargs.items() if k not in ("batch_size", "shuffle", "sampler")}
        batches = _SeededBatches(sampler, self.batch_size, False, epoch, skip)
        return DataLoader(_SeededDataset(self.dataset, self.seed), batch_sampler=batches, **kwargs)

    def state_dict(self) -> dict[str, int]:
        """Where the loader is: ``epoch`` and ``batches_done`` in it (plus what must match on resume)."""
        epoch, done = self._position
        if done >= len(self):
            epoch, done = epoch + 1, 0
        return {"epoch": epoch, "batches_done": done, "world_size": self.world_size,
                "batch_size": self.batch_size, "seed": self.seed, "dataset_len": len(self.dataset)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state``: the next pass starts after its ``batches_done`` batches.

        Raises ``ValueError`` when world size, batch size, seed or dataset length differ: the
        shards would then hold other samples and "the same position" would not exist.
        """
        mine = self.state_dict()
        changed = [f"{k}: saved {state[k]}, now {mine[k]}" for k in ("world_size", "batch_size", "seed", "dataset_len")
                   if k in state and state[k] != mine[k]]
        if changed:
            raise ValueError(f"cannot resume the data position exactly ({'; '.join(changed)}): each rank's shard "
                             "depends on them. Fix: resume with the same settings, or start the epoch afresh "
                             "with loader.set_epoch(state['epoch']).")
        self.epoch, self._skip = int(state["epoch"]), int(state["batches_done"])
        self._position = (self.epoch, self._skip)
