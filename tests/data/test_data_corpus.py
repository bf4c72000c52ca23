"""Sources: the shipped corpus, local files by glob, the Hub (mocked), no network for local sources."""

from __future__ import annotations

import gzip
import json
import socket
from pathlib import Path

import numpy as np
import pytest

from data.build_corpus import parse_kjv, parse_play
from data.config import DataConfig
from data.corpus import EMBEDDED_CORPUS, load_documents
from data.pipeline import prepare_corpus


@pytest.fixture(scope="module")
def shipped() -> list[dict]:
    with gzip.open(EMBEDDED_CORPUS, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_shipped_corpus_is_complete_and_plain(shipped):
    by_source = {s: [d for d in shipped if d["source"] == s] for s in ("shakespeare", "kjv")}
    assert len(by_source["kjv"]) == 1189  # every chapter of the Bible
    assert len(by_source["shakespeare"]) > 700  # every scene of 38 plays
    assert len(shipped) == len(by_source["kjv"]) + len(by_source["shakespeare"])
    assert sum(len(d["text"].encode()) for d in shipped) > 8_000_000
    assert len({d["title"] for d in shipped}) == len(shipped)
    for doc in shipped:
        assert set(doc) == {"text", "source", "title"} and doc["text"].strip()
        assert not any(mark in doc["text"] for mark in ("**", "#", "_", "\\")), doc["title"]
    genesis = by_source["kjv"][0]
    assert genesis["title"] == "Genesis 1"
    assert genesis["text"].startswith("Genesis 1\n\nIn the beginning God created the heaven and the earth. And")


def test_parse_play_strips_markdown():
    markdown = (
        "# A Play\n\n## ACT I\n\n### SCENE I. A room\\.\n\n_Enter HAMLET, with\na book_\n\n"
        "**HAMLET**  \nTo be, or not to be:  \nthat is the question.\n\n**OPHELIA**  \n__\\[Aside]_  \n"
        "Good my lord\\-\n\n### SCENE II. Another\n\n**HAMLET**  \nWords.\n"
    )
    scenes = list(parse_play(markdown, "fallback"))
    assert [title for title, _ in scenes] == ["A Play, ACT I, SCENE I. A room.", "A Play, ACT I, SCENE II. Another"]
    assert scenes[0][1] == (
        "ACT I, SCENE I. A room.\n\nEnter HAMLET, with\na book\n\nHAMLET:\nTo be, or not to be:\n"
        "that is the question.\n\nOPHELIA:\n[Aside]\nGood my lord-\n"
    )
    untitled = list(parse_play("## ACT I\n\n### SCENE I. Here\n\nText.\n", "Measure for Measure"))
    assert untitled == [("Measure for Measure, ACT I, SCENE I. Here", "ACT I, SCENE I. Here\n\nText.\n")]


def test_parse_kjv_joins_wrapped_verses():
    text = ("\nGenesis 1\n\n  1 In the beginning.\n  2 And the earth was\nwithout form.\n\n"
            "1 Kings 2\n\n  1 Now the days\nof David drew nigh.\n")
    assert list(parse_kjv(text)) == [
        ("Genesis 1", "Genesis 1\n\nIn the beginning. And the earth was without form.\n"),
        ("1 Kings 2", "1 Kings 2\n\nNow the days of David drew nigh.\n"),
    ]


def test_embedded_source_makes_no_network_call(tmp_path: Path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    docs = load_documents(DataConfig(max_docs=3, cache_dir=str(tmp_path)))
    assert len(docs) == 3 and docs[0]["title"].startswith("A Midsummer Night's Dream")
    assert (tmp_path / "hf").is_dir()  # datasets' cache went under cache_dir


def test_files_by_glob(tmp_path: Path):
    root = tmp_path / "corpus"
    (root / "nested").mkdir(parents=True)
    (root / "b.txt").write_text("second file\nwith two lines")
    (root / "a.txt").write_text("first file")
    (root / "empty.txt").write_text("  \n")
    (root / "nested" / "rows.jsonl").write_text(
        json.dumps({"body": "row one", "id": 1}) + "\n" + json.dumps({"body": "row two", "id": 2}) + "\n")
    cfg = DataConfig(source="files", path=str(root / "**" / "*.*"), text_field="body", cache_dir=str(tmp_path / "c"))
    docs = load_documents(cfg)
    assert list(docs["text"]) == ["first file", "second file\nwith two lines", "row one", "row two"]
    assert list(docs["title"])[0].endswith("a.txt") and list(docs["title"])[2].endswith("rows.jsonl#0")
    capped = load_documents(DataConfig(**{**vars(cfg), "max_docs": 3}))
    assert list(capped["text"]) == ["first file", "second file\nwith two lines", "row one"]
    with pytest.raises(ValueError, match=r"'text' is not a column of .*rows.jsonl; columns: \['body', 'id'\]"):
        load_documents(DataConfig(**{**vars(cfg), "text_field": "text"}))


def test_files_errors_name_the_pattern(tmp_path: Path):
    with pytest.raises(ValueError, match=r"matches no files"):
        load_documents(DataConfig(source="files", path=str(tmp_path / "*.txt")))
    (tmp_path / "notes.md").write_text("x")
    with pytest.raises(ValueError, match=r"\['\.md'\].*supported"):
        load_documents(DataConfig(source="files", path=str(tmp_path / "*")))


class FakeStream:
    """Stands in for a streaming ``datasets.IterableDataset``: endless, and counts what was read."""

    def __init__(self) -> None:
        self.read = 0

    def __iter__(self):
        while True:
            self.read += 1
            yield {"text": f"streamed document number {self.read}, " * 20, "url": "x"}


def test_hub_source_streams_and_takes_max_docs(tmp_path: Path, monkeypatch):
    import datasets

    calls, stream = [], FakeStream()

    def fake_load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return stream

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    cfg = DataConfig(source="hub", hub_name="someone/web-text", hub_config="en", hub_split="train",
                     hub_revision="abc123", max_docs=40, vocab_size=300, val_fraction=0.1,
                     cache_dir=str(tmp_path))
    docs = load_documents(cfg)
    assert len(docs) == 40 and stream.read == 40
    assert docs[0]["text"].startswith("streamed document number 1,")
    assert docs[39]["title"] == "someone/web-text:train#39"
    (args, kwargs), = calls
    assert args == ("someone/web-text", "en") and kwargs["streaming"] is True
    assert kwargs["split"] == "train" and kwargs["revision"] == "abc123"
    assert Path(kwargs["cache_dir"]) == tmp_path / "hf"

    prepared = prepare_corpus(cfg)  # the whole pipeline on the streamed documents
    doc_ids = np.concatenate([prepared.train.doc_ids, prepared.val.doc_ids])
    assert set(doc_ids.tolist()) == set(range(40))
    with pytest.raises(ValueError, match="'body' is not a column"):
        load_documents(DataConfig(**{**vars(cfg), "text_field": "body"}))
