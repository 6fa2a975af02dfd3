"""The documentation's links: every relative link of README.md, the docs/ pages and the
benchmark suite's manual names a file of the repository, and every ``#anchor`` a heading
of its target (GitHub's heading ids); README.md stays a front page that links each page.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", ROOT / "benchmarks" / "README.md",
                *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def outside_fences(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    kept, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced:
            kept.append(line)
    return kept


def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code."""
    return "\n".join(re.sub(r"`[^`]*`", "", line) for line in outside_fences(text))


def heading_ids(text: str) -> set[str]:
    """GitHub's ids of a page's headings: lower case, punctuation other than '-' and '_'
    dropped, spaces as '-', a repeated id numbered -1, -2, ..."""
    ids: set[str] = set()
    for line in outside_fences(text):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = re.sub(r"[^\w\- ]", "", m.group(1).replace("`", "").lower()).replace(" ", "-")
        slug, n = base, 0
        while slug in ids:
            n += 1
            slug = f"{base}-{n}"
        ids.add(slug)
    return ids


def links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page.read_text())) if not re.match(r"[a-z]+:", t)]


def test_the_pages_hold_links():
    assert len(PAGES) >= 8
    assert sum(len(links(p)) for p in PAGES) >= 20


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    bad = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or ROOT not in (dest, *dest.parents):
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in heading_ids(dest.read_text()):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not bad, "\n".join(bad)


def test_the_front_page_is_short_and_links_every_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 350
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(ROOT / "README.md")}
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_the_heading_ids_follow_github():
    text = "# Use with `transformers`\n## What it replaces, and how it decides\n## A\n## A\n"
    assert heading_ids(text) == {"use-with-transformers", "what-it-replaces-and-how-it-decides",
                                 "a", "a-1"}
