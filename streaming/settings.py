"""Typed settings of the Spark pipeline. Loaded from TOML by ``edgebus.settings``."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from schemas.names import RETENTION_DAYS
from sinks.storage import LakePath, ObjectPath
from streaming.errors import PipelineConfigError

# Where the query's checkpoint lives when the lake is in a bucket: on this machine (see
# :attr:`PipelineSettings.checkpoint_root`), one directory per bucket and prefix.
LOCAL_CHECKPOINTS = "checkpoints"


@dataclass(frozen=True, slots=True)
class PipelineSettings:
    """Where the journals are, where the lake is, and how the streaming jobs run.

    ``data_dir/journal/{node}/`` holds each edge node's journal; tables live under ``lake`` (a
    directory, or ``s3://bucket/prefix``) and query checkpoints under ``lake/_checkpoints/{job}``
    (a lake in a bucket: ``data_dir/checkpoints/{bucket}/{prefix}/{job}``).
    """

    data_dir: Path = Path("data")
    lake: LakePath = Path("lake")
    # Edges serving their journal over HTTP (``edgebus edge --http``), "HOST:PORT" each: read
    # besides the journals under data_dir (issue 12); the executors fetch from them directly.
    edges: tuple[str, ...] = ()
    master: str = "local[*]"
    # A backlog's batches: each batch's fixed costs (trigger, offset and commit logs, the Delta
    # commit) spread over more rows, and the driver holds none of them; 500,000 against 200,000:
    # +9 to +13 % rows/s on a 4M-record backlog (BENCHMARKS.md, issues 12 and 18). A live
    # stream's batches are far smaller (a trigger interval's records).
    max_records_per_batch: int = 500_000
    # A new micro-batch at most this often; a batch that takes longer runs the next at once.
    trigger_interval_seconds: float = 0.5
    shuffle_partitions: int = 4
    driver_memory: str = "2g"
    # The tables behind the stream (logs, quarantine, usage) are written at most this often
    # (0: as soon as a batch is handed over), each write holding every batch since the last:
    # their commits cost about the same whatever their rows, and written after every batch they
    # took more of the machine than messages (BENCHMARKS.md, issue 12, 2026-11-28).
    others_interval_seconds: float = 5.0
    # Data quality: every table's great-expectations suite runs this often (0: never).
    quality_interval_seconds: float = 600.0
    # Table maintenance: compaction, checkpoint and vacuum run this often (0: never) ...
    maintenance_interval_seconds: float = 3600.0
    # ... and vacuum deletes files no version younger than this needs (Delta's default: 7 days).
    vacuum_retention_hours: float = 168.0
    # How long each table's Delta log keeps a commit: how far back time travel reaches (a
    # checkpoint before it included). A commit lists the log's directory, whose names a stream
    # adds four a second to: 6 hours is ~86,000 entries, +0.01-0.03 s a commit; 24 hours +0.1-0.2 s
    # (bench.delta_log, BENCHMARKS.md). Delta's own default: 30 days.
    delta_log_retention_hours: float = 6.0
    # History kept, in whole days besides today (0: forever), by maintenance; a tenant's own
    # ``logs_retention_days`` / ``messages_retention_days`` in the tenants file overrides it.
    logs_retention_days: int = 30  # as flespi
    messages_retention_days: int = 0
    # "HOST:PORT" serving the pipeline's Prometheus metrics at /metrics ("": none; port 0: any
    # free port). ``edgebus pipeline --metrics`` overrides it.
    metrics_listen: str = ""

    def __post_init__(self) -> None:
        if self.max_records_per_batch < 1:
            raise PipelineConfigError(
                f"pipeline.max_records_per_batch: must be >= 1, got {self.max_records_per_batch}"
            )
        if self.trigger_interval_seconds <= 0:
            raise PipelineConfigError(
                "pipeline.trigger_interval_seconds: must be > 0, "
                f"got {self.trigger_interval_seconds}"
            )
        if self.shuffle_partitions < 1:
            raise PipelineConfigError(
                f"pipeline.shuffle_partitions: must be >= 1, got {self.shuffle_partitions}"
            )
        for key in (
            "others_interval_seconds",
            "quality_interval_seconds",
            "maintenance_interval_seconds",
        ):
            if getattr(self, key) < 0:
                raise PipelineConfigError(f"pipeline.{key}: must be >= 0, got {getattr(self, key)}")
        if not self.delta_log_retention_hours * 60 >= 1:
            raise PipelineConfigError(
                "pipeline.delta_log_retention_hours: must be at least a minute (1/60), "
                f"got {self.delta_log_retention_hours}"
            )
        if self.vacuum_retention_hours < 0:
            raise PipelineConfigError(
                f"pipeline.vacuum_retention_hours: must be >= 0, got {self.vacuum_retention_hours}"
            )
        for key in RETENTION_DAYS.values():
            days = getattr(self, key)
            if not isinstance(days, int) or isinstance(days, bool) or days < 0:
                raise PipelineConfigError(
                    f"pipeline.{key}: must be a whole number of days >= 0 (0: forever), "
                    f"got {days!r}"
                )
        for edge in self.edges:
            host, sep, port = edge.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65_535:
                raise PipelineConfigError(
                    f'pipeline.edges: each edge is "HOST:PORT" (port 1..65535), got {edge!r}'
                )
        if len(set(self.edges)) != len(self.edges):
            raise PipelineConfigError(f"pipeline.edges: an edge is listed twice: {self.edges}")
        if not self.master:
            raise PipelineConfigError("pipeline.master: must not be empty")
        if not re.fullmatch(r"[1-9][0-9]*[kmgt]", self.driver_memory, re.IGNORECASE):
            # The JVM's own syntax: it becomes the heap's -Xmx and -Xms (streaming.session).
            raise PipelineConfigError(
                "pipeline.driver_memory: must be a whole number with a unit k, m, g or t "
                f'(e.g. "2g"), got {self.driver_memory!r}'
            )
        if self.metrics_listen:
            host, sep, port = self.metrics_listen.rpartition(":")
            if not sep or not host.strip("[]") or not port.isdigit() or int(port) > 65_535:
                raise PipelineConfigError(
                    'pipeline.metrics_listen: "HOST:PORT" (port 0..65535; "" for none), '
                    f"got {self.metrics_listen!r}"
                )

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """``metrics_listen`` as (host, port), None when there is none."""
        if not self.metrics_listen:
            return None
        host, _, port = self.metrics_listen.rpartition(":")
        return host.strip("[]"), int(port)

    @property
    def journal_root(self) -> Path:
        return self.data_dir / "journal"

    @property
    def checkpoint_root(self) -> Path:
        """Beside the tables for a local lake; on this machine for a lake in a bucket: the
        journal source reads the offset log from a local path, the journal notices and the
        checkpoint check read it too, and Spark's checkpoint relies on atomic renames, which
        S3 lacks. The checkpoint matters as much as the journal: keep ``data_dir``."""
        if isinstance(self.lake, ObjectPath):
            return self.data_dir / LOCAL_CHECKPOINTS / self.lake.bucket / self.lake.key
        return self.lake / "_checkpoints"

    def table_path(self, table: str) -> LakePath:
        return self.lake / table

    def checkpoint_path(self, job: str) -> Path:
        return self.checkpoint_root / job
