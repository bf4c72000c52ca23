"""Data pipeline: documents -> byte-level BPE -> packed windows with document ids -> batches.

    from data import CorpusDataModule, DataConfig
    dm = CorpusDataModule(DataConfig(), seq_len=256, seed=0, max_steps=1000)

Modules: ``config`` (DataConfig, validate), ``corpus`` (sources, split), ``tokenizer``, ``packing``,
``store`` (on-disk format), ``pipeline`` (cache), ``datamodule``, ``export`` (shards CLI),
``build_corpus`` (regenerates the shipped corpus; ``--large`` builds the large one, ``large_corpus``).

Names are imported on first use, so ``import data`` stays cheap and the command-line modules do not
pull in Lightning or ``datasets``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Public name -> the module that defines it.
_EXPORTS = {
    "DataConfig": "data.config",
    "SOURCES": "data.config",
    "validate": "data.config",
    "load_documents": "data.corpus",
    "validation_mask": "data.corpus",
    "EOT": "data.tokenizer",
    "decode": "data.tokenizer",
    "encode": "data.tokenizer",
    "load_or_train_tokenizer": "data.tokenizer",
    "load_tokenizer": "data.tokenizer",
    "save_tokenizer": "data.tokenizer",
    "train_tokenizer": "data.tokenizer",
    "PackedWindows": "data.packing",
    "TokenStream": "data.packing",
    "pack_documents": "data.packing",
    "unigram_entropy": "data.packing",
    "PreparedCorpus": "data.store",
    "load_prepared": "data.store",
    "cache_folder": "data.pipeline",
    "prepare_corpus": "data.pipeline",
    "CorpusDataModule": "data.datamodule",
    "StepSampler": "data.datamodule",
    "export_shards": "data.export",
}
__all__ = [
    "EOT", "SOURCES", "CorpusDataModule", "DataConfig", "PackedWindows", "PreparedCorpus", "StepSampler",
    "TokenStream", "cache_folder", "decode", "encode", "export_shards", "load_documents",
    "load_or_train_tokenizer", "load_prepared", "load_tokenizer", "pack_documents", "prepare_corpus",
    "save_tokenizer", "train_tokenizer", "unigram_entropy", "validate", "validation_mask",
]

if TYPE_CHECKING:  # for type checkers and editors; at run time __getattr__ imports on demand
    from data.config import SOURCES, DataConfig, validate
    from data.corpus import load_documents, validation_mask
    from data.datamodule import CorpusDataModule, StepSampler
    from data.export import export_shards
    from data.packing import PackedWindows, TokenStream, pack_documents, unigram_entropy
    from data.pipeline import cache_folder, prepare_corpus
    from data.store import PreparedCorpus, load_prepared
    from data.tokenizer import (
        EOT,
        decode,
        encode,
        load_or_train_tokenizer,
        load_tokenizer,
        save_tokenizer,
        train_tokenizer,
    )


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'data' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
