"""`python -m platform.compare`: see platform/compare/__init__.py."""

from ..env import set_offline_defaults

set_offline_defaults()

from .command import main  # noqa: E402

if __name__ == "__main__":
    main()
