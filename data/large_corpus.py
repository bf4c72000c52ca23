"""The large offline corpus: about 15M tokens of English for GPU runs, built from Debian packages.

    python -m data.build_corpus --large        # 0.5-2 minutes on two cores; see --help

Sources, in this fixed order (licences in ``data/corpus/LICENSES.md``):
- ``embedded``: the shipped corpus ``data/corpus/english.jsonl.gz`` (Shakespeare's plays by scene,
  the King James Bible by chapter; public domain), read as it is.
- ``gcide``: the GNU Collaborative International Dictionary of English (Debian ``dict-gcide``,
  GPL-2-or-later), read through its dictd index: one entry per distinct (offset, length) of
  ``gcide.index``, in file order. An entry keeps its headword and text; the pronunciation between
  backslashes, the ``{...}`` cross-reference braces and the source tags on lines of their own
  (``[1913 Webster]``, ``[WordNet 1.5]``, ...) are removed, and the wrapped lines of a paragraph are
  joined. Consecutive entries are grouped into documents of about ``--gcide-doc-chars`` characters.
- ``pydoc``: the reStructuredText sources of the Python 3.11 documentation (Debian
  ``python3.11-doc``, ``html/_sources/**/*.rst.txt``; PSF licence), one document per page, kept
  as they are.

Exact duplicates are dropped (dictionary entries before grouping, then whole documents across all
sources): two texts are the same when they are equal after lower-casing and collapsing whitespace;
the first one in source order is kept. The documents go to ``data/corpus/large/english-large.jsonl``
(one ``{"text", "source", "title"}`` per line), and from there through the ordinary pipeline
(``source="files"``: split by a hash of each document's text, byte-level BPE trained on the training
documents, packing) into pre-tokenized shards in ``data/shards/large/`` (``data.export``'s layout),
with the licence note copied beside them. Both folders are git-ignored; the shards are what travels
to a GPU host without internet (``data=large`` reads them).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import shutil
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from data.config import REPO_ROOT, DataConfig, validate

EMBEDDED = REPO_ROOT / "data" / "corpus" / "english.jsonl.gz"
GCIDE_DICT = Path("/usr/share/dictd/gcide.dict.dz")
PYDOC_SOURCES = Path("/usr/share/doc/python3.11/html/_sources")
CORPUS_OUT = REPO_ROOT / "data" / "corpus" / "large" / "english-large.jsonl"
SHARDS_OUT = REPO_ROOT / "data" / "shards" / "large"
LICENSES = REPO_ROOT / "data" / "corpus" / "LICENSES.md"
GCIDE_DOC_CHARS = 8000  # ~2.4k tokens: a few training windows of 1024 per document
SOURCE_ORDER = ("shakespeare", "kjv", "gcide", "pydoc")

# What to install when a source is missing, by the flag that points at it.
INSTALL = {
    "--embedded": "restore it from the repository: `git checkout -- data/corpus/english.jsonl.gz`",
    "--gcide": "install the Debian package dict-gcide: `apt-get install dict-gcide`",
    "--pydoc": "install the Debian package python3.11-doc: `apt-get install python3.11-doc`",
}


class SourceMissing(FileNotFoundError):
    """A source of the large corpus is not on this machine; the message says what to install."""


def require(path: Path, flag: str, what: str) -> Path:
    if not path.exists():
        raise SourceMissing(f"{what} not found at {path}: {INSTALL[flag]} (or pass {flag} <path>)")
    return path


# --- the dictionary -----------------------------------------------------------------------------------
_B64 = {c: i for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}
_PRONUNCIATION = re.compile(r"\\[^\\\n]*\\,?")  # `\Ab*do"men\,` after a headword
_SOURCE_TAG = re.compile(r"^\[[^\]\n]{1,40}\]$")  # a line that is only `[1913 Webster]`, `[PJC]`, ...
_SPACES = re.compile(r"[ \t]+")


def dictd_number(text: str) -> int:
    """A number in dictd's index encoding (base 64, most significant digit first)."""
    value = 0
    for char in text:
        if char not in _B64:
            raise ValueError(f"{text!r} is not a dictd base-64 number (bad character {char!r})")
        value = value * 64 + _B64[char]
    return value


def dictd_spans(index_text: str) -> list[tuple[int, int]]:
    """The distinct ``(offset, length)`` byte spans of a dictd index, in file order.

    Several headwords point at the same span (an entry with variant spellings). The database's own
    entries (its name, URL and licence header, under ``00-database-*`` and aliases such as
    ``00-gcide-*``) are left out, whatever other headword points at them.
    """
    spans, metadata = set(), set()
    for number, line in enumerate(index_text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) < 3:
            raise ValueError(f"line {number} of the dictd index is not `headword<TAB>offset<TAB>length`: {line!r}")
        span = (dictd_number(parts[1]), dictd_number(parts[2]))
        (metadata if parts[0].startswith(("00-", "00database")) else spans).add(span)
    return sorted(spans - metadata)


