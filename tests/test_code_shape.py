"""The package's shape: no function or method in forecastkv/ is longer than `MAX_FUNCTION_LINES`
(from its def line to its last line, docstring included; decorators above the def not counted),
so each reads as one screen of named steps; and no two of its modules import each other."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "forecastkv"
MAX_FUNCTION_LINES = 80


def long_functions(root: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """'path:line name (N lines)' of every function or method under `root` longer than `limit`
    lines, counted from its def line to its last line (nested functions are measured too)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_function_in_the_package_is_over_80_lines():
    offenders = "\n".join(long_functions(PACKAGE))
    assert not offenders, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps):\n{offenders}"


def test_the_check_names_what_is_over_the_limit_and_nothing_else(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    body = lambda lines, indent: "\n".join(f"{indent}x{i} = {i}" for i in range(lines))  # noqa: E731
    # a method of 1 + 80 lines (with a nested function of 1 + 2), a function of exactly 1 + 79
    method = f"class A:\n    def long(self):\n        def inner():\n{body(2, ' ' * 12)}\n{body(77, ' ' * 8)}\n"
    (package / "sub" / "long.py").write_text("def short():\n    return 1\n\n\n" + method)
    (package / "ok.py").write_text(f"async def exactly_80():\n{body(79, ' ' * 4)}\n")
    assert long_functions(package) == ["pkg/sub/long.py:6 long (81 lines)"]
    assert long_functions(package, limit=79) == [
        "pkg/ok.py:1 exactly_80 (80 lines)",
        "pkg/sub/long.py:6 long (81 lines)",
    ]
    assert long_functions(package, limit=2) == [
        "pkg/ok.py:1 exactly_80 (80 lines)",
        "pkg/sub/long.py:6 long (81 lines)",
        "pkg/sub/long.py:7 inner (3 lines)",
    ]




def module_imports(root: Path) -> dict[str, set[str]]:
    """Each module of the package -> the package modules it imports anywhere (function-level and
    TYPE_CHECKING imports included: a lazy import is still a dependency)."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    imports = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join([*base, *([node.module] if node.module else [])])
                found.update([target, *(f"{target}.{alias.name}" for alias in node.names)])
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        # a package's __init__ is where names are gathered, not a module's dependency
        imports[name] = {m for m in found if m in modules and m != name and modules[m].name != "__init__.py"}
    return imports


def test_no_two_modules_import_each_other():
    imports = module_imports(PACKAGE)
    circles = {(a, b) for a in imports for b in imports[a] if a < b and a in imports[b]}
    assert not circles, f"import circles (move the shared part to a module both import): {circles}"
