"""Routing policies by name: weighted scorers + a picker (+ the KV index the policy routes on).

    kvyard policy      scorers (weight)     picker                         index
    round-robin        -                    round-robin                    -
    random             -                    random                         -
    least-loaded       load (1.0)           max-score (random tie-break)   -
    kv                 kv cost (1.0)        max-score, or softmax(T > 0)   KvIndex

kv parameters: overlap_weight, reuse_weight, request_weight, temperature, pending_ttl_s (defaults: router/config.py, the
served defaults), index (a KvIndex to share, e.g. with the event ingestor; a new one by default), seed. Every
policy takes `seed` (its picker's random tie-breaks or order; round-robin has none), so a replay can be repeated
exactly. Factories are the single table of names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from router.config import KV_DEFAULTS
from router.interfaces import Picker, Scorer
from router.kv_index import KvIndex
from router.plugins import KvCostScorer, LoadScorer, MaxScorePicker, RandomPicker, RoundRobinPicker, SoftmaxPicker

__all__ = ["Policy", "build_policy", "policy_names"]


@dataclass(slots=True)
class Policy:
    name: str
    picker: Picker
    scorers: list[tuple[Scorer, float]] = field(default_factory=list)
    index: KvIndex | None = None  # set when the policy routes on cached prefixes


def _kv(overlap_weight: float = KV_DEFAULTS.overlap_weight, temperature: float = KV_DEFAULTS.temperature,
        index: KvIndex | None = None, seed: int | None = None, reuse_weight: float = KV_DEFAULTS.reuse_weight,
        request_weight: float = KV_DEFAULTS.request_weight, pending_ttl_s: float = KV_DEFAULTS.pending_ttl_s) -> Policy:
    picker = SoftmaxPicker(temperature, seed) if temperature > 0 else MaxScorePicker(seed)
    scorer = KvCostScorer(overlap_weight, reuse_weight, request_weight)
    return Policy("kv", picker, [(scorer, 1.0)], KvIndex(pending_ttl_s=pending_ttl_s) if index is None else index)


_FACTORIES: dict[str, Callable[..., Policy]] = {
    "round-robin": lambda seed=None: Policy("round-robin", RoundRobinPicker()),
    "random": lambda seed=None: Policy("random", RandomPicker(seed)),
    "least-loaded": lambda seed=None: Policy("least-loaded", MaxScorePicker(seed), [(LoadScorer(), 1.0)]),
    "kv": _kv,
}


def policy_names() -> list[str]:
    return sorted(_FACTORIES)


def build_policy(name: str, **params: Any) -> Policy:
    """A fresh policy by name; `params` go to its factory (only kv takes any)."""
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(policy_names())}") from None
    try:
        return factory(**params)
    except TypeError as exc:
        raise ValueError(f"bad parameters for routing policy {name!r}: {exc}") from None
