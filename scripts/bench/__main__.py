"""The benchmarks, one command: `python -m scripts.bench NAME [ARGS]` from the repository's root.

    python -m scripts.bench                 # each scenario and what it measures
    python -m scripts.bench NAME --help     # its options
    python -m scripts.bench NAME [ARGS]     # run it

A scenario is a module of this package with a `main(argv)`; scripts/tables.py names, for each
published table, the scenario and arguments that produced its results file.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path

from scripts.bench.harness import scenario

SHARED = {"harness", "servers"}  # the modules every scenario uses, not scenarios themselves


def scenarios() -> dict[str, str]:
    """Scenario name (dashes) -> module name."""
    here = [m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)])]
    return {scenario(m): m for m in sorted(here) if m not in SHARED and not m.startswith("_")}


def summary(module: str) -> str:
    doc = importlib.import_module(f"scripts.bench.{module}").__doc__ or ""
    return " ".join(doc.strip().split("\n\n")[0].split())


def main(argv: list[str]) -> int:
    known = scenarios()
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print(__doc__.strip().split("\n\n")[0] + "\n")
        width = max(map(len, known))
        for name, module in known.items():
            print(f"  {name:{width}s}  {summary(module)}")
        return 0
    name, rest = argv[0], argv[1:]
    if scenario(name) not in known:
        print(f"python -m scripts.bench: no scenario {name!r} (there are: {', '.join(known)})", file=sys.stderr)
        return 2
    module = importlib.import_module(f"scripts.bench.{known[scenario(name)]}")
    return module.main(rest) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
