"""The data config: where documents come from, how they are tokenized, split and batched.

``DataConfig`` is a plain dataclass so that it can live in Hydra's ConfigStore (a misspelt key then
fails at composition). ``validate`` checks values before any loading or tokenizing starts, so a bad
sweep or command line fails in milliseconds with a message that names the value and the choices.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
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


def validate(cfg: DataConfig | Mapping) -> DataConfig:
    """Check every value that can be checked without touching data; return the config as a dataclass.

    Raises ``ValueError`` naming the offending field, its value and what would be valid.
    """
    cfg = as_data_config(cfg)
    if cfg.source not in SOURCES:
        raise ValueError(f"data.source={cfg.source!r} is not a known source; choose one of {list(SOURCES)}")
    if cfg.source in ("files", "shards") and not cfg.path:
        what = "a glob of " + "/".join(FILE_SUFFIXES) + " files" if cfg.source == "files" else (
            "the folder written by `python -m data.export`")
        raise ValueError(f"data.source={cfg.source!r} needs data.path (got {cfg.path!r}): {what}")
    if cfg.source == "hub":
        if not cfg.hub_name:
            raise ValueError(f"data.source='hub' needs data.hub_name (got {cfg.hub_name!r}), e.g. 'wikitext'")
        if cfg.max_docs is None:
            raise ValueError("data.source='hub' needs data.max_docs (got None): Hub datasets are "
                             "streamed, so the number of documents to take must be given")
    if not cfg.text_field:
        raise ValueError(f"data.text_field={cfg.text_field!r} must name a column, e.g. 'text'")
    if cfg.max_docs is not None and cfg.max_docs < 1:
        raise ValueError(f"data.max_docs={cfg.max_docs!r} must be None (all) or an integer >= 1")
    if cfg.vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"data.vocab_size={cfg.vocab_size!r} is too small: a byte-level BPE needs at "
                         f"least {MIN_VOCAB_SIZE} (256 bytes + <|endoftext|> + merges)")
    if not 0.0 < cfg.val_fraction < 1.0:
        raise ValueError(f"data.val_fraction={cfg.val_fraction!r} must be in the open interval (0, 1)")
    if cfg.batch_size < 1:
        raise ValueError(f"data.batch_size={cfg.batch_size!r} must be an integer >= 1")
    if cfg.num_workers < 0:
        raise ValueError(f"data.num_workers={cfg.num_workers!r} must be an integer >= 0")
    if cfg.val_windows is not None and cfg.val_windows < 1:
        raise ValueError(f"data.val_windows={cfg.val_windows!r} must be None (all) or an integer >= 1")
    if not cfg.cache_dir:
        raise ValueError(f"data.cache_dir={cfg.cache_dir!r} must be a folder, e.g. 'data/cache'")
    return cfg
