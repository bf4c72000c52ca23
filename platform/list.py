"""List what can be selected: `python -m platform.list [residuals|ablations]`.

Registered residual mechanisms with their config fields, and registered ablations with the
question each answers, its baseline, the config it changes and the paper's number.
"""

from __future__ import annotations

import dataclasses
import sys


def residual_table() -> list[tuple[str, str, str]]:
    import residuals

    rows = []
    for name in residuals.names():
        cls = residuals.get(name)
        doc = (cls.__doc__ or sys.modules[cls.__module__].__doc__ or "").strip().splitlines()[0]
        fields = ", ".join(f"{f.name}={_default(f)}" for f in dataclasses.fields(cls.Config) if f.name != "name")
        rows.append((name, doc, fields))
    return rows


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return "?"


def main(argv: list[str] | None = None) -> None:
    import ablations

    argv = sys.argv[1:] if argv is None else argv
    what = argv[0] if argv else "all"
    if what not in ("all", "residuals", "ablations"):
        raise SystemExit(f"error: unknown listing {what!r}; choose residuals, ablations or nothing (both)")
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(120, Console().width))
    if what in ("all", "residuals"):
        table = Table(title="residuals (residual=<name>)", show_lines=True)
        for col in ("name", "description", "config fields (defaults)"):
            table.add_column(col, overflow="fold")
        for row in residual_table():
            table.add_row(*row)
        console.print(table)
    if what in ("all", "ablations"):
        table = Table(title="ablations (ablation=<name>)", show_lines=True)
        for col in ("name", "question", "baseline", "changes", "paper"):
            table.add_column(col, overflow="fold")
        for ab in ablations.all_ablations():
            table.add_row(ab.name, ab.question, ab.baseline, ab.describe_changes(), ab.paper or "-")
        if not ablations.names():
            table.add_row("(none registered yet)", "", "", "", "")
        console.print(table)


if __name__ == "__main__":
    main()
