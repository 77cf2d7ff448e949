"""The tests' own shape: every test file sits in a folder that mirrors a wing of the
package (tests/serve/http/ for python/srm_max/serve/http/, ...), or in tests/bench/ or
tests/project/; helpers live in tests/support/ and hold no tests; no file of tests/ is
longer than 400 lines."""

from __future__ import annotations

from pathlib import Path

from tests.support.paths import REPO_ROOT

MAX_TEST_FILE_LINES = 400
# folders of tests that mirror no package folder: the benchmarks (bench/ at the repository
# root) and the promises of the repository as a whole
OWN_FOLDERS = ("bench", "project")
HELPERS = "support"


def package_folders(repo: Path) -> set[str]:
    """Every folder of the package on the way to Python code, relative to the package root
    (``serve``, ``serve/http``, ...): graphs/ counts as the package's ``graphs``."""
    roots = {repo / "python" / "srm_max": (), repo / "graphs": ("graphs",)}
    found = set()
    for root, prefix in roots.items():
        for path in root.rglob("*.py"):
            parts = (*prefix, *path.parent.relative_to(root).parts)
            found.update("/".join(parts[:n]) for n in range(1, len(parts) + 1))
    return found


def misplaced_test_files(tests: Path, wings: set[str]) -> list[str]:
    """Test files (``test_*.py``) directly in ``tests``, among the helpers, or in a folder
    that mirrors no package folder in ``wings`` and is not one of OWN_FOLDERS."""
    misplaced = []
    for path in sorted(tests.rglob("test_*.py")):
        folder = path.parent.relative_to(tests).as_posix()
        top = folder.split("/")[0]
        if folder == "." or top == HELPERS or not (folder in wings or top in OWN_FOLDERS):
            misplaced.append(path.relative_to(tests).as_posix())
    return misplaced


def long_files(tests: Path, limit: int = MAX_TEST_FILE_LINES) -> list[str]:
    """Python files under ``tests`` (tests, helpers, conftests) of more than ``limit`` lines."""
    return sorted(f"{path.relative_to(tests).as_posix()}: {n} lines"
                  for path in tests.rglob("*.py")
                  if (n := len(path.read_text().splitlines())) > limit)


def test_every_test_file_mirrors_a_wing_of_the_package():
    assert misplaced_test_files(REPO_ROOT / "tests", package_folders(REPO_ROOT)) == []


def test_no_file_of_the_tests_is_longer_than_400_lines():
    assert long_files(REPO_ROOT / "tests") == []


def write(path: Path, lines: int = 1) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("x = 1\n" * lines)


def test_the_checks_see_a_synthetic_violation_of_each_rule(tmp_path):
    repo, tests = tmp_path, tmp_path / "tests"
    write(repo / "python" / "srm_max" / "serve" / "http" / "app.py")
    write(repo / "graphs" / "sampler.py")
    wings = package_folders(repo)
    assert wings == {"serve", "serve/http", "graphs"}
    for good in ("serve/test_a.py", "serve/http/test_b.py", "graphs/test_c.py", "bench/test_d.py",
                 "project/test_e.py"):
        write(tests / good)
    write(tests / "support" / "helpers.py", MAX_TEST_FILE_LINES)
    assert misplaced_test_files(tests, wings) == [] and long_files(tests) == []

    for bad in ("test_flat.py", "support/test_in_helpers.py", "servr/test_typo.py", "serve/web/test_f.py"):
        write(tests / bad)
    assert misplaced_test_files(tests, wings) == [
        "serve/web/test_f.py", "servr/test_typo.py", "support/test_in_helpers.py", "test_flat.py"]
    write(tests / "serve" / "test_a.py", MAX_TEST_FILE_LINES + 1)
    assert long_files(tests) == [f"serve/test_a.py: {MAX_TEST_FILE_LINES + 1} lines"]
