import pytest
import torch

from dtlab import data

pytestmark = pytest.mark.cluster  # code a cluster runs: make test-runtime repeats these on its stack


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


def _labels(batches):
    return [y.tolist() for _, y in batches]


def test_a_pass_left_early_ends_its_epoch_and_the_state_says_so():
    """`break` or `zip(range(k), loader)`: the next pass starts the next epoch, and state_dict() must
    name that position, so a run resumed from it sees what the run that went on saw."""
    dataset = data.synthetic_classification(96)
    going_on = data.DistributedLoader(dataset, batch_size=8, rank=0, world_size=2, seed=5)
    _ = list(zip(range(3), going_on))               # three steps, then the pass is abandoned
    state = going_on.state_dict()
    assert (state["epoch"], state["batches_done"]) == (1, 0), state
    next_pass = _labels(going_on)
    resumed = data.DistributedLoader(dataset, batch_size=8, rank=0, world_size=2, seed=5)
    resumed.load_state_dict(state)
    assert _labels(resumed) == next_pass


def test_a_pass_in_progress_reports_its_position_and_a_new_pass_resets_it():
    loader = data.DistributedLoader(data.synthetic_classification(64), batch_size=8, rank=0, world_size=1, seed=1)
    it = iter(loader)
    next(it), next(it)
    assert (loader.state_dict()["epoch"], loader.state_dict()["batches_done"]) == (0, 2)
    again = iter(loader)                            # a second pass while the first one is still referenced
    next(again)
    assert (loader.state_dict()["epoch"], loader.state_dict()["batches_done"]) == (1, 1)


class _Augmented(torch.utils.data.Dataset):
    """Each read adds fresh random noise, as random augmentation in a loader worker does."""

    def __init__(self, n=48):
        self.x = torch.arange(float(n)).unsqueeze(1)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + torch.rand(1), i


def test_worker_augmentation_resumes_exactly_mid_epoch():
    def loader():
        return data.DistributedLoader(_Augmented(), batch_size=4, rank=1, world_size=2, seed=7, num_workers=2)

    straight = loader()
    reference = [x for _ in range(2) for x, _ in straight]          # two epochs, never stopped
    first = loader()
    seen = []
    for x, _ in first:
        seen.append(x)
        if len(seen) == 4:
            state = first.state_dict()                              # checkpoint mid-epoch, then "killed"
            break
    second = loader()
    second.load_state_dict(state)
    seen += [x for _ in range(2) for x, _ in second][: len(reference) - 4]
    assert len(seen) == len(reference)
    assert all(torch.equal(a, b) for a, b in zip(seen, reference)), "augmentation differed after the resume"
    assert not torch.equal(reference[0], reference[len(reference) // 2]), "epochs are augmented differently"
