"""The large corpus builder, run end to end on tiny fake sources (CI has no dict-gcide or python3.11-doc)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from data import build_corpus
from data import large_corpus as large
from data.config import DataConfig
from data.pipeline import prepare_corpus
from data.tokenizer import decode

B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

# Three entries as dictd stores them (the same wrapping, tags and markup as gcide.dict.dz), one of
# them twice under two headwords, one of them an exact duplicate at another offset, and the
# database's own header entry under its name and two aliases (as in Debian's gcide.index).
HEADER = "00-database-short\n   The Collaborative International Dictionary of English v.0.48\n\n"
ABDICATION = ("Abdication \\Ab`di*ca\"tion\\, n. [L. abdicatio: cf. F.\n   abdication.]\n"
              "   The act of abdicating; the renunciation of a high office,\n   dignity, or trust.\n"
              "   [1913 Webster]\n\n")
ABDOMEN = ("Abdomen \\Ab*do\"men\\, n. [L. abdomen.]\n   1. (Anat.) The belly. See {Abdominal ring}.\n"
           "      [1913 Webster]\n\n   2. (Zool.) The posterior section of the body.\n      [1913 Webster]\n\n")
ABDITIVE = "Abditive \\Ab\"di*tive\\, a.\n   Having the quality of hiding. [R.] --Bailey.\n   [1913 Webster]\n\n"


def b64(n: int) -> str:
    digits = ""
    while True:
        n, r = divmod(n, 64)
        digits = B64[r] + digits
        if not n:
            return digits


def write_dictd(folder: Path, entries: list[tuple[list[str], str]]) -> Path:
    """A gzip'd dictd database and its index; each entry is (headwords, text)."""
    data, index = b"", []
    for headwords, text in entries:
        raw = text.encode("utf-8")
        index += [f"{h}\t{b64(len(data))}\t{b64(len(raw))}" for h in headwords]
        data += raw
    (folder / "gcide.index").write_text("\n".join(sorted(index)) + "\n")
    with gzip.open(folder / "gcide.dict.dz", "wb") as f:
        f.write(data)
    return folder / "gcide.dict.dz"


