"""Training data from a table: shards in a folder, streamed to every rank, resumable at any number of ranks.

A real training set does not fit in each process's memory and does not come as a ``TensorDataset``: it is a
table (on Databricks a Delta table in Unity Catalog) that is written once as *shards*, files of a few
thousand samples each in a folder (on Databricks a Unity Catalog volume, ``/Volumes/<catalog>/<schema>/<volume>``),
and every rank of the job reads only the shards that hold its samples. This module is that path:

* ``write_shards(table, folder, ...)`` — rows (a pyarrow ``Table``, or a Spark DataFrame through
  ``write_shards_from_dataframe``) as Parquet shards plus ``index.json``: the columns, the sequence length,
  the tokenizer's fingerprint, each shard's rows, and a fingerprint of the data. The index is the last file
  written, so a folder without one is an unfinished write (also on a volume, where a rename is not atomic).
* ``ShardStream(folder, batch_size, ...)`` — one rank's batches. The order of an epoch is a function of the
  seed and the epoch alone (shards shuffled, then the rows inside each shard), *not* of the number of ranks:
  each global step takes the next ``world_size x batch_size`` samples of that order and gives rank r its
  slice. So the ranks' batches are disjoint and cover the epoch exactly once, and the stream's position is one
  number, the samples the whole job has consumed in the epoch: a run resumed on 3 ranks from a state saved on 2
  continues with the same next sample, and still sees every sample exactly once.
* ``coverage(ids, num_samples)`` — counts what an epoch's ids cover: duplicates and missing samples.

Refusals happen before training, each naming the fix: shards written with another tokenizer or sequence length
than the run expects (``ShardMismatch``), a stream state from another data set, a table without the columns the
reader needs.

Mosaic Streaming (``streaming.StreamingDataset``) is what Databricks documents for this on its ML runtimes;
notebook 21 shows it beside this reader where it is installed (why this module exists too: its README).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

INDEX = "index.json"
FORMAT = "dtlab-shards/1"


class ShardMismatch(ValueError):
    """The shards are not what the run expects (another tokenizer, sequence length or data set); the message names
    the fix."""


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


def _arrow_schema(table: Any) -> dict[str, str]:
    return {f.name: str(f.type) for f in table.schema}


def write_shards(table: Any, folder: str | os.PathLike, *, seq_len: int, tokenizer: str, rows_per_shard: int = 1024,
                 id_column: str = "id", tokens_column: str = "tokens") -> dict[str, Any]:
    """Write a pyarrow ``table`` (an id column and a token-list column of ``seq_len + 1`` tokens per row) as
    Parquet shards of ``rows_per_shard`` rows into ``folder``, then ``index.json``; return the index.

    ``tokenizer`` is the tokenizer's fingerprint (``fingerprint(tokenizer.to_str())``): a reader that expects
    another one refuses the shards. Rows are written in ``id`` order, so the same table gives the same shards.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    check_columns(_arrow_schema(table), {id_column: "integer", tokens_column: "integer list"})
    if rows_per_shard < 1:
        raise ValueError(f"rows_per_shard={rows_per_shard}: at least 1 row per shard. Fix: e.g. 1024")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / INDEX).unlink(missing_ok=True)           # from here until the index is written, the folder is unfinished
    table = table.select([id_column, tokens_column]).sort_by(id_column)
    tokens = table.column(tokens_column).combine_chunks()
    lengths = np.unique(np.diff(np.asarray(tokens.offsets)))
    if lengths.size and (lengths.size > 1 or lengths[0] != seq_len + 1):
        raise ShardMismatch(f"rows hold {sorted(set(lengths.tolist()))} tokens, the run expects seq_len + 1 = "
                            f"{seq_len + 1} (inputs and the next-token targets). Fix: tokenize with seq_len={seq_len}, "
                            "or pass the table's seq_len")
    table = pa.table({"id": table.column(id_column).cast(pa.int64()),
                      "tokens": tokens.cast(pa.list_(pa.int32()))})
    for old in folder.glob("shard-*.parquet"):
        old.unlink()
    files = []
    for i, start in enumerate(range(0, table.num_rows, rows_per_shard)):
        name = f"shard-{i:05d}.parquet"
        pq.write_table(table.slice(start, rows_per_shard), folder / name)
        files.append(name)
    return _write_index(folder, files, seq_len, tokenizer)


