"""Prometheus text exposition as the tests read it: every sample by name and labels."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """Every sample of an exposition (parsed by prometheus-client's own parser)."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> Any:
    """The sample ``name`` with exactly these labels; None when there is none."""
    return samples.get((name, tuple(sorted(labels.items()))))
