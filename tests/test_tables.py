"""Every measured table in README.md and docs/*.md holds the numbers of its raw results file.

scripts/tables.py rebuilds each table from docs/results/; the README and the pages under
docs/ mark each table with `<!-- table NAME -->`, once across all of them. The numbers must
agree (the prose around them is free), and the text before the table must say which file and
which script they come from."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from scripts import tables

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!-- table (\S+) -->$")
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


def numbers(lines: list[str]) -> list[str]:
    return [n.replace(",", "") for line in lines for n in NUMBER.findall(line)]


def marked_tables(text: str) -> dict[str, tuple[list[str], list[str]]]:
    """NAME -> (the table's lines, the 25 lines before its marker)."""
    lines = text.splitlines()
    found: dict[str, tuple[list[str], list[str]]] = {}
    for i, line in enumerate(lines):
        match = MARKER.match(line.strip())
        if not match:
            continue
        assert match[1] not in found, f"table {match[1]} is marked twice"
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        table = []
        while j < len(lines) and lines[j].startswith("|"):
            table.append(lines[j])
            j += 1
        assert table, f"no table under the marker of {match[1]}"
        found[match[1]] = (table, lines[max(0, i - 25):i])
    return found


def all_marked_tables(pages: list[Path]) -> dict[str, tuple[Path, list[str], list[str]]]:
    """NAME -> (the page, the table's lines, the 25 lines before its marker), over all pages."""
    found: dict[str, tuple[Path, list[str], list[str]]] = {}
    for page in pages:
        for name, (table, before) in marked_tables(page.read_text()).items():
            assert name not in found, f"table {name} is marked in {found[name][0].name} and in {page.name}"
            found[name] = (page, table, before)
    return found


@pytest.fixture(scope="module")
def marked() -> dict[str, tuple[Path, list[str], list[str]]]:
    return all_marked_tables(PAGES)


def test_every_table_is_marked_once_and_every_marker_is_a_table(marked):
    assert set(marked) == set(tables.TABLES)


@pytest.mark.parametrize("name", sorted(tables.TABLES))
def test_a_table_holds_the_numbers_its_results_file_gives(marked, name):
    page, published, _ = marked[name]
    rebuilt = tables.render(name)
    assert numbers(published) == numbers(rebuilt), "\n".join([f"{page.name}:", *published, "rebuilt:", *rebuilt])


@pytest.mark.parametrize("name", sorted(tables.TABLES))
def test_a_table_says_which_file_and_script_it_comes_from(marked, name):
    page, _, before = marked[name]
    text = "\n".join(before)
    table = tables.TABLES[name]
    words = table.command.split()
    # python -m scripts.bench NAME: the scenario; python scripts/x.py: the script; else the command
    script = (" ".join(words[2:4]) if words[:2] == ["python", "-m"] else words[1] if words[0] == "python"
              else words[0])
    # the results file as the page would link it: docs/results/... from the README, results/... from docs/
    results = (ROOT / "docs" / "results").relative_to(page.parent).as_posix()
    for file in table.files:
        assert f"{results}/{file}" in text, f"the text before table {name} in {page.name} does not name {results}/{file}"
    assert script in text, f"the text before table {name} in {page.name} does not name {script}"


def test_numbers_are_compared_whole():
    assert numbers(["| 1,026 runs | 0.98x (ngram-simple, k=3) | 45 ms |"]) == ["1026", "0.98", "3", "45"]


def test_a_table_is_the_block_of_rows_under_its_marker():
    text = "intro\n<!-- table t -->\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\nafter 3\n"
    assert marked_tables(text) == {"t": (["| a | b |", "|---|---|", "| 1 | 2 |"], ["intro"])}


def test_a_table_is_marked_once_across_the_pages(tmp_path):
    table = "<!-- table t -->\n| a |\n|---|\n| 1 |\n"
    (tmp_path / "a.md").write_text(table)
    (tmp_path / "b.md").write_text(table)
    with pytest.raises(AssertionError, match="marked in a.md and in b.md"):
        all_marked_tables([tmp_path / "a.md", tmp_path / "b.md"])
