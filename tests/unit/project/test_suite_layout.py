"""The suite collects under pytest's default import mode, where a test module is imported by its
basename: two test files with one name in different folders stop the whole run at collection
("import file mismatch"). CI hit exactly that; this keeps it from coming back."""

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2]


def test_no_two_test_modules_share_a_basename():
    folders_by_name: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        folders_by_name[path.name].append(str(path.parent.relative_to(TESTS)))
    clashes = {name: folders for name, folders in folders_by_name.items() if len(folders) > 1}
    assert not clashes, f"rename one of each: {clashes}"
