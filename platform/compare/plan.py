"""What a comparison runs: its typed options (`compare.*`, a `compare=<preset>` from conf/compare/),
the variants (residuals or registered ablations) in table order, with their baselines and references.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from omegaconf import OmegaConf

from ..cli import override_key
from ..env import REPO_ROOT

PRESET_DIR = REPO_ROOT / "conf" / "compare"
# docs/method.md §5, main results (MoE, 18B tokens); the paper's method is the block variant.
PAPER_MAIN = {"vanilla": "1.799", "mhc": "1.776", "attnres": "1.769", "attnres_block": "1.769",
              "msar": "1.750", "msar_block": "1.750"}
PAPER_MAIN_NOTE = "final loss, MoE 18B tokens"


@dataclass
class CompareConfig:
    """`compare.*`: the schema of a comparison and of every preset in conf/compare/ (a misspelt key fails)."""

    runs: list[str] = field(default_factory=lambda: ["vanilla", "msar_block"])  # residual or ablation names
    seeds: Optional[list[int]] = field(default_factory=lambda: [0, 1, 2])  # null (train=false): all found
    train: bool = True  # train the runs MLflow lacks; false: only read
    baseline: str = "vanilla"  # plain residuals' baseline; ablations use their own
    add_baselines: bool = True  # also run/read the variants' baselines and the references
    references: list[str] = field(default_factory=lambda: ["vanilla"])  # a Δ column each, paired by seed
    target: Optional[str] = None  # whose final loss the wall-clock column times; default references[0]
    overrides: list[str] = field(default_factory=list)  # config overrides of the preset (before the command line's)
    workers: int = 1  # runs trained in parallel, one GPU each (0: one per visible GPU; 1 on a CPU machine)
    name: Optional[str] = None  # report name; default the variants joined by "_"
    out_dir: Optional[str] = None  # default outputs/compare/<name>
    report: Optional[str] = None  # also write the markdown (plots and json beside it), e.g. benchmarks/results/
    level: float = 0.95  # confidence level of the intervals
    log_comparison: bool = True  # log the table and plots to an MLflow comparison run


@dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # "residual" | "ablation"
    override: str  # the config override that selects it
    baseline: str | None  # the variant it is compared with (None: it is the reference)
    paper: str = ""
    describe: str = ""


def presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_preset(name: str):
    if name not in presets():
        raise ValueError(f"compare={name!r} is not a preset; presets: {', '.join(presets()) or 'none'} "
                         f"(files in {PRESET_DIR.relative_to(REPO_ROOT)}/)")
    return OmegaConf.load(PRESET_DIR / f"{name}.yaml")


def parse_args(argv: Sequence[str]) -> tuple[CompareConfig, list[str]]:
    """Split `compare=<preset>` and `compare.*` options (typed) from the config overrides that every run
    shares. A preset's own `overrides` come first in the returned list, so the command line wins."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    node = OmegaConf.structured(CompareConfig)
    parsed = list(zip(argv, OverridesParser.create().parse_overrides(list(argv))))
    for text, ov in parsed:  # the preset first, whatever its place on the line
        if ov.key_or_group == "compare":
            try:
                node = OmegaConf.merge(node, load_preset(str(ov.value())))
            except ValueError:
                raise
            except Exception as e:  # a preset key that is not a compare.* option, or a wrong type
                raise ValueError(f"conf/compare/{ov.value()}.yaml: {str(e).splitlines()[0]}; options: "
                                 f"{', '.join(CompareConfig.__dataclass_fields__)}") from None
    base = []
    for text, ov in parsed:
        key = ov.key_or_group
        if key == "compare":
            continue
        if not key.startswith("compare."):
            if key.lstrip("+~") in ("residual", "ablation", "seed"):
                raise ValueError(f"{text!r}: the variants come from compare.runs and the seeds from compare.seeds")
            base.append(text)
            continue
        if ov.is_sweep_override():
            raise ValueError(f"{text!r}: give a list, e.g. compare.runs=[vanilla,msar_block]")
        OmegaConf.update(node, key[len("compare."):], ov.value(), merge=False)
    cc: CompareConfig = OmegaConf.to_object(node)
    if not cc.runs:
        raise ValueError("compare.runs is empty")
    if cc.seeds is not None and not cc.seeds:
        raise ValueError("compare.seeds is empty (null reads every seed found, with compare.train=false)")
    if cc.seeds is None and cc.train:
        raise ValueError("compare.seeds=null needs compare.train=false: training needs the seeds to run")
    if not 0 < cc.level < 1:
        raise ValueError(f"compare.level={cc.level} must be in (0, 1)")
    if cc.workers < 0:
        raise ValueError(f"compare.workers={cc.workers} must be >= 0 (0: one per visible GPU)")
    if cc.target is not None and cc.target not in cc.references:
        raise ValueError(f"compare.target={cc.target!r} must be one of compare.references {cc.references}")
    bad = [o for o in cc.overrides if override_key(o) in ("residual", "ablation", "seed")]
    if bad:
        raise ValueError(f"compare.overrides {bad}: the variants come from compare.runs and the seeds from compare.seeds")
    given = {override_key(o) for o in base}  # Hydra refuses a key given twice
    return cc, [*(o for o in cc.overrides if override_key(o) not in given), *base]


def resolve_variant(name: str, default_baseline: str) -> Variant:
    import ablations
    import residuals

    if name in ablations.names():
        ab = ablations.get(name)
        return Variant(name, "ablation", f"ablation={name}", ab.baseline if ab.baseline != name else None,
                       ab.paper, f"ablation: {ab.describe_changes()}")
    if name in residuals.names():
        paper = f"{PAPER_MAIN[name]} ({PAPER_MAIN_NOTE})" if name in PAPER_MAIN else ""
        return Variant(name, "residual", f"residual={name}", default_baseline if name != default_baseline else None,
                       paper, "residual")
    raise ValueError(f"compare.runs: {name!r} is neither a registered ablation ({', '.join(ablations.names())}) "
                     f"nor a residual ({', '.join(residuals.names())})")


def plan_variants(cc: CompareConfig) -> list[Variant]:
    """The variants in table order: the references first (when baselines are added), then each added
    baseline just before the first variant that needs it."""
    asked = [resolve_variant(n, cc.baseline) for n in dict.fromkeys(cc.runs)]
    for ref in cc.references:
        resolve_variant(ref, cc.baseline)  # a misspelt reference fails here, naming the valid ones
    names = {v.name for v in asked}
    out: list[Variant] = []
    if cc.add_baselines:
        for ref in cc.references:
            if ref not in names and ref not in {v.name for v in out}:
                out.append(resolve_variant(ref, cc.baseline))
    names |= {v.name for v in out}
    for v in asked:
        if cc.add_baselines and v.baseline and v.baseline not in names:
            out.append(resolve_variant(v.baseline, cc.baseline))
            names.add(v.baseline)
        out.append(v)
    return out
