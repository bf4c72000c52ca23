"""Pre-tokenized shards: export, then load as ``source="shards"`` with the very same arrays."""

from __future__ import annotations

import json
import sys
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest

from data.config import DataConfig
from data.corpus import load_documents
from data.datamodule import CorpusDataModule
from data.export import build_parser, export_shards, main
from data.pipeline import prepare_corpus
from data.store import load_prepared


@pytest.fixture(scope="module")
def shards(small_cfg, small_prepared, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shards")
    export_shards(small_cfg, out)
    return out


def test_export_then_load_round_trip(shards, small_prepared):
    loaded = prepare_corpus(DataConfig(source="shards", path=str(shards)))
    assert loaded.vocab_size == small_prepared.vocab_size and loaded.eot_id == small_prepared.eot_id
    for split in ("train", "val"):
        ours, theirs = getattr(loaded, split), getattr(small_prepared, split)
        assert ours.tokens.dtype == np.uint16 and ours.doc_ids.dtype == np.int32
        assert np.array_equal(ours.tokens, theirs.tokens) and np.array_equal(ours.doc_ids, theirs.doc_ids)
    assert loaded.tokenizer.to_str() == small_prepared.tokenizer.to_str()
    manifest = json.loads((shards / "manifest.json").read_text())
    assert manifest["splits"]["train"]["tokens"] == len(small_prepared.train)
    assert manifest["config"]["vocab_size"] == 512 and manifest["token_dtype"] == "uint16"


def test_shards_train_through_the_datamodule(shards, small_prepared):
    dm = CorpusDataModule(DataConfig(source="shards", path=str(shards), batch_size=2), seq_len=16, seed=0, max_steps=3)
    dm.setup("fit")
    assert dm.vocab_size == small_prepared.vocab_size
    assert len(list(dm.train_dataloader())) == 3


def test_shards_decode_back_to_the_documents(shards, small_cfg):
    original = list(load_documents(small_cfg)["text"])
    assert list(load_documents(DataConfig(source="shards", path=str(shards)))["text"]) == original


def test_shards_load_without_tokenizers(shards, small_prepared, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # any `import tokenizers` now fails
    loaded = load_prepared(shards, verify=True)
    assert loaded.tokenizer is None
    assert np.array_equal(loaded.train.tokens, small_prepared.train.tokens)


def test_corrupted_shard_is_detected(shards, tmp_path: Path):
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in shards.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    tokens = np.load(copy / "val.tokens.npy")
    tokens[0] ^= 1
    np.save(copy / "val.tokens.npy", tokens)
    with pytest.raises(ValueError, match="val.tokens.npy does not match its digest"):
        load_prepared(copy, verify=True)
    (copy / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        load_prepared(copy)


def test_cli_flags_mirror_the_config(small_cfg, small_prepared, tmp_path: Path, capsys):
    dests = {action.dest for action in build_parser()._actions}
    assert {f.name for f in fields(DataConfig)} <= dests
    out = tmp_path / "cli"
    main(["--out", str(out), "--max-docs", "150", "--vocab-size", "512", "--val-fraction", "0.1",
          "--cache-dir", small_cfg.cache_dir, "--hub-name", "none"])
    assert "vocab 512" in capsys.readouterr().out
    assert np.array_equal(np.load(out / "train.tokens.npy"), small_prepared.train.tokens)
    with pytest.raises(SystemExit, match="data.vocab_size=100"):
        main(["--out", str(out), "--vocab-size", "100"])


def test_doc_ids_are_stored_per_document(shards, small_prepared):
    from data.store import doc_runs, expand_runs

    runs = np.load(shards / "train.docs.npy")
    assert runs.shape == (len(np.unique(small_prepared.train.doc_ids)), 2)
    assert np.array_equal(expand_runs(runs), small_prepared.train.doc_ids)
    ids = np.array([5, 5, 5, 2, 2, 9, 5], dtype=np.int32)  # the same id may come back later in a stream
    assert doc_runs(ids).tolist() == [[5, 3], [2, 2], [9, 1], [5, 1]]
    assert np.array_equal(expand_runs(doc_runs(ids)), ids) and doc_runs(ids[:0]).shape == (0, 2)


def test_format_1_shards_still_load(shards, small_prepared, tmp_path: Path):
    from data.store import expand_runs

    old = tmp_path / "v1"
    old.mkdir()
    manifest = json.loads((shards / "manifest.json").read_text())
    for split in ("train", "val"):
        (old / f"{split}.tokens.npy").write_bytes((shards / f"{split}.tokens.npy").read_bytes())
        np.save(old / f"{split}.doc_ids.npy", expand_runs(np.load(shards / f"{split}.docs.npy")))
    (old / "tokenizer.json").write_bytes((shards / "tokenizer.json").read_bytes())
    manifest.update(format=1, files={})
    (old / "manifest.json").write_text(json.dumps(manifest))
    loaded = load_prepared(old)
    assert np.array_equal(loaded.val.doc_ids, small_prepared.val.doc_ids)
    manifest["format"] = 7
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"format 7, this code reads \[1, 2\]"):
        load_prepared(old)
