"""The README is a front door: short, with a test command CI can find, and every link in it and in
docs/ leads to a file of the repository."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 250
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(page: Path) -> list[str]:
    targets = (match.group(1).split("#")[0] for match in LINK.finditer(page.read_text()))
    return [t for t in targets if t and not re.match(r"[a-z]+:", t)]


def test_readme_is_at_most_250_lines():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move reference material to docs/"


def test_readme_names_one_test_command_for_ci():
    text = (ROOT / "README.md").read_text()
    after_marker = text.split("<!-- test-command -->\n", 1)[1].splitlines()
    assert after_marker[0] == "```bash" and "pytest" in after_marker[1], after_marker[:2]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves_to_a_file(page):
    missing = [t for t in relative_links(page) if not (page.parent / t).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


def test_a_broken_link_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[there](there.md) and [web](https://example.org) and [anchor](#top)\n")
    assert relative_links(page) == ["there.md"]
