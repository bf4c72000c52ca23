"""Shared fixtures: a small slice of the embedded corpus, prepared once per session in a temp cache.

The slice (the first 150 scenes, ~0.9 MB) with a 512-token vocabulary builds in about a second, so
the data tests exercise the real pipeline end to end without the full corpus's ~8 s build.
"""

from __future__ import annotations

import pytest

from data.config import DataConfig
from data.pipeline import prepare_corpus

SMALL = {"max_docs": 150, "vocab_size": 512, "val_fraction": 0.1, "batch_size": 4}


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("data-cache"))


@pytest.fixture(scope="session")
def small_cfg(session_cache) -> DataConfig:
    return DataConfig(cache_dir=session_cache, **SMALL)


@pytest.fixture(scope="session")
def small_prepared(small_cfg):
    return prepare_corpus(small_cfg)
