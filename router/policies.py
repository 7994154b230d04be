"""Routing policies by name: weighted scorers + a picker.

    kvyard policy      scorers (weight)     picker
    round-robin        -                    round-robin
    random             -                    random
    least-loaded       load (1.0)           max-score (random tie-break)

The KV-aware policy registers here too. Factories are the single table of names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from router.interfaces import Picker, Scorer
from router.plugins import LoadScorer, MaxScorePicker, RandomPicker, RoundRobinPicker

__all__ = ["Policy", "build_policy", "policy_names"]


@dataclass(slots=True)
class Policy:
    name: str
    picker: Picker
    scorers: list[tuple[Scorer, float]] = field(default_factory=list)


_FACTORIES: dict[str, Callable[[], Policy]] = {
    "round-robin": lambda: Policy("round-robin", RoundRobinPicker()),
    "random": lambda: Policy("random", RandomPicker()),
    "least-loaded": lambda: Policy("least-loaded", MaxScorePicker(), [(LoadScorer(), 1.0)]),
}


def policy_names() -> list[str]:
    return sorted(_FACTORIES)


def build_policy(name: str) -> Policy:
    try:
        return _FACTORIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(policy_names())}") from None
