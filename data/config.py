"""The data config: where documents come from, how they are tokenized, split and batched.

``DataConfig`` is a plain dataclass so that it can live in Hydra's ConfigStore (a misspelt key then
fails at composition). ``validate`` checks values before any loading or tokenizing starts, so a bad
sweep or command line fails in milliseconds with a message that names the value and the choices.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

from platform.env import REPO_ROOT  # the one definition; commands run from the repo root
SOURCES = ("embedded", "files", "hub", "shards")
FILE_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
# A byte-level BPE needs its 256 byte tokens and <|endoftext|>; below 259 there is not even room for
# two merges, which is never what anyone meant.
MIN_VOCAB_SIZE = 259


@dataclass
class DataConfig:
    # Where documents come from: "embedded" (the shipped English corpus, offline), "files" (a local
    # glob), "hub" (a Hugging Face dataset, streamed), "shards" (a folder written by data.export).
    source: str = "embedded"
    # files: a glob, `**` allowed; .txt = one document per file, .jsonl/.json/.parquet = one per
    # row's `text_field`. shards: the export folder. Relative paths are resolved against the repo root.
    path: str | None = None
    hub_name: str | None = None  # e.g. "wikitext"; hub only
    hub_config: str | None = None  # the dataset's configuration name, e.g. "wikitext-103-raw-v1"
    hub_split: str = "train"  # the split streamed from the Hub; our own train/val split comes after
    hub_revision: str | None = None  # a commit or tag: pins the Hub data, so the cache key means something
    text_field: str = "text"  # the column holding a document's text (files with rows, hub)
    max_docs: int | None = None  # keep the first N documents; required for hub (streams can be endless)
    vocab_size: int = 4096  # BPE vocabulary incl. the 256 bytes and <|endoftext|>; shards bring their own
    val_fraction: float = 0.02  # share of documents held out for validation (whole documents)
    split_seed: int = 0  # seeds the document hash that decides train or validation
    batch_size: int = 16  # windows per step on each device
    num_workers: int = 0  # DataLoader workers; windows are array slices, so 0 is usually fastest
    # Size of the fixed validation set in windows (an evenly spread subset of the held-out text);
    # None: every window. trainer.val_batches is how many batches of it one validation runs.
    val_windows: int | None = None
    cache_dir: str = "data/cache"  # tokenizers, token arrays, datasets' cache; relative to the repo root


def as_data_config(cfg: DataConfig | Mapping) -> DataConfig:
    """A ``DataConfig`` from itself, a dict or an OmegaConf ``DictConfig`` (which is a Mapping)."""
    if isinstance(cfg, DataConfig):
        return cfg
    known = {f.name for f in fields(DataConfig)}
    unknown = sorted(set(cfg) - known)
    if "val_batches" in unknown:
        raise ValueError("data.val_batches was renamed to data.val_windows (the size of the fixed validation "
                         "set, in windows); trainer.val_batches (batches per validation) is unchanged")
    if unknown:
        raise ValueError(f"unknown data config key(s) {unknown}; valid keys: {sorted(known)}")
    return DataConfig(**{key: cfg[key] for key in cfg})


def resolve_path(path: str) -> Path:
    """A config path as an absolute path: relative ones are taken from the repo root, not the cwd."""
    expanded = Path(path).expanduser()
    return expanded if expanded.is_absolute() else REPO_ROOT / expanded


def _bad(key: str, value, why: str, valid: str) -> ValueError:
    """The one-line form every bad input takes: `data.<key>=<value>: <why>; valid: <...>`."""
    return ValueError(f"data.{key}={value!r}: {why}; valid: {valid}")


def validate(cfg: DataConfig | Mapping) -> DataConfig:
    """Check every value that can be checked without touching data; return the config as a dataclass.

    Raises ``ValueError`` naming the offending field, its value, why, and what would be valid.
    """
    cfg = as_data_config(cfg)
    if cfg.source not in SOURCES:
        raise _bad("source", cfg.source, "not a known source", ", ".join(SOURCES))
    if cfg.source in ("files", "shards") and not cfg.path:
        what = "a glob of " + "/".join(FILE_SUFFIXES) + " files" if cfg.source == "files" else (
            "the folder written by `python -m data.export`")
        raise _bad("path", cfg.path, f"data.source={cfg.source!r} needs data.path", what)
    if cfg.source == "hub":
        if not cfg.hub_name:
            raise _bad("hub_name", cfg.hub_name, "data.source='hub' needs a dataset name", "e.g. 'wikitext'")
        if cfg.max_docs is None:
            raise _bad("max_docs", None, "data.source='hub' streams its documents, so how many to take "
                       "must be given", "an integer >= 1")
    if not cfg.text_field:
        raise _bad("text_field", cfg.text_field, "must name a column", "a column name, e.g. 'text'")
    if cfg.max_docs is not None and cfg.max_docs < 1:
        raise _bad("max_docs", cfg.max_docs, "must be positive", "None (all) or an integer >= 1")
    if cfg.vocab_size < MIN_VOCAB_SIZE:
        raise _bad("vocab_size", cfg.vocab_size, "is too small: a byte-level BPE needs 256 bytes + "
                   "<|endoftext|> + merges", f">= {MIN_VOCAB_SIZE}")
    if not 0.0 < cfg.val_fraction < 1.0:
        raise _bad("val_fraction", cfg.val_fraction, "a share of the documents", "the open interval (0, 1)")
    if cfg.batch_size < 1:
        raise _bad("batch_size", cfg.batch_size, "must be positive", "an integer >= 1")
    if cfg.num_workers < 0:
        raise _bad("num_workers", cfg.num_workers, "must not be negative", "an integer >= 0")
    if cfg.val_windows is not None and cfg.val_windows < 1:
        raise _bad("val_windows", cfg.val_windows, "must be positive", "None (all) or an integer >= 1")
    if not cfg.cache_dir:
        raise _bad("cache_dir", cfg.cache_dir, "must be a folder", "a path, e.g. 'data/cache'")
    return cfg
