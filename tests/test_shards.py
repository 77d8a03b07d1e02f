"""dtlab.shards: shards written from a table, streamed to ranks exactly once per epoch, resumed at any N.

The claims notebook 21 makes about its data are held here too, and shown failing with a broken reader: every
sample once per epoch (counted), the same next sample after a resume (also on another number of ranks), and a
whole training loop — model, optimizer, data position — resumed bitwise at N = 2 and N = 3.
"""

import pyarrow as pa
import pytest
import torch

from dtlab import checkpoint, launch, shards, text

pytestmark = pytest.mark.cluster  # code a cluster runs: make test-runtime repeats these on its stack

SEQ = 8


def table(n=50, seq=SEQ):
    return pa.table({"id": pa.array(range(n), pa.int64()),
                     "tokens": pa.array([[(i * 7 + j) % 31 for j in range(seq + 1)] for i in range(n)],
                                        pa.list_(pa.int32()))})


@pytest.fixture
def folder(tmp_path):
    shards.write_shards(table(), tmp_path / "shards", seq_len=SEQ, tokenizer="tok", rows_per_shard=7)
    return tmp_path / "shards"


def read_epoch(folder, world, batch, state=None, **kw):
    """The ids each step hands each rank, from ``state`` on: ``[[rank 0's ids, rank 1's ids, ...], ...]``."""
    streams = [shards.ShardStream(folder, batch, rank=r, world_size=world, **kw) for r in range(world)]
    if state is not None:
        for s in streams:
            s.load_state_dict(state)
    return [[b["id"].tolist() for b in step] for step in zip(*streams)], streams[0]


def test_ranks_read_disjoint_samples_that_cover_the_epoch_exactly_once(folder):
    for world, batch in ((1, 4), (2, 4), (3, 5), (4, 3)):
        steps, _ = read_epoch(folder, world, batch)
        ids = [i for step in steps for rank in step for i in rank]
        assert shards.coverage(ids, 50) == {"seen": 50, "distinct": 50, "duplicates": 0, "missing": 0}, world
        assert all(len(rank) == batch for step in steps[:-1] for rank in step)   # whole steps but the last


def test_the_epoch_order_does_not_depend_on_the_number_of_ranks(folder):
    one, _ = read_epoch(folder, 1, 12)
    two, _ = read_epoch(folder, 2, 6)
    assert [sorted(s[0]) for s in one] == [sorted(s[0] + s[1]) for s in two]
    again, _ = read_epoch(folder, 1, 12, seed=1)
    assert [s[0] for s in again] != [s[0] for s in one]                   # another seed, another order
    nxt = shards.ShardStream(folder, 12, rank=0, world_size=1)
    assert [b["id"].tolist() for b in nxt] == [s[0] for s in one]
    assert [b["id"].tolist() for b in nxt] != [s[0] for s in one]         # the next pass is the next epoch


