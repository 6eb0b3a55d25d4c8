"""docs/request-map.md stays true: every file it names exists, and every name it says runs there
is defined in that file (a function, a class or a module-level name)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
LINE = re.compile(r"^\d+\. `([\w/]+\.py)`: (.*)$")


def _defined(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def test_every_file_and_name_in_the_request_map_exists():
    entries = [LINE.match(line) for line in (REPO / "docs" / "request-map.md").read_text().splitlines()]
    entries = [m for m in entries if m]
    assert len(entries) >= 30, "the map lists both paths"
    for match in entries:
        path = REPO / match.group(1)
        assert path.is_file(), f"docs/request-map.md names {match.group(1)}, which does not exist"
        # The names are the backticked words before the first parenthesis (which explains the step).
        named = re.findall(r"`(\w+)`", match.group(2).split("(")[0])
        missing = set(named) - _defined(path)
        assert not missing, f"docs/request-map.md: {match.group(1)} defines none of {sorted(missing)}"
