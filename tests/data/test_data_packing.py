"""Packing keeps document ids, windows tile the stream, and the split is by whole document."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from data.corpus import load_documents, validation_mask
from data.packing import PackedWindows, TokenStream, num_windows, pack_documents, unigram_entropy
from data.tokenizer import encode, eot_id

SEQ_LEN = 64


def test_pack_documents_appends_eot_and_labels_each_token(small_prepared):
    tokenizer = small_prepared.tokenizer
    texts = ["First document.", "", "Second, with\nlines.", "Third 😀"]
    stream = pack_documents(tokenizer, texts, [10, 11, 12, 13])
    eot = eot_id(tokenizer)
    expected_tokens, expected_ids = [], []
    for doc_id, text in zip([10, 11, 12, 13], texts):
        ids = encode(tokenizer, text).tolist() + [eot]
        expected_tokens += ids
        expected_ids += [doc_id] * len(ids)
    assert stream.tokens.tolist() == expected_tokens
    assert stream.doc_ids.tolist() == expected_ids
    assert stream.tokens.dtype == np.uint16 and stream.doc_ids.dtype == np.int32


@pytest.mark.parametrize("split", ["train", "val"])
def test_doc_ids_change_exactly_after_endoftext(small_prepared, split):
    stream = getattr(small_prepared, split)
    eot = small_prepared.eot_id
    windows = PackedWindows(stream, SEQ_LEN)
    assert len(windows) == num_windows(len(stream), SEQ_LEN) > 0
    crossings = 0
    for i in range(len(windows)):
        item = windows[i]
        tokens, doc_ids = item["tokens"], item["doc_ids"]
        assert tokens.dtype == doc_ids.dtype == torch.int64
        assert tokens.shape == doc_ids.shape == (SEQ_LEN + 1,)
        changes = doc_ids[1:] != doc_ids[:-1]
        after_eot = tokens[:-1] == eot
        assert torch.equal(changes, after_eot)
        crossings += int(changes.sum())
    assert crossings > 0  # the windows do cross documents, so the check above was exercised


@pytest.mark.parametrize("split", ["train", "val"])
def test_each_document_is_one_run_with_its_own_id(small_prepared, split):
    stream = getattr(small_prepared, split)
    starts = np.flatnonzero(np.diff(stream.doc_ids.astype(np.int64), prepend=-1))
    run_ids = stream.doc_ids[starts]
    assert len(np.unique(run_ids)) == len(run_ids)  # no id comes back later: one run per document
    assert (np.diff(run_ids) > 0).all()  # ids are corpus indices, in load order
    assert int((stream.tokens == small_prepared.eot_id).sum()) == len(run_ids)
    assert stream.tokens[-1] == small_prepared.eot_id


def test_windows_reassemble_the_stream(small_prepared):
    stream = small_prepared.train
    windows = PackedWindows(stream, SEQ_LEN)
    pieces = [windows[0]["tokens"].numpy()] + [windows[i]["tokens"][1:].numpy() for i in range(1, len(windows))]
    rebuilt = np.concatenate(pieces)
    covered = len(windows) * SEQ_LEN + 1
    assert len(rebuilt) == covered and len(stream) - covered < SEQ_LEN
    assert (rebuilt == stream.tokens[:covered]).all()


def test_window_subset_and_bounds():
    stream = TokenStream(np.arange(21, dtype=np.uint16), np.zeros(21, dtype=np.int32))
    windows = PackedWindows(stream, 4, windows=np.array([4, 0]))
    assert windows[0]["tokens"].tolist() == [16, 17, 18, 19, 20]
    assert windows[1]["tokens"].tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="window indices"):
        PackedWindows(stream, 4, windows=np.array([5]))


def test_split_is_disjoint_by_document(small_cfg, small_prepared):
    train_ids = set(np.unique(small_prepared.train.doc_ids).tolist())
    val_ids = set(np.unique(small_prepared.val.doc_ids).tolist())
    assert train_ids and val_ids and not train_ids & val_ids
    assert train_ids | val_ids == set(range(small_cfg.max_docs))
    texts = list(load_documents(small_cfg)["text"])
    assert not {texts[i] for i in val_ids} & {texts[i] for i in train_ids}


def test_split_is_deterministic_and_independent_of_order():
    rng = random.Random(0)
    texts = [f"document {i} " + "x" * rng.randint(0, 50) for i in range(3000)]
    mask = validation_mask(texts, 0.05, seed=3)
    assert (mask == validation_mask(texts, 0.05, seed=3)).all()
    order = list(range(len(texts)))
    rng.shuffle(order)
    shuffled = validation_mask([texts[i] for i in order], 0.05, seed=3)
    assert (shuffled == mask[order]).all()
    assert 0.035 < mask.mean() < 0.065  # binomial(3000, 0.05): 4 standard deviations either side
    assert (validation_mask(texts, 0.05, seed=4) != mask).any()


def test_split_keeps_duplicates_together_and_both_sides_nonempty():
    mask = validation_mask(["same text"] * 5 + ["other"], 0.5, seed=0)
    assert len(set(mask[:5].tolist())) == 1
    tiny = validation_mask(["a", "b"], 0.001, seed=0)
    assert tiny.sum() == 1


def test_unigram_entropy():
    assert unigram_entropy(np.array([0, 1, 2, 3] * 10), 8) == pytest.approx(math.log(4))
    assert unigram_entropy(np.array([5] * 10), 8) == 0.0
