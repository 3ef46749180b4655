#!/usr/bin/env python3
"""The README's measured tables, rebuilt from the raw results committed under docs/results/.

    python scripts/tables.py             # every table
    python scripts/tables.py fim pool    # some of them
    python scripts/tables.py --list      # each table's name, file and the command that measured it

Each table of measurements in README.md follows a marker line `<!-- table NAME -->`; the
table under it must hold the numbers this script prints for NAME (tests/test_tables.py
checks it), so a published figure always comes with the file it was computed from and the
command that produced that file. To publish a new measurement: run the command, commit its
output under docs/results/, and paste what this script prints.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"


@dataclass(frozen=True)
class Table:
    name: str
    files: tuple[str, ...]  # under docs/results/
    command: str            # what produced the files (the first one's meta says exactly)
    render: Callable[..., list[str]]  # one loaded file per name in `files` -> the table's lines


def load(name: str):
    path = RESULTS / name
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if name.endswith(".gz") else data)


def row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def header(*names: str) -> list[str]:
    return [row(*names), row(*["---"] * len(names))]


def median(values):
    return statistics.median(list(values))


# -- the tables ------------------------------------------------------------------------


def recurrent(data) -> list[str]:
    draft = data["args"]["draft"]
    lines = header("architecture", "rollback", "recurrent state", f"with {draft} snapshots", "one token",
                   f"verify of {draft + 1}, plain / with snapshots", "checkpoint copy / restore")
    for r in data["rows"]:
        lines.append(row(r["arch"], "snapshots" if r["snapshots_limit"] else "checkpoint",
                         f"{r['plain_state_mib']:.2f} MiB", f"{r['snapshots_state_mib']:.2f} MiB",
                         f"{r['plain_v1_ms']:.1f} ms", f"{r['plain_verify_ms']:.1f} / {r['snapshots_verify_ms']:.1f} ms",
                         f"{r['checkpoint_save_ms']:.2f} / {r['checkpoint_restore_ms']:.2f} ms"))
    return lines


TABLES = {t.name: t for t in [
    Table("recurrent", ("recurrent.json",), "python scripts/bench_recurrent.py -o docs/results/recurrent.json",
          recurrent),
]}


def render(name: str) -> list[str]:
    table = TABLES[name]
    return table.render(*(load(f) for f in table.files))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"tables to print (default: all): {', '.join(TABLES)}")
    parser.add_argument("--list", action="store_true", help="name, files and command of each table")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in TABLES]
    if unknown:
        parser.error(f"unknown table {', '.join(unknown)} (known: {', '.join(TABLES)})")
    for name in args.names or TABLES:
        table = TABLES[name]
        if args.list:
            print(f"{name}: docs/results/{', docs/results/'.join(table.files)}  ({table.command})")
            continue
        print(f"<!-- table {name} -->  {table.command}")
        print("\n".join(render(name)))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
