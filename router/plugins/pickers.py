"""Pickers: turn summed scores into a ranking.

- max-score: highest score first; ties broken at random (so equal workers share load).
- random: a uniformly random order (ignores scores).
- round-robin: rotates a cursor over the endpoints sorted by id (ignores scores).
"""

from __future__ import annotations

import random

from router.types import Endpoint

__all__ = ["MaxScorePicker", "RandomPicker", "RoundRobinPicker"]


class MaxScorePicker:
    name = "max-score"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def rank(self, scores: dict[str, float], endpoints: list[Endpoint]) -> list[Endpoint]:
        keyed = [(-scores.get(ep.worker_id, 0.0), self._rng.random(), ep) for ep in endpoints]
        keyed.sort(key=lambda t: (t[0], t[1]))
        return [ep for _, _, ep in keyed]


class RandomPicker:
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def rank(self, scores: dict[str, float], endpoints: list[Endpoint]) -> list[Endpoint]:
        order = list(endpoints)
        self._rng.shuffle(order)
        return order


class RoundRobinPicker:
    name = "round-robin"

    def __init__(self) -> None:
        self._cursor = 0

    def rank(self, scores: dict[str, float], endpoints: list[Endpoint]) -> list[Endpoint]:
        order = sorted(endpoints, key=lambda ep: ep.worker_id)
        start = self._cursor % len(order)
        self._cursor += 1
        return order[start:] + order[:start]
