"""Prepare an offline GPU host in one command: `make gpu-bundle` (or `python -m benchmarks.gpu_bundle`).

Writes, both git-ignored and small enough to travel with the working tree (≤ 64 MiB in all):
- `.whl/`: the wheels the host lacks for its Python (constraints/gpu-bundle.txt with their
  dependencies, minus what the host has: constraints/gpu-host.txt), for CPython 3.12 on x86-64
  manylinux. antlr4-python3-runtime 4.9.3 ships only an sdist: its wheel is built first and offered
  with `--find-links`, or pip silently resolves hydra-core 0.11.3 and omegaconf 1.4.1. The pinned
  versions are checked against the wheel files afterwards.
- `.shards/english/`: the embedded corpus as pre-tokenized shards (`python -m data.export`).

`benchmarks/gpu_check.sh` consumes both. Fails (exit 1) on a wrong version or an oversized bundle.
"""

from __future__ import annotations

import argparse
import fnmatch
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WANTED = ROOT / "constraints" / "gpu-bundle.txt"
HOST_HAS = ROOT / "constraints" / "gpu-host.txt"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_12_x86_64", "manylinux2010_x86_64", "manylinux_2_5_x86_64",
             "manylinux1_x86_64", "linux_x86_64")
MAX_WHEEL_MB = 40


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_lines(path: Path) -> list[str]:
    return [line.split("#")[0].strip() for line in path.read_text().splitlines() if line.split("#")[0].strip()]


def wheel_name_version(path: Path) -> tuple[str, str]:
    name, version = path.name.split("-")[:2]
    return norm(name), version


def pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def build_wheels(out: Path, python_version: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):
        old.unlink()
    with tempfile.TemporaryDirectory() as tmp:
        built, fetched = Path(tmp) / "built", Path(tmp) / "fetched"
        # 1. The sdist-only package, built into a pure-Python wheel (py3-none-any) that any host takes.
        pip("wheel", "--quiet", "--no-deps", "--wheel-dir", str(built), "antlr4-python3-runtime==4.9.3")
        # 2. Everything else with its dependencies, as binaries for the host's Python and platform.
        pip("download", "--quiet", "--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
            *[a for p in PLATFORMS for a in ("--platform", p)], "--find-links", str(built),
            "--dest", str(fetched), "-r", str(WANTED))
        host = [norm(p) for p in requirement_lines(HOST_HAS)]
        for wheel in sorted(fetched.glob("*.whl")):
            name, _ = wheel_name_version(wheel)
            if not any(fnmatch.fnmatch(name, pattern) for pattern in host):
                shutil.copy2(wheel, out / wheel.name)
    return sorted(out.glob("*.whl"))


def check(wheels: list[Path]) -> list[str]:
    """Problems: a pinned package missing or at another version, or a bundle over the size limit."""
    have = dict(wheel_name_version(w) for w in wheels)
    problems = []
    for line in requirement_lines(WANTED):
        name, _, version = line.partition("==")
        if norm(name) not in have:
            problems.append(f"{name}: no wheel in the bundle")
        elif version and have[norm(name)] != version:
            problems.append(f"{name}: resolved {have[norm(name)]}, wanted {version}")
    total = sum(w.stat().st_size for w in wheels) / 2**20
    if total > MAX_WHEEL_MB:
        problems.append(f"the wheels take {total:.1f} MiB, over the {MAX_WHEEL_MB} MiB budget")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wheels", type=Path, default=ROOT / ".whl")
    p.add_argument("--shards", type=Path, default=ROOT / ".shards" / "english")
    p.add_argument("--python-version", default="3.12")
    p.add_argument("--skip-shards", action="store_true")
    a = p.parse_args(argv)
    wheels = build_wheels(a.wheels, a.python_version)
    total = sum(w.stat().st_size for w in wheels) / 2**20
    print(f"\n{len(wheels)} wheels, {total:.1f} MiB in {a.wheels}:")
    for w in wheels:
        print(f"  {w.stat().st_size / 2**20:6.2f} MiB  {w.name}")
    problems = check(wheels)
    if not a.skip_shards:
        subprocess.run([sys.executable, "-m", "data.export", "--out", str(a.shards)], check=True, cwd=ROOT)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if not problems:
        print("pinned versions verified: " + ", ".join(l for l in requirement_lines(WANTED) if "==" in l))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
