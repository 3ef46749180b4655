"""The command line, `speculate`, imported as speculative.cli (see speculative/cli/__init__.py)."""
