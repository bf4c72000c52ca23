"""Check the environment: `python -m platform.doctor` (from the repo root).

Imports every dependency with our `platform` package shadowing the standard library's, calls the
stdlib API they use, and prints versions. Exit code 0 means the shim works here.
"""

from __future__ import annotations

import importlib
import platform


def main() -> dict[str, str]:
    assert hasattr(platform, "__path__"), "`platform` is not this repo's package: run from the repo root"
    report = {"platform.system": platform.system(), "platform.machine": platform.machine(),
              "platform.python_version": platform.python_version(), "platform.release": platform.uname().release}
    for mod in ("torch", "triton", "lightning", "torchmetrics", "hydra", "omegaconf", "optuna", "mlflow",
                "datasets", "tokenizers", "numpy"):
        report[mod] = getattr(importlib.import_module(mod), "__version__", "?")
    import torch

    report["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    for k, v in report.items():
        print(f"{k:>24}: {v}")
    return report


if __name__ == "__main__":
    main()
