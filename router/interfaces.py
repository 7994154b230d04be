"""Extension points of the router. Each is one small Protocol; implementations live in router/plugins/.

A policy is a list of weighted scorers plus one picker. The framework (router.scheduler) calls every
scorer, clamps each score to [0, 1], multiplies by the scorer's weight and sums per endpoint; the
picker turns the summed scores into a ranking. Scorers never see their weights or each other.

Stages run after the picker, in the order the router was given them, whatever the policy: each may move
endpoints forward in the ranking for a reason of its own (the session's worker, a worker holding the request's
LoRA adapter), keeping the policy's order otherwise (so the policy's cost stays the tie-break). A stage never
asks which policy or which other stage is present.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from router.types import Endpoint, RouteRequest

__all__ = ["Scorer", "Picker", "Stage"]


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


@runtime_checkable
class Stage(Protocol):
    name: str

    def rerank(self, request: RouteRequest, ranked: list[Endpoint]) -> list[Endpoint]:
        """Called once per decision with the policy's ranking (never empty); returns a permutation of it, best
        first. Must be pure and synchronous: no I/O; it may read its own state, not change it."""
        ...

    def on_booked(self, request: RouteRequest, endpoint: Endpoint) -> None:
        """Called when `request` is booked on `endpoint`: the first-ranked one, then each failover target."""
        ...

    def remove_worker(self, worker_id: str) -> None:
        """Called when a worker leaves the fleet: forget what the stage kept about it."""
        ...
