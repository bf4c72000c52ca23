"""`python -m platform.sweep`: see platform/sweep/__init__.py."""

from .cli import main

if __name__ == "__main__":
    main()
