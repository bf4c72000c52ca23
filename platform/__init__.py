"""The platform package, which also *is* the standard library's ``platform`` module.

``python -m platform.run`` puts the repo root first on ``sys.path``, so every ``import platform``
in the process (torch, lightning, mlflow, numpy, uuid, ...) resolves to this package. To keep them
working, the standard library module's code is executed into this namespace: ``platform.system()``,
``platform.machine()``, ``platform.uname()`` ... behave exactly as usual, and our submodules
(``platform.run``, ``platform.model``, ...) live beside them.

Only works from the repo root (see the README, "The repo-root rule").
"""

import importlib.machinery as _machinery
import sysconfig as _sysconfig

_spec = _machinery.PathFinder.find_spec("platform", [_sysconfig.get_paths()["stdlib"]])
if _spec is None or _spec.loader is None:  # pragma: no cover - a broken Python install
    raise ImportError("cannot locate the standard library's platform module")
exec(_spec.loader.get_code("platform"), globals())  # noqa: S102 - the stdlib's own code
del _machinery, _sysconfig, _spec
