"""README.md and docs/*.md: every relative link resolves, and the README stays short.

A link `[text](path)`, `[text](path#anchor)` or `[text](#anchor)` must name a file or folder
that exists (relative to the page, inside the repository), and an anchor must be a heading of
the Markdown file it points into, by GitHub's rule for heading anchors. Links to http(s) and
mailto are not followed; links inside code blocks and inline code are not links. No model, no
network: this runs in milliseconds."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 420

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
EXTERNAL = re.compile(r"^(https?:|mailto:)", re.IGNORECASE)


def prose_lines(text: str, blank_code: bool = True) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code blanked out."""
    lines = []
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if fence is None and match:
            fence = match[1][0] * len(match[1])
            continue
        if fence is not None:
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                fence = None
            continue
        lines.append((number, INLINE_CODE.sub("", line) if blank_code else line))
    return lines


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link in the page's prose."""
    found = []
    for number, line in prose_lines(text):
        found += [(number, m[1]) for m in LINK.finditer(line)]
        match = REFERENCE.match(line)
        if match:
            found.append((number, match[1]))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (before de-duplication)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = text.strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a Markdown page; repeated headings get -1, -2, ..."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(text, blank_code=False):  # code in a heading is part of its text
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match[2])
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(page: Path, root: Path) -> list[str]:
    """What is wrong with the page's relative links, one line each."""
    problems = []
    for number, target in links(page.read_text()):
        where = f"{page.relative_to(root)}:{number}: ({target})"
        if EXTERNAL.match(target):
            continue
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
            problems.append(f"{where} a link of another scheme")
            continue
        path, _, anchor = target.partition("#")
        path = unquote(path)
        if path.startswith("/"):
            problems.append(f"{where} an absolute path")
            continue
        resolved = (page.parent / path).resolve() if path else page.resolve()
        if not resolved.is_relative_to(root.resolve()):
            problems.append(f"{where} points outside the repository")
            continue
        if not resolved.exists():
            problems.append(f"{where} no such file")
            continue
        if anchor:
            if resolved.suffix != ".md" or not resolved.is_file():
                problems.append(f"{where} an anchor into something that is not a Markdown file")
            elif unquote(anchor) not in anchors(resolved.read_text()):
                problems.append(f"{where} no heading with anchor #{anchor} in {resolved.relative_to(root.resolve())}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    assert broken_links(page, ROOT) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_nothing_points_outside_the_repository(page):
    text = page.read_text()
    assert "../shared" not in text
    assert "/work/" not in text


def test_the_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into a page under docs/"


def test_the_readme_indexes_every_page():
    index = README.read_text()
    for page in PAGES[1:]:
        assert f"](docs/{page.name})" in index, f"the README does not link docs/{page.name}"


# -- the checker itself -------------------------------------------------------------------


def test_slugs_follow_githubs_rule():
    assert slug("Drafting from earlier runs: --spec-pool") == "drafting-from-earlier-runs---spec-pool"
    assert slug("llama.cpp's n-gram drafters: ngram-mod, ngram-map-k4v") == "llamacpps-n-gram-drafters-ngram-mod-ngram-map-k4v"
    assert slug("Editors: llama-server's own endpoints (llama.vim, llama.vscode)") == \
        "editors-llama-servers-own-endpoints-llamavim-llamavscode"
    assert slug("snake_case and [a link](x.md)") == "snake_case-and-a-link"
    assert anchors("# A\n## A\n```\n# A\n```\n### A\n## `B` c\n") == {"a", "a-1", "a-2", "b-c"}


def test_links_in_code_are_not_links():
    text = "[a](a.md) `[b](b.md)`\n```\n[c](c.md)\n```\n[d](d.md#x) [e](https://e) [f]: f.md\n[g]: g.md\n"
    assert links(text) == [(1, "a.md"), (5, "d.md#x"), (5, "https://e"), (6, "g.md")]


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "x.md").write_text("# X\n\n## Two words\n")
    page = tmp_path / "README.md"
    page.write_text(
        "# Top\n"
        "[ok](docs/x.md) [ok](docs/x.md#two-words) [ok](#top) [ok](https://example.com/nothing)\n"
        "[missing](docs/y.md)\n"
        "[bad anchor](docs/x.md#three-words)\n"
        "[bad local anchor](#bottom)\n"
        "[outside](../outside.md)\n"
        "[absolute](/etc/passwd)\n"
    )
    problems = broken_links(page, tmp_path)
    assert [p.split(":")[1] for p in problems] == ["3", "4", "5", "6", "7"], problems
