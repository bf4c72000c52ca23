"""Export a prepared corpus as pre-tokenized shards, for machines without a registry or internet.

    python -m data.export --out shards/english                    # the embedded corpus
    python -m data.export --out shards/wiki --source hub --hub-name wikitext \
        --hub-config wikitext-103-raw-v1 --max-docs 20000 --vocab-size 8192

The flags are generated from ``DataConfig`` (``--vocab-size`` for ``vocab_size``; ``none`` for an
optional value), so they cannot drift from it; no Hydra needed. On the other machine, train with
``data.source=shards data.path=<out>``: the arrays load with numpy alone, and training never needs
``datasets`` or a tokenizer run (layout in ``data/store.py``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import MISSING, asdict, fields
from pathlib import Path
from typing import Any

from data.config import DataConfig, validate
from data.pipeline import prepare_corpus
from data.store import save_prepared

# Fields save_prepared computes itself; the rest of the cache manifest (key, config, ...) is kept.
_COMPUTED = {"format", "vocab_size", "eot_id", "token_dtype", "splits", "files"}
_TRANSFER_LIMIT = 64 << 20  # what travels to the GPU machine with the working tree


def export_shards(cfg: DataConfig | Mapping, out: str | Path) -> dict[str, Any]:
    """Prepare ``cfg`` (from the cache when possible) and write it to ``out``; return the manifest."""
    cfg = validate(cfg)
    prepared = prepare_corpus(cfg)
    extra = {k: v for k, v in prepared.manifest.items() if k not in _COMPUTED}
    extra.setdefault("config", asdict(cfg))
    save_prepared(prepared, out, **extra)
    return prepared.manifest


def _parser_for(annotation: str) -> Callable[[str], Any]:
    """A converter for a field annotated ``T`` or ``T | None`` (annotations are strings here)."""
    optional = annotation.endswith("| None")
    convert = {"str": str, "int": int, "float": float}[annotation.removesuffix("| None").strip()]

    def parse(text: str) -> Any:
        return None if optional and text.lower() in ("none", "null") else convert(text)

    parse.__name__ = annotation  # argparse names the type in its error messages
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m data.export", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder to write the shards into")
    for f in fields(DataConfig):
        default = f.default if f.default is not MISSING else None
        parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=_parser_for(f.type),
                            default=default, help=f"(default: {default})")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = vars(build_parser().parse_args(argv))
    out = args.pop("out")
    try:
        cfg = validate(DataConfig(**args))
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    manifest = export_shards(cfg, out)
    total = sum((Path(out) / name).stat().st_size for name in [*manifest["files"], "manifest.json"])
    splits = manifest["splits"]
    print(f"{out}: vocab {manifest['vocab_size']}, train {splits['train']['tokens']:,} tokens / "
          f"{splits['train']['documents']} docs, val {splits['val']['tokens']:,} tokens / "
          f"{splits['val']['documents']} docs, {total / 2**20:.1f} MiB")
    if total > _TRANSFER_LIMIT:
        print(f"warning: more than {_TRANSFER_LIMIT >> 20} MiB; it will not travel with the working tree")


if __name__ == "__main__":
    main()
