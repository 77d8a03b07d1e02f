"""Training data from a table: shards in a folder, each rank reading its own share, resumable at any number of ranks.

A real training set does not fit in each process's memory and does not come as a ``TensorDataset``: it is a
table (on Databricks a Delta table in Unity Catalog) that is written once as *shards*, Parquet files in a folder
(on Databricks a Unity Catalog volume, ``/Volumes/<catalog>/<schema>/<volume>``), and every rank of the job reads
its own part of them. This module is that path:

* ``write_shards_from_dataframe(df, folder, ...)`` — Spark's executors write the shards: each task sorts its
  range of ``id``, checks every row's length, writes its shard in *blocks* (Parquet row groups of ``block_size``
  rows) and hashes what it wrote; the driver collects one line per shard (file, rows, blocks, bytes, hash) and
  writes ``index.json`` from those lines, last. The driver's memory does not grow with the table.
  ``write_shards(table, folder, ...)`` does the same from a pyarrow ``Table`` in this process (small tables).
* ``ShardStream(folder, batch_size, ...)`` — one rank's batches. An epoch's order depends on the seed and the
  epoch alone, never on the number of ranks (``EpochOrder``): the blocks are shuffled, the rows inside each block
  too, and that sequence is cut into ``partitions`` runs of whole blocks that take turns (sample 0 from run 0,
  sample 1 from run 1, ...). Each global step takes the next ``world_size x batch_size`` samples of that order,
  and rank r takes those of the runs r, r + N, r + 2N, ... So a rank reads only its own runs' blocks (a block
  where two runs meet is read by both), the ranks' batches are disjoint and cover the epoch exactly once, and the
  position is one number, the samples the whole job has consumed: a run resumed on 3 ranks from a state saved on
  2 continues with the same next samples. ``partitions`` must be a multiple of every world size the run uses
  (Mosaic Streaming's ``num_canonical_nodes`` is the same idea). A background thread reads the next batches
  while the current step runs (``prefetch``).
* The shuffle's quality, stated: a global batch takes its samples from up to ``partitions`` runs, i.e. different
  blocks of randomly chosen shards; inside one run consecutive samples come from the same block of
  ``block_size`` rows of the table, so rows that sit together in the table (one source, one day) reach the
  model in runs of up to ``block_size`` samples. ``shuffle_buffer=S`` shuffles every S consecutive samples of
  each run (S / ``block_size`` blocks from random shards) at the cost of holding them in memory.
* ``coverage(ids, num_samples)`` — counts what an epoch's ids cover: duplicates and missing samples.

Refusals happen before training, each naming the fix: shards written with another tokenizer or sequence length
than the run expects (``ShardMismatch``), a stream state from another data set or another block layout, a folder
whose write did not finish (no ``index.json``), a table without the columns the reader needs.

Mosaic Streaming (``streaming.StreamingDataset``) is what Databricks documents for this on its ML runtimes;
notebook 21 runs it beside this reader where it is installed and says when to use which.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

INDEX = "index.json"
FORMAT = "dtlab-shards/2"
PARTITIONS = 24      #: runs an epoch is cut into: a multiple of 1, 2, 3, 4, 6, 8, 12 and 24 ranks
BLOCK_SIZE = 1024    #: rows per block (Parquet row group): the unit a rank reads


class ShardMismatch(ValueError):
    """The shards are not what the run expects (another tokenizer, sequence length, data set or block layout); the
    message names the fix."""


def fingerprint(*parts: Any) -> str:
    """A short, stable hash of ``parts`` (strings, bytes, numbers, or JSON-able values)."""
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, (bytes, bytearray)):
            h.update(part)
        elif isinstance(part, str):
            h.update(part.encode())
        else:
            h.update(json.dumps(part, sort_keys=True).encode())
        h.update(b"\x00")
    return h.hexdigest()[:16]


def check_columns(schema: dict[str, str], needed: dict[str, str]) -> None:
    """Raise ``ValueError`` naming the first column of ``needed`` (name -> kind) missing from ``schema`` or of another
    kind. Kinds are ``"integer"`` or ``"integer list"``."""
    for name, kind in needed.items():
        if name not in schema:
            raise ValueError(f"the table has no column {name!r} (it has {', '.join(schema) or 'none'}). Fix: write the "
                             f"table with a column {name!r} of {kind}s, or pass columns= naming yours")
        have = schema[name]
        ok = "int" in have and (("list" in have or "array" in have) == (kind == "integer list"))
        if not ok:
            raise ValueError(f"column {name!r} holds {have}, not {kind}s. Fix: cast it (tokens as an array of "
                             "integers, ids as integers) before writing the shards")


# ---------------------------------------------------------------------------------------------------------------
# Writing: one shard per task, in blocks, hashed as it is written; the index from the tasks' lines, last.
# ---------------------------------------------------------------------------------------------------------------

def write_shard(batches: Iterable[Any], path: str | os.PathLike, *, width: int, block_size: int) -> dict[str, Any]:
    """Write record batches (columns ``id`` int64 and ``tokens`` list<int32>, in id order) to the Parquet file
    ``path`` in row groups of ``block_size`` rows; return its line of the index: ``{"rows", "blocks", "bytes",
    "sha", "lengths"}``.

    Memory: one block and one incoming batch. Every row must hold ``width`` tokens: rows of other lengths stop the
    write (nothing is left at ``path``) and their lengths come back in ``"lengths"``. The hash is of the rows
    themselves (``content_hash``), so the same rows give the same hash whatever writes them, however they arrive
    and whatever the block size. The file appears under its name
    only when complete (written beside it, then renamed).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    schema = pa.schema([("id", pa.int64()), ("tokens", pa.list_(pa.int32()))])
    sha_ids, sha_tokens, blocks, pending, writer = hashlib.sha256(), hashlib.sha256(), [], [], None
    held = 0

    def flush(table):                              # one block: hashed, then written as one row group
        nonlocal writer
        sha_ids.update(np.ascontiguousarray(table.column("id").to_numpy()).tobytes())
        sha_tokens.update(np.asarray(table.column("tokens").combine_chunks().flatten()).tobytes())
        if writer is None:
            writer = pq.ParquetWriter(partial, schema)
        writer.write_table(table, row_group_size=len(table))
        blocks.append(len(table))

    try:
        for batch in batches:
            table = pa.Table.from_batches([batch]) if isinstance(batch, pa.RecordBatch) else batch
            if table.num_rows == 0:
                continue
            tokens = table.column("tokens").combine_chunks()
            lengths = np.unique(np.diff(np.asarray(tokens.offsets)))
            if lengths.size > 1 or lengths[0] != width:
                if writer is not None:
                    writer.close()
                    writer = None
                partial.unlink(missing_ok=True)
                return {"rows": 0, "blocks": [], "bytes": 0, "sha": "", "lengths": sorted(lengths.tolist())[:10]}
            ids = table.column("id").combine_chunks().cast(pa.int64())
            pending.append(pa.table({"id": ids, "tokens": tokens.cast(pa.list_(pa.int32()))}, schema=schema))
            held += table.num_rows
            while held >= block_size:
                joined = pa.concat_tables(pending)
                flush(joined.slice(0, block_size))
                rest = joined.slice(block_size)
                pending, held = ([rest] if rest.num_rows else []), rest.num_rows
        if held:
            flush(pa.concat_tables(pending))
    finally:
        if writer is not None:
            writer.close()
    if not blocks:
        return {"rows": 0, "blocks": [], "bytes": 0, "sha": "", "lengths": []}
    os.replace(partial, path)
    return {"rows": sum(blocks), "blocks": blocks, "bytes": path.stat().st_size,
            "sha": content_hash(sha_ids, sha_tokens), "lengths": []}


