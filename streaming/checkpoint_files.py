"""Small files the pipeline keeps in a query's checkpoint directory beside Spark's own (the
other tables' progress, the quota decisions sent and not committed yet)."""

from __future__ import annotations

import os
from pathlib import Path


def write_durably(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically and synced: a crash leaves the old file or the new
    one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    with temporary.open("w", encoding="utf-8") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    temporary.replace(path)
