"""The code documents itself from this repository: comments cite `docs/` (by file and section) or public sources,
never notes that do not ship with it (the model files travel as remote code to every Hub user)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CODE_DIRS = ["modeling_kdsa", "quantization", "parallel", "eval", "scripts", "tests"]
# Team-internal notes outside the repository, by the names the code used to cite them.
OUTSIDE = re.compile(r"DESIGN\.md|\breference/[\w-]+\.md|\.\./shared|\btechniques\.md|\breal-checkpoints\.md")
CITATION = re.compile(r"docs/([\w-]+\.md)((?:[\s,;]*§\d+(?:-§\d+)?)*)")


def code_files() -> list[Path]:
    files = [p for d in CODE_DIRS for p in sorted((ROOT / d).rglob("*.py"))]
    return [p for p in files if p.name != "test_docs.py"]


def sections(doc: Path) -> set[int]:
    return {int(m) for m in re.findall(r"^## §(\d+)", doc.read_text(), flags=re.MULTILINE)}


@pytest.mark.parametrize("path", code_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_cites_nothing_outside_the_repository(path):
    hits = [f"{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1) if OUTSIDE.search(line)]
    assert not hits, "cite docs/ or a public source instead:\n" + "\n".join(hits)


def test_every_docs_citation_names_an_existing_file_and_section():
    broken = []
    for path in code_files():
        text = path.read_text()
        for match in CITATION.finditer(text):
            doc = ROOT / "docs" / match.group(1)
            if not doc.is_file():
                broken.append(f"{path.relative_to(ROOT)}: {match.group(0)} (no such file)")
                continue
            cited = set()
            for first, last in re.findall(r"§(\d+)(?:-§(\d+))?", match.group(2)):
                cited.update(range(int(first), int(last or first) + 1))
            missing = sorted(cited - sections(doc))
            if missing:
                broken.append(f"{path.relative_to(ROOT)}: {match.group(0)} (no section {missing})")
    assert not broken, "\n".join(broken)