@pytest.mark.parametrize("world_after", [2, 3, 1])
def test_a_resumed_stream_continues_at_the_same_next_sample_on_any_number_of_ranks(folder, world_after):
    uninterrupted, _ = read_epoch(folder, 1, 6)
    streams = [shards.ShardStream(folder, 3, rank=r, world_size=2) for r in range(2)]
    first = [[b["id"].tolist() for b in step] for _, step in zip(range(3), zip(*streams))]
    state = streams[0].state_dict()
    assert state["samples_seen"] == 18 and state["epoch"] == 0
    rest, _ = read_epoch(folder, world_after, 6 // world_after, state)
    assert sorted(sum(rest[0], [])) == sorted(uninterrupted[3][0])        # the same next global step
    ids = [i for step in first + rest for rank in step for i in rank]
    assert shards.coverage(ids, 50)["duplicates"] == 0 and shards.coverage(ids, 50)["missing"] == 0


class SkipsTheRankOffset(shards.ShardStream):
    """A broken reader: every rank reads rank 0's slice."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rank = 0


class ForgetsItsPosition(shards.ShardStream):
    """A broken reader: a resume starts the epoch again."""

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.samples_seen = 0


def test_the_coverage_claims_fail_for_a_broken_reader(folder):
    streams = [SkipsTheRankOffset(folder, 5, rank=r, world_size=2) for r in range(2)]
    ids = [i for step in zip(*streams) for b in step for i in b["id"].tolist()]
    broken = shards.coverage(ids, 50)
    assert broken["duplicates"] > 0 and broken["missing"] > 0
    stream = shards.ShardStream(folder, 5, rank=0, world_size=1)
    first = [b["id"].tolist() for _, b in zip(range(4), stream)]
    forgetful = ForgetsItsPosition(folder, 5, rank=0, world_size=1)
    forgetful.load_state_dict(stream.state_dict())
    rest = [i for b in forgetful for i in b["id"].tolist()]
    assert shards.coverage(sum(first, []) + rest, 50)["duplicates"] == 20


def test_shards_of_another_tokenizer_length_or_data_set_are_refused_before_training(folder, tmp_path):
    with pytest.raises(shards.ShardMismatch, match="tokenizer.*Fix: rewrite the shards"):
        shards.ShardStream(folder, 4, rank=0, world_size=1, tokenizer="other")
    with pytest.raises(shards.ShardMismatch, match="sequences of 8 tokens.*Fix"):
        shards.ShardStream(folder, 4, rank=0, world_size=1, seq_len=16)
    shards.write_shards(table(40), tmp_path / "other", seq_len=SEQ, tokenizer="tok")
    state = shards.ShardStream(tmp_path / "other", 4, rank=0, world_size=1).state_dict()
    with pytest.raises(shards.ShardMismatch, match="another data set.*Fix"):
        shards.ShardStream(folder, 4, rank=0, world_size=1).load_state_dict(state)
    with pytest.raises(FileNotFoundError, match="index.json is missing.*Fix"):
        shards.ShardStream(tmp_path, 4, rank=0, world_size=1)


def test_a_table_without_the_columns_or_lengths_the_reader_needs_names_them(tmp_path):
    with pytest.raises(ValueError, match="no column 'tokens'.*Fix"):
        shards.write_shards(table().rename_columns(["id", "input_ids"]), tmp_path, seq_len=SEQ, tokenizer="t")
    with pytest.raises(ValueError, match="column 'id' holds string"):
        shards.write_shards(pa.table({"id": ["a"], "tokens": [[1] * 9]}), tmp_path, seq_len=SEQ, tokenizer="t")
    with pytest.raises(shards.ShardMismatch, match=r"rows hold \[9\] tokens.*seq_len \+ 1 = 5"):
        shards.write_shards(table(), tmp_path, seq_len=4, tokenizer="t")


def test_the_corpus_tokenizer_and_rows_need_no_download():
    docs = text.corpus()
    assert len(docs) > 50 and sum(len(d.split()) for d in docs) > 30_000
    tok = text.train_tokenizer(docs[:20], 300)
    assert text.tokenizer_id(tok) == text.tokenizer_id(text.train_tokenizer(docs[:20], 300))   # deterministic
    rows = text.token_rows(docs[:20], tok, 16, multiple_of=8)
    assert rows.num_rows % 8 == 0 and len(rows.column("tokens")[0].as_py()) == 17
    assert "assert" in tok.decode(rows.column("tokens")[0].as_py())


def _train_on_the_stream(cfg):
    """A DDP loop over a ShardStream, checkpointed with dtlab.checkpoint (model, optimizer, stream): stops after
    ``stop_at`` steps, or resumes from the newest checkpoint and runs to the end of the epoch."""
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dtlab import distributed, models, resumable

    distributed.setup("gloo")
    world = distributed.world_size()
    torch.manual_seed(0)
    model = models.TinyGPT(vocab_size=31, block_size=SEQ, n_layer=1, n_head=2, n_embd=16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stream = shards.ShardStream(cfg["folder"], cfg["global_batch"] // world, seq_len=SEQ)
    ckpt = checkpoint.Checkpointer(cfg["ckpt"], every_steps=10**6)
    step, state = 0, ckpt.load_latest()
    if state is not None:
        _, step = checkpoint.restore(state, model, optimizer=optimizer, loader=stream, allow_new_world_size=True)
    ddp = DDP(model)
    ddp.register_comm_hook(None, resumable.ordered_sum_hook)      # sums in rank order: exact on any N
    for batch in stream:
        x, y = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
        loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if step == cfg.get("stop_at"):
            ckpt.save(step, checkpoint.training_state(model, optimizer=optimizer, loader=stream, step=step))
            break
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("world_before, world_after", [(2, 2), (3, 3), (2, 3)])
def test_the_whole_loop_resumes_model_optimizer_and_stream(tmp_path, world_before, world_after):
    """Same N: bitwise equal to the uninterrupted run. Another N: the sums regroup, so within rounding.
    (48 samples: whole steps of 6; 50 would leave a rank of 3 an empty last batch, which a model cannot take.)"""
    shards.write_shards(table(48), tmp_path / "s", seq_len=SEQ, tokenizer="tok", rows_per_shard=7)
    cfg = {"folder": str(tmp_path / "s"), "global_batch": 6, "ckpt": str(tmp_path / "c")}
    whole = launch.run(_train_on_the_stream, {**cfg, "ckpt": str(tmp_path / "whole")}, nprocs=world_before)[0]
    launch.run(_train_on_the_stream, {**cfg, "stop_at": 4}, nprocs=world_before)
    resumed = launch.run(_train_on_the_stream, cfg, nprocs=world_after)[0]
    diff = max((whole[k] - resumed[k]).abs().max().item() for k in whole)
    if world_before == world_after:
        assert diff == 0.0, diff
    else:
        assert 0 < diff < 1e-4, diff


def test_restore_reshards_a_streams_position_but_restarts_a_samplers_epoch(folder):
    model = torch.nn.Linear(2, 2)
    stream = shards.ShardStream(folder, 4, rank=0, world_size=1)
    for _, _ in zip(range(3), stream):
        pass
    state = {**checkpoint.training_state(model, loader=stream), "world_size": 2}
    later = shards.ShardStream(folder, 4, rank=0, world_size=1)
    checkpoint.restore(state, model, loader=later, allow_new_world_size=True)
    assert later.state_dict()["samples_seen"] == 12
