"""Prometheus text exposition, read for the few gauges and counters the frontend wants from an engine."""

from __future__ import annotations

import math

__all__ = ["samples_by_name"]


def samples_by_name(text: str, prefix: str) -> dict[str, list[float]]:
    """Every finite sample of the metrics whose name starts with `prefix`, by metric name (one value per label set).
    Lines it cannot read are skipped: an engine's odd line never fails a scrape."""
    values: dict[str, list[float]] = {}
    if not isinstance(text, str):
        return values
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            v = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        if math.isfinite(v):
            values.setdefault(name, []).append(v)
    return values
