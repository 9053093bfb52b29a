"""The layout of tests/: what several files share lives in helper modules not named test_*, so no
module imports a test module (a test file's internals stay its own), and every test_*.py holds
tests while no helper does (pytest would never collect them).
"""

import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent
SOURCES = sorted(TESTS.glob("*.py"))


def _is_test_module(name: str) -> bool:
    return name.startswith("test_")


def _imported_modules(tree: ast.AST):
    """(line, top-level module name) of every import, also those inside functions."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module.split(".")[0]


def _defines_tests(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            return True
        if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            return True
    return False


def test_no_module_imports_a_test_module():
    bad = []
    for path in SOURCES:
        tree = ast.parse(path.read_text(), filename=str(path))
        bad += [f"{path.name}:{line} imports {name}" for line, name in _imported_modules(tree)
                if _is_test_module(name) and (TESTS / f"{name}.py").exists()]
    assert not bad, "move what is shared into a helper module (not named test_*): " + "; ".join(bad)


def test_test_modules_hold_tests_and_helpers_hold_none():
    named_like_tests_without_tests, helpers_with_tests = [], []
    for path in SOURCES:
        tree = ast.parse(path.read_text(), filename=str(path))
        if _is_test_module(path.stem) and not _defines_tests(tree):
            named_like_tests_without_tests.append(path.name)
        if not _is_test_module(path.stem) and path.name != "conftest.py" and _defines_tests(tree):
            helpers_with_tests.append(path.name)
    assert not named_like_tests_without_tests, f"helpers named like test modules: {named_like_tests_without_tests}"
    assert not helpers_with_tests, f"tests in modules pytest does not collect: {helpers_with_tests}"


def test_the_checks_see_the_suite():
    names = {path.name for path in SOURCES}
    assert {"conftest.py", "dist.py", "megatron_harness.py", "test_suite_layout.py"} <= names
