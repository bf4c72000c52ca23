"""Byte-level BPE tokenizer (Hugging Face ``tokenizers``), trained on the training documents only.

Byte-level means the base alphabet is the 256 bytes, so any Unicode text encodes without unknown
tokens and decodes back exactly (no normalizer, no prefix space, no clean-up on decode).
``<|endoftext|>`` is the single special token (id 0); packing appends it after every document.
A literal "<|endoftext|>" inside a document is encoded as ordinary text (``encode_special_tokens``),
so document boundaries only ever come from packing.

``tokenizers`` is imported inside the functions: a machine that only loads exported shards and
never trains may lack it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from data.fileio import write_atomic

if TYPE_CHECKING:
    from tokenizers import Tokenizer

EOT = "<|endoftext|>"
# Bump when training settings change in a way that changes the tokenizer; it is part of cache keys.
TOKENIZER_VERSION = 1


def train_tokenizer(texts: Iterable[str], vocab_size: int, *, length: int | None = None) -> Tokenizer:
    """Train a byte-level BPE with ``vocab_size`` entries (fewer if the texts run out of merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],  # first, so its id is 0
        # All 256 bytes from the start: text the training set never showed still encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=sys.stderr.isatty(),
    )
    tokenizer.train_from_iterator(texts, trainer, length=length)
    tokenizer.encode_special_tokens = True
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, path: str | Path) -> None:
    """Write atomically, so a concurrent reader never sees half a file."""
    write_atomic(path, tokenizer.save)


def load_tokenizer(path: str | Path) -> Tokenizer:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    # Not stored in tokenizer.json, so it is set again on every load.
    tokenizer.encode_special_tokens = True
    return tokenizer


def load_or_train_tokenizer(
    path: str | Path, texts: Iterable[str], vocab_size: int, *, length: int | None = None
) -> Tokenizer:
    """The tokenizer at ``path`` if present (a cache hit costs ~10 ms), else train it and save it there.

    ``path`` must already encode what the tokenizer depends on (see ``pipeline.cache_key``).
    """
    path = Path(path)
    if path.is_file():
        return load_tokenizer(path)
    tokenizer = train_tokenizer(texts, vocab_size, length=length)
    save_tokenizer(tokenizer, path)
    return tokenizer


def eot_id(tokenizer: Tokenizer) -> int:
    token_id = tokenizer.token_to_id(EOT)
    if token_id is None:
        raise ValueError(f"the tokenizer has no {EOT} token; it was not made by data.tokenizer")
    return token_id


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype for ids: uint16 halves the arrays for vocabularies below 65536."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def encode(tokenizer: Tokenizer, text: str) -> np.ndarray:
    """Token ids of one text (no special token added), as a uint32 array."""
    return np.asarray(tokenizer.encode(text).ids, dtype=np.uint32)


def decode(tokenizer: Tokenizer, ids: Iterable[int] | np.ndarray) -> str:
    """Text of ``ids``; special tokens are kept, so ``decode(encode(t)) == t`` exactly."""
    return tokenizer.decode(np.asarray(ids).tolist(), skip_special_tokens=False)
