"""Reading a Prometheus text exposition in tests: sample values and the labels each series has."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry
from prometheus_client.samples import Sample


def samples(text: str) -> list[Sample]:
    """Every sample of the exposition ``text`` (``_total``, ``_bucket``, … as exported)."""
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def value(text: str, name: str, **labels: str) -> float | None:
    """The value of the sample ``name`` whose labels include ``labels``; None when absent."""
    for s in samples(text):
        if s.name == name and labels.items() <= s.labels.items():
            return float(s.value)
    return None


def label_names(text: str) -> dict[str, set[str]]:
    """Sample name -> every label name some sample of it carries (``le`` of buckets included)."""
    out: dict[str, set[str]] = {}
    for s in samples(text):
        out.setdefault(s.name, set()).update(s.labels)
    return out


def registry_text(registry: CollectorRegistry) -> str:
    """The exposition of an in-process registry (the trainer process's default one)."""
    from prometheus_client import generate_latest

    return generate_latest(registry).decode()
