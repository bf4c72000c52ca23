"""Fold the runs of another MLflow SQLite store into ours: runs trained on a host without internet
access come back as a copy of that host's store, and this makes them part of the local one.

    python -m platform.store merge /path/to/other/mlruns/mlflow.db            # into mlruns/mlflow.db
    python -m platform.store merge other.db --into sqlite:///elsewhere.db

Experiments are matched by name (created here when missing). A run we lack is copied whole: its
row, params, tags, metric history and latest metrics, and its artifact folder when it lies beside
the other store (`<dir of other.db>/artifacts/...`, the layout of `mlruns/`), with its artifact
location rewritten to ours. A run we both have gets the metric points, params and tags we lack, and
the other store's status and end time when ours is not finished and theirs is. Merging the same
store twice changes nothing. Both stores must be at the same schema revision (the same MLflow).
"""

from __future__ import annotations

import argparse
import shutil
import sqlite3
from pathlib import Path

from .env import REPO_ROOT
from .tracking import sqlite_path

RUN_TABLES = ("params", "tags", "metrics")  # rows keyed by run_uuid, copied where missing
DONE = ("FINISHED", "FAILED", "KILLED")


def _db_file(uri_or_path: str) -> Path:
    """The database file of a store given as a path or a `sqlite:///` URL (`tracking.sqlite_path`)."""
    if "://" not in uri_or_path:
        return Path(uri_or_path)
    db = sqlite_path(uri_or_path)
    if db is None:
        raise ValueError(f"{uri_or_path!r}: only SQLite stores can be merged (sqlite:///path or a path)")
    return db


def _columns(db: sqlite3.Connection, table: str) -> list[str]:
    return [row[1] for row in db.execute(f"PRAGMA main.table_info('{table}')")]


def _local_artifacts(uri: str | None, root: Path) -> Path | None:
    """Where a run's file: artifact folder lies under the store folder `root`: the part of its path
    from the store's `artifacts/` folder on (the layout of `mlruns/`); None for other URIs."""
    if not uri or not uri.startswith("file://"):
        return None
    parts = Path(uri[len("file://"):]).parts
    return root.joinpath(*parts[parts.index("artifacts"):]) if "artifacts" in parts else None


def merge(src: str | Path, into: str | Path) -> dict[str, int]:
    """Merge store `src` into store `into` (paths or sqlite:/// URIs); returns counts of what was added."""
    src_db, dst_db = _db_file(str(src)).resolve(), _db_file(str(into)).resolve()
    for p in (src_db, dst_db):
        if not p.is_file():
            raise ValueError(f"{p}: no MLflow store there (run something first, or check the path)")
    if src_db == dst_db:
        raise ValueError(f"{src_db}: a store cannot be merged into itself")
    db = sqlite3.connect(dst_db)
    try:
        db.execute("ATTACH DATABASE ? AS other", (str(src_db),))
        ours, theirs = (db.execute(f"SELECT version_num FROM {s}.alembic_version").fetchone()
                        for s in ("main", "other"))
        if ours != theirs:
            raise ValueError(f"schema revisions differ ({dst_db.name}: {ours[0]}, {src_db.name}: {theirs[0]}): "
                             "open both with the same MLflow version first")
        counts = {"experiments": 0, "runs": 0, "run_rows": 0, "artifact_dirs": 0}
        exp_map = {}
        for exp_id, name in db.execute("SELECT experiment_id, name FROM other.experiments").fetchall():
            row = db.execute("SELECT experiment_id FROM main.experiments WHERE name = ?", (name,)).fetchone()
            if row is None:
                cols = [c for c in _columns(db, "experiments") if c != "experiment_id"]
                cur = db.execute(f"INSERT INTO main.experiments ({','.join(cols)}) SELECT {','.join(cols)} "
                                 "FROM other.experiments WHERE experiment_id = ?", (exp_id,))
                row = (cur.lastrowid,)
                counts["experiments"] += 1
            exp_map[exp_id] = row[0]
        run_cols = _columns(db, "runs")
        for (uuid,) in db.execute("SELECT run_uuid FROM other.runs").fetchall():
            mine = db.execute("SELECT status FROM main.runs WHERE run_uuid = ?", (uuid,)).fetchone()
            if mine is None:
                values = dict(zip(run_cols, db.execute("SELECT * FROM other.runs WHERE run_uuid = ?",
                                                       (uuid,)).fetchone()))
                values["experiment_id"] = exp_map[values["experiment_id"]]
                src_art = _local_artifacts(values.get("artifact_uri"), src_db.parent)
                dst_art = _local_artifacts(values.get("artifact_uri"), dst_db.parent)
                if src_art is not None and dst_art is not None and src_art.is_dir() and src_art != dst_art:
                    shutil.copytree(src_art, dst_art, dirs_exist_ok=True)
                    values["artifact_uri"] = dst_art.as_uri()
                    counts["artifact_dirs"] += 1
                db.execute(f"INSERT INTO main.runs ({','.join(values)}) VALUES ({','.join('?' * len(values))})",
                           list(values.values()))
                counts["runs"] += 1
            elif mine[0] not in DONE:
                status, end = db.execute("SELECT status, end_time FROM other.runs WHERE run_uuid = ?",
                                         (uuid,)).fetchone()
                if status in DONE:
                    db.execute("UPDATE main.runs SET status = ?, end_time = ? WHERE run_uuid = ?", (status, end, uuid))
        for table in RUN_TABLES:
            cols = ",".join(_columns(db, table))
            before = db.total_changes
            db.execute(f"INSERT OR IGNORE INTO main.{table} ({cols}) SELECT {cols} FROM other.{table}")
            counts["run_rows"] += db.total_changes - before
        # latest_metrics: theirs where it is later (step, then timestamp) than ours or ours is missing
        cols = ",".join(_columns(db, "latest_metrics"))
        db.execute(f"INSERT OR REPLACE INTO main.latest_metrics ({cols}) SELECT {cols} FROM other.latest_metrics o "
                   "WHERE NOT EXISTS (SELECT 1 FROM main.latest_metrics m WHERE m.run_uuid = o.run_uuid AND "
                   "m.key = o.key AND (m.step > o.step OR (m.step = o.step AND m.timestamp >= o.timestamp)))")
        db.commit()
        return counts
    finally:
        db.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m platform.store", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge", help="fold another store's runs into ours")
    m.add_argument("src", help="the other store: a path to its mlflow.db or sqlite:///path")
    m.add_argument("--into", default=str(REPO_ROOT / "mlruns" / "mlflow.db"),
                   help="our store (default: mlruns/mlflow.db of the repo)")
    a = p.parse_args(argv)
    try:
        counts = merge(a.src, a.into)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    print(f"merged {a.src} into {a.into}: {counts['runs']} new run(s), {counts['run_rows']} param/tag/metric rows, "
          f"{counts['experiments']} new experiment(s), {counts['artifact_dirs']} artifact folder(s) copied")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
