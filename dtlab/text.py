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


def tokenizer_id(tokenizer: Any) -> str:
    """A fingerprint of the tokenizer (its vocabulary, merges and settings): equal ids mean the same tokens."""
    from dtlab.shards import fingerprint

    return fingerprint(tokenizer.to_str())


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
    eos = tokenizer.token_to_id(EOS)
    stream = []
    for encoding in tokenizer.encode_batch(texts):
        stream.extend(encoding.ids)
        stream.append(eos)
    width = seq_len + 1
    n = len(stream) // width
    if max_rows:
        n = min(n, max_rows)
    n -= n % multiple_of
    if n < 1:
        raise ValueError(f"{len(stream)} tokens make no row of {width} (after max_rows/multiple_of). Fix: more text, "
                         "a shorter seq_len or a smaller multiple_of")
    rows = np.asarray(stream[: n * width], dtype=np.int32).reshape(n, width)
    return pa.table({"id": pa.array(np.arange(n, dtype=np.int64)),
                     "tokens": pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)), width)
                     .cast(pa.list_(pa.int32()))})
