"""What a process's Prometheus endpoint serves, read as Prometheus reads it (its own
parser): every sample by name and labels, for the tests of ``--metrics-port``."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Series = tuple[str, tuple[tuple[str, str], ...]]  # (name, sorted (label, value) pairs)


def samples(url: str, timeout: float = 10) -> dict[Series, float]:
    """Every sample of a ``/metrics`` page: (name, sorted labels) -> value."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
