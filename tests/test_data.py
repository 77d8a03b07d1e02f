import pytest
import torch

from dtlab import data


def test_synthetic_sets_are_deterministic_and_shaped():
    a, b = data.synthetic_classification(100, 8, 3, seed=1), data.synthetic_classification(100, 8, 3, seed=1)
    assert torch.equal(a.tensors[0], b.tensors[0]) and torch.equal(a.tensors[1], b.tensors[1])
    assert a.tensors[0].shape == (100, 8) and set(a.tensors[1].tolist()) <= {0, 1, 2}
    assert not torch.equal(a.tensors[0], data.synthetic_classification(100, 8, 3, seed=2).tensors[0])
    img = data.synthetic_images(10, channels=1, size=8, classes=4)
    assert img.tensors[0].shape == (10, 1, 8, 8)


def test_synthetic_tokens_follow_the_rule_mostly_and_shift_by_one():
    x, y = data.synthetic_tokens(200, block_size=16, vocab_size=32).tensors
    assert x.shape == y.shape == (200, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])
    follows = ((3 * x + 1) % 32 == y).float().mean().item()
    assert 0.85 < follows < 0.95  # ~10% random resets


def test_digits_split_is_fixed_and_complete():
    train, test = data.digits(test_fraction=0.2, seed=0)
    assert len(train) + len(test) == 1797 and len(test) == 359
    assert train.tensors[0].shape[1:] == (1, 8, 8) and 0 <= train.tensors[0].min() and train.tensors[0].max() <= 1
    again, _ = data.digits(seed=0)
    assert torch.equal(train.tensors[1], again.tensors[1])


def _indices(loader):
    return [i for (x,) in loader for i in x.tolist()]


def test_distributed_loader_splits_the_data_between_ranks():
    ds = torch.utils.data.TensorDataset(torch.arange(20))
    parts = [_indices(data.DistributedLoader(ds, 4, rank=r, world_size=2, seed=0)) for r in range(2)]
    assert set(parts[0]).isdisjoint(parts[1])
    assert sorted(parts[0] + parts[1]) == list(range(20))


def test_distributed_loader_reshuffles_every_epoch_by_itself():
    ds = torch.utils.data.TensorDataset(torch.arange(64))
    loader = data.DistributedLoader(ds, 8, rank=0, world_size=2, seed=0)
    first, second = _indices(loader), _indices(loader)
    assert loader.epoch == 2 and first != second and sorted(first) != first
    loader.set_epoch(0)
    assert _indices(loader) == first  # resuming at epoch 0 reproduces its order


def test_distributed_loader_rejects_a_rank_outside_the_world():
    with pytest.raises(ValueError, match="outside world_size"):
        data.DistributedLoader(data.synthetic_classification(8), 2, rank=2, world_size=2)


def test_slow_dataset_wraps_items():
    ds = data.SlowDataset(data.synthetic_classification(4), delay_s=0)
    assert len(ds) == 4 and ds[0][0].shape == (64,)
