"""Token- and depth-axis kernels used by the residual mechanisms: one folder per op, each with a
pure-PyTorch ``reference.py`` (the specification) and one public function in ``__init__.py``."""
