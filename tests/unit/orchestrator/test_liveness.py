"""HungWorkers (orchestrator/resilience/liveness.py): suspicion confirmed by a health check, then the breaker trip and
the fail-over of exchanges in flight, only where another worker can take them."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.resilience.liveness import HungWorkers


class Exchange:
    def __init__(self) -> None:
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


def judge(healthy: bool, alternative: bool):
    trips: list[tuple[str, str]] = []

    async def probe(wid: str) -> bool:
        return healthy

    return HungWorkers(probe, lambda wid, why: trips.append((wid, why)), lambda wid: alternative), trips


@pytest.mark.parametrize(("healthy", "alternative", "tripped", "failed_over"),
                         [(True, True, False, False), (False, True, True, True), (False, False, True, False)])
async def test_suspicion_confirmed_then_failed_over(healthy, alternative, tripped, failed_over):
    hw, trips = judge(healthy, alternative)
    resp = Exchange()
    post = asyncio.get_running_loop().create_future()
    hw.book("w").add(resp)
    hw.book("w").add(post)
    hw.suspect("w", "2 scrapes failed")
    hw.suspect("w", "2 scrapes failed")  # one confirmation at a time
    await asyncio.sleep(0.01)
    assert [w for w, _ in trips] == (["w"] if tripped else [])
    assert resp.aborted == failed_over and post.cancelled() == failed_over
    if tripped:
        assert "health check failed" in trips[0][1]


async def test_finished_exchanges_drop_out_of_the_book():
    hw, _ = judge(False, True)
    resp = Exchange()
    hw.book("w").add(resp)
    del resp
    assert len(hw.book("w")) == 0
    hw.forget("w")
    assert hw.hung("w", "x") == 0
