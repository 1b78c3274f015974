"""The README and the pages of docs/ link to each other, and every local link lands: the file exists and,
for ``page.md#anchor``, a heading of that page has that anchor (as GitHub makes anchors from headings)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import ROOT

README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def prose(path: Path) -> list[str]:
    """The lines of a markdown file outside its fenced code blocks."""
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``path``: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces made ``-``, a repeated one numbered."""
    found: set[str] = set()
    for line in prose(path):
        heading = re.match(r"#{1,6} (.*)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            numbered, count = slug, 0
            while numbered in found:
                count += 1
                numbered = f"{slug}-{count}"
            found.add(numbered)
    return found


def local_links(path: Path) -> list[str]:
    return [target for line in prose(path) for target in LINK.findall(line)
            if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda page: page.relative_to(ROOT).as_posix())
def test_every_local_link_lands(page):
    for target in local_links(page):
        file, _, anchor = target.partition("#")
        linked = (page.parent / file).resolve() if file else page
        assert linked.exists(), f"{page.relative_to(ROOT)}: link to {target}: no such file"
        if anchor:
            assert anchor in anchors(linked), (f"{page.relative_to(ROOT)}: link to {target}: "
                                               f"{linked.relative_to(ROOT)} has no heading with that anchor")


def test_readme_links_every_page_and_every_page_links_back():
    from_readme = {(README.parent / target.partition("#")[0]).resolve() for target in local_links(README)}
    for page in PAGES:
        assert page.resolve() in from_readme, f"README.md does not link to {page.relative_to(ROOT)}"
        back = {(page.parent / target.partition("#")[0]).resolve() for target in local_links(page)}
        assert README.resolve() in back, f"{page.relative_to(ROOT)} does not link back to the README"
