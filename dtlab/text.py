"""Real text with no download: a corpus shipped with Python, a tokenizer trained on it, and training rows.

* ``corpus()`` — the Python Language Reference's help topics ("The assert statement", "Boolean operations",
  ... 79 documents, about 65,000 words of English), which every CPython ships as ``pydoc_data.topics`` (what
  ``help("assert")`` prints). A real, edited corpus, the same on every machine with the same Python.
* ``train_tokenizer(texts, vocab_size)`` — a byte-level BPE tokenizer (Hugging Face ``tokenizers``, the library
  behind every "fast" tokenizer in ``transformers``) learnt from those texts in about a second: nothing to
  download, and its fingerprint (``tokenizer_id``) travels with the shards so a run refuses shards another
  tokenizer wrote.
* ``token_rows(texts, tokenizer, seq_len)`` — the texts as one stream of tokens (an end-of-text token between
  documents) cut into rows of ``seq_len + 1`` tokens: a model reads the first ``seq_len`` and predicts the last
  ``seq_len`` (each the next token). Returned as a pyarrow table ``(id, tokens)``, ready for a DataFrame.
* ``token_table(df, tokenizer, seq_len)`` — the same rows from a Spark DataFrame of raw text, tokenized and
  packed by Spark's executors (``mapInArrow``): the driver holds the tokenizer and one count per partition.
* ``as_transformers(tokenizer)`` — a ``tokenizers.Tokenizer`` as the ``PreTrainedTokenizerFast`` that
  ``AutoTokenizer.from_pretrained`` returns, to save beside a model with ``save_pretrained``.

Wherever a tokenizer is taken, either kind works: a raw ``tokenizers.Tokenizer`` or what ``AutoTokenizer``
returns (a ``transformers`` fast tokenizer).
"""

from __future__ import annotations

from typing import Any

EOS = "<|endoftext|>"


def corpus(max_documents: int | None = None) -> list[str]:
    """The Python Language Reference's help topics (``pydoc_data.topics``), sorted by topic name."""
    from pydoc_data.topics import topics

    texts = [topics[name].strip() for name in sorted(topics)]
    return texts[:max_documents] if max_documents else texts


def train_tokenizer(texts: list[str], vocab_size: int = 512) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` with ``vocab_size`` tokens (``EOS`` among them) learnt from ``texts``.

    Byte-level: any text can be encoded, nothing maps to "unknown". Training is deterministic for the same texts
    and library version.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257 + 1:
        raise ValueError(f"vocab_size={vocab_size}: a byte-level BPE needs the 256 bytes and {EOS}. Fix: at least 258")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def as_transformers(tokenizer: Any) -> Any:
    """``tokenizer`` (a ``tokenizers.Tokenizer``) as a ``transformers.PreTrainedTokenizerFast`` with ``EOS`` as its
    end-of-sequence token: what ``AutoTokenizer.from_pretrained`` gives back after ``save_pretrained``. A
    ``transformers`` tokenizer is returned as it is."""
    if hasattr(tokenizer, "save_pretrained"):
        return tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=_backend(tokenizer), eos_token=EOS)


def _backend(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` inside ``tokenizer`` (itself, or a ``transformers`` fast tokenizer's)."""
    if hasattr(tokenizer, "to_str"):
        return tokenizer
    if getattr(tokenizer, "backend_tokenizer", None) is not None:
        return tokenizer.backend_tokenizer
    raise TypeError(f"{type(tokenizer).__name__} is not a fast tokenizer (no tokenizers.Tokenizer inside). Fix: "
                    "AutoTokenizer.from_pretrained(folder, use_fast=True), or a tokenizers.Tokenizer")


def eos_id(tokenizer: Any) -> int:
    """The id that ends a document: the tokenizer's ``eos_token_id`` (``transformers``), else ``EOS``'s id."""
    found = getattr(tokenizer, "eos_token_id", None)
    if found is None:
        found = _backend(tokenizer).token_to_id(EOS)
    if found is None:
        raise ValueError(f"the tokenizer has no end-of-sequence token (no eos_token, no {EOS!r}). Fix: give it one, "
                         f"e.g. tokenizer.add_special_tokens({{'eos_token': {EOS!r}}})")
    return int(found)


def tokenizer_id(tokenizer: Any) -> str:
    """A fingerprint of the tokenizer (its vocabulary, merges and settings): equal ids mean the same tokens.

    A raw ``tokenizers.Tokenizer`` and the ``transformers`` tokenizer wrapping it (``as_transformers``, or
    ``AutoTokenizer`` after ``save_pretrained``) have the same fingerprint when they end documents alike.
    """
    import json

    from dtlab.shards import fingerprint

    state = json.loads(_backend(tokenizer).to_str())
    for how_called in ("truncation", "padding", "post_processor"):    # how a caller cuts, pads or frames its input
        state.pop(how_called, None)       # (dtlab encodes without special tokens), not what the ids mean
    return fingerprint(state, eos_id(tokenizer))


def _encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Each text's token ids, without special tokens added (the documents are joined by ``eos_id`` instead)."""
    return [e.ids for e in _backend(tokenizer).encode_batch(texts, add_special_tokens=False)]


def token_rows(texts: list[str], tokenizer: Any, seq_len: int, max_rows: int | None = None,
               multiple_of: int = 1) -> Any:
    """The texts as rows of ``seq_len + 1`` tokens: a pyarrow table with ``id`` (0, 1, ...) and ``tokens``.

    The tokens of all texts, an ``EOS`` after each, are cut into consecutive rows; the incomplete tail is
    dropped. ``max_rows`` keeps the first rows only; ``multiple_of`` trims the count to a multiple (a global
    batch, so every step of an epoch is whole).
    """
    import numpy as np
    import pyarrow as pa

    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len}: at least 1 token per sequence. Fix: e.g. 64")
    width = seq_len + 1
    rows = pack(_encode(tokenizer, texts), eos_id(tokenizer), width)
    n = min(len(rows), max_rows) if max_rows else len(rows)
    n -= n % multiple_of
    if n < 1:
        raise ValueError(f"{len(rows)} rows of {width} tokens leave none after max_rows/multiple_of. Fix: more text, "
                         "a shorter seq_len or a smaller multiple_of")
    rows = rows[:n]
    return pa.table({"id": pa.array(np.arange(n, dtype=np.int64)),
                     "tokens": pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)), width)
                     .cast(pa.list_(pa.int32()))})


