"""Admission order: priority classes first, weighted fair share across keys within a class, FIFO when off."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from orchestrator.resilience.admission import AdmissionController
from orchestrator.resilience.fairshare import FairQueue, priority_rank


def drain(q: FairQueue) -> list:
    out = []
    while (item := q.pop()) is not None:
        out.append(item)
    return out


def test_classes_go_strictly_in_order():
    q = FairQueue()
    for i, cls in enumerate(["low", "normal", "high", "low", "high"]):
        q.push(f"{cls}{i}", key="k", priority=cls)
    assert drain(q) == ["high2", "high4", "normal1", "low0", "low3"]
    assert len(q) == 0


def test_a_flooding_key_cannot_starve_a_polite_one():
    q = FairQueue()
    for i in range(100):
        q.push(("flood", i), key="flood")
    q.push(("polite", 0), key="polite")  # arrives after all 100
    order = drain(q)
    assert order.index(("polite", 0)) <= 1  # served within the first two, not 101st


@pytest.mark.parametrize("weight", [1, 2, 3])
def test_weights_share_slots_while_both_wait(weight):
    q = FairQueue()
    for i in range(60):
        q.push("a", key="a", weight=weight)
        q.push("b", key="b", weight=1)
    first = Counter(drain(q)[:40])
    assert first["a"] == pytest.approx(40 * weight / (weight + 1), abs=1)


def test_an_idle_key_banks_no_credit():
    q = FairQueue()
    for _ in range(10):
        q.push("a", key="a")
    for _ in range(5):
        q.pop()  # a alone for a while: virtual time moves on
    for _ in range(5):
        q.push("b", key="b")
    got = drain(q)
    assert Counter(got[:4]) == {"a": 2, "b": 2}  # b shares from now on; it does not jump ahead of all of a's


def test_fifo_when_off_and_dead_waiters_skipped():
    alive = {1: True, 2: False, 3: True}
    q = FairQueue(fair=False, alive=lambda i: alive[i])
    q.push(1, key="x", priority="low")
    q.push(2, key="y", priority="high")
    q.push(3, key="z", priority="high", weight=5)
    assert q.depth_by_class() == {"high": 0, "normal": 3, "low": 0}
    q.prune()
    assert len(q) == 2
    assert drain(q) == [1, 3]


def test_bad_inputs():
    with pytest.raises(ValueError):
        priority_rank("urgent")
    with pytest.raises(ValueError):
        FairQueue().push(1, weight=0)


def _recorder(ctl: AdmissionController, order: list[str]):
    """A coroutine factory: admit one request of `key` in `cls`, note its tag when granted, release."""

    async def one(tag: str, key: str, cls: str = "normal") -> None:
        t = await ctl.admit("m", key, cls)
        order.append(tag)
        t.release()

    return one


async def test_admission_grants_high_before_normal_and_shares_within_a_class():
    ctl = AdmissionController(max_inflight=1, max_queued=100, queue_timeout_s=5)
    holder = await ctl.admit("m")
    order: list[str] = []
    one = _recorder(ctl, order)

    tasks = [asyncio.create_task(one(f"flood{i}", "flood")) for i in range(6)]
    await asyncio.sleep(0.01)
    tasks.append(asyncio.create_task(one("polite", "polite")))
    tasks.append(asyncio.create_task(one("vip", "vip", "high")))
    await asyncio.sleep(0.01)
    assert ctl.queued_by_class()["m"] == {"high": 1, "normal": 7, "low": 0}
    holder.release()
    await asyncio.gather(*tasks)
    assert order[0] == "vip" and order.index("polite") <= 2
    await ctl.close()


async def test_admission_fifo_when_fair_share_is_off():
    ctl = AdmissionController(max_inflight=1, max_queued=100, queue_timeout_s=5, fair=False)
    holder = await ctl.admit("m")
    order: list[str] = []
    one = _recorder(ctl, order)

    tasks = [asyncio.create_task(one(f"flood{i}", "flood")) for i in range(4)]
    await asyncio.sleep(0.01)
    tasks.append(asyncio.create_task(one("vip", "vip", "high")))
    await asyncio.sleep(0.01)
    holder.release()
    await asyncio.gather(*tasks)
    assert order == ["flood0", "flood1", "flood2", "flood3", "vip"]
    await ctl.close()
