"""The README's and docs/'s relative links lead to files of the repository: a reader of a clone, a release
archive or the repository's web page has those files and no others (no ``../shared/...`` beside a checkout)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCED = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`([^`]*)`")
# An inline link's or image's target (its text may span lines), a reference definition's, an HTML href or src.
LINKS = re.compile(
    r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)"
    r"|^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)"
    r"|\b(?:href|src)=\"([^\"]+)\"",
    re.MULTILINE,
)
PATH_SPAN = re.compile(r"^\.\.?/\S+$")  # a code span naming a path from the file's folder, which a reader follows
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # https:, mailto:, ...


def relative_targets(document: Path) -> list[str]:
    """The relative link targets of a Markdown file (outside code, which shows no link), and its code spans that
    name a path from its folder; without a ``#fragment``. Fragments alone (a heading of the same file) and URLs
    with a scheme are left out."""
    prose = FENCED.sub("", document.read_text())
    spans = CODE_SPAN.findall(prose)
    links = [next(filter(None, groups)) for groups in LINKS.findall(CODE_SPAN.sub("", prose))]
    targets = links + [span for span in spans if PATH_SPAN.match(span)]
    return [target.partition("#")[0] for target in targets if not EXTERNAL.match(target) and target[0] != "#"]


def test_the_documents_have_relative_links() -> None:
    """The finder sees the links (a format it misses would pass the test below with nothing checked)."""
    found = {target for document in DOCUMENTS for target in relative_targets(document)}
    assert {"docs/SPEC.md", "docs/engines.md", "docs/reliability.md"} <= found


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda document: str(document.relative_to(REPO)))
def test_every_relative_link_is_a_file_of_the_repository(document: Path) -> None:
    for target in relative_targets(document):
        resolved = (document.parent / target).resolve()
        assert resolved.is_relative_to(REPO), f"{target} leads out of the repository"
        assert resolved.exists(), f"{target} is not in the repository"


def test_the_architecture_map_names_every_source_module() -> None:
    """The README's Architecture section is where a reader finds what each module is for: every module of the
    four packages, its subpackages' too (as ``tgi/routes.py``), is named there, so a new one cannot land
    unmapped."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## Architecture\n", 1)[1].split("\n## ", 1)[0]
    modules = {package: [path.relative_to(REPO / package).as_posix() for path in sorted((REPO / package).rglob("*.py"))
                         if path.name != "__init__.py"] for package in ("api", "common", "worker", "server")}
    assert sum(map(len, modules.values())) > 40 and "tgi/routes.py" in modules["api"]
    unnamed = [f"{package}/{module}" for package, names in modules.items() for module in names
               if f"`{module}`" not in section.split(f"- `{package}/`", 1)[1].split("\n- `", 1)[0]]
    assert unnamed == []
