"""Pickers: turn summed scores into a ranking.

- max-score: highest score first; a tie for first place is broken uniformly at random (so equal
  workers share load); the rest keep score order, ties in input order.
- softmax: first place sampled with p(w) proportional to exp(score(w) / temperature), then the rest
  in score order. With the kv cost scorer this is Dynamo's softmax over -(logit / (max - min)) / T;
  temperature <= 0 is max-score.
- random: a uniformly random order (ignores scores).
- round-robin: rotates a cursor over the endpoints sorted by id (ignores scores).
"""

from __future__ import annotations

import math
import random

from router import _kernels
from router.types import Endpoint

__all__ = ["MaxScorePicker", "RandomPicker", "RoundRobinPicker", "SoftmaxPicker"]


def _score_order(scores: dict[str, float], endpoints: list[Endpoint]) -> tuple[list[float], list[int]]:
    get = scores.get
    vals = [get(ep.worker_id, 0.0) for ep in endpoints]
    return vals, sorted(range(len(vals)), key=vals.__getitem__, reverse=True)  # stable: ties keep input order


class MaxScorePicker:
    name = "max-score"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def draw(self) -> int:
        """The tie-break draw of one ranking: the tied leaders are rotated by it (r % ties), so each is first with
        p ~ 1/ties. Router.route draws it for its fused kv pass (router/_kernels.py, kv_rank) as rank() does."""
        return self._rng.getrandbits(62)

    def rank(self, scores: dict[str, float], endpoints: list[Endpoint]) -> list[Endpoint]:
        return _kernels.rank_by_score(scores, endpoints if type(endpoints) is list else list(endpoints), self.draw())


class SoftmaxPicker:
    name = "softmax"

    def __init__(self, temperature: float = 0.0, seed: int | None = None) -> None:
        self.temperature = temperature
        self._rng = random.Random(seed)
        self._argmax = MaxScorePicker(seed)

    def rank(self, scores: dict[str, float], endpoints: list[Endpoint]) -> list[Endpoint]:
        if self.temperature <= 0:
            return self._argmax.rank(scores, endpoints)
        vals, order = _score_order(scores, endpoints)
        top = vals[order[0]]
        weights = [math.exp((v - top) / self.temperature) for v in vals]
        first = self._rng.choices(range(len(vals)), weights)[0]
        order.remove(first)
        return [endpoints[first]] + [endpoints[i] for i in order]


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
