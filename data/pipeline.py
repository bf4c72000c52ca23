"""From a ``DataConfig`` to a ``PreparedCorpus``: load, split, train the tokenizer, pack, cache.

The cache entry ``<cache_dir>/<key>/`` (layout in ``data/store.py``) is keyed by a hash of
everything its content depends on: the source's identity (file contents, or the Hub name and
revision), ``max_docs``, the split (``val_fraction``, ``split_seed``), ``vocab_size`` and the code
versions of the tokenizer and of packing. The tokenizer depends on the split because it is trained
on the training documents only. A second run with the same config finds the entry and memory-maps
it (tens of milliseconds); a changed file or setting gets a new entry and leaves the old one alone.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path

import numpy as np

from data.config import DataConfig, resolve_path, validate
from data.corpus import load_documents, source_identity, validation_mask
from data.packing import pack_documents
from data.store import TOKENIZER_FILE, PreparedCorpus, is_complete, load_prepared, save_prepared
from data.tokenizer import TOKENIZER_VERSION, eot_id, load_or_train_tokenizer

# Bump when packing or the split changes what ends up in the arrays; it is part of the cache key.
PACKING_VERSION = 1


def cache_key(cfg: DataConfig, identity: dict) -> str:
    payload = {
        "identity": identity,
        "val_fraction": cfg.val_fraction,
        "split_seed": cfg.split_seed,
        "vocab_size": cfg.vocab_size,
        "tokenizer_version": TOKENIZER_VERSION,
        "packing_version": PACKING_VERSION,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def cache_folder(cfg: DataConfig | Mapping) -> Path:
    """The cache entry a config maps to (it may not exist yet)."""
    cfg = validate(cfg)
    return resolve_path(cfg.cache_dir) / cache_key(cfg, source_identity(cfg))


def prepare_corpus(cfg: DataConfig | Mapping) -> PreparedCorpus:
    """The tokenizer and packed train/validation streams for ``cfg``, from the cache when possible.

    ``source="shards"`` reads the exported folder as it is (its own tokenizer and vocabulary;
    ``vocab_size``, the split settings and ``max_docs`` of ``cfg`` do not apply).
    """
    cfg = validate(cfg)
    if cfg.source == "shards":
        return load_prepared(resolve_path(cfg.path), verify=True)

    identity = source_identity(cfg)
    key = cache_key(cfg, identity)
    folder = resolve_path(cfg.cache_dir) / key
    if is_complete(folder):
        return load_prepared(folder)

    docs = load_documents(cfg)
    texts = list(docs["text"])
    is_val = validation_mask(texts, cfg.val_fraction, cfg.split_seed)
    # A document's id is its index in the loaded corpus: distinct across both splits.
    train_ids, val_ids = np.flatnonzero(~is_val), np.flatnonzero(is_val)
    train_texts = [texts[i] for i in train_ids]
    tokenizer = load_or_train_tokenizer(folder / TOKENIZER_FILE, train_texts, cfg.vocab_size,
                                        length=len(train_texts))
    prepared = PreparedCorpus(
        tokenizer=tokenizer,
        vocab_size=tokenizer.get_vocab_size(),
        eot_id=eot_id(tokenizer),
        train=pack_documents(tokenizer, train_texts, train_ids, desc="tokenizing train"),
        val=pack_documents(tokenizer, [texts[i] for i in val_ids], val_ids, desc="tokenizing val"),
    )
    titles = list(docs["title"])
    # Which documents were held out, for people reading the manifest (capped to keep it small).
    save_prepared(prepared, folder, key=key, identity=identity, config=asdict(cfg),
                  val_titles=[titles[i] for i in val_ids[:1000]])
    return prepared
