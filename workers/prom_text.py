"""Prometheus text exposition, read for the few gauges and counters the frontend wants from an engine.

One regular expression over the whole text (a vLLM exposition is ~700 lines, scraped from every engine every
second): a sample line is a name, optional labels (quoted values may hold any character, escaped quotes
included), a value and an optional timestamp. Lines it cannot read are skipped: an engine's odd line never fails a
scrape.
"""

from __future__ import annotations

import math
import re
from functools import lru_cache

__all__ = ["samples_by_name"]


@lru_cache(maxsize=16)
def _sample_line(prefix: str, names: frozenset[str] | None) -> re.Pattern:
    # it starts with a literal (a newline and the prefix), which re finds by a fast scan rather than trying a match
    # at every character as a line anchor would; `names` narrows the match to the metrics wanted
    name = (r"(?:" + "|".join(re.escape(n[len(prefix):]) for n in sorted(names, key=len, reverse=True)) + r")"
            if names is not None else r"[a-zA-Z0-9_:]*")
    return re.compile(
        r"\n[ \t]*(" + re.escape(prefix) + name + r")"  # the metric's name
        r'(?:\{(?:[^"}\n]|"(?:[^"\\\n]|\\.)*")*\})?'  # labels, quoted values with escapes
        r"[ \t]+([^ \t\r\n]+)"  # the value
        r"(?:[ \t]+-?[0-9]+)?[ \t]*(?=\r?\n)")  # an optional timestamp, then the line's end (not consumed)


def samples_by_name(text: str, prefix: str, names: frozenset[str] | None = None) -> dict[str, list[float]]:
    """Every finite sample of the metrics whose name starts with `prefix` (and is in `names`, if given), by metric
    name, one value per label set."""
    values: dict[str, list[float]] = {}
    if not isinstance(text, str):
        return values
    if names is not None:
        names = frozenset(n for n in names if n.startswith(prefix))
        if not names:
            return values
    for name, raw in _sample_line(prefix, names).findall("\n" + text + "\n"):
        try:
            v = float(raw)
        except ValueError:
            continue
        if math.isfinite(v):
            values.setdefault(name, []).append(v)
    return values
