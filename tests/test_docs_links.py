"""Relative links in README.md and docs/*.md point at files that exist (and at headings that exist)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def prose(markdown: str) -> str:
    """The text outside fenced blocks and code spans (where a ``[x](y)`` is not a link)."""
    return CODE_SPAN.sub("", FENCE.sub("", markdown))


def github_anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {github_anchor(m[1]) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page.read_text())) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_helpers_on_a_hand_written_page():
    page = "See [a](docs/a.md#two-words), ![f](x.png), [web](https://e.org), `[no](code.md)`\n```\n[no](f.md)\n```\n"
    assert LINK.findall(prose(page)) == ["docs/a.md#two-words", "x.png", "https://e.org"]
    assert github_anchor("Two words") == "two-words"
    assert github_anchor("A device log without an LLM: `fedroute demo-log`") == "a-device-log-without-an-llm-fedroute-demo-log"
    assert github_anchor("0. A signed bundle (shared by the next two)") == "0-a-signed-bundle-shared-by-the-next-two"


def test_the_docs_pages_exist_and_have_links():
    names = {p.name for p in PAGES}
    for page in ("routers-and-results.md", "device-and-bundles.md", "sync-protocol-and-operations.md",
                 "privacy-and-dp.md", "benchmarks.md"):
        assert page in names
    assert len(relative_links(ROOT / "README.md")) >= 10


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    broken = []
    for target in relative_links(page):
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.is_relative_to(ROOT) or not resolved.exists():
            broken.append(f"{target}: no file {resolved}")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            broken.append(f"{target}: no heading #{fragment} in {resolved.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in relative_links(ROOT / "README.md")}
    missing = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"