@pytest.fixture
def sources(tmp_path: Path) -> dict[str, Path]:
    embedded = tmp_path / "embedded.jsonl.gz"
    rows = [{"text": f"SCENE {i}\n\nFirst speaker: words of scene {i}, " * 20, "source": "shakespeare",
             "title": f"Play, Scene {i}"} for i in range(4)]
    rows.append({"text": "Genesis 1\n\nIn the beginning God created the heaven and the earth.\n", "source": "kjv",
                 "title": "Genesis 1"})
    with gzip.open(embedded, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    dictd = tmp_path / "dictd"
    dictd.mkdir()
    entries = [(["00-database-short", "00-gcide-short", "00-web1913-info"], HEADER), (["Abdication"], ABDICATION),
               (["Abdomen", "Abdomens"], ABDOMEN), (["Abditive"], ABDITIVE), (["Abditive2"], ABDITIVE)]
    gcide = write_dictd(dictd, entries)
    pydoc = tmp_path / "_sources"
    (pydoc / "library").mkdir(parents=True)
    (pydoc / "library" / "os.rst.txt").write_text(":mod:`os` --- Miscellaneous operating system interfaces\n" * 30)
    (pydoc / "tutorial.rst.txt").write_text("The Python Tutorial\n===================\n\nPython is easy.\n" * 30)
    # The same page again, differing only in case and spacing: an exact duplicate after normalising.
    (pydoc / "zcopy.rst.txt").write_text("THE PYTHON TUTORIAL\n===================\n\n  Python is easy.\n" * 30)
    return {"embedded": embedded, "gcide": gcide, "pydoc": pydoc}


def test_dictd_numbers_decode_like_the_real_index():
    # From Debian's gcide.index: `00-database-short<TAB>y<TAB>BS` is the span at byte 50, 82 bytes long.
    assert (large.dictd_number("y"), large.dictd_number("BS")) == (50, 82)
    assert all(large.dictd_number(b64(n)) == n for n in (0, 1, 63, 64, 4095, 4096, 13_527_370))
    with pytest.raises(ValueError, match="bad character '-'"):
        large.dictd_number("A-B")


def test_spans_skip_the_header_and_merge_variant_headwords(sources):
    index = (sources["gcide"].parent / "gcide.index").read_text()
    spans = large.dictd_spans(index)
    assert len(spans) == 4  # 8 index lines: the header and its aliases dropped, Abdomen/Abdomens one span
    assert spans == sorted(spans) and spans[0][0] == len(HEADER.encode())
    with pytest.raises(ValueError, match="line 1 of the dictd index"):
        large.dictd_spans("Abdomen 12 4\n")


def test_entry_cleaning_removes_markup_and_joins_wrapped_lines():
    assert large.clean_gcide_entry(ABDOMEN) == (
        "Abdomen n. [L. abdomen.] 1. (Anat.) The belly. See Abdominal ring.\n"
        "2. (Zool.) The posterior section of the body.")
    assert large.clean_gcide_entry(ABDICATION).startswith("Abdication n. [L. abdicatio: cf. F. abdication.] The act")
    assert "[1913 Webster]" not in large.clean_gcide_entry(ABDITIVE)
    assert "[R.] --Bailey." in large.clean_gcide_entry(ABDITIVE)  # an inline tag is text, not a source tag


def test_grouping_reaches_the_target_size_and_keeps_every_entry():
    entries = [f"Word{i} n. meaning number {i}." for i in range(50)]
    docs = list(large.group_entries(entries, target_chars=200))
    assert all(len(text) >= 200 for _, text in docs[:-1])
    assert [e for _, text in docs for e in text.strip().split("\n\n")] == entries
    assert docs[0][0] == f"GCIDE: Word0 n. meaning number 0. ... {docs[0][1].strip().split(chr(10) * 2)[-1]}"
    with pytest.raises(ValueError, match="target_chars=0"):
        list(large.group_entries(entries, 0))


def test_dedup_is_exact_after_case_and_whitespace():
    texts = ["A b\nc", "a  B c", "a b c d", "A B C"]
    assert list(large.deduplicate(texts)) == ["A b\nc", "a b c d"]


def test_build_from_fake_sources(sources, tmp_path: Path):
    out, shards = tmp_path / "large.jsonl", tmp_path / "shards"
    summary = large.build_large(embedded=sources["embedded"], gcide_dict=sources["gcide"], pydoc=sources["pydoc"],
                                corpus_out=out, shards_out=shards, vocab_size=300, val_fraction=0.2,
                                cache_dir=str(tmp_path / "cache"), gcide_doc_chars=150)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["source"] for r in rows] == ["shakespeare"] * 4 + ["kjv"] + ["gcide"] * 2 + ["pydoc"] * 2
    assert summary["duplicates_dropped"] == {"gcide entries": 1, "pydoc": 1}
    assert summary["gcide_entries"] == 3 and summary["documents"]["gcide"] == 2
    assert rows[5]["text"].startswith("Abdication n.") and "Abditive" in rows[6]["text"]
    assert summary["train_documents"] + summary["val_documents"] == len(rows)
    assert summary["val_documents"] >= 1
    assert (shards / "LICENSES.md").read_text() == large.LICENSES.read_text()
    assert summary["shard_bytes"] == sum(p.stat().st_size for p in shards.iterdir())

    prepared = prepare_corpus(DataConfig(source="shards", path=str(shards)))
    assert len(prepared.train) == summary["train_tokens"] and len(prepared.val) == summary["val_tokens"]
    assert prepared.train.tokens.dtype == np.uint16
    texts = {r["text"] for r in rows}
    for stream in (prepared.train, prepared.val):  # every packed document decodes to a corpus document
        eot = np.flatnonzero(np.asarray(stream.tokens) == prepared.eot_id)
        first = decode(prepared.tokenizer, stream.tokens[: eot[0]])
        assert first in texts
    assert "epochs" in "\n".join(large.summary_lines(summary))


def test_a_missing_source_names_the_package_to_install(sources, tmp_path: Path, capsys):
    missing = tmp_path / "nowhere" / "gcide.dict.dz"
    with pytest.raises(large.SourceMissing, match=r"apt-get install dict-gcide"):
        large.collect_documents(sources["embedded"], missing, missing.with_suffix(".index"), sources["pydoc"])
    with pytest.raises(SystemExit, match=r"error: the Python documentation sources not found .*apt-get install "
                                         r"python3.11-doc"):
        build_corpus.main(["--large", "--embedded", str(sources["embedded"]), "--gcide", str(sources["gcide"]),
                           "--pydoc", str(tmp_path / "no-docs"), "--out", str(tmp_path / "x.jsonl"),
                           "--shards-out", str(tmp_path / "s")])
    assert not (tmp_path / "x.jsonl").exists()  # nothing is written before every source is found


def test_epochs():
    assert large.epochs(16 * 1024 * 100, steps=300) == pytest.approx(3.0)


def test_bad_vocabulary_is_one_line_error(sources, tmp_path: Path):
    with pytest.raises(SystemExit, match=r"error: data.vocab_size=100: is too small"):
        build_corpus.main(["--large", "--embedded", str(sources["embedded"]), "--gcide", str(sources["gcide"]),
                           "--pydoc", str(sources["pydoc"]), "--out", str(tmp_path / "x.jsonl"),
                           "--shards-out", str(tmp_path / "s"), "--vocab-size", "100",
                           "--cache-dir", str(tmp_path / "cache")])
    assert not (tmp_path / "x.jsonl").exists()
