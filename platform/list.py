"""List what can be selected: `python -m platform.list [residuals|ablations|--markdown]`.

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
        doc = (cls.__doc__ or sys.modules[cls.__module__].__doc__ or "").strip().split("\n\n")[0]
        doc = " ".join(doc.split())
        fields = ", ".join(f"{f.name}={_default(f)}" for f in dataclasses.fields(cls.Config) if f.name != "name")
        rows.append((name, doc, fields))
    return rows


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
        if dataclasses.is_dataclass(value):  # a nested variant config: point at its own row
            return f"<{value.name} defaults>"
        return value
    return "?"


def markdown() -> str:
    """Both tables as markdown (the README's tables are this output)."""
    import ablations

    lines = ["| residual | what it computes | config fields (defaults) |", "|---|---|---|"]
    lines += [f"| `{n}` | {d} | {f or '-'} |" for n, d, f in residual_table()]
    lines += ["", "| ablation | question | baseline | changes | paper |", "|---|---|---|---|---|"]
    lines += [f"| `{a.name}` | {a.question} | `{a.baseline}` | {a.describe_changes()} | {a.paper or '-'} |"
              for a in ablations.all_ablations()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    import ablations

    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--markdown":
        print(markdown())
        return
    what = argv[0] if argv else "all"
    if what not in ("all", "residuals", "ablations"):
        raise SystemExit(f"error: unknown listing {what!r}; choose residuals, ablations, --markdown or nothing")
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=max(120, Console().width))
    if what in ("all", "residuals"):
        table = Table(title="residuals (residual=<name>)", show_lines=True)
        for col in ("name", "description", "config fields (defaults)"):
            table.add_column(col, overflow="fold")
        for row in residual_table():
            table.add_row(*map(escape, row))  # descriptions hold [brackets] that Rich would read as markup
        console.print(table)
    if what in ("all", "ablations"):
        table = Table(title="ablations (ablation=<name>)", show_lines=True)
        for col in ("name", "question", "baseline", "changes", "paper"):
            table.add_column(col, overflow="fold")
        for ab in ablations.all_ablations():
            table.add_row(*map(escape, (ab.name, ab.question, ab.baseline, ab.describe_changes(), ab.paper or "-")))
        if not ablations.names():
            table.add_row("(none registered yet)", "", "", "", "")
        console.print(table)


if __name__ == "__main__":
    main()