def clean_gcide_entry(raw: str) -> str:
    """One entry as plain prose: headword line first, one line per paragraph, no markup."""
    paragraphs, lines = [], []
    for line in raw.splitlines():
        line = line.strip()
        if _SOURCE_TAG.match(line):
            continue
        if line:
            lines.append(line)
        elif lines:
            paragraphs.append(" ".join(lines))
            lines = []
    if lines:
        paragraphs.append(" ".join(lines))
    text = "\n".join(paragraphs)
    text = _PRONUNCIATION.sub("", text).replace("{", "").replace("}", "")
    return "\n".join(_SPACES.sub(" ", p).strip() for p in text.split("\n")).strip()


def gcide_entries(dict_path: Path, index_path: Path) -> Iterator[str]:
    """The cleaned entries of a dictd database (``.dict.dz`` is gzip-compatible; ``.dict`` plain)."""
    opener = gzip.open if dict_path.suffix == ".dz" or dict_path.suffix == ".gz" else open
    with opener(dict_path, "rb") as f:
        data = f.read()
    for offset, length in dictd_spans(index_path.read_text(encoding="utf-8")):
        if offset + length > len(data):
            raise ValueError(f"{index_path}: span ({offset}, {length}) lies beyond the end of {dict_path} "
                             f"({len(data)} bytes): index and database do not belong together")
        text = clean_gcide_entry(data[offset:offset + length].decode("utf-8", errors="replace"))
        if text:
            yield text


def group_entries(entries: Iterable[str], target_chars: int) -> Iterator[tuple[str, str]]:
    """Consecutive entries joined (blank line between) into documents of at least ``target_chars``
    characters (the last may be shorter); the title names the first and last headword."""
    if target_chars < 1:
        raise ValueError(f"target_chars={target_chars!r} must be >= 1")
    group: list[str] = []
    size = 0

    def flush() -> tuple[str, str]:
        first, last = (g.split("\n", 1)[0][:40] for g in (group[0], group[-1]))
        return f"GCIDE: {first} ... {last}", "\n\n".join(group) + "\n"

    for entry in entries:
        group.append(entry)
        size += len(entry) + 2
        if size >= target_chars:
            yield flush()
            group, size = [], 0
    if group:
        yield flush()


# --- the Python documentation -------------------------------------------------------------------------
def pydoc_pages(root: Path) -> Iterator[tuple[str, str]]:
    """``(title, text)`` per ``*.rst.txt`` page under ``root``, sorted by path; title = the page's path."""
    pages = sorted(root.rglob("*.rst.txt"))
    if not pages:
        raise SourceMissing(f"no *.rst.txt pages under {root}: {INSTALL['--pydoc']} (or pass --pydoc <path>)")
    for page in pages:
        text = page.read_text(encoding="utf-8", errors="replace").strip()
        if text:
            yield f"Python docs: {page.relative_to(root).as_posix().removesuffix('.rst.txt')}", text + "\n"


# --- assembling -------------------------------------------------------------------------------------------
def normalized_hash(text: str) -> bytes:
    """Equal for texts that differ only in case and whitespace."""
    return hashlib.blake2b(" ".join(text.lower().split()).encode("utf-8"), digest_size=16).digest()


def deduplicate(texts: Iterable[str], seen: set[bytes] | None = None) -> Iterator[str]:
    """``texts`` without exact duplicates (after normalisation), first occurrence kept; ``seen`` is
    updated, so one set can span several calls."""
    seen = set() if seen is None else seen
    for text in texts:
        key = normalized_hash(text)
        if key not in seen:
            seen.add(key)
            yield text


@dataclass
class BuildStats:
    documents: dict[str, int] = field(default_factory=dict)  # kept documents per source
    chars: dict[str, int] = field(default_factory=dict)  # kept characters per source
    duplicates: dict[str, int] = field(default_factory=dict)  # dropped exact duplicates per source
    gcide_entries: int = 0  # dictionary entries kept (before grouping)


