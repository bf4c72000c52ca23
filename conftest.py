"""Root conftest: make ``platform`` our package (which also carries the stdlib API) for pytest.

The ``pytest`` console script imports the standard library's ``platform`` before any conftest runs;
drop that module and re-import with the repo root first on ``sys.path``.
"""

import os
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent)
if sys.path[0] != ROOT:
    sys.path.insert(0, ROOT)
if not hasattr(sys.modules.get("platform"), "__path__"):
    sys.modules.pop("platform", None)
    import platform  # noqa: F401,E402 - re-import as our package

os.environ.setdefault("OMP_NUM_THREADS", "1")
from platform.env import set_offline_defaults  # noqa: E402

set_offline_defaults()
# Kernels run through Triton's interpreter on CPU; it must be set before any kernel module import.
try:
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    _torch.set_num_threads(1)
except ImportError:  # pragma: no cover
    pass
