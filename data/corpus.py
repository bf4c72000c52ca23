"""Documents from each source, through Hugging Face ``datasets``, and the train/validation split.

Sources (``DataConfig.source``):
- ``embedded``: ``data/corpus/english.jsonl.gz``, shipped with the repo (Shakespeare and the King
  James Bible, see ``data/build_corpus.py``); works offline.
- ``files``: a glob of local files; ``.txt`` is one document per file, ``.jsonl``/``.json``/
  ``.parquet`` one document per row (column ``text_field``).
- ``hub``: any Hugging Face dataset, streamed (nothing is downloaded beyond the first ``max_docs``).
- ``shards``: a folder written by ``data.export``; it holds tokens, which are decoded back to text.

For the local sources the loader sets ``HF_DATASETS_OFFLINE=1`` and ``HF_HUB_OFFLINE=1`` (unless the
environment already says otherwise) before ``datasets`` is imported, so they never touch the
network. ``datasets`` reads these when it is first imported; a process that imported it earlier
keeps what it read then. Its cache goes under ``<cache_dir>/hf``, not ``~/.cache``.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from data.config import FILE_SUFFIXES, REPO_ROOT, DataConfig, resolve_path, validate
from data.fileio import file_digest

if TYPE_CHECKING:
    import datasets

EMBEDDED_CORPUS = Path(__file__).resolve().parent / "corpus" / "english.jsonl.gz"
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def hf_cache_dir(cfg: DataConfig) -> Path:
    return resolve_path(cfg.cache_dir) / "hf"


def _stay_offline() -> None:
    from platform.env import set_offline_defaults

    set_offline_defaults()


def _display_path(path: Path) -> str:
    """Paths inside the repo are named relative to it, so titles and keys do not depend on the clone."""
    try:
        return str(path.relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def matching_files(cfg: DataConfig) -> list[Path]:
    """The files of ``source="files"``, sorted; an empty match or an unknown suffix is an error."""
    pattern = str(resolve_path(cfg.path))
    files = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    if not files:
        raise ValueError(f"data.path={cfg.path!r} matches no files (looked for {pattern})")
    unknown = sorted({f.suffix for f in files} - set(FILE_SUFFIXES))
    if unknown:
        raise ValueError(f"data.path={cfg.path!r} matches files with suffix {unknown}; "
                         f"supported: {list(FILE_SUFFIXES)}")
    return files


def source_identity(cfg: DataConfig) -> dict:
    """What the loaded documents depend on, cheap to compute without loading them.

    Local sources are identified by the content of their files, so an edited file is a new corpus;
    a Hub dataset by its name, configuration, split and revision (pin ``hub_revision`` to make the
    cache key exact).
    """
    cfg = validate(cfg)
    identity: dict = {"source": cfg.source, "max_docs": cfg.max_docs}
    if cfg.source == "embedded":
        identity["digest"] = file_digest(EMBEDDED_CORPUS)
    elif cfg.source == "files":
        identity["files"] = [[_display_path(f), file_digest(f)] for f in matching_files(cfg)]
        identity["text_field"] = cfg.text_field
    elif cfg.source == "hub":
        identity.update(name=cfg.hub_name, config=cfg.hub_config, split=cfg.hub_split,
                        revision=cfg.hub_revision, text_field=cfg.text_field)
    else:
        from data.store import MANIFEST

        identity["manifest"] = file_digest(resolve_path(cfg.path) / MANIFEST)
    return identity


Rows = Iterator[tuple[str, str]]  # (text, title) in load order


def _text_of(row: Mapping, text_field: str, where: str) -> str:
    if text_field not in row:
        raise ValueError(f"data.text_field={text_field!r} is not a column of {where}; columns: {sorted(row)}")
    return row[text_field]


def _embedded_rows(cfg: DataConfig) -> Rows:
    import datasets

    ds = datasets.load_dataset("json", data_files=str(EMBEDDED_CORPUS), split="train",
                               cache_dir=str(hf_cache_dir(cfg)))
    yield from zip(ds["text"], ds["title"])


def _file_rows(cfg: DataConfig) -> Rows:
    import datasets

    for path in matching_files(cfg):
        name = _display_path(path)
        if path.suffix == ".txt":
            try:
                yield path.read_text(encoding="utf-8"), name
            except UnicodeDecodeError as e:
                raise ValueError(f"data.path={cfg.path}: {name} is not UTF-8 text (byte {e.start}); "
                                 f"valid: UTF-8 .txt, .jsonl, .json or .parquet files") from None
            continue
        # One file at a time so that every row's title can say which file it came from.
        ds = datasets.load_dataset(_BUILDERS[path.suffix], data_files=str(path), split="train",
                                   cache_dir=str(hf_cache_dir(cfg)))
        if cfg.text_field not in ds.column_names:
            raise ValueError(f"data.text_field={cfg.text_field!r} is not a column of {name}; "
                             f"columns: {ds.column_names}")
        titles = ds["title"] if "title" in ds.column_names else (f"{name}#{i}" for i in range(len(ds)))
        yield from zip(ds[cfg.text_field], titles)


def _hub_rows(cfg: DataConfig) -> Rows:
    import datasets

    stream = datasets.load_dataset(cfg.hub_name, cfg.hub_config, split=cfg.hub_split, streaming=True,
                                   revision=cfg.hub_revision, cache_dir=str(hf_cache_dir(cfg)))
    where = f"the Hub dataset {cfg.hub_name!r}"
    for i, row in enumerate(stream):
        yield _text_of(row, cfg.text_field, where), f"{cfg.hub_name}:{cfg.hub_split}#{i}"


def _shard_rows(cfg: DataConfig) -> Rows:
    from data.store import load_prepared
    from data.tokenizer import decode

    prepared = load_prepared(resolve_path(cfg.path))
    if prepared.tokenizer is None:
        raise ValueError(f"data.path={cfg.path!r}: decoding shards to text needs the `tokenizers` package")
    docs = []
    for stream in (prepared.train, prepared.val):
        # A document's tokens share one id and end with <|endoftext|>, which is dropped here.
        starts = np.flatnonzero(np.diff(stream.doc_ids, prepend=-1))
        docs += zip(stream.doc_ids[starts].tolist(), np.split(stream.tokens, starts[1:]))
    for doc_id, tokens in sorted(docs, key=lambda doc: doc[0]):  # ids are the original load order
        yield decode(prepared.tokenizer, tokens[:-1]), f"doc {doc_id}"


_ROWS = {"embedded": _embedded_rows, "files": _file_rows, "hub": _hub_rows, "shards": _shard_rows}


def load_documents(cfg: DataConfig | Mapping) -> datasets.Dataset:
    """The documents of the configured source, in load order, as a ``Dataset`` of ``text`` and ``title``.

    Empty or whitespace-only documents are skipped (they would only add separators); ``max_docs``
    counts the documents kept, and a stream is read no further than that.
    """
    cfg = validate(cfg)
    if cfg.source != "hub":
        _stay_offline()
    import datasets
    from tqdm.auto import tqdm

    rows = ((text, title) for text, title in _ROWS[cfg.source](cfg) if isinstance(text, str) and text.strip())
    texts, titles = [], []
    for text, title in tqdm(itertools.islice(rows, cfg.max_docs), total=cfg.max_docs, delay=2,
                            desc=f"loading {cfg.source} documents", unit="doc"):
        texts.append(text)
        titles.append(str(title))
    return datasets.Dataset.from_dict({"text": texts, "title": titles})


def validation_mask(texts: Sequence[str], val_fraction: float, seed: int) -> np.ndarray:
    """``True`` for documents held out for validation.

    A document is held out when a seeded hash of its text, read as a number in [0, 1), falls below
    ``val_fraction``. The choice depends only on the text, not on its position or the loading order,
    and identical texts land on the same side, so duplicates cannot leak validation text into
    training. With two or more documents both sides get at least one.
    """
    key = f"split-seed-{seed}".encode()
    scores = np.array([
        int.from_bytes(hashlib.blake2b(t.encode("utf-8"), digest_size=8, key=key).digest(), "little")
        / 2.0**64
        for t in texts
    ])
    is_val = scores < val_fraction
    if len(texts) >= 2 and not is_val.any():
        is_val[np.argmin(scores)] = True
    if len(texts) >= 2 and is_val.all():
        is_val[np.argmax(scores)] = False
    return is_val
