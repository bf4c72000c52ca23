"""The `platform` package also provides the standard library's platform API."""

import subprocess
import sys

import platform

from tests.helpers import ROOT


def test_package_is_ours_and_has_stdlib_api():
    assert hasattr(platform, "__path__"), "tests must see this repo's platform package"
    assert platform.system() == __import__("os").uname().sysname
    assert platform.python_version() == ".".join(map(str, sys.version_info[:3]))
    assert platform.uname().machine == platform.machine()
    assert isinstance(platform.platform(), str) and platform.platform()


def test_dependencies_import_under_python_m():
    # `python -m platform.doctor` from the repo root: torch, lightning, mlflow, optuna, hydra,
    # datasets ... all import while our package shadows the stdlib module.
    out = subprocess.run([sys.executable, "-m", "platform.doctor"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    for mod in ("torch", "lightning", "mlflow", "optuna", "hydra", "datasets", "platform.system"):
        assert f"{mod}:" in out.stdout


def test_run_help_lists_groups():
    out = subprocess.run([sys.executable, "-m", "platform.run", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "residual:" in out.stdout and "vanilla" in out.stdout
