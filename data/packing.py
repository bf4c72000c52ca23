"""Pack tokenized documents into one stream with per-token document ids, and cut it into windows.

Stream layout: ``doc_0 <|endoftext|> doc_1 <|endoftext|> ...``. Every token carries the id of the
document it belongs to, and a document's closing ``<|endoftext|>`` belongs to that document, so
``doc_ids`` changes exactly after each ``<|endoftext|>``. The model uses ``doc_ids`` to keep
attention (and any residual mixing over positions) inside one document.

Windows hold ``seq_len + 1`` tokens (inputs ``[:-1]``, targets ``[1:]``) and start every ``seq_len``
tokens, so consecutive windows share one token and every token of the stream but the first is a
target exactly once. The last, incomplete window is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import Dataset

from data.tokenizer import eot_id, token_dtype

if TYPE_CHECKING:
    from tokenizers import Tokenizer


@dataclass
class TokenStream:
    tokens: np.ndarray  # (N,) uint16 or uint32 token ids
    doc_ids: np.ndarray  # (N,) int32, the document (index in the loaded corpus) of each token

    def __post_init__(self) -> None:
        if self.tokens.shape != self.doc_ids.shape or self.tokens.ndim != 1:
            raise ValueError(f"tokens {self.tokens.shape} and doc_ids {self.doc_ids.shape} must be "
                             "1-D arrays of the same length")

    def __len__(self) -> int:
        return len(self.tokens)


def pack_documents(
    tokenizer: Tokenizer,
    texts: Sequence[str],
    doc_ids: Sequence[int] | np.ndarray,
    *,
    batch_size: int = 256,
    desc: str = "tokenizing",
) -> TokenStream:
    """Tokenize ``texts`` (``encode_batch``, all cores) and pack them, each followed by ``<|endoftext|>``.

    ``doc_ids[i]`` is the id given to every token of ``texts[i]``; ids should be distinct.
    A progress bar appears when this takes more than two seconds (the whole embedded corpus: ~4 s).
    """
    from tqdm.auto import tqdm

    if len(texts) != len(doc_ids):
        raise ValueError(f"{len(texts)} texts but {len(doc_ids)} doc_ids")
    dtype = token_dtype(tokenizer.get_vocab_size())
    eot = np.array([eot_id(tokenizer)], dtype=dtype)
    pieces: list[np.ndarray] = []
    lengths = np.zeros(len(texts), dtype=np.int64)
    with tqdm(total=len(texts), desc=desc, unit="doc", delay=2) as bar:
        for start in range(0, len(texts), batch_size):
            batch = list(texts[start : start + batch_size])
            for i, encoding in enumerate(tokenizer.encode_batch(batch), start=start):
                pieces += [np.asarray(encoding.ids, dtype=dtype), eot]
                lengths[i] = len(encoding.ids) + 1
            bar.update(len(batch))
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)
    ids = np.repeat(np.asarray(doc_ids, dtype=np.int32), lengths)
    return TokenStream(tokens, ids)


def num_windows(num_tokens: int, seq_len: int) -> int:
    """Complete windows of ``seq_len + 1`` tokens with stride ``seq_len``."""
    return max(0, (num_tokens - 1) // seq_len)


class PackedWindows(Dataset):
    """Window ``i`` of a token stream: ``tokens[i*seq_len : i*seq_len + seq_len + 1]`` and its doc ids.

    ``windows`` optionally selects (and orders) which windows the dataset exposes.
    """

    def __init__(self, stream: TokenStream, seq_len: int, windows: np.ndarray | None = None) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len!r} must be >= 1")
        self.stream = stream
        self.seq_len = seq_len
        total = num_windows(len(stream), seq_len)
        self.windows = np.arange(total) if windows is None else np.asarray(windows, dtype=np.int64)
        if len(self.windows) and not 0 <= self.windows.min() <= self.windows.max() < total:
            raise ValueError(f"window indices must lie in [0, {total})")

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = int(self.windows[index]) * self.seq_len
        stop = start + self.seq_len + 1
        # astype copies, so the tensors never alias a read-only memory map.
        return {
            "tokens": torch.from_numpy(self.stream.tokens[start:stop].astype(np.int64)),  # (seq_len+1,)
            "doc_ids": torch.from_numpy(self.stream.doc_ids[start:stop].astype(np.int64)),  # (seq_len+1,)
        }


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy in nats of the empirical token distribution: the loss of the best context-free model."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=vocab_size)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
