"""dtlab.shards: shards written from a table, streamed to ranks exactly once per epoch, resumed at any N.

The claims notebook 21 makes about its data are held here too, and shown failing with a broken reader: every
sample once per epoch (counted), the same next sample after a resume (also on another number of ranks), and a
whole training loop — model, optimizer, data position — resumed bitwise at N = 2 and N = 3.
"""

import hashlib
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
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


BIG = 11_950


def big(tmp_path, n=BIG, block_size=50, name="big", seq=128):
    """Shards of realistic shape at small size: 8 shards of 1,500 rows of 129 random tokens, in blocks of
    ``block_size`` rows (so a block is much larger than its entry in the file's footer, as at full size)."""
    tokens = np.random.default_rng(0).integers(0, 50_000, (n, seq + 1), dtype=np.int32)
    rows = pa.table({"id": pa.array(np.arange(n)), "tokens": pa.FixedSizeListArray.from_arrays(
        pa.array(tokens.reshape(-1)), seq + 1).cast(pa.list_(pa.int32()))})
    shards.write_shards(rows, tmp_path / name, seq_len=seq, tokenizer="tok", rows_per_shard=1500,
                        block_size=block_size)
    return tmp_path / name


class ContiguousSlices(shards.ShardStream):
    """A reader that covers the epoch exactly once but gives rank r the r-th contiguous slice of each step (the
    previous design): every rank reads blocks of every run."""

    def _batch(self, order, start, end):
        b = -(-(end - start) // self.world_size)
        positions = np.arange(start + self.rank * b, min(end, start + (self.rank + 1) * b))
        blocks, rows = order.locate(positions)
        out = {"id": [], "tokens": []}
        for k, r in zip(blocks.tolist(), rows.tolist()):
            ids, tokens, stored = self._block(*order.blocks[k][:2])
            out["id"].append(ids[r])
            out["tokens"].append(tokens[r])
            self.share_bytes += stored / order.blocks[k][2]
        return {"id": torch.tensor(np.array(out["id"])), "tokens": torch.tensor(np.array(out["tokens"])).long()}


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_reads_its_own_blocks_and_no_more_than_a_quarter_beyond_its_share(tmp_path, world):
    folder = big(tmp_path)
    stored = [pq.ParquetFile(folder / s["file"]).metadata for s in shards.read_index(folder)["shards"]]
    total = sum(m.row_group(g).column(c).total_compressed_size for m in stored for g in range(m.num_row_groups)
                for c in range(m.num_columns))                    # the data's stored bytes, footers left out
    for reader, bound in ((shards.ShardStream, 1.25), (ContiguousSlices, None)):
        streams = [reader(folder, 5, rank=r, world_size=world) for r in range(world)]
        ids = [i for step in zip(*streams) for b in step for i in b["id"].tolist()]
        assert shards.coverage(ids, BIG)["duplicates"] == shards.coverage(ids, BIG)["missing"] == 0
        ratios = [s.read_bytes / s.share_bytes for s in streams]
        assert abs(sum(s.share_bytes for s in streams) - total) < 0.01 * total    # the shares add up to the data
        if bound:
            assert max(ratios) <= bound, ratios
        else:
            assert min(ratios) > 1.5, ratios              # the broken reader fails the same check


def test_the_shuffle_is_as_good_as_the_block_or_the_buffer(tmp_path):
    """Stated in the docstring: without a buffer, consecutive samples of a run come from one block; a buffer of
    four blocks mixes each window of a block's length across blocks. Both keep the epoch exactly once."""
    folder = big(tmp_path, n=2400, block_size=10)
    def blocks_per_window(buffer):
        stream = shards.ShardStream(folder, 10, rank=0, world_size=1, partitions=1, shuffle_buffer=buffer)
        ids = np.concatenate([b["id"].numpy() for b in stream])
        assert shards.coverage(ids, 2400)["missing"] == 0 and len(ids) == 2400
        windows = ids.reshape(-1, 10) // 10                 # each window's rows -> the block each came from
        return np.mean([len(set(w)) for w in windows])
    assert blocks_per_window(0) == 1.0
    assert blocks_per_window(40) > 3.0


@pytest.mark.parametrize("buffer", [0, 32])
def test_a_resume_on_another_n_reads_every_sample_once_with_or_without_a_buffer(tmp_path, buffer):
    folder = big(tmp_path)
    streams = [shards.ShardStream(folder, 6, rank=r, world_size=2, shuffle_buffer=buffer) for r in range(2)]
    first = [i for _, step in zip(range(50), zip(*streams)) for b in step for i in b["id"].tolist()]
    state = streams[0].state_dict()
    assert state["samples_seen"] == 600
    rest, _ = read_epoch(folder, 3, 4, state, shuffle_buffer=buffer)
    uninterrupted, _ = read_epoch(folder, 1, 12, shuffle_buffer=buffer)
    assert sorted(sum(rest[0], [])) == sorted(uninterrupted[50][0])        # the same next global step
    c = shards.coverage(first + [i for step in rest for rank in step for i in rank], BIG)
    assert c["duplicates"] == c["missing"] == 0


def test_the_next_batches_are_read_while_the_step_runs_and_errors_reach_the_loop(tmp_path):
    folder = big(tmp_path)
    stream = shards.ShardStream(folder, 8, rank=0, world_size=1, prefetch=2)
    batches = iter(stream)
    next(batches)
    deadline = time.monotonic() + 10
    while stream.read_until < stream.samples_seen + 16 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stream.read_until >= stream.samples_seen + 16        # two batches ahead, while "the step" runs
    for _ in range(2):
        next(batches)
    batches.close()                                             # a loop that breaks: the thread stops
    assert stream.samples_seen == 24
    again = [b["id"].tolist() for b in stream]                  # continues from what the loop consumed
    whole = [b["id"].tolist() for b in shards.ShardStream(folder, 8, rank=0, world_size=1, prefetch=0)]
    assert again == whole[3:]
    inline = shards.ShardStream(folder, 8, rank=0, world_size=1, prefetch=0)
    next(iter(inline))
    assert inline.read_until == inline.samples_seen == 8        # prefetch=0 reads in the step
    broken = shards.ShardStream(folder, 8, rank=0, world_size=1)
    for f in folder.glob("data-*/shard-*.parquet"):
        f.unlink()
    with pytest.raises(OSError):
        for _ in broken:
            pass


def test_stream_states_of_another_layout_or_order_are_refused_with_the_fix(tmp_path):
    folder = big(tmp_path)
    state = shards.ShardStream(folder, 4, rank=0, world_size=2).state_dict()
    other = big(tmp_path, block_size=70, name="other")
    assert shards.read_index(other)["data"] == shards.read_index(folder)["data"]    # the same rows...
    with pytest.raises(shards.ShardMismatch, match="another block layout.*blocks of 50 rows.*blocks of 70.*"
                                                   "Fix: .*block_size=50"):
        shards.ShardStream(other, 4, rank=0, world_size=2).load_state_dict(state)   # ...in other blocks
    with pytest.raises(shards.ShardMismatch, match="partitions: saved 24, now 12.*Fix"):
        shards.ShardStream(folder, 4, rank=0, world_size=2, partitions=12).load_state_dict(state)
    with pytest.raises(shards.ShardMismatch, match="shuffle_buffer: saved 0, now 64"):
        shards.ShardStream(folder, 4, rank=0, world_size=2, shuffle_buffer=64).load_state_dict(state)
    with pytest.raises(ValueError, match=r"partitions=24 is not a multiple of world_size=5.*Fix.*= 120"):
        shards.ShardStream(folder, 4, rank=0, world_size=5)


def test_the_index_holds_each_shards_rows_blocks_and_a_hash_of_its_rows(tmp_path):
    folder = big(tmp_path)
    index = shards.read_index(folder)
    assert [s["rows"] for s in index["shards"]] == [1500] * 7 + [1450]
    for s in index["shards"]:
        back = pq.read_table(folder / s["file"])                     # read back independently of the writer
        meta = pq.ParquetFile(folder / s["file"]).metadata
        assert s["blocks"] == [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        assert max(s["blocks"]) == 50 and s["bytes"] == (folder / s["file"]).stat().st_size
        tokens = np.stack(back.column("tokens").to_numpy(zero_copy_only=False)).astype(np.int32)
        assert s["sha"] == hashlib.sha256(hashlib.sha256(back.column("id").to_numpy().tobytes()).digest()
                                          + hashlib.sha256(tokens.tobytes()).digest()).hexdigest()
    assert not list(folder.rglob("*.partial"))


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


@pytest.fixture(scope="module")
def spark():
    """One local Spark for the file's two Spark tests (a session costs 8 s and 9 core-s to start)."""
    from dtlab import spark as dtspark

    session = dtspark.session(cores=2)
    yield session
    dtspark.stop(session)


def dataframe(spark, rows):
    from dtlab import delta

    return delta.dataframe(spark, rows)


@pytest.mark.slow
def test_executors_write_the_shards_and_the_driver_collects_one_line_each(spark, tmp_path):
    rows = table(500)
    index = shards.write_shards_from_dataframe(dataframe(spark, rows), tmp_path / "s", seq_len=SEQ, tokenizer="tok",
                                               shards=3, block_size=16)
    written = sorted(str(p.relative_to(tmp_path / "s")) for p in (tmp_path / "s").rglob("*.parquet"))
    assert written == [s["file"] for s in index["shards"]]             # the files the finished tasks wrote
    ids = [pq.read_table(tmp_path / "s" / s["file"]).column("id").to_pylist() for s in index["shards"]]
    assert sum(ids, []) == list(range(500))                            # range-split, each sorted
    assert [s["rows"] for s in index["shards"]] == [len(i) for i in ids]
    # The executors' hashes equal this process's over the same rows in one shard.
    one = shards.write_shards_from_dataframe(dataframe(spark, rows), tmp_path / "one", seq_len=SEQ, tokenizer="tok",
                                             shards=1, block_size=16)
    here = shards.write_shards(rows, tmp_path / "here", seq_len=SEQ, tokenizer="tok", rows_per_shard=10**6,
                               block_size=16)
    assert (one["data"], one["layout"]) == (here["data"], here["layout"])


@pytest.mark.slow
def test_an_interrupted_write_leaves_no_index_and_the_reader_says_so(spark, tmp_path):
    import threading

    folder = tmp_path / "s"
    shards.write_shards_from_dataframe(dataframe(spark, table(100)), folder, seq_len=SEQ, tokenizer="tok", shards=2)
    assert (folder / "index.json").is_file()
    wide = big(tmp_path, n=24_000, block_size=500, name="source")              # 12 MB to write in 6 shards
    df = spark.read.parquet(str(next(wide.glob("data-*"))))
    failed = []

    def write():
        try:
            shards.write_shards_from_dataframe(df, folder, seq_len=128, tokenizer="tok", shards=6, block_size=500)
        except Exception as err:                                           # the cancelled job
            failed.append(err)

    before = set(folder.glob("data-*/shard-*.parquet"))
    writer = threading.Thread(target=write)
    writer.start()
    deadline = time.monotonic() + 120
    while not set(folder.glob("data-*/shard-*.parquet")) - before and time.monotonic() < deadline:
        time.sleep(0.02)
    spark.sparkContext.cancelAllJobs()                                     # the job dies half-way
    writer.join()
    assert failed and list(folder.glob("data-*/shard-*.parquet"))           # some shards were written...
    assert not (folder / "index.json").exists()                            # ...but no index
    with pytest.raises(FileNotFoundError, match="a write that did not finish.*Fix"):
        shards.ShardStream(folder, 4, rank=0, world_size=1)
    with pytest.raises(shards.ShardMismatch, match=r"rows hold \[9\] tokens.*seq_len \+ 1 = 5"):
        shards.write_shards_from_dataframe(dataframe(spark, table(100)), folder, seq_len=4, tokenizer="tok")
    assert not (folder / "index.json").exists()
    again = shards.write_shards_from_dataframe(dataframe(spark, table(100)), folder, seq_len=SEQ, tokenizer="tok",
                                               shards=2)
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*.parquet")) == [s["file"] for s in
                                                                                      again["shards"]]
