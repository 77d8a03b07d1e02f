import math

import pytest
import torch

from dtlab import models


def test_mlp_shapes_and_parameter_count():
    m = models.MLP(in_features=64, hidden=32, out_features=10, depth=2)
    assert m(torch.zeros(5, 1, 8, 8)).shape == (5, 10)  # flattens images
    assert models.count_parameters(m) == (64 * 32 + 32) + (32 * 32 + 32) + (32 * 10 + 10)
    with pytest.raises(ValueError, match="depth"):
        models.MLP(depth=0)


def test_count_parameters_trainable_only():
    m = models.MLP(8, 4, 2, depth=1)
    m.net[0].weight.requires_grad_(False)
    assert models.count_parameters(m, trainable_only=True) == models.count_parameters(m) - 8 * 4


def test_small_resnet_on_digits_and_rgb_images():
    assert models.SmallResNet(in_channels=1, num_classes=10)(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    assert models.SmallResNet(in_channels=3, num_classes=7, width=8)(torch.zeros(2, 3, 32, 32)).shape == (2, 7)


def test_tiny_gpt_ties_head_to_embedding_and_counts_it_once():
    m = models.TinyGPT(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)
    assert m.head.weight is m.tok_emb.weight
    distinct = {id(p): p.numel() for mod in m.modules() for p in mod.parameters(recurse=False)}
    assert models.count_parameters(m) == sum(distinct.values())
    assert models.count_parameters(m) < sum(p.numel() for mod in m.modules() for p in mod.parameters(recurse=False))


def test_tiny_gpt_initial_loss_is_near_uniform_and_causal():
    torch.manual_seed(0)
    m = models.TinyGPT(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
    idx, targets = torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))
    logits, loss = m(idx, targets)
    assert logits.shape == (4, 16, 64)
    assert abs(loss.item() - math.log(64)) < 0.3
    changed = idx.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 64  # the last token must not affect earlier positions
    assert torch.allclose(m(changed)[:, :-1], logits[:, :-1], atol=1e-6)
    with pytest.raises(ValueError, match="block_size"):
        m(torch.zeros(1, 17, dtype=torch.long))


def test_models_are_deterministic_given_the_seed():
    torch.manual_seed(3)
    a = models.TinyGPT(n_layer=1)
    torch.manual_seed(3)
    b = models.TinyGPT(n_layer=1)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
