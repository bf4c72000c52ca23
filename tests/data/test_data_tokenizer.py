"""Byte-level BPE: exact round trips, <|endoftext|> only from packing, the cache, train-only training."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from data import tokenizer as tok_module
from data.config import DataConfig
from data.corpus import load_documents, validation_mask
from data.pipeline import cache_folder, prepare_corpus
from data.tokenizer import EOT, decode, encode, eot_id, load_or_train_tokenizer, train_tokenizer

# Code point ranges that stress a byte-level tokenizer: ASCII with controls, Latin, combining marks,
# CJK, right-to-left scripts, emoji and other astral characters (4-byte UTF-8).
_RANGES = [(0x0, 0x7F), (0x80, 0x24F), (0x300, 0x36F), (0x590, 0x6FF), (0x4E00, 0x9FFF),
           (0xAC00, 0xD7A3), (0xE000, 0xF8FF), (0xFE00, 0xFFFD), (0x1F300, 0x1FAFF), (0x10000, 0x10FFFF)]


def _random_text(rng: random.Random) -> str:
    chars = []
    for _ in range(rng.randint(0, 80)):
        low, high = rng.choice(_RANGES)
        code = rng.randint(low, high)
        if 0xD800 <= code <= 0xDFFF:  # surrogates are not Unicode scalar values
            code = 0x20
        chars.append(chr(code))
    if rng.random() < 0.2:
        chars.insert(rng.randint(0, len(chars)), EOT)
    return "".join(chars)


@pytest.fixture(scope="module")
def small_tokenizer(small_prepared):
    return small_prepared.tokenizer


def test_random_unicode_round_trips_exactly(small_tokenizer):
    rng = random.Random(1234)
    texts = [_random_text(rng) for _ in range(300)] + ["", " ", "\r\n\t\x00", "  leading", "e\u0301", "🇫🇷👩‍💻"]
    for text in texts:
        assert decode(small_tokenizer, encode(small_tokenizer, text)) == text


def test_corpus_text_round_trips_exactly(small_cfg, small_tokenizer):
    texts = list(load_documents(small_cfg)["text"])
    for text, encoding in zip(texts, small_tokenizer.encode_batch(texts)):
        assert small_tokenizer.decode(encoding.ids, skip_special_tokens=False) == text


def test_literal_endoftext_in_text_is_not_the_separator(small_tokenizer):
    ids = encode(small_tokenizer, f"a{EOT}b")
    assert eot_id(small_tokenizer) not in ids.tolist()
    assert eot_id(small_tokenizer) == 0


def test_bpe_compresses_english(small_cfg, small_tokenizer):
    text = "\n".join(list(load_documents(small_cfg)["text"])[:20])
    assert len(text.encode()) / len(encode(small_tokenizer, text)) > 1.7  # ~1.9 at vocab 512, 3.4 at 4096


def test_cache_hit_returns_the_identical_tokenizer_fast(tmp_path: Path, monkeypatch):
    texts = ["the quick brown fox jumps over the lazy dog " * 20, "pack my box with five dozen liquor jugs"]
    path = tmp_path / "tok" / "tokenizer.json"
    first = load_or_train_tokenizer(path, texts, 300)

    def no_training(*args, **kwargs):
        raise AssertionError("the cached tokenizer should have been loaded, not trained")

    monkeypatch.setattr(tok_module, "train_tokenizer", no_training)
    start = time.perf_counter()
    second = load_or_train_tokenizer(path, texts, 300)
    assert time.perf_counter() - start < 0.5
    assert second.to_str() == first.to_str()
    sample = "the lazy fox, five jugs"
    assert second.encode(sample).ids == first.encode(sample).ids


def test_prepared_corpus_cache_hit_skips_loading(small_cfg, small_prepared, monkeypatch):
    import data.pipeline as pipeline

    def no_loading(*args, **kwargs):
        raise AssertionError("a cache hit must not load documents")

    monkeypatch.setattr(pipeline, "load_documents", no_loading)
    start = time.perf_counter()
    again = prepare_corpus(small_cfg)
    assert time.perf_counter() - start < 1.0
    assert again.tokenizer.to_str() == small_prepared.tokenizer.to_str()
    assert (again.train.tokens == small_prepared.train.tokens).all()
    assert (again.val.doc_ids == small_prepared.val.doc_ids).all()


def test_cache_key_changes_with_what_the_tokenizer_depends_on(small_cfg):
    base = cache_folder(small_cfg)
    for change in ({"vocab_size": 600}, {"val_fraction": 0.2}, {"split_seed": 1}, {"max_docs": 151}):
        assert cache_folder(DataConfig(**{**vars(small_cfg), **change})) != base
    # batch_size does not change the data, so it shares the entry.
    assert cache_folder(DataConfig(**{**vars(small_cfg), "batch_size": 64})) == base


def test_tokenizer_is_trained_on_training_documents_only(tmp_path: Path):
    # Filler documents, plus one document made of a word that appears nowhere else, placed on the
    # validation side of the split: the BPE must not have learnt that word as one token.
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma"]
    filler = [" ".join(rng.choice(words) for _ in range(60)) + f" {i}" for i in range(40)]
    rare = "zqvxj"
    candidates = [f"{rare} " * 300 + str(i) for i in range(200)]
    mask = validation_mask(filler + candidates, 0.1, 0)
    assert mask[: len(filler)].any()  # so the split never has to move a candidate to validation
    held_out = next(c for c, is_val in zip(candidates, mask[len(filler):]) if is_val)
    trained_in = next(c for c, is_val in zip(candidates, mask[len(filler):]) if not is_val)

    def build(docs: list[str], name: str):
        folder = tmp_path / name
        folder.mkdir()
        for i, doc in enumerate(docs):
            (folder / f"{i:03}.txt").write_text(doc)
        cfg = DataConfig(source="files", path=str(folder / "*.txt"), vocab_size=400, val_fraction=0.1,
                         cache_dir=str(tmp_path / "cache"))
        return prepare_corpus(cfg).tokenizer

    word = f" {rare}"  # as it occurs inside the document, after a space
    assert len(encode(build(filler + [held_out], "held-out"), word)) == len(word)
    # Control: the same kind of document on the training side does become a single token.
    assert len(encode(build(filler + [trained_in], "trained-in"), word)) == 1


def test_train_tokenizer_respects_vocab_size():
    tokenizer = train_tokenizer(["abc abd abe " * 50, "xyz xyw " * 50], 270)
    assert 257 < tokenizer.get_vocab_size() <= 270
