"""Run a command that reads the lake many times in fresh processes, as a user would.

delta-rs can abort the interpreter at exit (``DeltaTable.to_pyarrow_*``; exit 134), and only
sometimes, so one run proves nothing: every run must exit as the command means to (0, or 1 for
``edgebus quality`` over a failed run) with nothing on stderr.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence


def outputs_of_repeated_runs(
    command: Sequence[str], runs: int = 20, *, returncode: int = 0
) -> tuple[str, str]:
    """Run ``command`` ``runs`` times, alternating ``--format table`` and ``--format json``;
    assert each exits with ``returncode`` quietly and gives the same output as the others of
    its format.

    Returns the table output and the JSON output.
    """
    outputs: dict[str, set[str]] = {"table": set(), "json": set()}
    for i in range(runs):
        fmt = "json" if i % 2 else "table"
        done = subprocess.run(
            [*command, "--format", fmt], capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == returncode, (i, done.returncode, done.stderr[-2000:])
        assert done.stderr == ""
        outputs[fmt].add(done.stdout)
    (table,), (json,) = outputs["table"], outputs["json"]  # the same every time
    return table, json
