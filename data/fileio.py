"""Small file helpers shared by the cache and the export: atomic writes and content digests."""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Callable
from pathlib import Path


def write_atomic(path: str | Path, write: Callable[[str], None]) -> None:
    """``write(tmp_path)``, then rename onto ``path``: readers see the old file or the whole new one,
    also when two processes fill the same cache entry at once."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        write(str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def file_digest(path: str | Path) -> str:
    """BLAKE2b of a file's bytes (hex, 128 bits), read in 1 MiB chunks."""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
