"""Extension points of the router. Each is one small Protocol; implementations live in router/plugins/.

A policy is a list of weighted scorers plus one picker. The framework (router.scheduler) calls every
scorer, clamps each score to [0, 1], multiplies by the scorer's weight and sums per endpoint; the
picker turns the summed scores into a ranking. Scorers never see their weights or each other.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from router.types import Endpoint, RouteRequest

__all__ = ["Scorer", "Picker"]


@runtime_checkable
class Scorer(Protocol):
    name: str

    def score(self, request: RouteRequest, endpoints: list[Endpoint]) -> dict[str, float]:
        """Called once per routing decision with the live candidate endpoints (never empty).

        Returns worker_id -> score; higher is better; values outside [0, 1] are clamped; a missing
        endpoint scores 0. Must be pure: no I/O, no mutation of the endpoints.
        """
        ...


@runtime_checkable
class Picker(Protocol):
    name: str

    def rank(self, scores: dict[str, float], endpoints: list[Endpoint]) -> list[Endpoint]:
        """Called once per decision after scoring: all endpoints, best first."""
        ...
