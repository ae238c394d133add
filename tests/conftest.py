"""The order the suite's files run in: the longest first.

``scripts/test.sh`` runs the suite in two xdist workers that take whole files (``--dist
loadfile``) in collection order (``--no-loadscope-reorder``; xdist's own order puts the files
with the most tests first, which left the few files of one long Spark or cluster test to the
end, where one worker ran them while the other had nothing left). Files whose tests start
Spark, a cluster or edge processes go first, the longest of them in the order measured
(``pytest --durations``, BENCHMARKS.md "CI time"), and the many quick files fill in around them.
"""

from __future__ import annotations

import pytest

# The longest files, longest first (seconds each in a two-worker run, measured 2026-11-26).
LONGEST = (
    "tests/e2e/test_standalone_cluster_edges.py",  # 315
    "tests/notebooks/test_notebooks.py",  # 290
    "tests/spark/test_lake_upgrade.py",  # 247
    "tests/e2e/test_quota_loop.py",  # 238
    "tests/spark/test_history_job.py",  # 230
    "tests/spark/test_quality_run.py",  # 207
    "tests/e2e/test_edge_to_delta.py",  # 178
)
# Then the rest of these folders' files (Spark, edge processes), then everything else.
SLOW_FOLDERS = ("tests/spark/", "tests/e2e/", "tests/notebooks/")


def _rank(path: str) -> tuple[int, int]:
    if path in LONGEST:
        return (0, LONGEST.index(path))
    return (1, 0) if path.startswith(SLOW_FOLDERS) else (2, 0)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A stable sort: a file's tests keep their order (its fixtures are made once).
    items.sort(key=lambda item: _rank(item.nodeid.split("::", 1)[0]))