def write_shards_from_dataframe(df: Any, folder: str | os.PathLike, *, seq_len: int, tokenizer: str,
                                shards: int = 4, id_column: str = "id",
                                tokens_column: str = "tokens") -> dict[str, Any]:
    """The same shards from a Spark DataFrame, written by Spark's executors (nothing passes through the driver):
    ``shards`` files, rows range-partitioned and sorted by ``id_column``, then ``index.json`` written last.

    ``folder`` is a local path here, a ``/Volumes/<catalog>/<schema>/<volume>/...`` path on Databricks
    (``spark_path``).
    """
    import pyarrow.parquet as pq
    from pyspark.sql import functions as F

    schema = {f.name: f.dataType.simpleString() for f in df.schema.fields}
    check_columns(schema, {id_column: "integer", tokens_column: "integer list"})
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / INDEX).unlink(missing_ok=True)
    data = folder / "data"
    (df.select(F.col(id_column).cast("long").alias("id"), F.col(tokens_column).cast("array<int>").alias("tokens"))
       .repartitionByRange(shards, "id").sortWithinPartitions("id")
       .write.mode("overwrite").parquet(spark_path(data)))
    files = sorted(str(p.relative_to(folder)) for p in data.glob("part-*.parquet"))
    lengths = set()
    for name in files:                                   # every row must hold seq_len + 1 tokens
        column = pq.read_table(folder / name, columns=["tokens"]).column("tokens").combine_chunks()
        lengths |= set(np.unique(np.diff(np.asarray(column.offsets))).tolist())
    if lengths and lengths != {seq_len + 1}:
        raise ShardMismatch(f"rows hold {sorted(lengths)} tokens, the run expects seq_len + 1 = {seq_len + 1}. "
                            f"Fix: tokenize with seq_len={seq_len}, or pass the table's seq_len")
    return _write_index(folder, files, seq_len, tokenizer)


def spark_path(path: Path) -> str:
    """``path`` as Spark must be told it so that this process sees the same files: a ``/Volumes/...`` path as it is
    (Databricks maps it to the volume), any other folder as a ``file://`` URI (on Databricks a bare path would mean
    DBFS, which this process does not see as files). A ``file://`` folder must be on storage every node shares:
    on a cluster of several nodes, use a volume."""
    text = str(path)
    return text if text.startswith("/Volumes/") else Path(path).resolve().as_uri()


def _write_index(folder: Path, files: list[str], seq_len: int, tokenizer: str) -> dict[str, Any]:
    import pyarrow.parquet as pq

    shards, digest = [], []
    for name in files:
        rows = pq.ParquetFile(folder / name).metadata.num_rows
        if rows == 0:
            continue
        shards.append({"file": name, "rows": rows})
        digest.append((folder / name).read_bytes())
    index = {"format": FORMAT, "columns": {"id": "int64", "tokens": "list<int32>"}, "seq_len": seq_len,
             "tokenizer": tokenizer, "num_samples": sum(s["rows"] for s in shards), "shards": shards,
             "data": fingerprint(seq_len, tokenizer, *digest)}
    # Written last, in place: a folder without it is an unfinished write (no rename needed, so a volume works too).
    (folder / INDEX).write_text(json.dumps(index, indent=1))
    return index