def collect_documents(embedded: Path, gcide_dict: Path, gcide_index: Path, pydoc: Path,
                      gcide_doc_chars: int = GCIDE_DOC_CHARS) -> tuple[list[dict[str, str]], BuildStats]:
    """All documents of the large corpus in source order, deduplicated; fails before reading anything
    when a source is missing."""
    require(embedded, "--embedded", "the embedded corpus")
    require(gcide_dict, "--gcide", "the GCIDE dictionary")
    require(gcide_index, "--gcide", "the GCIDE index")
    require(pydoc, "--pydoc", "the Python documentation sources")
    stats = BuildStats()
    seen: set[bytes] = set()
    docs: list[dict[str, str]] = []

    def add(source: str, title: str, text: str) -> None:
        key = normalized_hash(text)
        if key in seen:
            stats.duplicates[source] = stats.duplicates.get(source, 0) + 1
            return
        seen.add(key)
        docs.append({"text": text, "source": source, "title": title})
        stats.documents[source] = stats.documents.get(source, 0) + 1
        stats.chars[source] = stats.chars.get(source, 0) + len(text)

    with gzip.open(embedded, "rt", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            add(row["source"], row["title"], row["text"])
    entries = list(gcide_entries(gcide_dict, gcide_index))
    unique = list(deduplicate(entries))
    stats.gcide_entries = len(unique)
    stats.duplicates["gcide entries"] = len(entries) - len(unique)
    for title, text in group_entries(unique, gcide_doc_chars):
        add("gcide", title, text)
    for title, text in pydoc_pages(pydoc):
        add("pydoc", title, text)
    return docs, stats


def write_jsonl(docs: list[dict[str, str]], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps(doc, ensure_ascii=False) + "\n")
    tmp.replace(out)


def build_large(*, embedded: Path = EMBEDDED, gcide_dict: Path = GCIDE_DICT, gcide_index: Path | None = None,
                pydoc: Path = PYDOC_SOURCES, corpus_out: Path = CORPUS_OUT, shards_out: Path = SHARDS_OUT,
                vocab_size: int = 4096, val_fraction: float = 0.02, cache_dir: str = "data/cache",
                gcide_doc_chars: int = GCIDE_DOC_CHARS) -> dict:
    """Collect, deduplicate, write the JSONL, tokenize and export the shards; return a summary."""
    from data.export import export_shards

    start = time.perf_counter()
    # Settings are checked before any reading, so a bad vocabulary fails in milliseconds.
    cfg = validate(DataConfig(source="files", path=str(corpus_out), vocab_size=vocab_size,
                              val_fraction=val_fraction, cache_dir=cache_dir))
    gcide_index = gcide_index or gcide_dict.with_name(gcide_dict.name.split(".")[0] + ".index")
    docs, stats = collect_documents(embedded, gcide_dict, gcide_index, pydoc, gcide_doc_chars)
    write_jsonl(docs, corpus_out)
    manifest = export_shards(cfg, shards_out)
    shutil.copyfile(LICENSES, shards_out / LICENSES.name)
    shard_bytes = sum(p.stat().st_size for p in shards_out.iterdir() if p.is_file())
    splits = manifest["splits"]
    return {
        "documents": stats.documents, "chars": stats.chars, "duplicates_dropped": stats.duplicates,
        "gcide_entries": stats.gcide_entries,
        "text_bytes": sum(len(doc["text"].encode("utf-8")) for doc in docs), "jsonl_bytes": corpus_out.stat().st_size,
        "train_tokens": splits["train"]["tokens"], "val_tokens": splits["val"]["tokens"],
        "train_documents": splits["train"]["documents"], "val_documents": splits["val"]["documents"],
        "vocab_size": manifest["vocab_size"], "shard_bytes": shard_bytes, "build_s": time.perf_counter() - start,
        "corpus": str(corpus_out), "shards": str(shards_out),
    }


def epochs(train_tokens: int, steps: int, tokens_per_step: int = 16 * 1024) -> float:
    """How many passes over the training tokens a run of ``steps`` steps makes."""
    return steps * tokens_per_step / train_tokens


def summary_lines(summary: dict) -> list[str]:
    mib = summary["shard_bytes"] / 2**20
    lines = [
        f"corpus: {summary['corpus']} ({summary['text_bytes'] / 1e6:.1f} MB of UTF-8 text, "
        f"{summary['text_bytes'] / (summary['train_tokens'] + summary['val_tokens']):.2f} bytes per token)",
        "documents per source: " + ", ".join(f"{k} {v:,}" for k, v in summary["documents"].items())
        + f" (gcide: {summary['gcide_entries']:,} entries)",
        "exact duplicates dropped: " + ", ".join(f"{k} {v:,}" for k, v in summary["duplicates_dropped"].items()),
        f"shards: {summary['shards']}: vocab {summary['vocab_size']}, train {summary['train_tokens']:,} tokens "
        f"({summary['train_documents']:,} docs), val {summary['val_tokens']:,} tokens "
        f"({summary['val_documents']:,} docs), {mib:.1f} MiB",
        "epochs of a run with 16x1024 tokens per step: " + ", ".join(
            f"{s} steps {epochs(summary['train_tokens'], s):.2f}" for s in (300, 1000, 3000)),
        f"built in {summary['build_s']:.0f} s",
    ]
    if mib > 64:
        lines.append("warning: the shards exceed 64 MiB and will not travel with the working tree")
    return lines
