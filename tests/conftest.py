"""The suite's files in order of their running time, the longest first.

`./scripts/test.sh` runs `pytest -n 2 --dist loadfile --no-loadscope-reorder`: each file whole in one worker, and
the files handed out in collection order, each worker taking the next as it finishes one (pytest-xdist's
LoadScopeScheduling: `workqueue.popitem(last=False)`; without --no-loadscope-reorder it sorts them by their number of
tests instead, which says little of their time). Longest first, the last files to start are the shortest, and
neither worker waits long for the other at the end.

The times are docs/architecture.md's table (what scripts/test_times.py prints from a run's JUnit report). A file
not in it yet goes first: its time is unknown, and a short file early costs nothing at the end.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TABLE_ROW = re.compile(r"^\| `(tests/\S+\.py)` \| \d+ \| (\d+) \|$", flags=re.MULTILINE)


def recorded_seconds() -> dict[str, int]:
    """Each test file's seconds in docs/architecture.md's table, by its path from the repository's root."""
    table = ROOT / "docs" / "architecture.md"
    text = table.read_text() if table.is_file() else ""
    return {path: int(seconds) for path, seconds in TABLE_ROW.findall(text)}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seconds = recorded_seconds()
    unknown = max(seconds.values(), default=0) + 1

    def expected(item: pytest.Item) -> int:
        path = Path(str(item.fspath)).resolve()
        return seconds.get(path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else "", unknown)

    # Stable: each file's tests stay together and in their own order.
    items.sort(key=expected, reverse=True)
