"""DataConfig validation: every bad value fails before any loading, naming the value and the choices."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from data.config import DataConfig, validate
from data.datamodule import CorpusDataModule

BAD = [
    pytest.param({"source": "wiki"}, ["'wiki'", "embedded", "files", "hub", "shards"], id="unknown-source"),
    pytest.param({"source": "files"}, ["data.path", "files"], id="files-without-path"),
    pytest.param({"source": "shards"}, ["data.path", "data.export"], id="shards-without-path"),
    pytest.param({"source": "hub", "max_docs": 10}, ["data.hub_name"], id="hub-without-name"),
    pytest.param({"source": "hub", "hub_name": "wikitext"}, ["data.max_docs", "None"], id="hub-without-cap"),
    pytest.param({"vocab_size": 258}, ["258", "259"], id="vocab-too-small"),
    pytest.param({"val_fraction": 0.0}, ["data.val_fraction=0.0", "(0, 1)"], id="val-fraction-zero"),
    pytest.param({"val_fraction": 1.5}, ["1.5", "(0, 1)"], id="val-fraction-above-one"),
    pytest.param({"batch_size": 0}, ["data.batch_size=0", ">= 1"], id="batch-size-zero"),
    pytest.param({"max_docs": 0}, ["data.max_docs=0"], id="max-docs-zero"),
    pytest.param({"num_workers": -1}, ["data.num_workers=-1"], id="negative-workers"),
    pytest.param({"val_windows": 0}, ["data.val_windows=0"], id="val-windows-zero"),
    pytest.param({"text_field": ""}, ["data.text_field"], id="empty-text-field"),
]


def test_defaults_are_valid():
    cfg = validate(DataConfig())
    assert cfg.source == "embedded" and cfg.vocab_size == 4096


@pytest.mark.parametrize(("change", "expected"), BAD)
def test_bad_values_name_the_value_and_the_choices(change, expected):
    with pytest.raises(ValueError) as error:
        validate(DataConfig(**change))
    for fragment in expected:
        assert fragment in str(error.value)


def test_minimum_vocab_size_is_accepted():
    validate(DataConfig(vocab_size=259))


def test_structured_config_round_trip():
    # The lead stores DataConfig in Hydra's ConfigStore: a DictConfig of it must validate too.
    node = OmegaConf.structured(DataConfig)
    node.vocab_size = 1024
    assert validate(node) == DataConfig(vocab_size=1024)


def test_unknown_key_in_a_mapping_is_named():
    with pytest.raises(ValueError, match=r"vocab_sise.*valid keys"):
        validate({"vocab_sise": 1024})


def test_datamodule_rejects_bad_config_before_touching_disk(tmp_path: Path):
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="data.source='files' needs data.path"):
        CorpusDataModule(DataConfig(source="files", cache_dir=str(cache)), seq_len=8, seed=0, max_steps=1)
    with pytest.raises(ValueError, match="seq_len=0"):
        CorpusDataModule(DataConfig(cache_dir=str(cache)), seq_len=0, seed=0, max_steps=1)
    assert not cache.exists()


def test_package_exports_resolve():
    import data

    assert sorted(data.__all__) == sorted(data._EXPORTS)
    for name in data.__all__:
        assert getattr(data, name) is not None
