"""bench.pipeline_network's edges: real ``edgebus edge --http`` processes on the bench's
journals, answering the pipeline with the operator token they made (the bench failed with 401
before it showed them one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.pipeline import write_journals
from bench.pipeline_network import start_edges, stop_edges
from ingest.remote import EdgeRefused, journal_range
from schemas import operator_token


def test_the_benchs_edges_serve_their_journals_to_the_token_in_their_data_dir(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    write_journals(data / "journal", 10, 2)
    edges = start_edges(data, 2, tmp_path)
    try:
        token = operator_token.read(data)
        assert token is not None
        served = {
            found.node: found.last_seq
            for found in (journal_range(address, token) for _, address in edges)
        }
        assert served == {"node-0": 5, "node-1": 5}
        with pytest.raises(EdgeRefused, match="401"):
            journal_range(edges[0][1], None)
    finally:
        stop_edges(edges)