def content_hash(ids: Any, tokens: Any) -> str:
    """The shard's hash: SHA-256 of the SHA-256 of its ids (int64, in order) and of its tokens (int32, row after
    row). ``ids`` and ``tokens`` are arrays, or running ``hashlib.sha256`` objects fed them."""
    def digest(part, dtype):
        if hasattr(part, "digest"):
            return part.digest()
        return hashlib.sha256(np.ascontiguousarray(np.asarray(part, dtype=dtype)).tobytes()).digest()
    return hashlib.sha256(digest(ids, np.int64) + digest(tokens, np.int32)).hexdigest()


def _begin(folder: Path) -> str:
    """Start a write: the old index goes first (from here on the folder reads as unfinished), then the old data;
    returns the new data's subfolder name."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / INDEX).unlink(missing_ok=True)
    for old in [*folder.glob("data-*"), folder / "data", *folder.glob("shard-*.parquet")]:
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        elif old.exists():
            old.unlink()
    return f"data-{uuid.uuid4().hex[:8]}"


def _finish(folder: Path, lines: list[dict[str, Any]], seq_len: int, tokenizer: str,
            block_size: int) -> dict[str, Any]:
    """Check the shards' lines and write ``index.json`` from them, last."""
    bad = sorted({n for line in lines for n in line["lengths"]})
    if bad:
        raise ShardMismatch(f"rows hold {bad} tokens, the run expects seq_len + 1 = {seq_len + 1} (inputs and the "
                            f"next-token targets). Fix: tokenize with seq_len={seq_len}, or pass the table's seq_len")
    shards = [{k: line[k] for k in ("file", "rows", "blocks", "bytes", "sha")} for line in lines if line["rows"]]
    index = {"format": FORMAT, "columns": {"id": "int64", "tokens": "list<int32>"}, "seq_len": seq_len,
             "tokenizer": tokenizer, "block_size": block_size, "num_samples": sum(s["rows"] for s in shards),
             "bytes": sum(s["bytes"] for s in shards), "shards": shards,
             "data": fingerprint(seq_len, tokenizer, *(s["sha"] for s in shards)),
             "layout": fingerprint(*(s["blocks"] for s in shards))}
    # Written last, in place: a folder without it is an unfinished write (no rename needed, so a volume works too).
    (folder / INDEX).write_text(json.dumps(index, indent=1))
    return index


