"""The documents: the README is a front door whose links all lead somewhere, and docs/design.md indexes
every ``Note [...]`` of the sources (docs/configuration.md is checked in test_config.py).

A Note is *defined* where ``Note [Name]`` opens a comment or docstring line, alone on it (a heading) or
followed by a colon; everywhere else it is a reference."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "results" / "README.md"]
SOURCES = sorted([*(ROOT / "dcredit_opt").rglob("*.py"),
                  *(p for p in (ROOT / "csrc").rglob("*") if p.suffix in (".h", ".cc", ".cu", ".cpp"))])

DEFINITION = re.compile(r'^\s*(?:#+|//+|/?\*+)?\s*(?:""")?Note \[([^\]]+)\](?::|\s*$)')
MENTION = re.compile(r"Note\s+\[([^\]]+)\]")
INDEX_ROW = re.compile(r"^\| Note \[([^\]]+)\] \| `([^`]+)` \| .+ \|$")
LINK = re.compile(r"\]\(([^)\s]+)\)")

pytestmark = pytest.mark.timeout(60)


def _definitions() -> dict[str, set[str]]:
    """Each Note name and the files that define it."""
    found: dict[str, set[str]] = {}
    for path in SOURCES:
        for line in path.read_text().splitlines():
            m = DEFINITION.match(line)
            if m:
                found.setdefault(m.group(1), set()).add(str(path.relative_to(ROOT)))
    return found


def test_the_sources_define_notes():
    found = _definitions()
    assert {"Lazy step", "Credit window", "Dispatch loop", "Same order on every rank"} <= set(found), sorted(found)
    assert "dcredit_opt/planner/plan.py" in found["Credit window"] and "csrc/core/scheduler.cc" in found["Dispatch loop"]


def test_every_note_referenced_in_the_sources_is_defined():
    defined = set(_definitions())
    mentioned = {m.group(1).replace("\n", " ") for path in SOURCES
                 for m in MENTION.finditer(re.sub(r"\s*(?:#+|//+)?\s*\n\s*(?:#+|//+)?\s*", " ", path.read_text()))}
    assert mentioned - defined == set(), f"referenced but defined nowhere: {sorted(mentioned - defined)}"


def test_the_design_doc_indexes_every_note_in_its_file():
    rows = [INDEX_ROW.match(line) for line in (ROOT / "docs" / "design.md").read_text().splitlines()]
    index = [(m.group(1), m.group(2)) for m in rows if m]
    names = [name for name, _ in index]
    assert len(names) == len(set(names)), "a Note is listed twice"
    defined = _definitions()
    assert set(names) == set(defined), (f"defined but not listed: {sorted(set(defined) - set(names))}; "
                                        f"listed but defined nowhere: {sorted(set(names) - set(defined))}")
    wrong = {name: (where, sorted(defined[name])) for name, where in index if where not in defined[name]}
    assert not wrong, f"listed in a file that does not define it (listed, defined in): {wrong}"


def test_the_readme_is_a_front_door():
    text = README.read_text()
    assert len(text.splitlines()) <= 250, f"README.md is {len(text.splitlines())} lines"
    assert "make demo    # " in text and "make test    # " in text  # the two commands
    for target in ("docs/lazy-step.md", "docs/horovod.md", "docs/configuration.md", "docs/design.md",
                   "docs/usage.md", "benchmarks/results/README.md"):
        assert f"]({target}" in text, f"the README does not link {target}"
    measured = re.findall(r"\]\((benchmarks/results/[^)#]+\.md)\)", text)
    assert any(re.search(r"/\d{4}-\d{2}-\d{2}-", m) for m in measured), "the speed table names no results file"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_to_files_and_headings(doc):
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        assert dest.exists(), f"{doc.name} links {target}, which does not exist"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), f"{doc.name} links {target}: no such heading in {dest.name}"


def _anchors(doc: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in doc.read_text().splitlines() if re.match(r"#{1,6} ", line)}
