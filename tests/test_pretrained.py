"""dtlab.pretrained: a folder written by ``save_pretrained`` loaded into FSDP2 the meta-device way, trained, and
written back as a folder ``AutoModelForCausalLM.from_pretrained`` reads — each held against one plain process."""

import pytest
import torch

from dtlab import launch, pretrained, text
from dtlab.measure import max_diff

pytestmark = pytest.mark.cluster  # code a cluster runs: make test-runtime repeats these on its stack


def small_llama(folder, seed=0):
    """A small Llama and its tokenizer, written by save_pretrained: what a learner's own folder looks like."""
    from transformers import LlamaConfig, LlamaForCausalLM

    docs = text.corpus(12)
    tok = text.as_transformers(text.train_tokenizer(docs, 300))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                         rope_theta=500.0))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return text.token_rows(docs, tok, 16, max_rows=8).column("tokens").to_pylist()


def train_steps(folder, rows, out, steps=3, fsdp=True):
    """Each rank: meta model -> (shard) -> to_empty -> load_weights; ``steps`` AdamW steps, each rank its slice of
    every batch (the gradient averaged); export. Returns the first loss and the logits before training."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from transformers import AutoConfig, AutoModelForCausalLM

    from dtlab.parallel import fsdp2

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    if fsdp and world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        fsdp2.shard_blocks(model, init_device_mesh("cpu", (world,)), blocks="model.layers")
    model.to_empty(device="cpu")
    pretrained.load_weights(model, folder)
    # before any forward: FSDP2 keeps the root's gathered weights registered after a forward, until a backward
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.tensor(rows)
    before = model(input_ids=tokens[:, :-1]).logits.detach()
    per = len(rows) // world
    for _ in range(steps):
        mine = tokens[rank * per:(rank + 1) * per]
        logits = model(input_ids=mine[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), mine[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    pretrained.export(model, out)
    dist.destroy_process_group()
    return before


@pytest.mark.skipif(not __import__("dtlab.parallel.fsdp2", fromlist=["x"]).AVAILABLE, reason="FSDP2 needs torch 2.6")
def test_a_save_pretrained_folder_loads_into_fsdp2_trains_and_exports_like_one_process(tmp_path):
    from transformers import AutoModelForCausalLM

    rows = small_llama(tmp_path / "mine")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "mine")
    tokens = torch.tensor(rows)
    expected = plain(input_ids=tokens[:, :-1]).logits.detach()
    one = launch.run(train_steps, str(tmp_path / "mine"), rows, str(tmp_path / "one"), nprocs=1)[0]
    two = launch.run(train_steps, str(tmp_path / "mine"), rows, str(tmp_path / "two"), nprocs=2)
    # loaded: the sharded model's logits are the folder's (the rotary table restored too: to_empty leaves garbage)
    assert (one - expected).abs().max() == 0 and (two[0] - expected).abs().max() <= 1e-5
    # trained and exported: from_pretrained of each export is a plain model, and 2 ranks equal 1
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "one").state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "two").state_dict()
    assert set(a) == set(plain.state_dict()) and max_diff(a, plain.state_dict()) > 1e-4     # it did train
    assert max_diff(a, b) <= 1e-5
    assert not (tmp_path / "two.partial").exists()


def test_without_a_process_group_the_weights_load_into_a_meta_built_model(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    rows = small_llama(tmp_path / "mine", seed=3)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / "mine"))
    model.to_empty(device="cpu")
    pretrained.load_weights(model, tmp_path / "mine")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "mine")
    x = torch.tensor(rows)[:, :-1]
    assert (model(input_ids=x).logits - plain(input_ids=x).logits).abs().max() == 0


def test_a_folder_without_a_model_is_refused_with_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        pretrained.resolve(tmp_path)
    with pytest.raises(FileNotFoundError, match="tokenizer.save_pretrained"):
        pretrained.tokenizer_folder(tmp_path)


def test_an_autotokenizer_is_taken_wherever_a_tokenizer_is(tmp_path):
    from transformers import AutoTokenizer

    docs = text.corpus(10)
    raw = text.train_tokenizer(docs, 300)
    text.as_transformers(raw).save_pretrained(tmp_path)
    auto = AutoTokenizer.from_pretrained(tmp_path)
    assert text.tokenizer_id(auto) == text.tokenizer_id(raw)
    assert text.tokenizer_id(auto) != text.tokenizer_id(text.train_tokenizer(docs[:5], 300))
    assert text.token_rows(docs, auto, 16).equals(text.token_rows(docs, raw, 16))