def _check_block_size(block_size: int) -> None:
    if block_size < 1:
        raise ValueError(f"block_size={block_size}: at least 1 row per block. Fix: e.g. {BLOCK_SIZE}")


def write_shards(table: Any, folder: str | os.PathLike, *, seq_len: int, tokenizer: str, rows_per_shard: int = 8192,
                 block_size: int = BLOCK_SIZE, id_column: str = "id", tokens_column: str = "tokens") -> dict[str, Any]:
    """Write a pyarrow ``table`` (an id column and a token-list column of ``seq_len + 1`` tokens per row) as
    Parquet shards of ``rows_per_shard`` rows into ``folder``, then ``index.json``; return the index. For a table
    that fits in this process; a Spark DataFrame goes through ``write_shards_from_dataframe``.

    ``tokenizer`` is the tokenizer's fingerprint (``dtlab.text.tokenizer_id``): a reader that expects another one
    refuses the shards. Rows are written in ``id`` order, so the same table gives the same shards.
    """
    import pyarrow as pa

    check_columns({f.name: str(f.type) for f in table.schema}, {id_column: "integer", tokens_column: "integer list"})
    if rows_per_shard < 1:
        raise ValueError(f"rows_per_shard={rows_per_shard}: at least 1 row per shard. Fix: e.g. 8192")
    _check_block_size(block_size)
    folder = Path(folder)
    data = _begin(folder)
    (folder / data).mkdir()
    table = table.select([id_column, tokens_column]).sort_by(id_column)
    table = pa.table({"id": table.column(id_column).cast(pa.int64()),
                      "tokens": table.column(tokens_column).cast(pa.list_(pa.int32()))})
    lines = []
    for i, start in enumerate(range(0, table.num_rows, rows_per_shard)):
        name = f"{data}/shard-{i:05d}.parquet"
        part = table.slice(start, rows_per_shard)
        lines.append({"file": name, **write_shard(part.to_batches(), folder / name, width=seq_len + 1,
                                                  block_size=block_size)})
    return _finish(folder, lines, seq_len, tokenizer, block_size)