def pack(token_lists: list[list[int]], eos: int, width: int) -> Any:
    """Token lists joined, ``eos`` after each, cut into rows of ``width`` (the incomplete tail dropped): an int32
    array of shape ``(rows, width)``."""
    import numpy as np

    stream = np.fromiter((t for ids in token_lists for t in (*ids, eos)), dtype=np.int32)
    n = len(stream) // width
    return stream[: n * width].reshape(n, width)


def token_table(df: Any, tokenizer: Any, seq_len: int, text_column: str = "text") -> Any:
    """A Spark DataFrame of raw text (one document per row in ``text_column``) as training rows ``(id, tokens)`` of
    ``seq_len + 1`` tokens, tokenized and packed on Spark's executors.

    Each partition's documents are encoded, joined with the end-of-sequence token and cut into rows
    (``mapInArrow``): a partition's incomplete tail is dropped, so a few tokens per partition go unused. The ids are
    0, 1, ... in partition order (each partition's row count is the only thing the driver collects). The result is
    checkpointed on the executors (``localCheckpoint``), so counting and numbering read the text once.
    """
    import pyarrow as pa
    from pyspark.sql import functions as F

    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len}: at least 1 token per sequence. Fix: e.g. 64")
    fields = {f.name: f.dataType.simpleString() for f in df.schema.fields}
    if fields.get(text_column) != "string":
        raise ValueError(f"no text column {text_column!r} of strings (the table has {fields}). Fix: pass "
                         "text_column= naming the column that holds each document's text")
    spec, eos, width = _backend(tokenizer).to_str(), eos_id(tokenizer), seq_len + 1

    def rows_of(batches):                          # runs on an executor, once per partition
        from pyspark import TaskContext
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(spec)
        texts = [t for batch in batches for t in batch.column(0).to_pylist() if t]
        rows = pack(_encode(backend, texts), eos, width)
        part = TaskContext.get().partitionId()
        yield pa.RecordBatch.from_pydict({
            "part": pa.array([part] * len(rows), pa.int32()), "pos": pa.array(range(len(rows)), pa.int64()),
            "tokens": pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)), width).cast(pa.list_(pa.int32()))})

    packed = (df.select(text_column).mapInArrow(rows_of, "part int, pos long, tokens array<int>")
              .localCheckpoint())
    counts = sorted((r["part"], r["count"]) for r in packed.groupBy("part").count().collect())
    offsets, start = [], 0
    for part, count in counts:
        offsets.append((part, start))
        start += count
    if start == 0:
        raise ValueError(f"the text makes no row of {width} tokens. Fix: more text, or a shorter seq_len")
    starts = df.sparkSession.createDataFrame(offsets, "part int, start long")
    return (packed.join(F.broadcast(starts), "part")
            .select((F.col("start") + F.col("pos")).alias("id"), "tokens"))
