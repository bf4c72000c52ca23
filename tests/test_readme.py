"""The README stays true: it documents every registered residual and ablation, and its tables."""

import ablations
import residuals
from platform.list import markdown
from tests.helpers import ROOT

README = (ROOT / "README.md").read_text()


def test_readme_lists_every_residual_and_ablation():
    for name in residuals.names():
        assert f"`{name}`" in README, name
    for name in ablations.names():
        assert f"`{name}`" in README, name


def test_readme_tables_match_the_registries():
    # Regenerate with `python -m platform.list --markdown` when a registry entry changes.
    for line in markdown().splitlines():
        if line.startswith("| `"):
            assert line in README, line
