"""docs/architecture.md matches the code: every `path.py:Name` it cites names a function, class or
method that exists in that file, and every path it cites exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
CITATION = re.compile(r"`((?:forecastkv|tests|benchmarks)/[\w/]+\.py)(?::([\w.]+))?`")


def defined_names(path: Path) -> set[str]:
    """Qualified names of the functions and classes defined in `path` (`Class.method` for
    methods), and its module-level assignments."""
    names: set[str] = set()

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                names.add(name)
                if isinstance(child, ast.ClassDef):
                    visit(child, name + ".")
            elif isinstance(child, (ast.Assign, ast.AnnAssign)) and not prefix:
                targets = child.targets if isinstance(child, ast.Assign) else [child.target]
                names.update(t.id for t in targets if isinstance(t, ast.Name))

    visit(ast.parse(path.read_text()), "")
    return names


def citations(text: str) -> list[tuple[str, str | None]]:
    return [(match.group(1), match.group(2)) for match in CITATION.finditer(text)]


def test_every_citation_names_something_that_exists():
    text = DOC.read_text()
    cited = citations(text)
    assert len(cited) >= 30, "the decode walk cites its files and functions"
    missing = []
    for path, name in cited:
        file = ROOT / path
        if not file.is_file():
            missing.append(f"{path} (no such file)")
        elif name is not None and name not in defined_names(file):
            missing.append(f"{path}:{name}")
    assert not missing, f"docs/architecture.md cites what the code does not have: {missing}"


def test_the_check_catches_a_wrong_citation():
    """The parser finds `path:name` citations and the name check fails on one that is not there."""
    cited = citations("see `forecastkv/modeling/cache.py:SparseCache.begin_call` and `forecastkv/modeling/cache.py`")
    assert cited == [("forecastkv/modeling/cache.py", "SparseCache.begin_call"), ("forecastkv/modeling/cache.py", None)]
    names = defined_names(ROOT / "forecastkv/modeling/cache.py")
    assert "SparseCache.begin_call" in names and "SparseCache.no_such_method" not in names
