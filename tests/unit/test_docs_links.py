"""Links between the user's pages resolve: every relative link in README.md, DEVELOPERS.md and
docs/*.md names a file of the repository, and a #fragment names a heading of that page (GitHub's
anchors). Links out of the repository (http, mailto) are not followed."""

import re
from pathlib import Path
from typing import List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "DEVELOPERS.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _prose(page: Path) -> List[str]:
    """The page's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> Set[str]:
    return {_anchor(line.lstrip("#")) for line in _prose(page) if re.match(r"#{1,6} ", line)}


def _links(page: Path) -> List[Tuple[str, str]]:
    return [(page.name, target) for line in _prose(page) for target in LINK.findall(line)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path):
    broken = []
    for _, target in _links(page):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, fragment = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif fragment and linked.suffix == ".md" and fragment not in _anchors(linked):
            broken.append(f"{target}: no heading #{fragment}")
    assert broken == []


def test_the_readme_keeps_the_set_up_commands_and_stays_a_front_door():
    """CI and its hook grep the README for `make demo` and `make test`; the guide is in docs/."""
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
    assert len(readme.splitlines()) <= 300