def write_shards_from_dataframe(df: Any, folder: str | os.PathLike, *, seq_len: int, tokenizer: str,
                                shards: int = 4, block_size: int = BLOCK_SIZE, id_column: str = "id",
                                tokens_column: str = "tokens") -> dict[str, Any]:
    """The same shards from a Spark DataFrame, written by Spark's executors: ``shards`` files, rows range-split and
    sorted by ``id_column``, each checked, written in blocks and hashed by the task that holds it
    (``write_shard``). The driver collects one short line per shard and writes ``index.json`` last, so its memory
    does not depend on the table's size, and the index lists exactly the files the finished tasks wrote.

    ``folder`` must be storage every executor writes to and every rank reads: a ``/Volumes/<catalog>/<schema>/
    <volume>/...`` path on Databricks (a local folder works on one machine). Choose ``shards`` so that each holds
    tens to hundreds of MB (rows x (seq_len + 1) x 4 bytes), and at least a few per rank.
    """
    import pyarrow as pa
    from pyspark.sql import functions as F

    check_columns({f.name: f.dataType.simpleString() for f in df.schema.fields},
                  {id_column: "integer", tokens_column: "integer list"})
    if shards < 1:
        raise ValueError(f"shards={shards}: at least 1. Fix: e.g. 4 per rank")
    _check_block_size(block_size)
    folder = Path(folder).absolute()
    data = _begin(folder)
    (folder / data).mkdir()
    root, width = str(folder), seq_len + 1
    line = pa.schema([("part", pa.int32()), ("file", pa.string()), ("rows", pa.int64()),
                      ("blocks", pa.list_(pa.int64())), ("bytes", pa.int64()), ("sha", pa.string()),
                      ("lengths", pa.list_(pa.int64()))])

    def write_task(batches):                       # runs on an executor, once per shard
        from pyspark import TaskContext

        from dtlab.shards import write_shard

        name = f"{data}/shard-{TaskContext.get().partitionId():05d}.parquet"
        out = write_shard(batches, Path(root) / name, width=width, block_size=block_size)
        yield pa.RecordBatch.from_pylist([{"part": TaskContext.get().partitionId(), "file": name, **out}],
                                         schema=line)

    columns = [F.col(id_column).cast("long").alias("id"), F.col(tokens_column).cast("array<int>").alias("tokens")]
    rows = (df.select(*columns).repartitionByRange(shards, "id").sortWithinPartitions("id")
            .mapInArrow(write_task, "part int, file string, rows long, blocks array<long>, bytes long, sha string, "
                                    "lengths array<long>")
            .collect())
    lines = [r.asDict() for r in sorted(rows, key=lambda r: r["part"])]
    return _finish(folder, lines, seq_len, tokenizer, block_size)


def read_index(folder: str | os.PathLike) -> dict[str, Any]:
    """The shards' ``index.json``; a ``FileNotFoundError`` naming the fix when the folder holds no finished shards."""
    path = Path(folder) / INDEX
    if not path.is_file():
        raise FileNotFoundError(f"no shards in {folder}: {INDEX} is missing (nothing written there, or a write "
                                "that did not finish: the index is the last file a write makes). Fix: write them "
                                "with dtlab.shards.write_shards_from_dataframe(df, folder, ...), or point the reader "
                                "at the folder that has them")
    index = json.loads(path.read_text())
    if index.get("format") != FORMAT:
        raise ShardMismatch(f"{path} is not a {FORMAT} index (format {index.get('format')!r}). Fix: rewrite the "
                            "shards with this dtlab")
    return index