def read_index(folder: str | os.PathLike) -> dict[str, Any]:
    """The shards' ``index.json``; a ``FileNotFoundError`` naming the fix when the folder holds no finished shards."""
    path = Path(folder) / INDEX
    if not path.is_file():
        raise FileNotFoundError(f"no shards in {folder}: {INDEX} is missing (nothing written there, or a write "
                                "that did not finish). Fix: write them with "
                                "dtlab.shards.write_shards_from_dataframe(df, folder, ...), or point the reader at "
                                "the folder that has them")
    index = json.loads(path.read_text())
    if index.get("format") != FORMAT:
        raise ShardMismatch(f"{path} is not a dtlab shard index (format {index.get('format')!r}). Fix: rewrite the "
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


def epoch_order(index: dict[str, Any], epoch: int, seed: int, shuffle: bool = True) -> list[tuple[int, np.ndarray]]:
    """The epoch's order as ``[(shard number, its rows in reading order), ...]``: shards shuffled by (seed, epoch),
    then the rows inside each shard. It does not depend on the number of ranks."""
    counts = [s["rows"] for s in index["shards"]]
    if not shuffle:
        return [(i, np.arange(n)) for i, n in enumerate(counts)]
    rng = np.random.default_rng([seed, epoch])
    return [(int(i), rng.permutation(counts[i])) for i in rng.permutation(len(counts))]


def rank_slice(start: int, end: int, rank: int, world_size: int, batch_size: int) -> tuple[int, int]:
    """Positions ``[a, b)`` of the global step that starts at ``start`` (the epoch ends at ``end``) that ``rank``
    reads: ``batch_size`` each while a whole step remains; the epoch's last, shorter step split as evenly as
    possible (sizes differ by at most one; a rank gets none only when fewer samples than ranks remain)."""
    left = end - start
    if left >= world_size * batch_size:
        return start + rank * batch_size, start + (rank + 1) * batch_size
    return start + rank * left // world_size, start + (rank + 1) * left // world_size


class ShardStream:
    """This rank's batches from the shards in ``folder``: disjoint from every other rank's, exactly once per epoch,
    resumable from ``state_dict()`` on any number of ranks.

    Each pass over it is one epoch (or the rest of one, after ``load_state_dict``); the epoch advances by itself.
    A batch is ``{"id": (b,), "tokens": (b, seq_len + 1)}`` int64 tensors; ``b`` is ``batch_size`` except in the
    epoch's last step. Only the shards holding this rank's samples are read, one at a time.

    Args:
        folder: where ``write_shards`` wrote (a ``/Volumes/...`` path on Databricks).
        batch_size: samples per rank per step.
        rank, world_size: default to the running process group (or 0 and 1).
        seed, shuffle: the epoch order (``epoch_order``).
        seq_len, tokenizer: what this run expects; shards of another are refused (``ShardMismatch``).

    >>> stream = ShardStream("shards", batch_size=8, seq_len=64, tokenizer=tok_id)      # doctest: +SKIP
    >>> for batch in stream: ...                                                        # doctest: +SKIP
    """

    #: ``dtlab.checkpoint.restore`` may hand it a state saved at another world size: the position reshards.
    reshards = True

    def __init__(self, folder: str | os.PathLike, batch_size: int, *, rank: int | None = None,
                 world_size: int | None = None, seed: int = 0, shuffle: bool = True, seq_len: int | None = None,
                 tokenizer: str | None = None):
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
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.num_samples = self.index["num_samples"]
        self.epoch, self.samples_seen = 0, 0            # the position: samples the whole job consumed in the epoch
        self._cache: tuple[int, dict[str, np.ndarray]] | None = None

    def __len__(self) -> int:
        """Steps in a whole epoch."""
        return -(-self.num_samples // (self.world_size * self.batch_size))

    def _shard(self, number: int, rows: np.ndarray) -> dict[str, np.ndarray]:
        """Shard ``number``'s rows in reading order (kept until the next shard is needed)."""
        if self._cache is None or self._cache[0] != number:
            import pyarrow.parquet as pq

            table = pq.read_table(self.folder / self.index["shards"][number]["file"])
            tokens = table.column("tokens").combine_chunks()
            flat = np.asarray(tokens.flatten()).reshape(len(tokens), -1)
            ids = table.column("id").to_numpy()
            self._cache = (number, {"id": ids[rows], "tokens": flat[rows]})
        return self._cache[1]

    def _read(self, order: list[tuple[int, np.ndarray]], starts: np.ndarray, a: int, b: int) -> dict[str, torch.Tensor]:
        """Positions ``[a, b)`` of the epoch's order."""
        ids, tokens = [], []
        pos = a
        while pos < b:
            k = int(np.searchsorted(starts, pos, side="right") - 1)
            number, rows = order[k]
            lo, hi = pos - starts[k], min(b, starts[k] + len(rows)) - starts[k]
            shard = self._shard(number, rows)
            ids.append(shard["id"][lo:hi])
            tokens.append(shard["tokens"][lo:hi])
            pos = starts[k] + hi
        seq = self.index["seq_len"] + 1
        return {"id": torch.from_numpy(np.concatenate(ids) if ids else np.zeros(0, np.int64)).long(),
                "tokens": torch.from_numpy(np.concatenate(tokens) if tokens else np.zeros((0, seq), np.int32)).long()}

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        epoch = self.epoch
        order = epoch_order(self.index, epoch, self.seed, self.shuffle)
        starts = np.cumsum([0] + [len(rows) for _, rows in order])
        step = self.world_size * self.batch_size
        while self.epoch == epoch and self.samples_seen < self.num_samples:
            start = self.samples_seen
            a, b = rank_slice(start, self.num_samples, self.rank, self.world_size, self.batch_size)
            batch = self._read(order, starts, a, b)
            self.samples_seen = min(self.num_samples, start + step)   # counted when handed out: a step on it follows
            yield batch
        if self.epoch == epoch:
            self.epoch, self.samples_seen = epoch + 1, 0
            self._cache = None

    def state_dict(self) -> dict[str, Any]:
        """The position (``epoch``, ``samples_seen`` by the whole job) and what must match to resume from it."""
        return {"epoch": self.epoch, "samples_seen": self.samples_seen, "world_size": self.world_size,
                "batch_size": self.batch_size, "seed": self.seed, "shuffle": self.shuffle,
                "num_samples": self.num_samples, "data": self.index["data"]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next batch starts at its ``samples_seen``, on any number of ranks.

        Raises ``ShardMismatch`` when the state belongs to other shards (another data set, a rewritten table) or to
        another epoch order (seed, shuffle): "the same position" would not exist.
        """
        if state.get("data") != self.index["data"]:
            raise ShardMismatch(f"this stream state belongs to another data set (shards {state.get('data')}, these are "
                                f"{self.index['data']}): resuming would skip or repeat samples. Fix: resume from the "
                                "shards the run was trained on, or start the data afresh (no loader state)")
        changed = [f"{k}: saved {state[k]}, now {getattr(self, k)}" for k in ("seed", "shuffle") if state[k] !=
                   getattr(self, k)]
        if changed:
            raise ShardMismatch(f"cannot resume the data position ({'; '.join(changed)}): the epoch's order depends on "
                                "them. Fix: resume with the saved seed and shuffle")
        self.epoch, self.samples_seen = int(state["epoch"]), int(state["samples_seen"])
        self._cache = None


def coverage(ids: Any, num_samples: int) -> dict[str, int]:
    """What the sample ids read in one epoch cover: ``{"seen", "distinct", "duplicates", "missing"}``.

    ``ids`` is every id read (all ranks, in any order); an epoch read exactly once has ``duplicates == missing ==
    0`` and ``distinct == num_samples``.
    """
    ids = torch.as_tensor(ids).flatten().long()
    distinct = int(torch.unique(ids).numel())
    return {"seen": int(ids.numel()), "distinct": distinct, "duplicates": int(ids.numel()) - distinct,
            "missing": num_samples - distinct}
