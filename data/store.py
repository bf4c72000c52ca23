"""The on-disk form of a prepared corpus: a cache entry and an exported shard folder share it.

```
<folder>/
  tokenizer.json        the byte-level BPE (Hugging Face tokenizers format)
  train.tokens.npy      (N_train,) uint16 (uint32 for vocabularies above 65536)
  train.docs.npy        (D_train, 2) int64, one row per document in stream order: [doc id, tokens]
  val.tokens.npy        (N_val,)
  val.docs.npy          (D_val, 2)
  manifest.json         sizes, dtypes, file digests, and the config and key it was built from
```
The manifest is written last, so a folder without one is incomplete and never read. Document ids
are stored per document, not per token (format 2; format 1 stored an int32 per token, twice the
size of the tokens, and is still read), so 15M uint16 tokens make ~30 MB that can travel to an
offline host. Loading memory-maps the tokens, expands the document ids (milliseconds) and needs
only numpy; ``tokenizers`` is used when installed, to load ``tokenizer.json``, and is not needed
to train on the ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from data.fileio import file_digest, write_atomic
from data.packing import TokenStream
from data.tokenizer import token_dtype

if TYPE_CHECKING:
    from tokenizers import Tokenizer

FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
SPLITS = ("train", "val")
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"


@dataclass
class PreparedCorpus:
    """Everything training needs: the tokenizer and the packed train and validation streams."""

    tokenizer: Tokenizer | None  # None where `tokenizers` is not installed (shards only)
    vocab_size: int
    eot_id: int
    train: TokenStream
    val: TokenStream
    manifest: dict[str, Any] = field(default_factory=dict)


def _save_array(path: Path, array: np.ndarray) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:  # a file object, so np.save does not append ".npy" to tmp
            np.save(f, array)

    write_atomic(path, write)


def doc_runs(doc_ids: np.ndarray) -> np.ndarray:
    """(D, 2) int64 ``[doc id, run length]`` of a per-token id array: the inverse of ``expand_runs``."""
    doc_ids = np.asarray(doc_ids)
    if not len(doc_ids):
        return np.zeros((0, 2), dtype=np.int64)
    starts = np.flatnonzero(np.diff(doc_ids, prepend=doc_ids[0] - 1))
    lengths = np.diff(np.append(starts, len(doc_ids)))
    return np.stack([doc_ids[starts].astype(np.int64), lengths], axis=1)


def expand_runs(runs: np.ndarray) -> np.ndarray:
    """The per-token int32 document ids of ``[doc id, run length]`` rows."""
    return np.repeat(runs[:, 0].astype(np.int32), runs[:, 1])


def save_prepared(prepared: PreparedCorpus, folder: str | Path, **manifest_extra: Any) -> Path:
    """Write ``prepared`` into ``folder``; ``manifest_extra`` (key, config, ...) goes into the manifest."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if prepared.tokenizer is None:
        raise ValueError("cannot save a prepared corpus without its tokenizer")
    dtype = token_dtype(prepared.vocab_size)
    write_atomic(folder / TOKENIZER_FILE, prepared.tokenizer.save)
    splits = {}
    for name in SPLITS:
        stream: TokenStream = getattr(prepared, name)
        _save_array(folder / f"{name}.tokens.npy", np.ascontiguousarray(stream.tokens, dtype=dtype))
        runs = doc_runs(stream.doc_ids)
        _save_array(folder / f"{name}.docs.npy", runs)
        splits[name] = {"tokens": len(stream), "documents": len(runs)}
    files = [TOKENIZER_FILE] + [f"{s}.{kind}.npy" for s in SPLITS for kind in ("tokens", "docs")]
    manifest = {
        "format": FORMAT_VERSION,
        "vocab_size": prepared.vocab_size,
        "eot_id": prepared.eot_id,
        "token_dtype": dtype.name,
        "splits": splits,
        "files": {name: file_digest(folder / name) for name in files},
        **manifest_extra,
    }
    write_atomic(folder / MANIFEST, lambda tmp: Path(tmp).write_text(json.dumps(manifest, indent=2) + "\n"))
    prepared.manifest = manifest
    return folder / MANIFEST


def is_complete(folder: str | Path) -> bool:
    return (Path(folder) / MANIFEST).is_file()


def load_prepared(folder: str | Path, *, verify: bool = False) -> PreparedCorpus:
    """Read a folder written by ``save_prepared``; ``verify`` also checks every file's digest
    (worth it for shards carried to another machine, ~50 ms for the embedded corpus)."""
    folder = Path(folder)
    if not is_complete(folder):
        raise FileNotFoundError(f"{folder} has no {MANIFEST}: not a (complete) exported corpus")
    manifest = json.loads((folder / MANIFEST).read_text())
    version = manifest.get("format")
    if version not in READABLE_FORMATS:
        raise ValueError(f"{folder}: format {version!r}, this code reads {list(READABLE_FORMATS)}")
    if verify:
        for name, expected in manifest["files"].items():
            if file_digest(folder / name) != expected:
                raise ValueError(f"{folder / name} does not match its digest in {MANIFEST}: copy it again")
    streams = {}
    for name in SPLITS:
        tokens = np.load(folder / f"{name}.tokens.npy", mmap_mode="r")
        if version == 1:
            doc_ids = np.load(folder / f"{name}.doc_ids.npy", mmap_mode="r")
        else:
            doc_ids = expand_runs(np.load(folder / f"{name}.docs.npy"))
        expected = manifest["splits"][name]["tokens"]
        if len(tokens) != expected or tokens.dtype.name != manifest["token_dtype"]:
            raise ValueError(f"{folder}: {name} tokens are {tokens.dtype}[{len(tokens)}], the manifest "
                             f"says {manifest['token_dtype']}[{expected}]")
        streams[name] = TokenStream(tokens, doc_ids)
    try:
        from data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(folder / TOKENIZER_FILE)
    except ImportError:
        tokenizer = None
    return PreparedCorpus(tokenizer, manifest["vocab_size"], manifest["eot_id"],
                          streams["train"], streams["val"], manifest)