def check_shards(index: dict[str, Any], *, seq_len: int | None = None, tokenizer: str | None = None) -> None:
    """Refuse shards whose sequence length or tokenizer is not the run's (``ShardMismatch``, naming the fix)."""
    if seq_len is not None and index["seq_len"] != seq_len:
        raise ShardMismatch(f"the shards hold sequences of {index['seq_len']} tokens; this run trains on {seq_len}. "
                            f"Fix: rewrite the shards with seq_len={seq_len}, or train with seq_len={index['seq_len']}")
    if tokenizer is not None and index["tokenizer"] != tokenizer:
        raise ShardMismatch(f"the shards were tokenized by tokenizer {index['tokenizer']}, this run's is {tokenizer}: "
                            "the same ids would mean other words. Fix: rewrite the shards with this tokenizer, or load "
                            "the tokenizer the shards were written with")


# ---------------------------------------------------------------------------------------------------------------
# Reading: an epoch's order, the same at any N, and one rank's share of it.
# ---------------------------------------------------------------------------------------------------------------

class EpochOrder:
    """The order of one epoch, a function of (index, epoch, seed) and the layout choices alone, never of N.

    The blocks (``(shard, row group)``) are shuffled, the rows inside each block too; that sequence is cut into
    ``partitions`` runs of consecutive samples (sizes differ by at most one), and the epoch takes one sample from
    each run in turn: position p is run ``p % partitions``'s sample ``p // partitions``. With ``shuffle_buffer=S``
    each run's samples are also shuffled within every window of S. ``locate(positions)`` gives each position's
    ``(block number, row in the block)``.
    """

    def __init__(self, index: dict[str, Any], epoch: int, seed: int, *, shuffle: bool = True,
                 partitions: int = PARTITIONS, shuffle_buffer: int = 0):
        self.epoch, self.seed, self.shuffle, self.buffer = epoch, seed, shuffle, shuffle_buffer
        blocks = [(i, j, n) for i, s in enumerate(index["shards"]) for j, n in enumerate(s["blocks"])]
        order = np.random.default_rng([seed, epoch]).permutation(len(blocks)) if shuffle else range(len(blocks))
        self.blocks = [blocks[k] for k in order]                     # (shard, row group, rows) in reading order
        self.starts = np.cumsum([0] + [n for *_, n in self.blocks])
        self.num_samples = int(self.starts[-1])
        self.partitions = partitions
        self.full, self.extra = divmod(self.num_samples, partitions)  # every run has `full` samples, `extra` one more
        c = np.arange(partitions)
        self.run_start = c * self.full + np.minimum(c, self.extra)
        self._perms: OrderedDict[tuple, np.ndarray] = OrderedDict()

    def _perm(self, key: tuple, n: int) -> np.ndarray:
        perm = self._perms.get(key)
        if perm is None:
            perm = np.random.default_rng([self.seed, self.epoch, *key]).permutation(n)
            self._perms[key] = perm
            if len(self._perms) > 4 * self.partitions + 64:
                self._perms.popitem(last=False)
        return perm

    def runs(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each position's run and its place in the run."""
        p = np.asarray(positions, dtype=np.int64)
        whole = p < self.full * self.partitions
        run = np.where(whole, p % self.partitions, p - self.full * self.partitions)
        place = np.where(whole, p // self.partitions, self.full)
        return run, place

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each position's block (its number in ``self.blocks``) and row inside that block."""
        run, place = self.runs(positions)
        if self.buffer > 1:                          # shuffle each window of `buffer` samples of a run
            window = place // self.buffer
            for r, w in set(zip(run.tolist(), window.tolist())):
                at = (run == r) & (window == w)
                lo = w * self.buffer
                n = min(self.buffer, int(self.full + (r < self.extra)) - lo)
                place[at] = lo + self._perm((2, r, w), n)[place[at] - lo]
        g = self.run_start[run] + place
        block = np.searchsorted(self.starts, g, side="right") - 1
        row = g - self.starts[block]
        if self.shuffle:
            for k in set(block.tolist()):
                at = block == k
                row[at] = self._perm((1, k), self.blocks[k][2])[row[at]]
        return block, row


def share(start: int, end: int, rank: int, world_size: int) -> np.ndarray:
    """The positions ``[start, end)`` of a global step that ``rank`` takes: those of the runs rank, rank + N, ...
    (every N-th position, since N divides the number of runs)."""
    return np.arange(start + (rank - start) % world_size, end, world_size)


class ShardStream:
    """This rank's batches from the shards in ``folder``: disjoint from every other rank's, exactly once per epoch,
    resumable from ``state_dict()`` on any number of ranks that divides ``partitions``.

    Each pass over it is one epoch (or the rest of one, after ``load_state_dict``); the epoch advances by itself.
    A batch is ``{"id": (b,), "tokens": (b, seq_len + 1)}`` int64 tensors; ``b`` is ``batch_size`` except in the
    epoch's last step. The rank reads only the blocks of its own runs (``EpochOrder``), each once, and a
    background thread reads ``prefetch`` batches ahead of the step.

    Args:
        folder: where the shards were written (a ``/Volumes/...`` path on Databricks).
        batch_size: samples per rank per step.
        rank, world_size: default to the running process group (or 0 and 1).
        seed, shuffle: the epoch's order.
        partitions: runs the epoch is cut into; a multiple of every world size the run will use.
        shuffle_buffer: shuffle every this many consecutive samples of a run (0: blocks and rows only).
        seq_len, tokenizer: what this run expects; shards of another are refused (``ShardMismatch``).
        prefetch: batches read ahead in a background thread (0: read in the step).

    After (or during) a pass, ``read_bytes`` is what this rank read from storage and ``share_bytes`` the stored
    size of the samples it was handed; ``waited`` is the seconds the training loop waited for a batch;
    ``read_until`` is the position up to which batches are read, ahead of ``samples_seen``.

    >>> stream = ShardStream("shards", batch_size=8, seq_len=64, tokenizer=tok_id)      # doctest: +SKIP
    >>> for batch in stream: ...                                                        # doctest: +SKIP
    """

    #: ``dtlab.checkpoint.restore`` may hand it a state saved at another world size: the position reshards.
    reshards = True

    def __init__(self, folder: str | os.PathLike, batch_size: int, *, rank: int | None = None,
                 world_size: int | None = None, seed: int = 0, shuffle: bool = True, partitions: int = PARTITIONS,
                 shuffle_buffer: int = 0, seq_len: int | None = None, tokenizer: str | None = None,
                 prefetch: int = 2):
        from dtlab import distributed

        self.folder = Path(folder)
        self.index = read_index(folder)
        check_shards(self.index, seq_len=seq_len, tokenizer=tokenizer)
        self.rank = distributed.rank() if rank is None else rank
        self.world_size = distributed.world_size() if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank} is outside world_size={self.world_size}")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1 (samples per rank per step)")
        if partitions < 1 or partitions % self.world_size:
            raise ValueError(f"partitions={partitions} is not a multiple of world_size={self.world_size}: each rank "
                             "reads whole runs of the epoch. Fix: partitions= a multiple of every world size the run "
                             f"will use (e.g. math.lcm({partitions}, {self.world_size}) = "
                             f"{np.lcm(max(partitions, 1), self.world_size)}), the same at every resume")
        if shuffle_buffer < 0:
            raise ValueError(f"shuffle_buffer={shuffle_buffer}: 0 (off) or the samples to shuffle together")
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.partitions, self.shuffle_buffer, self.prefetch = partitions, shuffle_buffer, prefetch
        self.num_samples = self.index["num_samples"]
        self.epoch, self.samples_seen = 0, 0            # the position: samples the whole job consumed in the epoch
        self.read_bytes, self.share_bytes, self.waited = 0, 0.0, 0.0
        self.read_until = 0                             # the position up to which batches are read (ahead of the loop)
        self._order: EpochOrder | None = None
        self._blocks: OrderedDict[tuple[int, int], tuple[np.ndarray, np.ndarray, int]] = OrderedDict()
        self._files: OrderedDict[int, Any] = OrderedDict()
        self._footers: dict[int, Any] = {}

    def __len__(self) -> int:
        """Steps in a whole epoch."""
        return -(-self.num_samples // (self.world_size * self.batch_size))

    def _epoch_order(self) -> EpochOrder:
        if self._order is None or self._order.epoch != self.epoch:
            self._order = EpochOrder(self.index, self.epoch, self.seed, shuffle=self.shuffle,
                                     partitions=self.partitions, shuffle_buffer=self.shuffle_buffer)
            self._blocks.clear()
        return self._order

    def _block(self, shard: int, group: int) -> tuple[np.ndarray, np.ndarray, int]:
        """One block's ids and tokens (kept while this rank's runs may still need it) and its stored bytes."""
        key = (shard, group)
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return self._blocks[key]
        import pyarrow.parquet as pq

        if shard not in self._files:                       # open files: one per run this rank reads, and a few
            path = self.folder / self.index["shards"][shard]["file"]
            footer = self._footers.get(shard)              # each file's footer is read once
            self._files[shard] = pq.ParquetFile(path, metadata=footer)
            if footer is None:
                self._footers[shard] = self._files[shard].metadata
                self.read_bytes += self._footers[shard].serialized_size
            if len(self._files) > self.partitions // self.world_size + 4:
                self._files.popitem(last=False)[1].close()
        self._files.move_to_end(shard)
        file = self._files[shard]
        table = file.read_row_group(group)
        meta = file.metadata.row_group(group)
        stored = sum(meta.column(c).total_compressed_size for c in range(meta.num_columns))
        tokens = table.column("tokens").combine_chunks()
        block = (table.column("id").to_numpy(), np.asarray(tokens.flatten()).reshape(len(tokens), -1), stored)
        self.read_bytes += stored
        self._blocks[key] = block
        keep = (self.partitions // self.world_size) * (2 + self.shuffle_buffer // max(1, self.index["block_size"]))
        while len(self._blocks) > keep + 2:
            self._blocks.popitem(last=False)
        return block

    def _batch(self, order: EpochOrder, start: int, end: int) -> dict[str, torch.Tensor]:
        """This rank's samples of the global step at positions ``[start, end)``."""
        positions = share(start, end, self.rank, self.world_size)
        blocks, rows = order.locate(positions)
        ids = np.zeros(len(positions), np.int64)
        tokens = np.zeros((len(positions), self.index["seq_len"] + 1), np.int32)
        for k in dict.fromkeys(blocks.tolist()):          # in the order first needed
            at = blocks == k
            shard, group, n = order.blocks[k]
            block_ids, block_tokens, stored = self._block(shard, group)
            ids[at], tokens[at] = block_ids[rows[at]], block_tokens[rows[at]]
            self.share_bytes += stored * int(at.sum()) / n
        return {"id": torch.from_numpy(ids), "tokens": torch.from_numpy(tokens).long()}

    def _steps(self, order: EpochOrder, start: int, stop: threading.Event | None = None):
        step = self.world_size * self.batch_size
        while start < self.num_samples and not (stop is not None and stop.is_set()):
            end = min(self.num_samples, start + step)
            batch = self._batch(order, start, end)
            self.read_until = end
            yield end, batch
            start = end

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        epoch = self.epoch
        order = self._epoch_order()
        if self.prefetch < 1:
            source: Iterator = self._steps(order, self.samples_seen)
            stop = thread = None
        else:
            ready: queue.Queue = queue.Queue(maxsize=self.prefetch)
            stop = threading.Event()

            def read_ahead():
                try:
                    for item in self._steps(order, self.samples_seen, stop):
                        while not stop.is_set():
                            try:
                                ready.put(item, timeout=0.1)
                                break
                            except queue.Full:
                                pass
                    ready.put(None)
                except BaseException as err:      # handed to the training loop, raised there
                    ready.put(err)

            thread = threading.Thread(target=read_ahead, name="dtlab-shards-prefetch", daemon=True)
            thread.start()

            def take():
                while True:
                    t0 = time.perf_counter()
                    item = ready.get()
                    self.waited += time.perf_counter() - t0
                    if item is None:
                        return
                    if isinstance(item, BaseException):
                        raise item
                    yield item

            source = take()
        try:
            for end, batch in source:
                self.samples_seen = end          # counted when handed out: a step on it follows
                yield batch
        finally:
            if thread is not None:
                stop.set()
                while thread.is_alive():
                    try:
                        ready.get(timeout=0.1)
                    except queue.Empty:
                        pass
                thread.join()
        if self.epoch == epoch and self.samples_seen >= self.num_samples:
            self.epoch, self.samples_seen = epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        """The position (``epoch``, ``samples_seen`` by the whole job) and what must match to resume from it."""
        return {"epoch": self.epoch, "samples_seen": self.samples_seen, "world_size": self.world_size,
                "batch_size": self.batch_size, "seed": self.seed, "shuffle": self.shuffle,
                "partitions": self.partitions, "shuffle_buffer": self.shuffle_buffer,
                "num_samples": self.num_samples, "data": self.index["data"], "layout": self.index["layout"],
                "block_size": self.index["block_size"]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next batch starts at its ``samples_seen``, on any number of ranks.

        Raises ``ShardMismatch`` when the state belongs to other shards (another data set, a rewritten table), to
        another block layout (the same rows written in other blocks), or to another epoch order (seed, shuffle,
        partitions, shuffle buffer): "the same position" would not exist.
        """
        if state.get("data") != self.index["data"]:
            raise ShardMismatch(f"this stream state belongs to another data set (shards {state.get('data')}, these are "
                                f"{self.index['data']}): resuming would skip or repeat samples. Fix: resume from the "
                                "shards the run was trained on, or start the data afresh (no loader state)")
        if state.get("layout") != self.index["layout"]:
            raise ShardMismatch(
                f"this stream state was saved over another block layout of the same rows (blocks of "
                f"{state.get('block_size', 'unknown')} rows; these shards have blocks of {self.index['block_size']}): "
                "an epoch's order is made of blocks, so its position means other samples here. Fix: resume on the "
                f"shards the state was saved with (rewrite them with block_size={state.get('block_size')} and the same "
                "shards=), or start the data afresh (no loader state)")
        changed = [f"{k}: saved {state.get(k)}, now {getattr(self, k)}"
                   for k in ("seed", "shuffle", "partitions", "shuffle_buffer") if state.get(k) != getattr(self, k)]
        if changed:
            raise ShardMismatch(f"cannot resume the data position ({'; '.join(changed)}): the epoch's order depends on "
                                "them. Fix: build the stream with the saved values")
        self.epoch, self.samples_seen = int(state["epoch"]), int(state["samples_seen"])


def coverage(ids: Any, num_samples: int) -> dict[str, int]:
    """What the sample ids read in one epoch cover: ``{"seen", "distinct", "duplicates", "missing"}``.

    ``ids`` is every id read (all ranks, in any order); an epoch read exactly once has ``duplicates == missing ==
    0`` and ``distinct == num_samples``.
    """
    ids = torch.as_tensor(ids).flatten().long()
    distinct = int(torch.unique(ids).numel())
    return {"seen": int(ids.numel()), "distinct": distinct, "duplicates": int(ids.numel()) - distinct,
            "missing": num_samples - distinct}
