"""The on-disk form of a prepared corpus: a cache entry and an exported shard folder share it.

```
<folder>/
  tokenizer.json        the byte-level BPE (Hugging Face tokenizers format)
  train.tokens.npy      (N_train,) uint16 (uint32 for vocabularies above 65536)
  train.doc_ids.npy     (N_train,) int32, document id per token
  val.tokens.npy        (N_val,)
  val.doc_ids.npy       (N_val,)
  manifest.json         sizes, dtypes, file digests, and the config and key it was built from
```
The manifest is written last, so a folder without one is incomplete and never read. Loading
memory-maps the arrays (milliseconds) and needs only numpy; ``tokenizers`` is used when installed,
to load ``tokenizer.json``, and is not needed to train on the ids.
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

FORMAT_VERSION = 1
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
        _save_array(folder / f"{name}.doc_ids.npy", np.ascontiguousarray(stream.doc_ids, dtype=np.int32))
        documents = int(np.count_nonzero(np.diff(stream.doc_ids))) + 1 if len(stream) else 0
        splits[name] = {"tokens": len(stream), "documents": documents}
    files = [TOKENIZER_FILE] + [f"{s}.{kind}.npy" for s in SPLITS for kind in ("tokens", "doc_ids")]
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
    if manifest.get("format") != FORMAT_VERSION:
        raise ValueError(f"{folder}: format {manifest.get('format')!r}, this code reads {FORMAT_VERSION}")
    if verify:
        for name, expected in manifest["files"].items():
            if file_digest(folder / name) != expected:
                raise ValueError(f"{folder / name} does not match its digest in {MANIFEST}: copy it again")
    streams = {}
    for name in SPLITS:
        tokens = np.load(folder / f"{name}.tokens.npy", mmap_mode="r")
        doc_ids = np.load(folder / f"{name}.doc_ids.npy", mmap_mode="r")
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
